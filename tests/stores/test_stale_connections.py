"""Pooled connections the server closed while they sat idle (a restart, a failover,
``pg_terminate_backend``, an idle timeout) are never used for a statement.

Every call after such a close succeeds on a fresh connection; under a fallback the store
stays up (each process would otherwise decide from its own memory, N times the limit over
N processes). The backends are terminated by ``application_name``, on the test's own
database, so no other session is touched; the restart runs on a private cluster.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import threading
import time
import uuid
from typing import Any

import pytest

import quota
from quota import Fallback
from tests._workers import BARRIER_TIMEOUT, FIXED_NOW, run_processes
from tests.wrappers.test_resilience import Cluster, cluster  # noqa: F401 (the fixture)

pytestmark = pytest.mark.postgres

POOL = 8
CALLS = 16


def _named(url: str) -> tuple[str, str]:
    """`url` with an ``application_name`` of its own, and that name."""
    name = f"quota-stale-{uuid.uuid4().hex[:12]}"
    return url + ("&" if "?" in url else "?") + f"application_name={name}", name


def _terminate(url: str, name: str) -> int:
    """Terminate the backends named `name` and wait (5 s at most) until they are gone."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
            " WHERE application_name = %s AND datname = current_database()",
            (name,),
        ).fetchone()
        killed = int(row[0]) if row else 0
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            row = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s", (name,)
            ).fetchone()
            if row is not None and row[0] == 0:
                break
            time.sleep(0.02)
    time.sleep(0.05)  # the closes reach the client's sockets
    return killed


def _fill_sync(limiter: quota.Limiter, size: int = POOL) -> None:
    """Open `size` connections and leave them idle in the pool."""
    pool = limiter.store.pool if hasattr(limiter.store, "pool") else limiter.store.primary.pool  # type: ignore[attr-defined]
    conns = [pool.acquire() for _ in range(size)]
    for conn in conns:
        pool.release(conn)
    assert pool.opened == size


async def _fill_async(limiter: quota.AsyncLimiter) -> None:
    store: Any = limiter.store
    store = getattr(store, "primary", store)
    await limiter.rate_limit("warm", 10**6, 3600)
    pool = store._pool
    conns = [await pool.acquire() for _ in range(POOL)]
    for conn in conns:
        pool.release(conn)
    assert pool.open == POOL


def test_sync_calls_after_the_server_closed_idle_connections(pg_url: str) -> None:
    url, name = _named(pg_url)
    key = f"stale-{uuid.uuid4().hex}"
    with quota.connect(url, pool_size=POOL) as limiter:
        _fill_sync(limiter)
        assert _terminate(pg_url, name) == POOL
        # main: 8 of 16 raised (AdminShutdown), one per dead connection
        counts = [limiter.rate_limit(key, 10**6, 3600).count for _ in range(CALLS)]
    assert counts == list(range(1, CALLS + 1))


def test_async_calls_after_the_server_closed_idle_connections(pg_url: str) -> None:
    url, name = _named(pg_url)
    key = f"stale-{uuid.uuid4().hex}"

    async def main() -> list[int]:
        async with quota.connect_async(url, pool_size=POOL) as limiter:
            await _fill_async(limiter)
            assert await asyncio.to_thread(_terminate, pg_url, name) == POOL
            # main: 8 of 16 raised (InterfaceError: underlying connection is closed)
            return [(await limiter.rate_limit(key, 10**6, 3600)).count for _ in range(CALLS)]

    assert asyncio.run(asyncio.wait_for(main(), 60)) == list(range(1, CALLS + 1))


FALLBACK = Fallback(timeout=0.5, probe_interval=0.5)


def test_sync_fallback_stays_up_when_the_server_closes_idle_connections(pg_url: str) -> None:
    url, name = _named(pg_url)
    key = f"stale-{uuid.uuid4().hex}"
    with quota.connect(url, pool_size=POOL, fallback=FALLBACK) as limiter:
        limiter.rate_limit(key, 50, 3600)
        _fill_sync(limiter)
        assert _terminate(pg_url, name) == POOL
        ups = []
        for _ in range(CALLS):
            limiter.rate_limit(key, 50, 3600)
            ups.append(limiter.store.up)  # type: ignore[attr-defined]
    # main: down at the first dead connection, and for every probe after it
    assert all(ups), ups


def test_async_fallback_stays_up_when_the_server_closes_idle_connections(pg_url: str) -> None:
    url, name = _named(pg_url)
    key = f"stale-{uuid.uuid4().hex}"

    async def main() -> list[bool]:
        async with quota.connect_async(url, pool_size=POOL, fallback=FALLBACK) as limiter:
            await _fill_async(limiter)
            assert await asyncio.to_thread(_terminate, pg_url, name) == POOL
            ups = []
            for _ in range(CALLS):
                await limiter.rate_limit(key, 50, 3600)
                ups.append(limiter.store.up)  # type: ignore[attr-defined]
            return ups

    ups = asyncio.run(asyncio.wait_for(main(), 60))
    assert all(ups), ups


def _restart(cluster: Cluster) -> None:  # noqa: F811
    cluster.stop()  # -m fast: every backend is terminated, the idle pooled ones too
    cluster.start()


