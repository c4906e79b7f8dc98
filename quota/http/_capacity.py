"""Capacity a caller gets on a route class: scaling, tenant plans, system pressure.

Capacity a caller gets on a route class::

    rates of the route class (or of the caller's tier, if the class names one)
      x tier multiplier x plan scale x pressure factor, at least the request's cost

Every limit, burst and refill rate is scaled alike, so the time to refill a
bucket stays constant. Fixed windows and token buckets keep their state when
their capacity changes (neither puts it in the state key), so scaling a limit
never hands a caller a fresh bucket.

Everything here is pure or an in-memory cache the app seeds: no database,
no network. `SystemPressure` reads ``os.getloadavg`` and ``/proc/meminfo``;
`quota.http._signals.PredictivePressure` builds on the same sample.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import replace

from quota._core.algorithms import Rate
from quota._core.decision import MAX_LIMIT, check_span
from quota._core.errors import ConfigurationError
from quota.http._routes import Rates


def _scaled(value: int, factor: float, floor: int) -> int:
    """`value` x `factor`, rounded down, kept within ``floor..MAX_LIMIT``."""
    product = value * factor + 1e-9
    if not product < MAX_LIMIT:  # also NaN: never an exception per request
        return MAX_LIMIT
    return min(MAX_LIMIT, max(floor, math.floor(product)))


def scale_rate(rate: Rate, factor: float, floor: int) -> Rate:
    """`rate` with its limit, burst and refill multiplied by `factor`, limits at least `floor`.

    Limits stay within ``floor..MAX_LIMIT`` and a refill that would leave the
    positive finite numbers stays as it was: a configuration that validated
    never makes a request fail here.
    """
    limit = _scaled(rate.limit, factor, floor)
    burst = None if rate.burst is None else _scaled(rate.burst, factor, floor)
    refill = rate.refill_per_second
    if refill is not None and 0 < refill * factor < math.inf:
        refill *= factor
    return replace(rate, limit=limit, burst=burst, refill_per_second=refill)


class ScaledRates:
    """`scale_rate` over a tuple of rates, memoised (a handful of factors recur)."""

    def __init__(self, size: int = 4096) -> None:
        self._cache: dict[tuple[int, float, int], tuple[Rates, Rates]] = {}
        self._size = size

    def __call__(self, rates: Rates, factor: float, floor: int) -> Rates:
        if factor == 1.0 and (floor == 1 or all(r.capacity >= floor for r in rates)):
            return rates
        key = (id(rates), factor, floor)
        hit = self._cache.get(key)
        if hit is not None and hit[0] is rates:
            return hit[1]
        scaled = tuple(scale_rate(r, factor, floor) for r in rates)
        if len(self._cache) >= self._size:
            self._cache.clear()
        self._cache[key] = (rates, scaled)
        return scaled


class Plans:
    """Tenant → plan, seeded by the app (from its tenant service); entries expire.

    The limiter never asks a database for a plan: a miss or an expired
    entry is simply 1x. Thread-safe; bounded (the oldest entries go first).
    """

    def __init__(
        self, *, ttl: float | str | dt.timedelta = 300.0, max_entries: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:  # fmt: skip
        self._ttl = check_span("ttl", ttl)
        self._max = max_entries
        self._clock = clock
        self._entries: dict[str, tuple[str, float]] = {}
        self._lock = threading.Lock()

    def seed(
        self, tenant: str, plan: str, *, ttl: float | str | dt.timedelta | None = None
    ) -> None:
        """Remember that `tenant` is on `plan` for `ttl` seconds (default: the cache's).

        `ttl` (here and for the cache) is seconds, a duration like ``"5m"`` or a
        `datetime.timedelta`; anything else is a `quota.ConfigurationError`.
        """
        expires = self._clock() + (self._ttl if ttl is None else check_span("ttl", ttl))
        with self._lock:
            self._entries.pop(tenant, None)
            if len(self._entries) >= self._max:
                del self._entries[next(iter(self._entries))]
            self._entries[tenant] = (plan, expires)

    def forget(self, tenant: str) -> None:
        with self._lock:
            self._entries.pop(tenant, None)

    def plan(self, tenant: str | None) -> str | None:
        """`tenant`'s plan, or None when unknown or expired."""
        if tenant is None:
            return None
        entry = self._entries.get(tenant)
        if entry is None or entry[1] <= self._clock():
            return None
        return entry[0]


class SystemPressure:
    """System pressure in 0..1: an EWMA of max(CPU load per core, memory in use).

    Sampled at most once per `interval` seconds from ``os.getloadavg`` and
    ``/proc/meminfo`` (memory counts as 0 where that file is missing).
    Inject `sample` (returning a raw 0..1 reading) to drive it in tests.
    """

    def __init__(
        self, *, alpha: float = 0.3, interval: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        sample: Callable[[], float] | None = None,
    ) -> None:  # fmt: skip
        if not 0 < alpha <= 1:
            raise ConfigurationError(f"alpha must be in (0, 1], got {alpha!r}")
        self._alpha = alpha
        self._interval = interval
        self._clock = clock
        self._sample = sample or _system_sample
        self._value: float | None = None
        self._at = -math.inf

    def __call__(self) -> float:
        now = self._clock()
        if now - self._at >= self._interval:
            self._at = now
            reading = min(1.0, max(0.0, self._sample()))
            self._value = (
                reading
                if self._value is None
                else self._alpha * reading + (1 - self._alpha) * self._value
            )
        return self._value or 0.0


def _system_sample() -> float:
    cpu = 0.0
    with contextlib.suppress(OSError):
        cpu = os.getloadavg()[0] / (os.cpu_count() or 1)
    memory = 0.0
    try:
        with open("/proc/meminfo") as meminfo:
            values = {
                line.split(":")[0]: int(line.split()[1]) for line in meminfo if line.count(":") == 1
            }
        memory = 1 - values["MemAvailable"] / values["MemTotal"]
    except (OSError, KeyError, ValueError, IndexError, ZeroDivisionError):
        pass
    return min(1.0, max(cpu, memory))
