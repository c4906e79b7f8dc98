"""Bounded pools: many threads share few connections, idle ones close, close() closes all.

The PostgreSQL tests connect as a role of their own with a ``CONNECTION LIMIT``, so a
store that opened a connection per thread fails here with "too many connections for
role" instead of exhausting the shared server; ``pg_stat_activity`` counts that role's
sessions.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from urllib.parse import urlsplit

import pytest

import quota
from quota._core.errors import StorageError
from quota._stores.pool import PoolTimeout, SyncPool

#: The role's connection limit: above every pool size used here, far below 200 threads.
ROLE_LIMIT = 8


# -- SyncPool on its own, with an injected clock ------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Conns:
    """Stand-in connections: numbers, with a log of what was opened and closed."""

    def __init__(self) -> None:
        self.opened: list[int] = []
        self.closed: list[int] = []

    def open(self) -> int:
        self.opened.append(len(self.opened))
        return self.opened[-1]

    def close(self, conn: int) -> None:
        self.closed.append(conn)


def test_pool_reuses_one_connection_for_sequential_calls() -> None:
    conns = Conns()
    pool = SyncPool(conns.open, conns.close, size=3, wait_timeout=1)
    for _ in range(10):
        pool.release(pool.acquire())
    assert conns.opened == [0]
    assert pool.opened == 1
    pool.close()
    assert conns.closed == [0]


def test_pool_never_opens_more_than_its_size_and_a_full_pool_times_out() -> None:
    conns = Conns()
    pool = SyncPool(conns.open, conns.close, size=2, wait_timeout=0.05)
    held = [pool.acquire(), pool.acquire()]
    with pytest.raises(PoolTimeout, match="all 2 connections stayed busy"):
        pool.acquire()
    assert conns.opened == [0, 1]
    pool.release(held.pop())
    assert pool.acquire() == 1  # the freed one, not a third


@pytest.mark.parametrize(
    ("give_back", "handed"),
    [("release", 0), ("discard", 1)],  # the connection itself, or a new one in its slot
)
def test_a_waiting_thread_gets_what_frees_up(give_back: str, handed: int) -> None:
    conns = Conns()
    pool = SyncPool(conns.open, conns.close, size=1, wait_timeout=5)
    first = pool.acquire()
    got: list[int] = []
    waiter = threading.Thread(target=lambda: got.append(pool.acquire()))
    waiter.start()
    deadline = time.monotonic() + 5
    while pool._waiting == 0 and time.monotonic() < deadline:
        time.sleep(0.001)
    getattr(pool, give_back)(first)
    waiter.join(5)
    assert got == [handed]
    assert pool.opened == 1


def test_discard_frees_the_slot_and_closes_the_connection() -> None:
    conns = Conns()
    pool = SyncPool(conns.open, conns.close, size=1, wait_timeout=0.05)
    pool.discard(pool.acquire())
    assert conns.closed == [0]
    assert pool.acquire() == 1  # a new one in the freed slot


def test_reap_closes_connections_idle_past_the_timeout_oldest_first() -> None:
    conns = Conns()
    clock = FakeClock()
    pool = SyncPool(conns.open, conns.close, size=3, wait_timeout=1, idle_timeout=10, clock=clock)
    a, b = pool.acquire(), pool.acquire()
    pool.release(a)
    clock.now += 6
    pool.release(b)
    clock.now += 5  # a idle 11 s, b idle 5 s
    assert pool.reap() == 1
    assert conns.closed == [a]
    assert pool.opened == 1
    clock.now += 10
    assert pool.reap() == 1
    assert conns.closed == [a, b]
    assert pool.opened == 0
    pool.close()


def test_a_connection_lent_when_the_pool_closed_is_closed_on_its_return() -> None:
    conns = Conns()
    pool = SyncPool(conns.open, conns.close, size=2, wait_timeout=1)
    lent, idle = pool.acquire(), pool.acquire()
    pool.release(idle)
    pool.close()
    assert conns.closed == [idle]
    pool.release(lent)
    assert conns.closed == [idle, lent]
    assert pool.opened == 0
    with pytest.raises(StorageError, match="closed"):
        pool.acquire()


# -- PostgreSQL, as a role with a connection limit -----------------------------------------


@pytest.fixture(scope="module")
def role_url(pg_url: str) -> Iterator[str]:
    """`pg_url` as a new login role allowed `ROLE_LIMIT` connections; dropped afterwards."""
    import psycopg

    role = f"quota_pool_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(f"CREATE ROLE {role} LOGIN CONNECTION LIMIT {ROLE_LIMIT}")
        conn.execute(f"GRANT USAGE ON SCHEMA public TO {role}")
        conn.execute(
            f"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO {role}"
        )
    parts = urlsplit(pg_url)
    url = parts._replace(netloc=f"{role}@{parts.hostname}:{parts.port or 5432}").geturl()
    try:
        yield url
    finally:
        with psycopg.connect(pg_url, autocommit=True) as conn:
            conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s",
                (role,),
            )
            conn.execute(f"DROP OWNED BY {role}")
            conn.execute(f"DROP ROLE {role}")


def _sessions(pg_url: str, role_url: str) -> int:
    """Server sessions open now for `role_url`'s role."""
    import psycopg

    role = urlsplit(role_url).username
    with psycopg.connect(pg_url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE usename = %s", (role,)
        ).fetchone()
    assert row is not None
    return int(row[0])


def _wait_for(predicate: Callable[[], bool], seconds: float = 10) -> bool:
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


