"""Load shedding: a ceiling on work in flight, answered with 503 and ``Retry-After``.

`ConcurrencyGuard` counts the requests running inside it. One more than its
ceiling raises `quota.Overloaded` at once instead of queueing, so a flood
that gets past the edge costs a cheap 503, not memory and a slow database.
The count is taken and given back in two plain methods (`_take`, `_give`)
under a `threading.Lock` that is never held across an ``await``; the sync and
async context managers, the decorators and `SheddingMiddleware` are thin
shells around them, so one guard can serve threads and tasks at once.

The guard fails open: if its own bookkeeping breaks, the request is served
and the failure logged (at most once a minute), because a guard must never
block the traffic it protects.

`SheddingMiddleware` wraps any ASGI app (no framework needed)::

    from quota.http.shedding import ConcurrencyGuard, SheddingMiddleware

    app = SheddingMiddleware(app, ConcurrencyGuard.from_env(ceiling=64))
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping, MutableMapping
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar, overload

from quota._core.decision import check_int
from quota._core.errors import ConfigurationError, Overloaded
from quota._core.parsing import parse_whole

if TYPE_CHECKING:
    from quota._wrappers.metrics import Metrics

P = ParamSpec("P")
R = TypeVar("R")

log = logging.getLogger("quota")

ENV_CEILING = "QUOTA_SHED_CEILING"
ENV_RETRY_AFTER = "QUOTA_SHED_RETRY_AFTER"
MAX_CEILING = 1_000_000
MAX_RETRY_AFTER = 86_400
#: Seconds between two log lines about the guard's own failures.
FAILURE_LOG_INTERVAL = 60.0


class ConcurrencyGuard:
    """At most `ceiling` requests in flight; the next one gets `quota.Overloaded`.

    Use it as ``with guard:`` / ``async with guard:`` or as a decorator on a
    sync or async function. The slot is given back when the block ends:
    on success, on an exception, and on cancellation. Safe to share between
    threads and between the tasks of an event loop.

    `retry_after` is the whole seconds a shed client is told to wait.
    `route` labels the sheds in `metrics` (``quota_shed_total{route}``).
    Raises `ConfigurationError` naming the field when a value is invalid.
    """

    def __init__(
        self,
        ceiling: int,
        retry_after: int = 1,
        *,
        metrics: Metrics | None = None,
        route: str = "",
    ) -> None:
        self._ceiling = check_int("ceiling", ceiling, maximum=MAX_CEILING)
        self._retry_after = check_int("retry_after", retry_after, maximum=MAX_RETRY_AFTER)
        if not isinstance(route, str):
            raise ConfigurationError(f"route must be a str, got {route!r}")
        self._metrics = metrics
        self._route = route
        self._message = (
            f"shed: {self._ceiling} request(s) already in flight, the ceiling;"
            f" retry after {self._retry_after}s"
        )
        self._lock = threading.Lock()
        self._in_flight = 0
        self._failures = 0
        self._failure_logged_at = -FAILURE_LOG_INTERVAL
        # What each `with` / `async with` took, innermost last: the guard is
        # shared, so this cannot live on the instance. Threads and tasks each
        # see their own context.
        self._held: contextvars.ContextVar[tuple[bool, ...]] = contextvars.ContextVar(
            f"quota_guard_{id(self):x}", default=()
        )

    @classmethod
    def from_env(
        cls,
        *,
        ceiling: int | None = None,
        retry_after: int = 1,
        environ: Mapping[str, str] | None = None,
        metrics: Metrics | None = None,
        route: str = "",
    ) -> ConcurrencyGuard:
        """A guard configured by ``$QUOTA_SHED_CEILING`` and ``$QUOTA_SHED_RETRY_AFTER``.

        Each variable, when set, overrides the argument of the same name;
        `environ` defaults to `os.environ`. Raises `ConfigurationError` naming
        the variable when one holds no positive whole number, or when no
        ceiling is given either way.
        """
        env = os.environ if environ is None else environ
        env_ceiling = _env_int(env, ENV_CEILING, MAX_CEILING)
        env_retry = _env_int(env, ENV_RETRY_AFTER, MAX_RETRY_AFTER)
        if env_ceiling is not None:
            ceiling = env_ceiling
        if ceiling is None:
            raise ConfigurationError(
                f"no shedding ceiling: set {ENV_CEILING} or pass ceiling= to from_env()"
            )
        return cls(
            ceiling,
            env_retry if env_retry is not None else retry_after,
            metrics=metrics,
            route=route,
        )

    @property
    def ceiling(self) -> int:
        """The most requests allowed in flight at once."""
        return self._ceiling

    @property
    def retry_after(self) -> int:
        """Seconds a shed client is told to wait (the ``Retry-After`` value)."""
        return self._retry_after

    @property
    def route(self) -> str:
        """The label this guard's sheds are counted under."""
        return self._route

    @property
    def in_flight(self) -> int:
        """Requests inside the guard right now."""
        return self._in_flight

    def __repr__(self) -> str:
        return (
            f"ConcurrencyGuard(ceiling={self._ceiling}, retry_after={self._retry_after},"
            f" in_flight={self._in_flight})"
        )

    # -- the accounting, written once --------------------------------------------

    def _take(self) -> bool:
        """Take a slot: True if taken, False if the guard failed (serve anyway).

        Raises `Overloaded` when the ceiling is reached.
        """
        try:
            with self._lock:
                if self._in_flight >= self._ceiling:
                    shed = True
                else:
                    self._in_flight += 1
                    shed = False
        except Exception as exc:
            self._failed("taking a slot", exc)
            return False
        if shed:
            if self._metrics is not None:
                try:
                    self._metrics.record_shed(self._route)
                except Exception as exc:
                    self._failed("counting a shed request", exc)
            raise Overloaded(self._message, retry_after=self._retry_after)
        return True

    def _give(self, taken: bool) -> None:
        """Give back a slot that `_take` took."""
        if not taken:
            return
        try:
            with self._lock:
                self._in_flight -= 1
        except Exception as exc:
            self._failed("giving a slot back", exc)

    def _failed(self, doing: str, exc: Exception) -> None:
        # Never raises: the request goes on whatever happens here.
        try:
            now = time.monotonic()
            self._failures += 1
            if now - self._failure_logged_at < FAILURE_LOG_INTERVAL:
                return
            self._failure_logged_at = now
            log.error(
                "quota: the concurrency guard failed %s; serving the request anyway"
                " (%d failure(s) so far, logged at most once a minute)",
                doing,
                self._failures,
                exc_info=exc,
            )
        except Exception:  # pragma: no cover - logging itself broke
            pass

    # -- thin shells ---------------------------------------------------------------

    def _push(self) -> None:
        taken = self._take()
        try:
            self._held.set((*self._held.get(), taken))
        except Exception as exc:  # pragma: no cover - contextvars do not fail
            self._give(taken)
            self._failed("remembering a slot", exc)

    def _pop(self) -> None:
        try:
            held = self._held.get()
            self._held.set(held[:-1])
            taken = held[-1]
        except Exception as exc:
            self._failed("finding the slot to give back", exc)
            return
        self._give(taken)

    def __enter__(self) -> ConcurrencyGuard:
        self._push()
        return self

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        self._pop()

    async def __aenter__(self) -> ConcurrencyGuard:
        self._push()
        return self

    async def __aexit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        self._pop()

    @overload
    def __call__(
        self, fn: Callable[P, Coroutine[Any, Any, R]]
    ) -> Callable[P, Coroutine[Any, Any, R]]: ...
    @overload
    def __call__(self, fn: Callable[P, R]) -> Callable[P, R]: ...
    def __call__(self, fn: Callable[P, Any]) -> Callable[P, Any]:
        """Decorate `fn` (sync or async) so each call runs inside the guard."""
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def guarded_async(*args: P.args, **kwargs: P.kwargs) -> Any:
                taken = self._take()
                try:
                    return await fn(*args, **kwargs)
                finally:
                    self._give(taken)

            return guarded_async

        @functools.wraps(fn)
        def guarded(*args: P.args, **kwargs: P.kwargs) -> Any:
            taken = self._take()
            try:
                return fn(*args, **kwargs)
            finally:
                self._give(taken)

        return guarded