@pytest.mark.slow
@pytest.mark.parametrize("face", ["sync", "async"])
def test_a_restarted_server_is_used_again_at_once(cluster: Cluster, face: str) -> None:  # noqa: F811
    """After a restart no call meets a dead connection (the store never goes down), and
    when calls did find the server gone, the store is back within one probe interval of
    its return (main: 4.8 s sync, 1.8 s async: each probe spent one dead connection)."""
    fallback = Fallback(timeout=0.5, probe_interval=0.5)
    key = f"restart-{uuid.uuid4().hex}"
    if face == "sync":
        with quota.connect(cluster.url, pool_size=POOL, fallback=fallback) as limiter:
            limiter.rate_limit(key, 10**6, 3600)
            _fill_sync(limiter)
            _restart(cluster)
            ups = []
            for _ in range(CALLS):
                limiter.rate_limit(key, 10**6, 3600)
                ups.append(limiter.store.up)  # type: ignore[attr-defined]
            _fill_sync(limiter)
            stop = threading.Event()

            def load() -> None:
                for _ in range(100_000):
                    if stop.is_set():
                        return
                    limiter.rate_limit(key, 10**6, 3600)
                    time.sleep(0.005)

            loader = threading.Thread(target=load)
            loader.start()
            try:
                cluster.stop()
                waited = time.monotonic()
                while limiter.store.up and time.monotonic() < waited + 10:  # type: ignore[attr-defined]
                    time.sleep(0.01)
                assert not limiter.store.up, "the calls never found the server gone"  # type: ignore[attr-defined]
                cluster.start()
                back = time.monotonic()
                while not limiter.store.up and time.monotonic() < back + 10:  # type: ignore[attr-defined]
                    time.sleep(0.01)
                took = time.monotonic() - back
            finally:
                stop.set()
                loader.join(30)
    else:

        async def main() -> tuple[list[bool], float]:
            async with quota.connect_async(cluster.url, pool_size=POOL, fallback=fallback) as lim:
                await _fill_async(lim)
                await asyncio.to_thread(_restart, cluster)
                ups = []
                for _ in range(CALLS):
                    await lim.rate_limit(key, 10**6, 3600)
                    ups.append(lim.store.up)  # type: ignore[attr-defined]
                await _fill_async(lim)
                stop = asyncio.Event()

                async def load() -> None:
                    for _ in range(100_000):
                        if stop.is_set():
                            return
                        await lim.rate_limit(key, 10**6, 3600)
                        await asyncio.sleep(0.005)

                loader = asyncio.ensure_future(load())
                try:
                    await asyncio.to_thread(cluster.stop)
                    waited = time.monotonic()
                    while lim.store.up and time.monotonic() < waited + 10:  # type: ignore[attr-defined]
                        await asyncio.sleep(0.01)
                    assert not lim.store.up, "the calls never found the server gone"  # type: ignore[attr-defined]
                    await asyncio.to_thread(cluster.start)
                    back = time.monotonic()
                    while not lim.store.up and time.monotonic() < back + 10:  # type: ignore[attr-defined]
                        await asyncio.sleep(0.01)
                    took = time.monotonic() - back
                finally:
                    stop.set()
                    await loader
                return ups, took

        ups, took = asyncio.run(asyncio.wait_for(main(), 120))
    assert all(ups), ups
    assert took < fallback.probe_interval + 0.6, took


#: A key at its limit, hit by each process once the server closed their connections.
LIMIT = 50
PROCESSES = 3
PROCESS_POOL = 4  # 12 connections in all on the shared server


def at_limit_worker(barrier: Any, url: str, admin_url: str, name: str, key: str, index: int) -> int:
    """How many of `LIMIT` hits on `key` (already at its limit) this process was allowed,
    after the server closed its pooled connections (worker 0 closes every process's)."""
    limiter = quota.connect(url, pool_size=PROCESS_POOL, fallback=FALLBACK, clock=lambda: FIXED_NOW)
    try:
        assert not limiter.rate_limit(key, LIMIT, 3600).allowed
        _fill_sync(limiter, PROCESS_POOL)
        barrier.wait(timeout=BARRIER_TIMEOUT)
        if index == 0:
            assert _terminate(admin_url, name) == PROCESSES * PROCESS_POOL
        barrier.wait(timeout=BARRIER_TIMEOUT)
        return sum(limiter.rate_limit(key, LIMIT, 3600).allowed for _ in range(LIMIT))
    finally:
        limiter.close()


@pytest.mark.slow
def test_a_key_at_its_limit_stays_there_in_every_process_after_a_server_side_close(
    pg_url: str,
) -> None:
    """main: each process went down at its first dead connection and allowed the key
    `LIMIT` more hits from its own memory, `PROCESSES` times the limit in all."""
    url, name = _named(pg_url)
    key = f"stale-{uuid.uuid4().hex}"
    with quota.connect(pg_url, clock=lambda: FIXED_NOW) as limiter:
        assert all(limiter.rate_limit(key, LIMIT, 3600).allowed for _ in range(LIMIT))
    allowed = run_processes(
        multiprocessing.get_context("spawn"),
        at_limit_worker,
        [(url, pg_url, name, key, index) for index in range(PROCESSES)],
    )
    assert allowed == [0] * PROCESSES
