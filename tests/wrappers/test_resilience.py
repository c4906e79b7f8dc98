"""The fail-open fallback under real faults: a stopped PostgreSQL, a hung server,
a held row lock, a locked or deleted SQLite file.

The PostgreSQL outage runs on a throwaway cluster of its own
(``pg_createcluster`` on a free loopback port, dropped afterwards), so
stopping it never disturbs the shared server; the cluster is started again
and dropped even when a test fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import sqlite3
import subprocess
import threading
import time
import uuid
from collections.abc import Generator, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

import quota
from quota import Fallback

ENV_REQUIRE = "QUOTA_TEST_REQUIRE_POSTGRES"
BUDGET = 0.25  # the fallback's time budget in these tests: generous on a noisy 2-core box
MARGIN = 0.5  # what a call may take beyond the budget before the test calls it slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Cluster:
    """A PostgreSQL cluster of our own, to stop and start at will."""

    def __init__(self) -> None:
        versions = sorted(os.listdir("/etc/postgresql"))
        self.version = versions[-1]
        self.name = f"quota_fault_{uuid.uuid4().hex[:8]}"
        self.port = _free_port()
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _ctl(self, *args: str) -> None:
        subprocess.run(args, check=True, capture_output=True, timeout=60)

    def create(self) -> None:
        self._ctl(
            "pg_createcluster", self.version, self.name, "-p", str(self.port), "--start",
            "--", "--auth=trust",
        )  # fmt: skip

    def stop(self) -> None:
        self._ctl(
            "pg_ctlcluster",
            "--skip-systemctl-redirect",
            self.version,
            self.name,
            "stop",
            "-m",
            "fast",
        )

    def start(self) -> None:
        self._ctl("pg_ctlcluster", "--skip-systemctl-redirect", self.version, self.name, "start")

    def drop(self) -> None:
        subprocess.run(
            ["pg_dropcluster", self.version, self.name, "--stop"], capture_output=True, timeout=60
        )


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    if shutil.which("pg_createcluster") is None or not os.path.isdir("/etc/postgresql"):
        reason = "pg_createcluster (Debian's postgresql-common) is not installed"
        if os.environ.get(ENV_REQUIRE) == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    c = Cluster()
    try:
        c.create()
    except subprocess.CalledProcessError as exc:
        c.drop()
        pytest.fail(f"could not create a throwaway cluster: {exc.stderr!r}")
    try:
        quota.migrate(c.url)
        yield c
    finally:
        c.drop()


def _count(url: str, key: str) -> int:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT coalesce(sum(count), 0) FROM quota_counters WHERE client_key = %s",
            ("k:" + key,),
        ).fetchone()
    return int(row[0]) if row else 0


@pytest.mark.postgres
@pytest.mark.slow
def test_postgres_stopped_under_load_async(cluster: Cluster) -> None:
    """Stop the server mid-load: no exception, every call within budget, limits from
    memory, back on PostgreSQL within seconds with the outage's hits written back."""
    errors: list[BaseException] = []
    slowest = [0.0]
    outage_allowed = []

    async def main() -> None:
        fallback = Fallback(timeout=BUDGET, probe_interval=0.2)
        async with quota.connect_async(cluster.url, fallback=fallback, pool_size=8) as limiter:
            stop = asyncio.Event()

            async def call(key: str, limit: int) -> quota.Decision | None:
                t0 = time.perf_counter()
                try:
                    return await limiter.rate_limit(key, limit, 3600)
                except BaseException as exc:  # the point: nothing may escape
                    errors.append(exc)
                    return None
                finally:
                    slowest[0] = max(slowest[0], time.perf_counter() - t0)

            async def load(i: int) -> None:
                n = 0
                while not stop.is_set() and n < 20_000:
                    await call(f"load:{i % 4}", 10**9)
                    n += 1
                    await asyncio.sleep(0)

            workers = [asyncio.create_task(load(i)) for i in range(6)]
            await asyncio.sleep(0.5)
            assert limiter.store.up
            await asyncio.to_thread(cluster.stop)
            # While it is down: a fresh key gets exactly its limit, from memory.
            for _ in range(20):
                d = await call("outage", 5)
                if d is not None and d.allowed:
                    outage_allowed.append(d)
            assert not limiter.store.up
            await asyncio.to_thread(cluster.start)
            deadline = time.monotonic() + 20
            # Back, and the outage's hits written back behind the switch.
            while not (limiter.store.up and not limiter.store.health.owes()):
                if time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.1)
            stop.set()
            await asyncio.gather(*workers)
            assert limiter.store.up, "the store did not come back within 20 s of the restart"
            # The 20 outage hits were written back to the same window...
            assert await asyncio.to_thread(_count, cluster.url, "outage") == 20
            # ...so PostgreSQL now denies the key too.
            assert not (await limiter.rate_limit("outage", 5, 3600)).allowed

    asyncio.run(main())
    assert errors == []
    assert len(outage_allowed) == 5
    assert slowest[0] < BUDGET + MARGIN, f"a call took {slowest[0]:.3f}s"


