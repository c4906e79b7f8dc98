"""The async SQLite store runs statements on the event loop when the file is free,
hands them to its worker thread when another writer holds it, and checkpoints the
WAL off the loop."""

from __future__ import annotations

import asyncio
import os
import sqlite3
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import aiosqlite
import pytest

import quota
from quota._stores import sqlite as _sqlite


def _completes_without_suspending(coro: Coroutine[Any, Any, Any]) -> Any:
    """The coroutine's result if it finishes at its first step; AssertionError otherwise."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    coro.close()
    raise AssertionError("the call suspended: it left the event loop's thread")


def test_a_decision_on_a_free_file_never_leaves_the_loop(sqlite_url: str) -> None:
    async def main() -> list[int]:
        async with quota.connect_async(sqlite_url) as limiter:
            await limiter.rate_limit("warm", 10, 60)  # opens the store
            counts = []
            for _ in range(3):
                decision = _completes_without_suspending(limiter.rate_limit("k", 10, 60))
                counts.append(decision.count)
            return counts

    assert asyncio.run(main()) == [1, 2, 3]


def test_a_locked_file_sends_the_statement_to_the_worker_and_the_loop_keeps_running(
    sqlite_url: str,
) -> None:
    path = sqlite_url.removeprefix("sqlite:///")

    async def main() -> tuple[int, int, int]:
        async with quota.connect_async(sqlite_url, timeout=10.0) as limiter:
            await limiter.rate_limit("k", 10, 60)
            blocker = sqlite3.connect(path, isolation_level=None)
            blocker.execute("BEGIN IMMEDIATE")  # another writer holds the file
            ticks = 0

            async def ticker() -> None:
                nonlocal ticks
                while True:
                    ticks += 1
                    await asyncio.sleep(0.001)

            tick_task = asyncio.create_task(ticker())
            pending = asyncio.create_task(limiter.rate_limit("k", 10, 60))
            await asyncio.sleep(0.2)
            ticks_while_locked = ticks
            done_while_locked = pending.done()
            blocker.execute("COMMIT")
            blocker.close()
            decision = await pending
            tick_task.cancel()
            return ticks_while_locked, int(done_while_locked), decision.count

    ticks, done_while_locked, count = asyncio.run(main())

    assert done_while_locked == 0  # it waited for the lock...
    assert ticks > 20  # ...without stopping the loop
    assert count == 2  # and counted once, after the lock was released


def test_a_locked_file_is_waited_for_in_batching_mode_too(sqlite_url: str) -> None:
    path = sqlite_url.removeprefix("sqlite:///")

    async def main() -> list[int]:
        async with quota.connect_async(sqlite_url, batching=True, timeout=10.0) as limiter:
            await limiter.rate_limit("warm", 10, 60)
            blocker = sqlite3.connect(path, isolation_level=None)
            blocker.execute("BEGIN IMMEDIATE")
            calls = asyncio.gather(*(limiter.rate_limit("k", 100, 60) for _ in range(20)))
            await asyncio.sleep(0.1)
            blocker.execute("ROLLBACK")
            blocker.close()
            return sorted(decision.count for decision in await calls)

    assert asyncio.run(main()) == list(range(1, 21))


def test_the_wal_is_checkpointed_off_the_loop(sqlite_url: str, monkeypatch: Any) -> None:
    """The inline connection never checkpoints itself; without the store's own
    checkpoints the WAL would grow by every write (here to over 30 MB)."""
    monkeypatch.setattr(_sqlite, "INLINE_CHECKPOINT_EVERY", 50)
    monkeypatch.setattr(_sqlite, "WAL_CHECKPOINT_BYTES", 1_000_000)
    path = sqlite_url.removeprefix("sqlite:///")
    checkpoints = 0
    original = _sqlite.AsyncSQLiteStore._checkpoint_wal

    async def counting(self: Any) -> None:
        nonlocal checkpoints
        checkpoints += 1
        await original(self)

    monkeypatch.setattr(_sqlite.AsyncSQLiteStore, "_checkpoint_wal", counting)

    async def main() -> int:
        async with quota.connect_async(sqlite_url) as limiter:
            for i in range(3000):
                await limiter.rate_limit(f"key-{i}", 10, 60)
                if i % 100 == 0:
                    await asyncio.sleep(0.001)  # let a checkpoint run
            return os.path.getsize(path + "-wal")

    wal_bytes = asyncio.run(main())

    assert checkpoints >= 5
    assert wal_bytes < 3_000_000


def test_a_long_reader_elsewhere_never_stalls_decisions_behind_a_checkpoint(
    sqlite_url: str, monkeypatch: Any
) -> None:
    """The checkpoint is PASSIVE: with another connection holding an old snapshot it
    copies what it can and returns. A checkpoint that waited for readers (FULL,
    RESTART, TRUNCATE) would hold every writer for the whole busy timeout."""
    monkeypatch.setattr(_sqlite, "INLINE_CHECKPOINT_EVERY", 50)
    monkeypatch.setattr(_sqlite, "WAL_CHECKPOINT_BYTES", 200_000)
    path = sqlite_url.removeprefix("sqlite:///")

    async def main() -> tuple[float, int]:
        async with quota.connect_async(sqlite_url, timeout=2.0) as limiter:
            await limiter.rate_limit("warm", 10, 60)
            reader = sqlite3.connect(path, isolation_level=None)
            reader.execute("BEGIN")
            reader.execute("SELECT count(*) FROM quota_counters").fetchall()  # holds a snapshot
            slowest = 0.0
            loop = asyncio.get_running_loop()
            try:
                for i in range(2000):
                    started = loop.time()
                    await limiter.rate_limit(f"key-{i}", 10, 60)
                    slowest = max(slowest, loop.time() - started)
                    if i % 100 == 0:
                        await asyncio.sleep(0.001)  # let checkpoints run
            finally:
                reader.execute("COMMIT")
                reader.close()
            peek = await limiter.peek("key-1999", 10, 60)
            return slowest, peek.count

    slowest, count = asyncio.run(main())

    assert count == 1
    assert slowest < 1.0  # a checkpoint waiting on the reader would take the 2 s timeout


def test_a_task_deciding_in_a_tight_loop_still_keeps_the_wal_bounded(
    sqlite_url: str, monkeypatch: Any
) -> None:
    """Decisions on a free file never yield, so a task that only decides never lets
    the worker's checkpoint start: the store then checkpoints on the loop itself."""
    monkeypatch.setattr(_sqlite, "INLINE_CHECKPOINT_EVERY", 50)
    monkeypatch.setattr(_sqlite, "WAL_CHECKPOINT_BYTES", 200_000)
    path = sqlite_url.removeprefix("sqlite:///")

    async def main() -> int:
        async with quota.connect_async(sqlite_url) as limiter:
            await limiter.rate_limit("warm", 10, 60)
            for i in range(3000):  # never awaits anything that suspends
                _completes_without_suspending(limiter.rate_limit(f"key-{i}", 10, 60))
            return os.path.getsize(path + "-wal")

    assert asyncio.run(main()) < 5_000_000  # over 30 MB without the inline checkpoint


