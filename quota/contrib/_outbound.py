"""Outbound limits: what the httpx, requests and aiohttp integrations share.

An outbound call waits out the key's pause (`Limiter.paused`), then tries for its slot
under the key's rates (`Limiter.acquire` with no wait), sleeping until the slot opens
and reading the pause again before each try, and only then goes out; its response is read
for a provider saying to slow down (`quota.contrib._provider.provider_pause`), which
pauses the key in the store for every process (`Limiter.pause`). A 429 or 503 to an
idempotent request with a body that can be sent again is sent again after the pause,
up to `max_retries` times. `timeout` covers the whole call: slots, pauses and retries.

The flow is written once, without I/O (`Outbound.flow`, a generator of steps); each
integration drives it with its library's send and its limiter's face (`SyncCall`,
`AsyncCall`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections.abc import Awaitable, Callable, Generator
from typing import Any, Generic, TypeVar

from quota._core.algorithms import Rate, window_start
from quota._core.decision import Decision, _decision
from quota._core.errors import ConfigurationError, RateLimitTimeout
from quota._core.rates import as_rates
from quota._core.waiting import MAX_TIMEOUT, check_timeout, jitter_spread, pause
from quota.contrib._provider import IDEMPOTENT, Headers, provider_pause

log = logging.getLogger("quota")

R = TypeVar("R")  # a library's request
S = TypeVar("S")  # a library's response

#: The most times one call may be sent again after a 429 or 503.
MAX_RETRIES = 100
#: Statuses whose request is sent again after the pause they asked for.
RETRIED = frozenset({429, 503})

# The steps `Outbound.flow` yields, and what the driver sends back for each.
TRY = "try"  # (TRY, key, None) -> the Decision of one try for a slot (`acquire`, timeout 0)
PAUSED = "paused"  # (PAUSED, key, None) -> seconds the key stays paused
SLEEP = "sleep"  # (SLEEP, None, seconds) -> None
SEND = "send"  # (SEND, None, None) -> (status, headers) of the response
PAUSE = "pause"  # (PAUSE, key, seconds) -> None (a store that fails is logged)
DISCARD = "discard"  # (DISCARD, None, None) -> None: the response will not be returned
Step = tuple[str, Any, Any]
Flow = Generator[Step, Any, None]


def paused_decision(key: str, rate: Rate, now: float, seconds: float) -> Decision:
    """A denial of `key` under `rate` while its pause has `seconds` left."""
    start = int(window_start(now, rate.window))
    return _decision(
        False, key, rate.capacity, 0, rate.capacity, rate.window, start + rate.window,
        max(1, math.ceil(seconds)), seconds,
    )  # fmt: skip


def _check_retries(max_retries: object) -> int:
    if (
        isinstance(max_retries, bool)
        or not isinstance(max_retries, int)
        or not 0 <= max_retries <= MAX_RETRIES
    ):
        raise ConfigurationError(
            f"max_retries must be a whole number between 0 and {MAX_RETRIES}, got {max_retries!r}"
        )
    return max_retries


def _check_pause(max_pause: object) -> float:
    if (
        isinstance(max_pause, bool)
        or not isinstance(max_pause, (int, float))
        or not 0 < max_pause <= MAX_TIMEOUT
    ):
        raise ConfigurationError(
            f"max_pause must be seconds above 0 and at most {MAX_TIMEOUT:g}, got {max_pause!r}"
        )
    return float(max_pause)


class Outbound(Generic[R]):
    """One integration's settings, checked once, and the flow of each call.

    `limiter` is a `quota.Limiter` or `quota.AsyncLimiter`; `rates` as for `hit`;
    `key` a string, a callable of the library's request, or None for `origin`
    of the request; `face` the limiter class the integration drives. Raises `ConfigurationError` naming the argument for a bad one.
    """

    def __init__(
        self, limiter: Any, rates: Any, *, key: str | Callable[[R], str] | None,
        timeout: float, max_retries: int, max_pause: float, origin: Callable[[R], str],
        face: type[Any],
    ) -> None:  # fmt: skip
        if not isinstance(limiter, face):
            raise ConfigurationError(f"limiter must be a quota.{face.__name__}, got {limiter!r}")
        self.limiter: Any = limiter
        self.rates: list[Rate] = as_rates(rates)
        if key is not None and not callable(key) and not (isinstance(key, str) and key):
            raise ConfigurationError(
                f"key must be a non-empty str, a callable of the request, or None, got {key!r}"
            )
        self._key = key
        self._origin = origin
        self.timeout = check_timeout(timeout)
        self.max_retries = _check_retries(max_retries)
        self.max_pause = _check_pause(max_pause)
        self.clock: Callable[[], float] = limiter.options.app_clock
        self.sleep: Callable[[float], Any] | None = limiter.options.sleep
        self._spread = jitter_spread(min(1.0 / rate.rate for rate in self.rates))

    def key_of(self, request: R) -> str:
        """The key `request` counts on."""
        key = self._key
        if key is None:
            return self._origin(request)
        if isinstance(key, str):
            return key
        chosen = key(request)
        if not isinstance(chosen, str) or not chosen:
            raise ConfigurationError(
                f"key({request!r}) must return a non-empty str, got {chosen!r}"
            )
        return chosen

    def flow(self, key: str, method: str, replayable: bool) -> Flow:
        """One call: wait for the slot and the pause, send, read the answer, maybe again.

        Raises `RateLimitTimeout` before a request that could not go out in time: at
        once when the slot opens, or the pause ends, past the timeout (as `acquire`).
        Each try for a slot follows a read of the pause, so a key paused while its
        callers wait spends no slot; a denied try is never charged.
        """
        started = self.clock()
        retries = 0
        while True:
            tries = 0
            while True:
                # The pause before each try for a slot: a paused key spends none.
                paused = yield PAUSED, key, None
                if paused:
                    wait, denial = paused, None
                else:
                    decision = yield TRY, key, None
                    if decision.allowed:
                        break
                    wait, denial = decision.retry_after_exact, decision
                tries += 1
                now = self.clock()
                sleep = pause(
                    wait, self.timeout - (now - started), attempt=tries, spread=self._spread,
                    draw=random.random(),
                )  # fmt: skip
                if sleep is None:
                    if denial is None:
                        raise RateLimitTimeout(
                            f"{key!r} is paused for {wait:.3f}s more, past the timeout of"
                            f" {self.timeout:g}s",
                            decision=paused_decision(key, self.rates[0], now, wait),
                        )
                    raise RateLimitTimeout(
                        f"no slot for {key!r} within {self.timeout:g}s"
                        f" (the next opens in {wait:.3f}s)",
                        decision=denial,
                    )
                yield SLEEP, None, sleep
            status, headers = yield SEND, None, None
            seconds = self.heard(status, headers)
            if seconds is None:
                return
            yield PAUSE, key, seconds
            if (
                status not in RETRIED
                or retries >= self.max_retries
                or method.upper() not in IDEMPOTENT
                or not replayable
            ):
                return
            retries += 1
            yield DISCARD, None, None

    def heard(self, status: int, headers: Headers) -> float | None:
        """Seconds to pause the key for, per one response (None: it asks for nothing)."""
        return provider_pause(status, headers, max_pause=self.max_pause, now=self.clock())


def _paused_failed(key: str) -> None:
    log.warning(
        "quota: could not pause %r in the store; this process goes on without the pause",
        key,
        exc_info=True,
    )


class SyncCall(Generic[S]):
    """Drives `Outbound.flow` with a sync limiter and a sync send."""

    def __init__(self, outbound: Outbound[Any]) -> None:
        self.outbound = outbound

    def run(
        self, flow: Flow, send: Callable[[], S], seen: Callable[[S], tuple[int, Headers]],
        discard: Callable[[S], None],
    ) -> S:  # fmt: skip
        """The response to return; whatever `send` raises, or `RateLimitTimeout`, goes up."""
        limiter = self.outbound.limiter
        rates = self.outbound.rates
        sleep = self.outbound.sleep or time.sleep
        response: S | None = None
        reply: Any = None
        while True:
            try:
                step, key, arg = flow.send(reply)
            except StopIteration:
                assert response is not None
                return response
            reply = None
            if step is TRY:
                try:
                    reply = limiter.acquire(key, rates, timeout=0.0)
                except RateLimitTimeout as denied:
                    reply = denied.decision
            elif step is PAUSED:
                reply = limiter.paused(key)
            elif step is SEND:
                response = send()
                reply = seen(response)
            elif step is SLEEP:
                sleep(arg)
            elif step is PAUSE:
                try:
                    limiter.pause(key, arg)
                except Exception:
                    _paused_failed(key)
                    flow.close()
                    assert response is not None
                    return response
            else:  # DISCARD
                assert response is not None
                discard(response)
                response = None


class AsyncCall(Generic[S]):
    """Drives `Outbound.flow` with an async limiter and an async send."""

    def __init__(self, outbound: Outbound[Any]) -> None:
        self.outbound = outbound

    async def run(
        self, flow: Flow, send: Callable[[], Awaitable[S]],
        seen: Callable[[S], tuple[int, Headers]], discard: Callable[[S], Awaitable[None]],
    ) -> S:  # fmt: skip
        """The response to return; whatever `send` raises, or `RateLimitTimeout`, goes up."""
        limiter = self.outbound.limiter
        rates = self.outbound.rates
        sleep = self.outbound.sleep  # an injected sleep is called, never awaited (`Options.sleep`)
        response: S | None = None
        reply: Any = None
        while True:
            try:
                step, key, arg = flow.send(reply)
            except StopIteration:
                assert response is not None
                return response
            reply = None
            if step is TRY:
                try:
                    reply = await limiter.acquire(key, rates, timeout=0.0)
                except RateLimitTimeout as denied:
                    reply = denied.decision
            elif step is PAUSED:
                reply = await limiter.paused(key)
            elif step is SEND:
                response = await send()
                reply = seen(response)
            elif step is SLEEP:
                if sleep is None:
                    await asyncio.sleep(arg)
                else:
                    sleep(arg)
            elif step is PAUSE:
                try:
                    await limiter.pause(key, arg)
                except Exception:
                    _paused_failed(key)
                    flow.close()
                    assert response is not None
                    return response
            else:  # DISCARD
                assert response is not None
                await discard(response)
                response = None
