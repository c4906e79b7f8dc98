"""Partitioned counters (PostgreSQL, ``counters_partitioned=True``): migration, decisions, cleanup.

Each test migrates a throwaway database of its own. The clock is injected:
the first cleanup creates the partitions around it, as a scheduled cleanup
would around the real time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

import quota
from quota._sql import partitions as _partitions
from tests._support import Clock

pytestmark = pytest.mark.postgres

#: A two-hour-aligned instant: the hours [A, A+1h) and [A+1h, A+2h) are partitions X and Y.
A = 1_750_003_200
HOUR = _partitions.PARTITION_SECONDS


def _query(url: str, sql: str) -> list[tuple[object, ...]]:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        return conn.execute(sql).fetchall()


def _partition_starts(url: str) -> set[int]:
    rows = _query(
        url,
        "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid"
        " WHERE i.inhparent = 'quota_counters'::regclass",
    )
    return {
        int(str(name).removeprefix("quota_counters_p"))
        for (name,) in rows
        if name != "quota_counters_default"
    }


def _where(url: str) -> dict[str, str]:
    """Bucket key -> the partition holding its row."""
    rows = _query(url, "SELECT bucket_key, tableoid::regclass::text FROM quota_counters")
    return {str(key): str(table) for key, table in rows}


@pytest.fixture
def part_url(pg_make_database: Callable[[], str]) -> str:
    url = pg_make_database()
    quota.migrate(url, counters_partitioned=True)
    return url


def test_migration_up_and_down(pg_make_database: Callable[[], str]) -> None:
    url = pg_make_database()
    quota.migrate(url, counters_partitioned=True)
    assert _query(url, "SELECT relkind FROM pg_class WHERE relname = 'quota_counters'") == [("p",)]
    starts = _partition_starts(url)
    assert len(starts) >= _partitions.AHEAD // HOUR  # the day ahead, made by the migration
    persistence = _query(
        url, "SELECT DISTINCT relpersistence FROM pg_class WHERE relname LIKE 'quota_counters_%'"
        " AND relkind = 'r'",
    )  # fmt: skip
    assert persistence == [("u",)]  # unlogged partitions, as the plain table

    quota.downgrade(url, revision="base")
    assert _query(url, "SELECT count(*) FROM pg_class WHERE relname LIKE 'quota_counters%'") == [
        (0,)
    ]

    quota.migrate(url)  # the default: a plain table
    assert _query(url, "SELECT relkind FROM pg_class WHERE relname = 'quota_counters'") == [("r",)]


def test_decisions_keep_working_across_a_partition_boundary(part_url: str) -> None:
    clock = Clock(A + HOUR - 30)
    with quota.connect(part_url, clock=clock) as limiter:
        limiter.cleanup(grace=0)  # partitions around the clock
        assert {A, A + HOUR} <= _partition_starts(part_url)
        assert [limiter.rate_limit("k", 3, 60).count for _ in range(2)] == [1, 2]
        assert limiter.rate_limit("long", 3, 7200).count == 1
        clock.advance(60)  # into the next partition's hour
        assert [limiter.rate_limit("k", 3, 60).count for _ in range(2)] == [1, 2]
        assert limiter.rate_limit("long", 3, 7200).count == 2  # same window, same row
        assert limiter.peek("k", 3, 60).count == 2

    where = _where(part_url)
    assert where[f"60:{A + HOUR - 60}:k:k"] == f"quota_counters_p{A}"
    assert where[f"60:{A + HOUR}:k:k"] == f"quota_counters_p{A + HOUR}"
    assert where[f"7200:{A}:k:long"] == f"quota_counters_p{A}"


def test_batched_async_decisions_on_a_partitioned_table(part_url: str) -> None:
    clock = Clock(A + HOUR - 1)

    async def main() -> list[int]:
        async with quota.connect_async(part_url, clock=clock, batching=True) as limiter:
            await limiter.cleanup(grace=0)
            first = await asyncio.gather(*(limiter.rate_limit("hot", 50, 2) for _ in range(40)))
            clock.advance(2)
            second = await asyncio.gather(*(limiter.rate_limit("hot", 50, 2) for _ in range(40)))
            return [d.count for d in first + second]

    counts = asyncio.run(main())

    assert sorted(counts[:40]) == sorted(counts[40:]) == list(range(1, 41))
    assert set(_where(part_url).values()) == {f"quota_counters_p{A}", f"quota_counters_p{A + HOUR}"}


def test_cleanup_drops_only_partitions_whose_every_window_has_ended(part_url: str) -> None:
    clock = Clock(A + 10)
    with quota.connect(part_url, clock=clock) as limiter:
        limiter.cleanup(grace=0)
        limiter.rate_limit("short-x", 5, 60)  # partition X, ends A+60
        limiter.rate_limit("long", 5, 7200)  # partition X, ends A+2h
        clock.advance(HOUR)
        limiter.rate_limit("y", 5, 600)  # partition Y, ends A+1h+600
        clock.advance(190)

        # X's hour is over but "long" still runs in it: X stays, its ended row goes.
        result = limiter.cleanup(grace=0)
        assert (result.deleted, result.skipped) == (1, False)
        assert {A, A + HOUR} <= _partition_starts(part_url)
        assert set(_where(part_url)) == {f"7200:{A}:k:long", f"600:{A + HOUR}:k:y"}

        clock.advance(HOUR)  # now A+2h+200: every window in X and Y has ended
        limiter.rate_limit("now", 5, 60)
        result = limiter.cleanup(grace=0)
        assert result.deleted == 2
        starts = _partition_starts(part_url)
        assert A not in starts and A + HOUR not in starts  # dropped whole
        assert A + 2 * HOUR in starts  # the running hour stays
        assert A + 2 * HOUR + _partitions.AHEAD - HOUR in starts  # made ahead of need
        assert list(_where(part_url)) == [f"60:{A + 2 * HOUR + 180}:k:now"]
        assert limiter.peek("now", 5, 60).count == 1

        # A window starting in a dropped hour lands in the default partition, counted.
        assert limiter.rate_limit("day", 5, 86400).count == 1
        assert limiter.rate_limit("day", 5, 86400).count == 2
        assert set(_where(part_url).values()) >= {"quota_counters_default"}


def test_a_plain_table_keeps_the_row_cleanup(pg_clean_url: str) -> None:
    clock = Clock(A + 10)
    with quota.connect(pg_clean_url, clock=clock) as limiter:
        limiter.rate_limit("x", 5, 60)
        clock.advance(HOUR)
        assert limiter.cleanup(grace=0).deleted == 1
    assert _query(
        pg_clean_url, "SELECT relkind FROM pg_class WHERE relname = 'quota_counters'"
    ) == [("r",)]


# -- maintenance after a gap: rows in DEFAULT of the hours to partition --------------------

DAY = 86400


def _default_rows_in_partitioned_ranges(url: str) -> list[str]:
    """Bucket keys of DEFAULT rows whose window start lies in a partition's range."""
    starts = _partition_starts(url)
    rows = _query(url, "SELECT bucket_key, window_start FROM quota_counters_default")
    return [str(key) for key, start in rows if int(str(start)) // HOUR * HOUR in starts]


def _partition_shape(url: str, start: int) -> tuple[object, ...]:
    """Persistence, storage options and index count of the partition of `start`."""
    name = _partitions.partition_name(start)
    rows = _query(
        url,
        "SELECT c.relpersistence, c.reloptions,"
        " (SELECT count(*) FROM pg_index x WHERE x.indrelid = c.oid)"
        f" FROM pg_class c WHERE c.relname = '{name}'",
    )
    assert len(rows) == 1, name
    return rows[0]


def test_cleanup_after_a_gap_moves_default_rows_into_the_new_partitions(part_url: str) -> None:
    clock = Clock(A + 10)
    skewed = Clock(A)  # an instance whose clock runs hours ahead of the others
    H = A + 3 * DAY  # the hour of the cleanup that ends the gap
    with (
        quota.connect(part_url, clock=clock, pool_size=2) as limiter,
        quota.connect(part_url, clock=skewed, pool_size=2) as ahead,
    ):
        limiter.cleanup(grace=0)  # partitions A .. A+24h, then no maintenance for 3 days
        limiter.rate_limit("before", 5, 60)  # partition A

        clock.now = H - 2 * HOUR + 10  # the gap: no partition covers these hours
        limiter.rate_limit("old", 5, 60)  # ended long before the cleanup
        limiter.rate_limit("day", 5, DAY)  # starts H-16h (a past hour), runs until H+8h
        clock.now = H + 10
        limiter.rate_limit("cur", 5, 60)  # in the cleanup's hour, ended before it
        assert [limiter.rate_limit("live", 10, HOUR).count for _ in range(3)] == [1, 2, 3]
        skewed.now = H + 2 * HOUR + 5
        assert [ahead.rate_limit("skew2", 10, 600).count for _ in range(2)] == [1, 2]
        skewed.now = H + 5 * HOUR + 5
        assert ahead.rate_limit("skew5", 10, 60).count == 1
        where = _where(part_url)
        assert set(where.values()) == {f"quota_counters_p{A}", "quota_counters_default"}
        assert sum(t == "quota_counters_default" for t in where.values()) == 6

        clock.now = H + 1800
        result = limiter.cleanup(grace=0)

        # Dropped partition A ("before"), swept "old" and "cur" (moved, then expired).
        assert (result.deleted, result.skipped) == (3, False)
        starts = _partition_starts(part_url)
        assert set(_partitions.starts_between(H + 1800, H + 1800 + _partitions.AHEAD)) <= starts
        assert not {s for s in starts if s < H}  # every old hour dropped whole
        assert _where(part_url) == {
            f"86400:{H - 16 * HOUR}:k:day": "quota_counters_default",  # its hour has no partition
            f"3600:{H}:k:live": f"quota_counters_p{H}",
            f"600:{H + 2 * HOUR}:k:skew2": f"quota_counters_p{H + 2 * HOUR}",
            f"60:{H + 5 * HOUR}:k:skew5": f"quota_counters_p{H + 5 * HOUR}",
        }
        assert _default_rows_in_partitioned_ranges(part_url) == []
        # A moved-into partition is one like the others: unlogged, same storage, both indexes.
        assert _partition_shape(part_url, H) == _partition_shape(part_url, H + HOUR)
        assert _partition_shape(part_url, H)[2] == 2

        # The counts carry on where they were, in the same windows.
        assert limiter.rate_limit("live", 10, HOUR).count == 4
        assert limiter.rate_limit("day", 5, DAY).count == 2
        skewed.now = H + 2 * HOUR + 6
        assert ahead.rate_limit("skew2", 10, 600).count == 3
        skewed.now = H + 5 * HOUR + 6
        assert ahead.rate_limit("skew5", 10, 60).count == 2
        assert _default_rows_in_partitioned_ranges(part_url) == []

        # Nothing left to do: a second cleanup changes nothing.
        again = limiter.cleanup(grace=0)
        assert (again.deleted, again.skipped) == (0, False)
        assert _partition_starts(part_url) == starts
        assert limiter.peek("live", 10, HOUR).count == 4


def test_async_cleanup_after_days_without_one_drops_old_partitions(part_url: str) -> None:
    clock = Clock(A + 10)
    G = A + 4 * DAY + 100  # four days later

    async def main() -> tuple[list[int], int, int, int]:
        async with quota.connect_async(part_url, clock=clock, pool_size=2) as limiter:
            await limiter.cleanup(grace=0)
            await limiter.rate_limit("x", 5, 60)  # partition A
            await limiter.rate_limit("long", 5, 2 * HOUR)  # partition A, ends A+2h
            clock.advance(5 * HOUR)
            await limiter.rate_limit("y", 5, 600)  # partition A+5h
            clock.now = G
            counts = [(await limiter.rate_limit("now", 5, 600)).count for _ in range(2)]
            assert _where(part_url)[f"600:{G - 100}:k:now"] == "quota_counters_default"
            first = (await limiter.cleanup(grace=0)).deleted
            counts.append((await limiter.rate_limit("now", 5, 600)).count)
            second = (await limiter.cleanup(grace=0)).deleted
            return counts, first, second, (await limiter.peek("now", 5, 600)).count

    counts, first, second, peeked = asyncio.run(main())

    assert counts == [1, 2, 3]
    assert (first, second, peeked) == (3, 0, 3)
    starts = _partition_starts(part_url)
    assert min(starts) == G - 100  # every partition of the old days dropped
    assert set(_partitions.starts_between(G, G + _partitions.AHEAD)) <= starts
    assert _where(part_url) == {f"600:{G - 100}:k:now": f"quota_counters_p{G - 100}"}
    assert _default_rows_in_partitioned_ranges(part_url) == []


def _waiting_on_a_lock(url: str) -> int:
    rows = _query(
        url,
        "SELECT count(*) FROM pg_stat_activity"
        " WHERE datname = current_database() AND wait_event_type = 'Lock'",
    )
    return int(str(rows[0][0]))


def test_a_hit_during_the_move_waits_and_counts_on_in_the_new_partition(part_url: str) -> None:
    import threading
    import time

    import psycopg

    from quota._sql import statements as _sql

    H = A + 3 * DAY
    clock = Clock(A + 10)
    with quota.connect(part_url, clock=clock, pool_size=2) as limiter:
        limiter.cleanup(grace=0)
        clock.now = H + 10  # days later: the hour has no partition, hits land in DEFAULT
        assert [limiter.rate_limit("k", 10, HOUR).count for _ in range(2)] == [1, 2]

        # The maintenance of H's partition, driven by hand: paused once the lock is held.
        op = _partitions._transaction(_partitions._create_partition(H, logged=False))
        counts: list[int] = []
        with psycopg.connect(part_url, autocommit=True) as conn:
            sql, params = next(op)
            while True:
                cursor = conn.execute(_sql.render(sql, "format"), params)
                rows = cursor.fetchall() if cursor.description is not None else []
                if sql == _partitions.LOCK_PARENT:  # a hit arrives now, before the move
                    hit = threading.Thread(
                        target=lambda: counts.append(limiter.rate_limit("k", 10, HOUR).count)
                    )
                    hit.start()
                    deadline = time.monotonic() + 10
                    while not _waiting_on_a_lock(part_url) and time.monotonic() < deadline:
                        time.sleep(0.01)
                    assert _waiting_on_a_lock(part_url) == 1 and not counts
                try:
                    sql, params = op.send(rows)
                except StopIteration:
                    break
            hit.join(10)

        assert counts == [3]  # waited for the commit, then counted on the moved row
        assert _where(part_url) == {f"3600:{H}:k:k": f"quota_counters_p{H}"}
        assert limiter.peek("k", 10, HOUR).count == 3


def test_a_move_that_cannot_get_its_lock_rolls_back_whole(part_url: str) -> None:
    import psycopg

    H = A + 3 * DAY
    clock = Clock(A + 10)
    with quota.connect(part_url, clock=clock, pool_size=2) as limiter:
        limiter.cleanup(grace=0)
        clock.now = H + 10
        assert [limiter.rate_limit("k", 10, HOUR).count for _ in range(2)] == [1, 2]
        with psycopg.connect(part_url) as blocker:  # a transaction left open on the table
            blocker.execute("SELECT count(*) FROM quota_counters")
            with pytest.raises(quota.StorageError, match="lock timeout"):
                limiter.cleanup(grace=0)  # gives up after DDL_SETTINGS' lock_timeout
            blocker.rollback()
        # Nothing half done: no partition of H, no table left over, the row where it was.
        assert H not in _partition_starts(part_url)
        assert _query(part_url, f"SELECT to_regclass('quota_counters_p{H}')") == [(None,)]
        assert _where(part_url) == {f"3600:{H}:k:k": "quota_counters_default"}
        assert limiter.rate_limit("k", 10, HOUR).count == 3

        assert not limiter.cleanup(grace=0).skipped  # the next one does it
        assert _where(part_url) == {f"3600:{H}:k:k": f"quota_counters_p{H}"}
        assert limiter.rate_limit("k", 10, HOUR).count == 4


SETTINGS = "SELECT current_setting('lock_timeout'), current_setting('synchronous_commit')"


def test_the_move_through_a_transaction_pooler_leaves_nothing_on_the_session(
    part_url: str, pgbouncer_binary: str
) -> None:
    from urllib.parse import urlsplit

    from tests._pgbouncer import running_pgbouncer

    H = A + 3 * DAY
    parts = urlsplit(part_url)
    with running_pgbouncer(
        binary=pgbouncer_binary,
        server_host=parts.hostname or "127.0.0.1",
        server_port=parts.port or 5432,
        pool_mode="transaction",
        default_pool_size=2,  # cleanup's lock holds one server connection, its work the other
    ) as bouncer:
        url = bouncer.url(parts.path.lstrip("/"))
        clock = Clock(A + 10)
        with quota.connect(url, clock=clock, pool_size=2, prepared_statements=False) as limiter:
            limiter.cleanup(grace=0)
            clock.now = H + 10
            assert [limiter.rate_limit("k", 10, HOUR).count for _ in range(2)] == [1, 2]
            clock.now = H + 600
            assert not limiter.cleanup(grace=0).skipped
            assert limiter.rate_limit("k", 10, HOUR).count == 3
            # Whichever server connection answers has the server's settings.
            settings = {row for _ in range(4) for row in _query(url, SETTINGS)}
        assert settings == set(_query(part_url, SETTINGS))
    assert _where(part_url) == {f"3600:{H}:k:k": f"quota_counters_p{H}"}


@pytest.mark.slow
def test_catching_up_after_a_gap_scans_the_default_partition_under_the_lock_once(
    part_url: str,
) -> None:
    """After a day without cleanup the default partition holds the gap's rows, and 25
    partitions are missing. Creating one takes the parent's lock, which every hit waits
    for, and checks that the default partition holds no row of its range: a scan of the
    whole default partition. Main: one such stall per partition (2M rows: a hit of
    648 ms, 376 over 100 ms). Only the running hour, whose rows move, may scan it now."""
    import threading
    import time

    import psycopg

    H = A + 3 * DAY
    clock = Clock(A + 10)
    with quota.connect(part_url, clock=clock, pool_size=2) as limiter:
        limiter.cleanup(grace=0)
        with psycopg.connect(part_url, autocommit=True) as conn:
            # The gap's rows: hours with no partition, ended long before the cleanup.
            conn.execute(
                "INSERT INTO quota_counters SELECT '60:' || s || ':k:' || i, 'k:' || i, s, 60, 1, 0"
                " FROM generate_series(1, 1000000) AS i, LATERAL (SELECT %s + i %% 40 * 60 AS s) AS w",
                (H - 2 * HOUR,),
            )
            conn.execute("VACUUM ANALYZE quota_counters")
            scan_started = time.monotonic()
            conn.execute("SELECT count(*) FROM quota_counters_default WHERE client_key = ''")
            scan = time.monotonic() - scan_started  # one scan of the default partition
        clock.now = H + 10
        limiter.rate_limit("live", 10, HOUR)  # the running hour has rows in the default

        latencies: list[float] = []
        done = threading.Event()

        def hits() -> None:
            with quota.connect(part_url, clock=clock, pool_size=1) as app:
                while not done.is_set():
                    started = time.monotonic()
                    app.rate_limit("busy", 10**9, 60)
                    latencies.append(time.monotonic() - started)

        hitter = threading.Thread(target=hits)
        hitter.start()
        try:
            # A grace of 3 h keeps the gap's rows (their row cleanup is not measured here).
            result = limiter.cleanup(grace=3 * HOUR)
        finally:
            done.set()
            hitter.join(30)

    assert not result.skipped
    assert set(_partitions.starts_between(H + 10, H + 10 + _partitions.AHEAD)) <= (
        _partition_starts(part_url)
    )
    assert _where(part_url)[f"3600:{H}:k:live"] == f"quota_counters_p{H}"
    stalls = [t for t in latencies if t > max(scan / 2, 0.1)]
    assert len(latencies) > 25
    # Main: a stall for each of the 25 partitions. A loaded machine may add one or two.
    assert len(stalls) <= 6, (scan, sorted(stalls))


def test_a_check_left_on_the_default_partition_by_a_dead_cleanup_is_dropped(
    part_url: str,
) -> None:
    """Partitions ahead are created behind a check on the DEFAULT partition that refuses
    rows of their hours; one left by a cleanup killed halfway goes with the next one."""
    import psycopg

    clock = Clock(A + 10)
    far = A + 30 * DAY
    with quota.connect(part_url, clock=clock, pool_size=2) as limiter:
        limiter.cleanup(grace=0)
        with psycopg.connect(part_url, autocommit=True) as conn:
            conn.execute(
                f"ALTER TABLE quota_counters_default ADD CONSTRAINT {_partitions.AHEAD_CHECK}"
                f" CHECK (window_start < {far} OR window_start >= {far + HOUR}) NOT VALID"
            )
        assert not limiter.cleanup(grace=0).skipped
        assert _query(
            part_url,
            f"SELECT count(*) FROM pg_constraint WHERE conname = '{_partitions.AHEAD_CHECK}'",
        ) == [(0,)]
        clock.now = far + 10  # a window of that hour lands in the DEFAULT partition
        assert limiter.rate_limit("k", 5, 60).count == 1
    assert _where(part_url) == {f"60:{far}:k:k": "quota_counters_default"}


def test_a_sweep_batch_on_partitioned_counters_scans_no_partition_whole(part_url: str) -> None:
    """The batch a partitioned table gets (`partitioned_sql`): found through the window-end
    index and deleted by primary key, however many rows the DEFAULT partition holds."""
    import psycopg

    from quota._sql import statements as _sql

    with psycopg.connect(part_url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO quota_counters SELECT '60:' || s || ':k:' || i, 'k:' || i, s, 60, 1, 0"
            " FROM generate_series(1, 200000) AS i, LATERAL (SELECT %s + i %% 40 * 60 AS s) AS w",
            (A - 3 * DAY,),
        )
        conn.execute("ANALYZE quota_counters")
        sql = _partitions.partitioned_sql(_sql.render(_sql.PG_DELETE_EXPIRED.sql, "format"))
        cutoff = A
        plan = "\n".join(
            str(row[0])
            for row in conn.execute("EXPLAIN " + sql, (_sql.PG_FIRST_CTID, cutoff, 10_000, cutoff))
        )
    assert "Seq Scan on quota_counters_default" not in plan, plan  # (empty ones cost nothing)
    assert "Index Scan using quota_counters_default_expr_idx" in plan, plan
