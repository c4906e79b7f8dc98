"""Helpers shared by the tests: the table of stores, an injectable clock and one sync face
over every backend.

Kept out of ``conftest.py`` so that test modules (and spawned worker
processes) can import them by name.
"""

from __future__ import annotations

import asyncio
import ctypes
import math
import signal
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit

import quota
from quota._core.url import DIALECTS

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class TestStore:
    """How the tests reach one declared store (`quota._core.url.DIALECTS`)."""

    url: str
    """The fixture of tests/conftest.py that gives a test an empty store of it: a new
    SQLite file, the session's PostgreSQL database (from the environment) emptied, a named
    memory store, a key prefix on Redis (from the environment) or on the private Redis
    Cluster (tests/_redis_cluster.py)."""
    mark: str | None = None
    """The marker of its rows (a server it needs), None when it always runs."""

    __test__ = False  # not a test class, whatever its name


#: The one table of stores the tests run on: an entry for every declared store, in the
#: order of the declaration (tests/test_generated.py checks that none is missing).
STORES: dict[str, TestStore] = {
    "sqlite": TestStore("sqlite_url"),
    "postgresql": TestStore("pg_store_url", "postgres"),
    "memory": TestStore("memory_url"),
    "redis": TestStore("redis_url", "redis"),
    "redis-cluster": TestStore("redis_cluster_url", "redis"),
}
#: The faces of a backend row: ``<dialect>-<face>``.
FACES = ("sync", "async")


def faces(*dialects: str) -> tuple[str, ...]:
    """The rows of `dialects`, each face: ``("sqlite",)`` -> ``("sqlite-sync", "sqlite-async")``."""
    return tuple(f"{dialect}-{face}" for dialect in dialects for face in FACES)


def split_row(name: str) -> tuple[str, str | None]:
    """A row's dialect and face: ``"redis-cluster-async"`` -> ``("redis-cluster", "async")``;
    a bare dialect has no face."""
    if name in DIALECTS:
        return name, None
    dialect, _, face = name.rpartition("-")
    return dialect, face


#: The rows of the SQL stores, both faces.
SQLITE_FACES = faces("sqlite")
POSTGRES_FACES = faces("postgresql")

#: A fixed instant, mid-minute and mid-hour, with a fractional second so
#: rounding mistakes show: 1_750_003_200 is a whole hour.
T0 = 1_750_003_200 + 1234.25


class Clock:
    """A clock the tests move by hand; pass it as ``clock=`` to `quota.connect`."""

    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def window_start(now: float, window: int) -> int:
    """The start of the epoch-aligned window holding `now`, as the spec states it."""
    return int(now - now % window)


def expected_retry_after(reset_at: int, now: float) -> int:
    """Whole seconds until `reset_at`, rounded up, as the spec states it."""
    return math.ceil(reset_at - now)


def with_database(url: str, name: str) -> str:
    """`url` pointing at database `name` on the same server."""
    return urlsplit(url)._replace(path="/" + name).geturl()


#: The `open_backend` fixture: ``open_backend("sqlite-sync", url, **options)``.
OpenBackend = Callable[..., "Backend"]


class Face:
    """One limiter (sync or async) behind plain sync methods.

    An async limiter's coroutines run on the event loop of the `Backend`
    that made this face, so every call shares one loop and its connections.
    """

    def __init__(self, limiter: Any, run: Callable[[Any], Any]) -> None:
        self.limiter = limiter
        self._run = run

    def rate_limit(self, key: Any, limit: Any, window: Any, **kwargs: Any) -> quota.Decision:
        return self._run(self.limiter.rate_limit(key, limit, window, **kwargs))  # type: ignore[no-any-return]

    def peek(self, key: Any, limit: Any, window: Any, **kwargs: Any) -> quota.Decision:
        return self._run(self.limiter.peek(key, limit, window, **kwargs))  # type: ignore[no-any-return]

    def hit(self, key: Any, rates: Any, **kwargs: Any) -> quota.Decision:
        return self._run(self.limiter.hit(key, rates, **kwargs))  # type: ignore[no-any-return]

    def acquire(self, key: Any, rates: Any, **kwargs: Any) -> quota.Decision:
        return self._run(self.limiter.acquire(key, rates, **kwargs))  # type: ignore[no-any-return]

    def reset(self, key: Any, window: Any = None) -> int:
        return self._run(self.limiter.reset(key, window))  # type: ignore[no-any-return]

    def pause(self, key: Any, seconds: Any) -> float:
        return self._run(self.limiter.pause(key, seconds))  # type: ignore[no-any-return]

    def paused(self, key: Any) -> float:
        return self._run(self.limiter.paused(key))  # type: ignore[no-any-return]

    def cleanup(self, **kwargs: Any) -> quota.CleanupResult:
        return self._run(self.limiter.cleanup(**kwargs))  # type: ignore[no-any-return]

    def top(self, n: int = 10) -> list[quota.Usage]:
        return self._run(self.limiter.top(n))  # type: ignore[no-any-return]

    def close_connections(self) -> None:
        """`Limiter.close` or `AsyncLimiter.aclose`; the limiter stays usable."""
        if isinstance(self.limiter, quota.AsyncLimiter):
            self._run(self.limiter.aclose())
        else:
            self.limiter.close()


class Backend(Face):
    """One row of the backend table: a store URL, a face (sync/async) and a clock.

    It is itself the face of its default limiter; `connect` makes more faces
    on the same database (other options), all closed by `close`.
    """

    def __init__(self, name: str, url: str, clock: Clock, **options: Any) -> None:
        self.name = name
        self.dialect, face = split_row(name)
        self.is_async = face == "async"
        self.url = url
        self.clock = clock
        self._loop = asyncio.new_event_loop() if self.is_async else None
        self._limiters: list[Any] = []
        try:
            default = self.connect(**options)
        except BaseException:
            self.close()
            raise
        super().__init__(default.limiter, self._run_value)

    def _run_value(self, value: Any) -> Any:
        if self._loop is None:
            return value
        return self._loop.run_until_complete(value)

    def run(self, awaitable: Awaitable[T]) -> T:
        """Run a coroutine on this backend's loop (async faces only)."""
        assert self._loop is not None, f"{self.name} has no event loop"
        return self._loop.run_until_complete(awaitable)

    def connect(self, **options: Any) -> Face:
        """Another limiter on the same database and face; ``clock`` defaults to ours."""
        options.setdefault("clock", self.clock)
        factory = quota.connect_async if self.is_async else quota.connect
        limiter = factory(self.url, **options)
        self._limiters.append(limiter)
        return Face(limiter, self._run_value)

    def close(self) -> None:
        """Close every limiter this backend made, then its event loop. Idempotent."""
        limiters, self._limiters = self._limiters, []
        if self._loop is None:
            for limiter in limiters:
                limiter.close()
            return
        if self._loop.is_closed():
            return
        try:
            for limiter in limiters:
                self._loop.run_until_complete(limiter.aclose())
            self._loop.run_until_complete(self._loop.shutdown_asyncgens())
        finally:
            self._loop.close()


def parent_death_signal() -> Callable[[], None] | None:
    """What the child calls before exec to get SIGTERM when the tests die (Linux only).

    Prepare it in the parent (a child that switched user may not read this Python's
    files to import anything) and pass it as ``preexec_fn``: it runs after Popen's
    switch of user, which would have cleared it.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig = 1

    def set_signal() -> None:  # pragma: no cover - runs in the child
        prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)

    return set_signal
