"""Cleanup: ended windows go, running ones stay; on PostgreSQL one cleanup runs at a time."""

from __future__ import annotations

import multiprocessing
import time
from typing import Any

import pytest

import quota
from quota._sql.statements import CLEANUP_LOCK_ID
from tests import _workers
from tests._support import Backend, Clock


def _seed(backend: Backend, *, expired: int, live: int) -> tuple[list[str], list[str]]:
    """`expired` keys in a 60 s window that ended over 2 minutes ago, `live` keys in running ones.

    Returns (expired keys, live keys); every key holds one row with count 2.
    """
    old_keys = [f"old:{i}" for i in range(expired)]
    live_keys = [f"live:{i}" for i in range(live)]
    for key in old_keys:
        backend.rate_limit(key, 10, 60)
        backend.rate_limit(key, 10, 60)
    backend.clock.advance(180)
    for i, key in enumerate(live_keys):
        window = 60 if i % 2 else 3600  # one row still running, of either length
        backend.rate_limit(key, 10, window)
        backend.rate_limit(key, 10, window)
    return old_keys, live_keys


def _remaining_rows(backend: Backend, keys: list[str]) -> list[str]:
    """The keys among `keys` that still have a row (reset counts and deletes them)."""
    return [key for key in keys if backend.reset(key) > 0]


def test_cleanup_deletes_exactly_the_ended_windows(backend: Backend) -> None:
    old_keys, live_keys = _seed(backend, expired=7, live=5)

    result = backend.cleanup(grace=0)

    assert result == quota.CleanupResult(deleted=7, expired=7)
    for i, key in enumerate(live_keys):
        assert backend.peek(key, 10, 60 if i % 2 else 3600).count == 2
    assert _remaining_rows(backend, old_keys) == []
    assert _remaining_rows(backend, live_keys) == live_keys


def test_a_window_is_swept_as_soon_as_grace_seconds_have_passed_since_its_end(
    backend: Backend,
) -> None:
    """Not a second later: a window that ended at E goes at any time after E + grace
    (the demo sweeps its burst right away, and once failed when run in a minute's
    first second, while the cutoff was rounded down)."""
    start = backend.clock.now - backend.clock.now % 60
    backend.clock.now = start + 10.25
    backend.rate_limit("k", 10, 60)  # the window [start, start + 60)

    backend.clock.now = start + 60 + 5  # 5 s after it ended
    assert backend.cleanup(grace=5).deleted == 0  # exactly at end + grace: not yet
    backend.clock.now = start + 60 + 5.5
    assert backend.cleanup(grace=5).deleted == 1


def test_a_second_cleanup_finds_nothing(backend: Backend) -> None:
    _seed(backend, expired=3, live=2)
    assert backend.cleanup(grace=0).deleted == 3

    assert backend.cleanup(grace=0) == quota.CleanupResult(deleted=0, expired=0)


def test_a_dry_run_counts_without_deleting(backend: Backend) -> None:
    old_keys, _ = _seed(backend, expired=4, live=3)

    first = backend.cleanup(grace=0, dry_run=True)
    second = backend.cleanup(grace=0, dry_run=True)

    assert first == second == quota.CleanupResult(deleted=0, expired=4, dry_run=True)
    assert backend.cleanup(grace=0).deleted == 4
    assert _remaining_rows(backend, old_keys) == []


def test_a_batch_smaller_than_the_work_still_deletes_everything(backend: Backend) -> None:
    old_keys, live_keys = _seed(backend, expired=23, live=4)

    result = backend.cleanup(grace=0, batch_size=5)

    assert (result.deleted, result.expired, result.skipped) == (23, 23, False)
    assert backend.cleanup(grace=0, dry_run=True).expired == 0
    assert _remaining_rows(backend, old_keys) == []
    assert _remaining_rows(backend, live_keys) == live_keys


@pytest.mark.parametrize("batch_size", [1, 2, 3])
def test_a_batch_size_that_divides_the_work_exactly(backend: Backend, batch_size: int) -> None:
    """The loop stops on a short batch; an exact multiple ends with one empty batch."""
    _seed(backend, expired=6, live=1)

    assert backend.cleanup(grace=0, batch_size=batch_size).deleted == 6
    assert backend.cleanup(grace=0, dry_run=True).expired == 0


def test_the_grace_period_keeps_recently_ended_windows(backend: Backend) -> None:
    window = 60
    long_ago = backend.rate_limit("long-ago", 10, window)
    backend.clock.now = long_ago.reset_at + 150
    recent = backend.rate_limit("recent", 10, window)
    backend.clock.now = recent.reset_at + 30
    assert backend.clock.now - long_ago.reset_at > 60  # beyond the grace period

    assert backend.cleanup(grace=60, dry_run=True).expired == 1
    assert backend.cleanup(grace=60).deleted == 1
    assert backend.reset("recent") == 1  # kept by the grace period ...
    assert backend.reset("long-ago") == 0  # ... the older one is gone

    backend.rate_limit("recent-again", 10, window)
    backend.clock.advance(window + 5)
    assert backend.cleanup(grace=0).deleted == 1