def test_a_lone_caller_in_batching_mode_goes_on_alone_and_yields_now_and_then(
    sqlite_url: str,
) -> None:
    """With group commit on an inline store, a task calling alone is not made to wait
    for the end of its loop turn, except once in `LONE_RUNS_PER_TURN` calls or so,
    which lets other tasks run. Every count stays exact."""
    from quota._wrappers.batching import LONE_RUNS_PER_TURN

    calls = 200

    async def main() -> tuple[int, list[int]]:
        async with quota.connect_async(sqlite_url, batching=True) as limiter:
            await limiter.rate_limit("warm", 10, 60)
            ticks, done = 0, False

            async def ticker() -> None:  # counts the loop turns the caller lets through
                nonlocal ticks
                while not done:
                    ticks += 1
                    await asyncio.sleep(0)

            tick_task = asyncio.create_task(ticker())
            await asyncio.sleep(0)
            suspended, counts = 0, []
            for _ in range(calls):
                before = ticks
                counts.append((await limiter.rate_limit("k", 10**6, 60)).count)
                suspended += ticks != before
            done = True
            await tick_task
            return suspended, counts

    suspended, counts = asyncio.run(main())

    assert counts == list(range(1, calls + 1))
    # Not every other call (a turn-gathering batcher without the exception), and
    # not never (a caller that would hold the loop for good).
    assert 1 <= suspended <= calls // LONE_RUNS_PER_TURN + 1