def _env_int(env: Mapping[str, str], name: str, maximum: int) -> int | None:
    raw = env.get(name)
    if raw is None or not raw.strip():
        return None
    number = parse_whole(raw)
    if number is None or not 1 <= number <= maximum:
        raise ConfigurationError(
            f"{name} must be a whole number between 1 and {maximum}, got {raw!r}"
        )
    return number


# -- ASGI ------------------------------------------------------------------------------

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class SheddingMiddleware:
    """Raw ASGI middleware: HTTP requests over the guard's ceiling get a 503.

    The answer carries ``Retry-After`` and a small JSON body
    (``{"error": "overloaded", "detail": …, "retry_after": n}``). Lifespan
    and websocket scopes pass straight through, unguarded. An `Overloaded`
    raised by the app itself (an inner guard) is not caught here.
    """

    def __init__(self, app: ASGIApp, guard: ConcurrencyGuard) -> None:
        if not isinstance(guard, ConcurrencyGuard):
            raise ConfigurationError(f"guard must be a ConcurrencyGuard, got {guard!r}")
        self.app = app
        self.guard = guard

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            taken = self.guard._take()
        except Overloaded as exc:
            await _send_503(send, exc)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            self.guard._give(taken)


async def _send_503(send: Send, exc: Overloaded) -> None:
    from quota.http._responses import overloaded

    response = overloaded(exc.retry_after, str(exc))
    headers = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in response.headers]
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": response.body})