def test_the_default_grace_keeps_a_window_that_just_ended(backend: Backend) -> None:
    decision = backend.rate_limit("k", 10, 60)
    backend.clock.now = decision.reset_at + 1

    assert backend.cleanup().deleted == 0
    assert backend.reset("k") == 1


# --- PostgreSQL: one cleanup at a time --------------------------------------------------


def test_cleanup_skips_while_another_holds_the_lock(pg_backend: Backend) -> None:
    import psycopg

    old_keys, _ = _seed(pg_backend, expired=5, live=2)

    with psycopg.connect(pg_backend.url, autocommit=True) as other:
        other.execute("SELECT pg_advisory_lock(%s)", (CLEANUP_LOCK_ID,))
        skipped = pg_backend.cleanup(grace=0)
        dry = pg_backend.cleanup(grace=0, dry_run=True)
        other.execute("SELECT pg_advisory_unlock(%s)", (CLEANUP_LOCK_ID,))

    assert skipped.skipped
    assert skipped.deleted == 0
    assert dry.expired == 5

    after = pg_backend.cleanup(grace=0)
    assert (after.skipped, after.deleted) == (False, 5)
    assert _remaining_rows(pg_backend, old_keys) == []


def test_cleanup_releases_its_lock(pg_backend: Backend) -> None:
    import psycopg

    _seed(pg_backend, expired=2, live=0)
    assert pg_backend.cleanup(grace=0).deleted == 2

    with psycopg.connect(pg_backend.url, autocommit=True) as other:
        got = other.execute("SELECT pg_try_advisory_lock(%s)", (CLEANUP_LOCK_ID,)).fetchone()
        assert got == (True,)
        other.execute("SELECT pg_advisory_unlock(%s)", (CLEANUP_LOCK_ID,))


@pytest.mark.postgres
@pytest.mark.slow
def test_two_cleanups_in_two_processes_share_no_work(pg_clean_url: str) -> None:
    # Small batches, so that one run takes long enough for the other to start meanwhile.
    rows, batch_size = 3000, 5
    now = _workers.FIXED_NOW
    # Load through the library: one key per row, in windows that have ended by `now`.
    with quota.connect(pg_clean_url, clock=lambda: now - 600) as limiter:
        for i in range(rows):
            limiter.rate_limit(f"bulk:{i}", 1, 60)
        assert limiter.cleanup(grace=0, dry_run=True).expired == 0  # not ended yet then

    results = _workers.run_processes(
        multiprocessing.get_context("spawn"),
        _workers.cleanup_worker,
        [(pg_clean_url, now, batch_size)] * 2,
    )

    assert sum(r["deleted"] for r in results) == rows
    # Either the second one found the lock taken, or it ran after the first was done.
    assert min(r["deleted"] for r in results) == 0, results
    import psycopg

    with psycopg.connect(pg_clean_url) as conn:
        assert conn.execute("SELECT count(*) FROM quota_counters").fetchone() == (0,)


def test_partition_maintenance_sets_nothing_on_the_session_even_when_a_statement_fails() -> None:
    """Cleanup's DDL runs with ``synchronous_commit = off`` and a lock timeout on a
    pooled connection: a failing DETACH must not leave either behind (a durable
    quota transaction on that connection would then commit without waiting)."""
    from quota._sql import partitions as _partitions
    from quota._sql.steps import drive

    now = 1_750_003_200 + 5 * _partitions.PARTITION_SECONDS
    old = 1_750_003_200
    sent: list[str] = []

    def execute(sql: str, params: object) -> list[tuple[object, ...]]:
        sent.append(sql)
        if sql == _partitions.IS_PARTITIONED:
            return [(1,)]
        if sql == _partitions.LIST_PARTITIONS:
            return [
                ("quota_counters_default", "DEFAULT", "u"),
                (f"quota_counters_p{old}", f"FOR VALUES FROM ('{old}') TO ('{old + 3600}')", "u"),
            ]
        if sql.startswith("SELECT max("):
            return [(None,)]
        if "DETACH PARTITION" in sql:
            raise RuntimeError("lock timeout")
        return []

    with pytest.raises(RuntimeError, match="lock timeout"):
        drive(_partitions.maintain(now, cutoff=now), execute)

    # Settings are SET LOCAL, inside the DDL's own transaction: nothing stays on the
    # connection (which a transaction pooler may hand to another client next).
    assert not [sql for sql in sent if sql.startswith(("SET ", "RESET "))]
    ddl = sent.index(next(sql for sql in sent if "DETACH PARTITION" in sql))
    assert sent[ddl - 2 : ddl] == ["BEGIN", _partitions.DDL_SETTINGS]
    assert "set_config('synchronous_commit', 'off', true)" in _partitions.DDL_SETTINGS
    assert sent[-1] == "ROLLBACK"