@pytest.mark.postgres
@pytest.mark.slow
def test_postgres_stopped_sync_face(cluster: Cluster) -> None:
    fallback = Fallback(timeout=BUDGET, probe_interval=0.2)
    limiter = quota.connect(cluster.url, fallback=fallback)
    try:
        assert limiter.rate_limit("sync", 3, 3600).allowed
        cluster.stop()
        decisions = [limiter.rate_limit("sync", 3, 3600) for _ in range(5)]
        # Memory starts the window afresh: 3 more pass, then denials.
        assert [d.allowed for d in decisions] == [True, True, True, False, False]
        assert not limiter.store.up
        cluster.start()
        deadline = time.monotonic() + 20
        while not (limiter.store.up and not limiter.store.health.owes()):  # type: ignore[attr-defined]
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)  # waiting on a real server restart (and the write-back), bounded
        assert limiter.store.up
        assert _count(cluster.url, "sync") == 1 + 5
    finally:
        limiter.close()


@contextlib.contextmanager
def _silent_listener() -> Iterator[int]:
    """A TCP port that accepts connections and never says a word."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    held: list[socket.socket] = []
    done = threading.Event()

    def accept() -> None:
        server.settimeout(0.1)
        while not done.is_set():
            with contextlib.suppress(OSError):
                held.append(server.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield int(server.getsockname()[1])
    finally:
        done.set()
        thread.join(5)
        for conn in held:
            conn.close()
        server.close()


def test_a_server_that_never_answers_trips_the_budget_not_the_request() -> None:
    async def main() -> list[float]:
        with _silent_listener() as port:
            url = f"postgresql://root@127.0.0.1:{port}/x"
            async with quota.connect_async(
                url, fallback=Fallback(timeout=0.1, probe_interval=5)
            ) as limiter:
                times = []
                for _ in range(4):
                    t0 = time.perf_counter()
                    d = await limiter.rate_limit("hung", 2, 60)
                    times.append(time.perf_counter() - t0)
                    assert d.key == "hung"
                return times

    times = asyncio.run(main())
    assert max(times) < 0.1 + MARGIN, times


def test_fail_closed_denies_and_fail_open_limits_from_memory_while_down() -> None:
    # Nothing listens on port 1: every connection is refused at once.
    url = f"postgresql://root@127.0.0.1:{1}/x"

    async def main() -> tuple[list[bool], list[quota.Decision]]:
        async with quota.connect_async(
            url, fallback=Fallback(timeout=0.1, probe_interval=5)
        ) as limiter:
            opened = [(await limiter.rate_limit("login", 3, 60)).allowed for _ in range(5)]
            closed = [await limiter.rate_limit("login", 3, 60, fail_closed=True) for _ in range(2)]
            return opened, closed

    opened, closed = asyncio.run(main())
    assert opened == [True, True, True, False, False]
    assert all(not d.allowed and d.retry_after >= 1 for d in closed)


@pytest.mark.postgres
def test_a_held_row_lock_trips_the_budget(pg_url: str) -> None:
    """A competing transaction holds the counter row: the call falls back instead of waiting."""
    import psycopg

    key = f"locked:{uuid.uuid4().hex}"
    with quota.connect(pg_url) as plain:
        plain.rate_limit(key, 10, 3600)
    bucket = f"3600:{int(time.time()) // 3600 * 3600}:k:{key}"
    with psycopg.connect(pg_url) as holder:
        holder.execute("SELECT 1 FROM quota_counters WHERE bucket_key = %s FOR UPDATE", (bucket,))
        limiter = quota.connect(pg_url, fallback=Fallback(timeout=0.1, probe_interval=5))
        try:
            t0 = time.perf_counter()
            d = limiter.rate_limit(key, 10, 3600)
            assert time.perf_counter() - t0 < 0.1 + MARGIN
            assert d.allowed and not limiter.store.up
        finally:
            limiter.close()
        holder.rollback()

        async def main() -> float:
            async with quota.connect_async(
                pg_url, fallback=Fallback(timeout=0.1, probe_interval=5)
            ) as al:
                await al.rate_limit("warm:" + key, 10, 3600)  # connect first
                holder.execute(
                    "SELECT 1 FROM quota_counters WHERE bucket_key = %s FOR UPDATE", (bucket,)
                )
                t0 = time.perf_counter()
                d = await al.rate_limit(key, 10, 3600)
                assert d.allowed and not al.store.up
                return time.perf_counter() - t0

        assert asyncio.run(main()) < 0.1 + MARGIN
        holder.rollback()


def test_sqlite_locked_file_falls_back_within_budget(tmp_path: Path) -> None:
    path = tmp_path / "q.db"
    url = f"sqlite:///{path}"
    quota.migrate(url)
    limiter = quota.connect(url, fallback=Fallback(timeout=0.1, probe_interval=5))
    try:
        assert limiter.rate_limit("k", 2, 60).allowed
        blocker = sqlite3.connect(path, isolation_level=None)
        blocker.execute("BEGIN EXCLUSIVE")
        try:
            t0 = time.perf_counter()
            decisions = [limiter.rate_limit("k", 2, 60) for _ in range(3)]
            assert time.perf_counter() - t0 < 0.1 + MARGIN
            assert not limiter.store.up
            assert [d.allowed for d in decisions] == [True, True, False]
        finally:
            blocker.execute("ROLLBACK")
            blocker.close()
    finally:
        limiter.close()


def test_sqlite_file_deleted_mid_run_raises_nothing(tmp_path: Path) -> None:
    path = tmp_path / "q.db"
    url = f"sqlite:///{path}"
    quota.migrate(url)
    limiter = quota.connect(url, fallback=Fallback(timeout=0.1, probe_interval=5))
    try:
        assert limiter.rate_limit("k", 5, 60).allowed
        for suffix in ("", "-wal", "-shm"):
            with contextlib.suppress(FileNotFoundError):
                os.remove(f"{path}{suffix}")
        # The open connection goes on writing to the unlinked file; a new
        # thread's connection finds no schema. Neither may raise.
        assert limiter.rate_limit("k", 5, 60).allowed
        results: list[object] = []
        thread = threading.Thread(target=lambda: results.append(limiter.rate_limit("k", 5, 60)))
        thread.start()
        thread.join(10)
        assert len(results) == 1 and isinstance(results[0], quota.Decision)
    finally:
        limiter.close()


def test_without_a_fallback_errors_still_raise() -> None:
    limiter = quota.connect_async("postgresql://root@127.0.0.1:1/x")

    async def main() -> None:
        try:
            await limiter.rate_limit("k", 1, 60)
        finally:
            await limiter.aclose()

    with pytest.raises(quota.StorageError):
        asyncio.run(main())


@pytest.mark.postgres
def test_the_budget_binds_decisions_not_durable_transactions(pg_url: str) -> None:
    """Under a fallback the server cuts decisions at the budget; quota transactions may wait."""

    def show() -> Generator[tuple[str, tuple[()]], Sequence[Sequence[object]], str]:
        rows = yield "SHOW statement_timeout", ()
        return str(rows[0][0])

    budget = Fallback(timeout=0.05)
    with quota.connect(pg_url, fallback=budget) as limiter:
        limiter.rate_limit("warm", 1, 60)
        assert limiter.store.run(show(), transaction=False) == "50ms"
        assert limiter.store.run(show(), transaction=True) == "30s"

    async def main() -> tuple[str, str]:
        async with quota.connect_async(pg_url, fallback=budget) as al:
            await al.rate_limit("warm", 1, 60)
            return (
                await al.store.run(show(), transaction=False),
                await al.store.run(show(), transaction=True),
            )

    assert asyncio.run(main()) == ("50ms", "30s")


def test_sqlite_quota_transactions_wait_their_turn_under_a_fallback(tmp_path: Path) -> None:
    """The fallback's short busy timeout is for decisions: a quota transaction waits longer."""
    path = tmp_path / "q.db"
    url = f"sqlite:///{path}"
    quota.migrate(url)
    limiter = quota.connect(url, fallback=Fallback(timeout=0.05, probe_interval=60))
    blocker = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    try:
        limiter.rate_limit("warm", 5, 60)  # opens this thread's connection
        blocker.execute("BEGIN IMMEDIATE")
        timer = threading.Timer(0.3, lambda: blocker.execute("ROLLBACK"))
        timer.start()
        decision = limiter.consume_quota("tenant", "calls", 10, "day")
        timer.join()
        assert decision.allowed and decision.used == 1
    finally:
        blocker.close()
        limiter.close()