def test_a_connection_asks_for_wal_only_when_the_file_is_not_in_wal_yet(tmp_path: Path) -> None:
    path = str(tmp_path / "wal.sqlite3")
    sent: list[str] = []
    for expected in (["PRAGMA journal_mode = WAL"], []):
        conn = sqlite3.connect(path, isolation_level=None)
        conn.set_trace_callback(sent.append)
        _sqlite.set_up(conn, 1.0)
        assert [s for s in sent if s.endswith("= WAL")] == expected
        assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)
        conn.close()
        sent.clear()


@pytest.mark.parametrize("face", ["sync", "async"])
def test_the_switch_to_wal_is_retried_while_another_connection_holds_the_file(
    tmp_path: Path, face: str
) -> None:
    """SQLite refuses the switch at once, busy timeout or not, while another connection
    holds the write lock (threads opening a new file together did): it is retried."""
    path = str(tmp_path / "new.sqlite3")
    holder = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    holder.execute("CREATE TABLE t (x INTEGER)")
    holder.execute("BEGIN IMMEDIATE")  # the write lock of a file still in rollback mode
    attempts: list[str] = []

    def trace(statement: str) -> None:
        if statement == "PRAGMA journal_mode = WAL":
            attempts.append(statement)
            if len(attempts) == 3:
                holder.execute("ROLLBACK")  # the other connection lets go

    if face == "sync":
        conn = sqlite3.connect(path, isolation_level=None)
        conn.set_trace_callback(trace)
        _sqlite.set_up(conn, 5.0)
        conn.close()
    else:

        async def main() -> None:
            async with aiosqlite.connect(path, isolation_level=None) as conn:
                await conn.set_trace_callback(trace)
                await _sqlite.aset_up(conn, 5.0)

        asyncio.run(main())

    assert len(attempts) == 3  # refused twice, then switched
    holder.close()
    fresh = sqlite3.connect(path)
    assert fresh.execute("PRAGMA journal_mode").fetchone() == ("wal",)  # the file's mode
    fresh.close()


#: The bound the WAL of a file hammered by several processes stays under (docs/databases.md).
WAL_BOUND = 64 * 1024 * 1024


@pytest.mark.slow
@pytest.mark.parametrize("face", ["sync", "async"])
def test_processes_saturating_one_file_keep_its_wal_bounded(tmp_path: Path, face: str) -> None:
    """Four processes writing as fast as they can: the WAL is checkpointed and cut back,
    never growing with the load (without that it reached hundreds of MB in seconds)."""
    import multiprocessing

    from tests import _workers

    path = str(tmp_path / "busy.db")
    url = f"sqlite:///{path}"
    quota.migrate(url)
    results = _workers.run_processes(
        multiprocessing.get_context("spawn"),
        _workers.wal_worker,
        [(url, path, face, 5.0)] * 4,
    )
    hits = sum(h for h, _ in results)
    peak = max(p for _, p in results)
    assert hits > 1000, results  # the file was busy
    assert peak < WAL_BOUND, f"the WAL reached {peak / 2**20:.0f} MiB after {hits} hits"
    after = os.stat(path + "-wal").st_size if os.path.exists(path + "-wal") else 0
    assert after < WAL_BOUND
