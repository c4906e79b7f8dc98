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
from quota import _partitions
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