class Sampler:
    """Reads the role's session count in a thread while a load runs; keeps the peak."""

    def __init__(self, pg_url: str, role_url: str) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(pg_url, role_url))

    def _run(self, pg_url: str, role_url: str) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _sessions(pg_url, role_url))

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


def _short_lived_threads(call: Callable[[int], object], total: int, alive: int) -> list[object]:
    """Run `call(i)` for i in range(total), each in a new thread, `alive` threads at a time."""
    results: list[object] = [None] * total

    def one(i: int) -> None:
        try:
            results[i] = call(i)
        except BaseException as exc:  # reported by the test
            results[i] = exc

    for first in range(0, total, alive):
        threads = [threading.Thread(target=one, args=(i,)) for i in range(first, first + alive)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
    return results


@pytest.mark.postgres
def test_500_short_lived_threads_share_pool_size_server_sessions(
    pg_url: str, role_url: str
) -> None:
    key = f"threads-{uuid.uuid4().hex}"
    with quota.connect(role_url, pool_size=3) as limiter, Sampler(pg_url, role_url) as sampler:
        results = _short_lived_threads(
            lambda i: limiter.rate_limit(key, limit=250, window=3600), total=500, alive=50
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        assert not errors, errors[:3]
        held = limiter.store.pool.opened  # type: ignore[attr-defined]
    decisions = [r for r in results if isinstance(r, quota.Decision)]
    assert sum(d.allowed for d in decisions) == 250  # exact, as ever
    assert sorted(d.count for d in decisions) == list(range(1, 501))
    assert held <= 3
    assert sampler.peak <= 3
    assert _wait_for(lambda: _sessions(pg_url, role_url) == 0), "close() left sessions open"


@pytest.mark.postgres
def test_idle_connections_are_closed_after_idle_timeout(pg_url: str, role_url: str) -> None:
    limiter = quota.connect(role_url, pool_size=3, idle_timeout=0.2)
    try:
        _short_lived_threads(lambda i: limiter.rate_limit("idle", 100, 60), total=6, alive=6)
        assert _sessions(pg_url, role_url) >= 1
        assert _wait_for(lambda: _sessions(pg_url, role_url) == 0), "idle sessions stayed open"
        assert limiter.rate_limit("idle", 100, 60).allowed  # reopens on demand
        assert _sessions(pg_url, role_url) == 1
    finally:
        limiter.close()


@pytest.mark.postgres
def test_async_pool_shrinks_when_idle(pg_url: str, role_url: str) -> None:
    async def main() -> None:
        limiter = quota.connect_async(role_url, pool_size=4, idle_timeout=0.2)
        try:
            await asyncio.gather(*(limiter.rate_limit("shrink", 100, 60) for _ in range(40)))
            assert _sessions(pg_url, role_url) >= 1
            deadline = time.monotonic() + 10
            while _sessions(pg_url, role_url) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert _sessions(pg_url, role_url) == 0, "the async pool kept idle sessions"
            assert (await limiter.rate_limit("shrink", 100, 60)).allowed
        finally:
            await limiter.aclose()

    asyncio.run(main())


@pytest.mark.postgres
def test_a_threaded_werkzeug_server_holds_at_most_pool_size_sessions(
    pg_url: str, role_url: str
) -> None:
    """Flask's development server runs a thread per request."""
    import http.client

    from flask import Flask
    from werkzeug.serving import make_server

    from quota.http import HttpConfig, RoutePolicy
    from quota.http.wsgi import QuotaWSGIMiddleware

    app = Flask(__name__)

    @app.get("/api/items")
    def items() -> str:
        return "ok"

    limiter = quota.connect(role_url, pool_size=3)
    config = HttpConfig(
        policies=[RoutePolicy(name="api", paths=["/api"], rates="40/hour")],
        hash_secret="x" * 32,
        runtime_policies=False,
    )
    app.wsgi_app = QuotaWSGIMiddleware(app.wsgi_app, limiter=limiter, config=config)  # type: ignore[method-assign]
    server = make_server("127.0.0.1", 0, app, threaded=True)
    port = server.server_port
    serving = threading.Thread(target=server.serve_forever, daemon=True)
    serving.start()

    def get(i: int) -> int:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        try:
            conn.request("GET", "/api/items")
            return conn.getresponse().status
        finally:
            conn.close()

    try:
        with Sampler(pg_url, role_url) as sampler:
            statuses = _short_lived_threads(get, total=120, alive=30)
    finally:
        server.shutdown()
        limiter.close()
    assert sorted(set(statuses)) == [200, 429], statuses  # type: ignore[type-var]
    assert statuses.count(200) == 40
    assert sampler.peak <= 3


# -- SQLite: file descriptors ---------------------------------------------------------------


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd (Linux)")
def test_200_short_lived_threads_keep_a_few_sqlite_descriptors(sqlite_url: str) -> None:
    before = _open_fds()
    with quota.connect(sqlite_url, pool_size=2) as limiter:
        results = _short_lived_threads(
            lambda i: limiter.rate_limit("fds", limit=150, window=3600), total=200, alive=40
        )
        during = _open_fds()
    after = _open_fds()
    assert not [r for r in results if isinstance(r, BaseException)]
    assert sum(r.allowed for r in results) == 150  # type: ignore[union-attr]
    # A connection holds the file, its WAL and its shared memory: 3 descriptors.
    assert during - before <= 2 * 3, (before, during)
    assert after <= before