@pytest.mark.postgres
@pytest.mark.parametrize("face", ["sync", "async"])
def test_outage_hits_stay_owed_until_written_when_a_write_back_fails(
    pg_url: str, face: str
) -> None:
    """The probe switches back to the database, then writes owed hits back in batches; a
    batch that fails (a row of it is locked by another session) stays owed, its hits
    written once when the retry of a later probe succeeds."""
    import psycopg

    keys = [f"owed-{i}-{uuid.uuid4().hex}" for i in range(5)]
    start = int(time.time()) // 3600 * 3600
    first = keys[0]
    fallback = Fallback(timeout=0.1, probe_interval=0.1)

    def counts() -> dict[str, int]:
        return {key: _count(pg_url, key) for key in keys}

    async def scenario(call: Any, store: Any, pause: Any) -> None:
        for key in keys:
            await call(key)  # a row for each, in the database
        with psycopg.connect(pg_url) as holder:
            holder.execute(
                "SELECT 1 FROM quota_counters WHERE bucket_key = %s FOR UPDATE",
                (f"3600:{start}:k:{first}",),
            )
            await call(first)  # waits on the lock past the budget: the store is down
            assert not store.up
            for key in keys:
                for _ in range(10):
                    await call(key)  # from memory, owed
            # Let the probe find the database and fail the first write-back a few times.
            for _ in range(100):
                if store.health.last_error is not None and "lock" in str(store.health.last_error):
                    break
                await pause(0.05)
            await pause(0.3)
            # Back on the database, the write-back still owed.
            assert store.up and store.health.owes()
            holder.rollback()
        for _ in range(200):
            if store.up and not store.health.owes():
                break
            await pause(0.05)
        assert store.up and not store.health.owes()

    if face == "sync":
        with quota.connect(pg_url, fallback=fallback) as limiter:

            async def call(key: str) -> None:
                limiter.rate_limit(key, 10**6, 3600)

            async def pause(seconds: float) -> None:
                time.sleep(seconds)

            asyncio.run(scenario(call, limiter.store, pause))
    else:

        async def main() -> None:
            async with quota.connect_async(pg_url, fallback=fallback) as limiter:

                async def call(key: str) -> None:
                    await limiter.rate_limit(key, 10**6, 3600)

                await call("warm-" + keys[0])  # the pool opens before the scenario
                await scenario(call, limiter.store, asyncio.sleep)

        asyncio.run(main())
    assert counts() == {key: 12 if key == first else 11 for key in keys}
