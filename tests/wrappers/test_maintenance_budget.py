"""Maintenance under a fallback runs without the fallback's time budget: `cleanup` and
`cleanup_ledger` of a large backlog finish on a limiter whose decisions are held to 50 ms,
and the connections they used hold decisions to the budget again afterwards.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import Callable, Generator, Sequence
from pathlib import Path
from typing import Any

import pytest

import quota
from quota import Fallback

ROWS = 200_000


def _fill(url: str) -> None:
    """`ROWS` windows that ended long ago and `ROWS` ledger entries from the same time."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO quota_counters"
            " (bucket_key, client_key, window_start, window_seconds, count, updated_at)"
            " SELECT '60:0:k:old' || g, 'k:old' || g, 0, 60, 1, 0"
            " FROM generate_series(1, %s) AS g",
            (ROWS,),
        )
        conn.execute(
            "INSERT INTO quota_ledger (at, subject, name, kind, cost)"
            " SELECT 1.0, 'old' || g, 'calls', 'consume', 1 FROM generate_series(1, %s) AS g",
            (ROWS,),
        )


def _left(url: str) -> tuple[int, int]:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT (SELECT count(*) FROM quota_counters WHERE client_key LIKE 'k:old%%'),"
            " (SELECT count(*) FROM quota_ledger)"
        ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def _show() -> Generator[tuple[str, tuple[()]], Sequence[Sequence[object]], str]:
    rows = yield "SHOW statement_timeout", ()
    return str(rows[0][0])


@pytest.mark.postgres
@pytest.mark.parametrize("face", ["sync", "async"])
def test_cleanup_of_a_large_backlog_under_a_fallback(
    pg_make_database: Callable[[], str], face: str
) -> None:
    """main: the first 10,000-row delete was cancelled at the 50 ms budget, nothing was
    deleted, and the backlog never cleared."""
    url = pg_make_database()
    quota.migrate(url)
    _fill(url)
    fallback = Fallback(timeout=0.05, probe_interval=60)
    # One connection: the one maintenance used is the one decisions get next.
    options: dict[str, Any] = {"fallback": fallback, "pool_size": 1}
    if face == "sync":
        with quota.connect(url, **options) as limiter:
            limiter.rate_limit("warm", 10, 60)
            windows = limiter.cleanup()
            ledger = limiter.cleanup_ledger(older_than=3600)
            budget = limiter.store.run(_show(), transaction=False)  # type: ignore[arg-type]
    else:

        async def main() -> tuple[quota.CleanupResult, quota.CleanupResult, str]:
            async with quota.connect_async(url, **options) as limiter:
                await limiter.rate_limit("warm", 10, 60)
                windows = await limiter.cleanup()
                ledger = await limiter.cleanup_ledger(older_than=3600)
                budget = await limiter.store.run(_show(), transaction=False)  # type: ignore[arg-type]
                return windows, ledger, budget

        windows, ledger, budget = asyncio.run(main())
    assert windows.deleted == ROWS and ledger.deleted == ROWS
    assert _left(url) == (0, 0)
    assert budget == "50ms"  # decisions are held to the budget again


@pytest.mark.parametrize("face", ["sync", "async"])
def test_sqlite_cleanup_under_a_fallback_waits_its_turn(tmp_path: Path, face: str) -> None:
    """Another process's writer holds the file for 0.3 s: the cleanup waits for it, as a
    durable quota transaction does (main: "database is locked" at the 50 ms budget)."""
    path = tmp_path / "q.db"
    url = f"sqlite:///{path}"
    quota.migrate(url)
    with sqlite3.connect(path) as conn:
        conn.executemany(
            "INSERT INTO quota_counters VALUES (?, ?, 0, 60, 1, 1.0)",
            ((f"60:0:k:old{i}", f"k:old{i}") for i in range(5000)),
        )
    blocker = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    fallback = Fallback(timeout=0.05, probe_interval=60)
    try:

        def hold() -> threading.Timer:
            blocker.execute("BEGIN IMMEDIATE")
            timer = threading.Timer(0.3, lambda: blocker.execute("ROLLBACK"))
            timer.start()
            return timer

        if face == "sync":
            with quota.connect(url, fallback=fallback) as limiter:
                limiter.rate_limit("warm", 10, 60)
                timer = hold()
                try:
                    result = limiter.cleanup()
                finally:
                    timer.join()
        else:

            async def main() -> quota.CleanupResult:
                async with quota.connect_async(url, fallback=fallback) as limiter:
                    await limiter.rate_limit("warm", 10, 60)
                    timer = hold()
                    try:
                        return await limiter.cleanup()
                    finally:
                        timer.join()

            result = asyncio.run(main())
    finally:
        blocker.close()
    assert result.deleted == 5000