@pytest.mark.postgres
def test_cleanup_never_deletes_a_state_row_an_inflight_update_made_live(pg_clean_url: str) -> None:
    """The sweep picks a token-bucket row that looked expired, waits for an update in
    flight on it, and must then see that the update made it live again."""
    import threading

    import psycopg

    clock = Clock()
    with quota.connect(pg_clean_url, clock=clock) as limiter:
        limiter.rate_limit("bucket", 5, 60, algorithm="token_bucket", cost=5)  # empty bucket
        with psycopg.connect(pg_clean_url, autocommit=True) as conn:
            key, expires = conn.execute("SELECT bucket_key, expires_at FROM quota_state").fetchone()
        clock.advance(3600)  # the row has long been the same as no row: it looks expired
        with psycopg.connect(pg_clean_url) as updater:
            # A hit in flight that empties the bucket again: the row is live once it commits.
            updater.execute(
                "UPDATE quota_state SET expires_at = %s WHERE bucket_key = %s",
                (clock.now + 60, key),
            )
            result: list[quota.CleanupResult] = []
            sweep = threading.Thread(target=lambda: result.append(limiter.cleanup(grace=0)))
            sweep.start()
            deadline = time.monotonic() + 10
            with psycopg.connect(pg_clean_url, autocommit=True) as watch:
                while time.monotonic() < deadline:  # the sweep waits on the updater's row lock
                    waiting = watch.execute(
                        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                        " AND query LIKE 'WITH swept AS (DELETE FROM quota_state%'"
                    ).fetchone()
                    if waiting and waiting[0]:
                        break
                    time.sleep(0.01)
            updater.commit()
            sweep.join(10)
        assert result and result[0].deleted == 0
        with psycopg.connect(pg_clean_url, autocommit=True) as conn:
            assert conn.execute("SELECT count(*) FROM quota_state").fetchone() == (1,)
    assert expires < clock.now


