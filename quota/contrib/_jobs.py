"""Task limits: what the Celery, arq and dramatiq integrations share.

A limited task is admitted before its body runs: first a concurrency slot when
`concurrency` is set (`Limiter.concurrency`, one try), then a hit under every rate
(`Limiter.acquire` with no wait, all or nothing across the rates). A task that is
not admitted is *deferred*: the integration hands it back to its framework to run
again after `Admission.delay` seconds (Celery's ``retry``, arq's ``Retry``,
dramatiq's ``Retry``), so no worker sleeps while a task waits for its turn. A slot
taken for a task that is then denied by a rate is given back at once.

The delay of a deferral:

- denied by a rate: when the rate's slot opens (`Decision.retry_after_exact`), plus
  one window for each `limit` tasks already deferred on the key and not yet due, plus
  a jitter of up to one slot's share of the window (between 50 ms and 1 s). The
  deferred tasks of a key thus form a queue: each takes a ticket (`queue_key`, a GCRA
  counter draining at the rate that denied it: one more statement per deferral) that
  says how many are ahead of it, and comes back in the window where its turn should
  be, instead of every deferred task coming back at each slot to be denied again.
  The order is kept only roughly (a task admitted at once takes a slot a ticket
  counted on, and a task that loses its slot takes a new ticket), and a ticket that
  cannot be taken (the store failing) leaves the plain delay;
- no concurrency slot free: `BUSY_DELAY` seconds, plus up to as much again of jitter
  (a lease frees no sooner than its holder ends, which nobody can foretell);
- the store failing (`quota.StorageError`, which a limiter with a fallback does
  not raise): `STORE_DELAY` seconds plus up to as much again; logged. A task is
  never run unchecked while its limit cannot be read, and never lost.

No delay is longer than `MAX_DELAY` (plus its jitter): a task whose slot is further
off comes back then and is deferred again. Brokers hold a deferred task for its whole
delay (Celery on Redis redelivers one held past the transport's visibility timeout,
an hour by default), and a short delay costs one statement.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import math
import os
import random
import threading
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from quota._core.algorithms import GCRA, Rate
from quota._core.decision import MAX_LIMIT, Decision
from quota._core.errors import ConfigurationError, RateLimitTimeout, StorageError
from quota._core.leases import MAX_LEASE, MAX_SLOTS, MIN_LEASE
from quota._core.rates import as_rates
from quota._core.url import default_url
from quota._limiter import AsyncLimiter, Limiter, connect, connect_async
from quota._limiter.leases import AsyncConcurrency, Concurrency

log = logging.getLogger("quota")

#: Seconds a task waits before trying again when every concurrency slot is taken.
BUSY_DELAY = 1.0
#: Seconds a task waits before trying again when the store fails.
STORE_DELAY = 5.0
#: The longest deferral, in seconds, before its jitter.
MAX_DELAY = 300.0
#: The jitter of a rate's deferral lies between these (seconds).
MIN_JITTER, MAX_JITTER = 0.05, 1.0

Key = str | Callable[..., str] | None


def queue_key(key: str) -> str:
    """The key of the ticket counter of the tasks deferred on `key`."""
    return f"{key}:deferred"


@functools.lru_cache(maxsize=256)
def queue_rate(limit: int, window: int) -> Rate:
    """The ticket counter of a key that a rate of `limit` per `window` denied: a GCRA
    that drains at that rate and holds `MAX_DELAY` seconds of tickets (and more: a
    ticket it denies only means the task is at least that far back)."""
    burst = min(MAX_LIMIT, math.ceil(limit * MAX_DELAY / window) + limit)
    return Rate(limit=limit, window=window, algorithm=GCRA, burst=burst)


@dataclass(frozen=True, slots=True)
class Admission:
    """What admitting one run of a task decided.

    `delay` is None when the task may run (holding `block`, if a concurrency slot
    was taken: `release` it when the run ends), else the seconds to defer it by;
    `reason` says why (``"rate"``, ``"busy"``, ``"store"``) and `decision` is the
    rate's denial when a rate denied.
    """

    delay: float | None
    reason: str = ""
    decision: Decision | None = None
    block: Concurrency | AsyncConcurrency | None = None

    @property
    def admitted(self) -> bool:
        return self.delay is None

    def release(self) -> None:
        """Frees the concurrency slot of a sync run (nothing without one)."""
        if isinstance(self.block, Concurrency):
            self.block.__exit__(None, None, None)

    async def release_async(self) -> None:
        """Frees the concurrency slot of an async run (nothing without one)."""
        if isinstance(self.block, AsyncConcurrency):
            await self.block.__aexit__(None, None, None)


def _check_concurrency(concurrency: object) -> int | None:
    if concurrency is None:
        return None
    if (
        isinstance(concurrency, bool)
        or not isinstance(concurrency, int)
        or not 1 <= concurrency <= MAX_SLOTS
    ):
        raise ConfigurationError(
            f"concurrency must be None or a whole number between 1 and {MAX_SLOTS},"
            f" got {concurrency!r}"
        )
    return concurrency


def _check_lease(lease: object) -> float:
    if (
        isinstance(lease, bool)
        or not isinstance(lease, (int, float))
        or not MIN_LEASE <= lease <= MAX_LEASE
    ):
        raise ConfigurationError(
            f"lease must be seconds between {MIN_LEASE:g} and {MAX_LEASE:g}, got {lease!r}"
        )
    return float(lease)


class JobLimit:
    """One decorated task's limit, checked once when the task is decorated.

    `rates` as for `Limiter.hit`; `key` a non-empty string, a callable of the task's
    own arguments returning one, or None for `name` (the task's name); `limiter` a
    `face` instance or None for the default one (opened on first use from
    ``$QUOTA_DATABASE_URL``, else the embedded SQLite file; one per process, and per
    event loop for the async face); `concurrency` None or the most runs at once
    across every worker, each holding a lease of `lease` seconds, renewed while it
    runs. Raises `ConfigurationError` naming the argument for a bad one.
    """

    def __init__(
        self, rates: Rate | str | Iterable[Rate], *, key: Key, limiter: Any,
        concurrency: int | None, lease: float, name: str, face: type[Any],
    ) -> None:  # fmt: skip
        if limiter is not None and not isinstance(limiter, face):
            raise ConfigurationError(
                f"limiter must be a quota.{face.__name__} or None, got {limiter!r}"
            )
        if key is not None and not callable(key) and not (isinstance(key, str) and key):
            raise ConfigurationError(
                f"key must be a non-empty str, a callable of the task's arguments, or None,"
                f" got {key!r}"
            )
        self.rates: list[Rate] = as_rates(rates)
        self.concurrency = _check_concurrency(concurrency)
        self.lease = _check_lease(lease)
        self.name = name
        self.face = face
        self._key = key
        self._limiter = limiter
        self._jitter = max(MIN_JITTER, min(MAX_JITTER, min(1.0 / r.rate for r in self.rates)))

    def key_of(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        """The key a run with these arguments counts on."""
        key = self._key
        if key is None:
            return self.name
        if isinstance(key, str):
            return key
        chosen = key(*args, **kwargs)
        if not isinstance(chosen, str) or not chosen:
            raise ConfigurationError(
                f"key(...) of task {self.name!r} must return a non-empty str, got {chosen!r}"
            )
        return chosen

    # -- the limiter ------------------------------------------------------------------------

    def limiter(self) -> Limiter:
        """The sync limiter: the one given, else this process's default."""
        return self._limiter if self._limiter is not None else default_limiter()

    def async_limiter(self) -> AsyncLimiter:
        """The async limiter: the one given, else the running loop's default."""
        return self._limiter if self._limiter is not None else default_async_limiter()

    # -- admission --------------------------------------------------------------------------

    def admit(self, key: str) -> Admission:
        """Admit one run on `key` with the sync limiter, or say how long to defer it."""
        limiter = self.limiter()
        block = None
        try:
            if self.concurrency is not None:
                block = limiter.concurrency(key, self.concurrency, lease=self.lease, timeout=0)
                try:
                    block.__enter__()
                except RateLimitTimeout:
                    return self._busy()
            try:
                limiter.acquire(key, self.rates, timeout=0.0)
            except RateLimitTimeout as exc:
                if block is not None:
                    block.__exit__(None, None, None)
                block = None
                decision = exc.decision
                if decision is None:
                    return self._denied(None, None)
                try:
                    ticket = limiter.hit(queue_key(key), _queue_rate(decision))
                except StorageError:
                    ticket = None
                return self._denied(decision, ticket)
        except StorageError as exc:
            if block is not None and block.holder is not None:
                block.__exit__(None, None, None)
            return self._store_failed(key, exc)
        return Admission(None, block=block)

    async def admit_async(self, key: str) -> Admission:
        """`admit` with the async limiter."""
        limiter = self.async_limiter()
        block = None
        try:
            if self.concurrency is not None:
                block = limiter.concurrency(key, self.concurrency, lease=self.lease, timeout=0)
                try:
                    await block.__aenter__()
                except RateLimitTimeout:
                    return self._busy()
            try:
                await limiter.acquire(key, self.rates, timeout=0.0)
            except RateLimitTimeout as exc:
                if block is not None:
                    await block.__aexit__(None, None, None)
                block = None
                decision = exc.decision
                if decision is None:
                    return self._denied(None, None)
                try:
                    ticket = await limiter.hit(queue_key(key), _queue_rate(decision))
                except StorageError:
                    ticket = None
                return self._denied(decision, ticket)
        except StorageError as exc:
            if block is not None and block.holder is not None:
                await block.__aexit__(None, None, None)
            return self._store_failed(key, exc)
        return Admission(None, block=block)

    def _denied(self, decision: Decision | None, ticket: Decision | None) -> Admission:
        """The deferral of a run `decision` denied; `ticket` its place in the key's queue."""
        if decision is None:
            wait = BUSY_DELAY
        else:
            wait = max(0.0, decision.retry_after_exact)
            if ticket is not None:
                if ticket.allowed:
                    ahead = max(0, ticket.limit - 1 - ticket.remaining)
                    wait += (ahead // max(1, decision.limit)) * decision.window
                else:
                    wait = MAX_DELAY
        return Admission(min(MAX_DELAY, wait) + self._jitter * random.random(), "rate", decision)

    def _busy(self) -> Admission:
        return Admission(BUSY_DELAY * (1.0 + random.random()), "busy")

    def _store_failed(self, key: str, exc: StorageError) -> Admission:
        delay = STORE_DELAY * (1.0 + random.random())
        log.warning(
            "quota: the limit of task %s (key %r) could not be read (%s); deferred by %.1fs",
            self.name, key, exc, delay,
        )  # fmt: skip
        return Admission(delay, "store")


def check_sync(func: Callable[..., Any], framework: str) -> None:
    """Refuses a coroutine function where the framework runs sync tasks."""
    if inspect.iscoroutinefunction(func):
        raise ConfigurationError(
            f"{framework} tasks are functions, got the coroutine function {func.__qualname__!r}"
        )


# -- the default limiters ----------------------------------------------------------------------

_lock = threading.Lock()
_sync: tuple[int, Limiter] | None = None
_inherited: list[Limiter] = []  # a parent's limiter, kept (not closed) in a forked child
_async: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AsyncLimiter] = (
    weakref.WeakKeyDictionary()
)


def default_limiter() -> Limiter:
    """This process's sync limiter on the default URL, opened on first use.

    A forked child (a prefork worker started after the parent opened one) opens its
    own: the parent's connections are not the child's to use, nor to close.
    """
    global _sync
    pid = os.getpid()
    current = _sync
    if current is not None and current[0] == pid:
        return current[1]
    with _lock:
        current = _sync
        if current is not None and current[0] == pid:
            return current[1]
        if current is not None:
            _inherited.append(current[1])
        limiter = connect(default_url())
        _sync = (pid, limiter)
        return limiter


def default_async_limiter() -> AsyncLimiter:
    """The running event loop's async limiter on the default URL, opened on first use."""
    loop = asyncio.get_running_loop()
    limiter = _async.get(loop)
    if limiter is None:
        limiter = _async[loop] = connect_async(default_url())
    return limiter


def _queue_rate(decision: Decision) -> Rate:
    return queue_rate(max(1, decision.limit), max(1, decision.window))