def test_sqlite_cleanup_lets_a_budgeted_app_write_between_its_slices(tmp_path: Any) -> None:
    """A cleanup of 200,000 expired rows in another process: an app deciding meanwhile
    under a 50 ms budget keeps deciding on the database (main: the sweep held the write
    lock ~0.8 s, the store was marked down and half the decisions came from memory)."""
    import sqlite3
    import subprocess
    import sys
    import threading

    path = tmp_path / "q.db"
    url = f"sqlite:///{path}"
    quota.migrate(url)
    with sqlite3.connect(path) as conn:
        conn.executemany(
            "INSERT INTO quota_counters VALUES (?, ?, ?, 60, 1, 1.0)",
            ((f"60:0:k:old{i}", f"k:old{i}", 0) for i in range(200_000)),
        )
    metrics = quota.Metrics()
    app = quota.connect(url, fallback=quota.Fallback(timeout=0.05), metrics=metrics)
    try:
        app.rate_limit("warm", 10**6, 3600)
        sweep = subprocess.Popen(
            [sys.executable, "-c", "from quota._cli import main; main()", "cleanup", "--url", url],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        stop = threading.Event()
        decided = 0

        def decide() -> None:
            nonlocal decided
            while not stop.is_set():
                app.rate_limit("live", 10**6, 3600)
                decided += 1

        worker = threading.Thread(target=decide)
        worker.start()
        out, err = sweep.communicate(timeout=120)
        stop.set()
        worker.join(10)
        assert sweep.returncode == 0, err
        assert "200000" in out.replace(",", "") or "200000" in err.replace(",", ""), (out, err)
        assert app.store.up  # type: ignore[attr-defined]
        totals = metrics.snapshot()["totals"]
        assert decided > 50
        assert totals["fallback"] == 0, totals
    finally:
        app.close()


def _cleanup_cli(url: str, *args: str) -> Any:
    import subprocess
    import sys

    return subprocess.Popen(
        [sys.executable, "-c", "from quota._cli import main; main()", "cleanup", "--url", url,
         "--grace", "0", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


@pytest.mark.postgres
@pytest.mark.slow
def test_cleanup_keeps_its_lock_past_idle_in_transaction_session_timeout(
    pg_make_database: Any,
) -> None:
    """The lock's transaction idles for the whole sweep: a server that ends idle
    transactions after 1 s must not take the lock away mid-sweep (main: every row
    deleted, then exit 3, and a second cleanup swept alongside the first)."""
    import psycopg
    from psycopg import sql

    url = pg_make_database()
    quota.migrate(url)
    rows = 300_000
    with psycopg.connect(url, autocommit=True) as conn:
        name = conn.execute("SELECT current_database()").fetchone()[0]  # the test's own
        conn.execute(
            sql.SQL("ALTER DATABASE {} SET idle_in_transaction_session_timeout = '1s'").format(
                sql.Identifier(name)
            )
        )
        conn.execute(
            "INSERT INTO quota_counters SELECT '60:0:k:' || i, 'k:' || i, 0, 60, 1, 0"
            " FROM generate_series(1, %s) AS i",
            (rows,),
        )
        conn.execute("ANALYZE quota_counters")
    # Batches of 5 rows: 60,000 statements, a sweep of many seconds even on a fast
    # machine (batches of 25 have swept three quarters of the rows in the 2.5 s watched).
    first = _cleanup_cli(url, "--batch-size", "5")
    try:
        with psycopg.connect(url, autocommit=True) as watch:
            deadline = time.monotonic() + 60
            held_since = None
            while time.monotonic() < deadline and first.poll() is None:
                (held,) = watch.execute(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted"
                ).fetchone()
                if held and held_since is None:
                    held_since = time.monotonic()
                if held_since is not None and time.monotonic() - held_since > 2.5:
                    break  # the lock's transaction has idled past the timeout twice over
                time.sleep(0.05)
            assert first.poll() is None, "the sweep ended too soon to test the timeout"
            (left,) = watch.execute("SELECT count(*) FROM quota_counters").fetchone()
            assert left > rows // 4, "the sweep is too close to its end to test a second one"
        second = _cleanup_cli(url)
        out2, err2 = second.communicate(timeout=60)
        out1, err1 = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
            first.communicate(timeout=10)
    assert second.returncode == 0, err2
    assert "another cleanup is running; skipped" in out2, (out2, err2)
    assert first.returncode == 0, err1
    assert f"deleted {rows:,} expired row(s)" in out1, (out1, err1)
    with psycopg.connect(url, autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM quota_counters").fetchone() == (0,)


def _sweep_statements(dialect: str, cutoff: int, batch: int) -> list[tuple[str, Any]]:
    """The delete statements (rendered for psycopg) and params of one `dialect` cleanup
    batch per table, as `ops.cleanup` yields them."""
    from quota._sql import ops as _ops
    from quota._sql import statements as _sql
    from quota._sql.steps import drive

    sent: list[tuple[str, Any]] = []

    def execute(statement: Any, params: Any) -> list[tuple[Any, ...]]:
        if statement.name == _sql.PG_TRY_LOCK.name:
            return [(True,)]
        if "DELETE" in str(statement):
            sent.append((_sql.render(str(statement), "format"), params))
            return [(0, None)] if dialect == "postgresql" else []
        return []

    drive(_ops.cleanup(dialect, cutoff, grace=0, batch_size=batch, dry_run=False), execute)
    return sent


@pytest.mark.postgres
def test_a_postgres_sweep_batch_reads_no_more_than_its_rows_however_many_expired(
    pg_make_database: Any,
) -> None:
    """With many expired rows the planner took a sequential scan of the whole table for
    every batch (main: 8 µs a row at 100,000 rows, 48 at 2,000,000): a batch must go on
    from where the last one stopped (a TID range scan) and delete by ctid, no scan."""
    import psycopg

    url = pg_make_database()
    quota.migrate(url)
    rows, now = 200_000, 2_000_000_000
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO quota_counters SELECT '60:' || (i / 1000 * 60) || ':ip:' || md5(i::text),"
            " 'ip:' || md5(i::text), i / 1000 * 60, 60, 1, 0 FROM generate_series(1, %s) AS i",
            (rows,),
        )
        conn.execute(
            "INSERT INTO quota_state SELECT 'tb:60:ip:' || md5(i::text), 'ip:' || md5(i::text),"
            " 60, 1.0, 0.0, 0.0, 1, i FROM generate_series(1, %s) AS i",
            (rows,),
        )
        conn.execute("ANALYZE quota_counters")
        conn.execute("ANALYZE quota_state")
        # The counters and the algorithm state; the leases (a row per running block, never
        # a backlog of millions) keep the plain form.
        statements = [
            (sql, params)
            for sql, params in _sweep_statements("postgresql", now, 10_000)
            if "quota_leases" not in sql
        ]
        assert len(statements) == 2
        for sql, params in statements:
            plan = "\n".join(str(r[0]) for r in conn.execute("EXPLAIN " + sql, params))
            assert "Seq Scan" not in plan, plan
            assert "Tid Range Scan" in plan, plan
