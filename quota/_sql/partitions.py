"""Partitioned counters on PostgreSQL: whole partitions dropped instead of rows deleted.

Chosen at migration time (``quota migrate --partitioned-counters``, or
``-x counters_partitioned=true``): ``quota_counters`` is then range-partitioned
by ``window_start``, one partition per `PARTITION_SECONDS`, plus a DEFAULT
partition that catches any row no partition covers (a long window whose start
lies in a range already dropped, or a cleanup that has not run in a while).
Its primary key is ``(bucket_key, window_start)``, as PostgreSQL requires of
a partitioned table, so the stores give the hot upsert that conflict target
(`partitioned_sql`); the plain table, the default, keeps its statement as is.

Cleanup (`maintain`, run inside `quota._sql.ops.cleanup`):

1. creates the partitions of the next `AHEAD` seconds that do not exist yet,
   so new windows land in a partition, not in the default one; when the
   default partition already holds rows of such a range (no cleanup ran for
   longer than `AHEAD`, or an instance's clock runs ahead), it creates the
   partition as a table of its own, moves those rows into it and attaches
   it, in one transaction (`_create_partition`); ranges further ahead, of
   which the default holds no row, are created behind a check constraint
   that spares the scan of the default partition under the parent's lock
   (`_create_missing`, `_create_ahead`);
2. drops every partition whose range ended before the cutoff and whose
   every window has ended (checked on the window-end index): it detaches the
   partition (a lock on the parent held for a catalog update, not for the
   rows), moves back any live row that reached it after the check, counts
   and drops it;
3. leaves what is left (the default partition, partitions held back by a
   long window) to the ordinary row-by-row cleanup.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Generator

from quota._sql import statements as _sql
from quota._sql.statements import Statement
from quota._sql.steps import Rows, Step

#: Seconds of window starts per partition.
PARTITION_SECONDS = 3600
#: Seconds ahead of now for which cleanup (and the migration) create partitions.
AHEAD = 24 * 3600
#: Seconds behind now for which the migration creates partitions too.
BEHIND = 3600

TABLE = "quota_counters"
DEFAULT_PARTITION = "quota_counters_default"
#: Storage settings of every partition: room on each page keeps count updates HOT.
STORAGE = (
    "fillfactor = 70, autovacuum_vacuum_scale_factor = 0.05, autovacuum_analyze_scale_factor = 0.05"
)

#: One row when the counters table is partitioned, none otherwise.
IS_PARTITIONED = Statement(
    "is_partitioned",
    "SELECT 1 FROM pg_class WHERE oid = to_regclass('quota_counters') AND relkind = 'p'",
)
#: The partitions (default excluded) with their bounds, and whether they are logged.
LIST_PARTITIONS = Statement(
    "list_partitions",
    "SELECT c.relname, pg_get_expr(c.relpartbound, c.oid), c.relpersistence"
    " FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid"
    " WHERE i.inhparent = to_regclass('quota_counters')",
)
_BOUND = re.compile(r"FROM \('?(-?\d+)'?\) TO \('?(-?\d+)'?\)")

_CONFLICT = "ON CONFLICT (bucket_key)"

_WINDOW_ENDED = "(window_start + window_seconds) < ?"
#: `_sql.PG_DELETE_EXPIRED` for a partitioned table, whose ``ctid`` names a row within
#: one partition only: the batch found through the window-end index, deleted by its
#: (unique) bucket key; the ``ctid`` to go on from is ignored. Same params and row.
PARTITIONED_DELETE_EXPIRED = Statement(
    "partitioned_delete_expired",
    "WITH swept AS (DELETE FROM quota_counters WHERE bucket_key = ANY(ARRAY("
    "SELECT bucket_key FROM quota_counters WHERE CAST(? AS text) IS NOT NULL"
    f" AND {_WINDOW_ENDED} ORDER BY (window_start + window_seconds) LIMIT ?))"
    f" AND {_WINDOW_ENDED} RETURNING ctid)"
    " SELECT count(*), CAST(max(ctid) AS text) FROM swept",
)
#: Rendered texts of the statements `partitioned_sql` replaces, in every driver's style.
_BY_KEY = {
    _sql.render(_sql.PG_DELETE_EXPIRED.sql, style): _sql.render(
        PARTITIONED_DELETE_EXPIRED.sql, style
    )
    for style in ("format", "numeric_dollar")
}


@functools.cache
def partitioned_sql(text: str) -> str:
    """`text` for a partitioned counters table.

    Upserts into ``quota_counters`` conflict on ``(bucket_key, window_start)``,
    the partitioned primary key; the bucket key already holds the window
    start, so the two keys name the same rows. Cleanup's batch deletes by
    bucket key instead of ``ctid``, which names a row within one partition
    only. Other statements pass as they are.
    """
    if text.startswith("INSERT INTO quota_counters"):
        return text.replace(_CONFLICT, "ON CONFLICT (bucket_key, window_start)")
    return _BY_KEY.get(text, text)


def partition_name(start: int) -> str:
    return f"quota_counters_p{start}"


def create_table_sql(logged: bool) -> list[str]:
    """DDL of the partitioned counters table, its window-end index and its DEFAULT partition."""
    unlogged = "" if logged else "UNLOGGED "
    return [
        "CREATE TABLE quota_counters ("
        ' bucket_key TEXT COLLATE "C" NOT NULL, client_key TEXT COLLATE "C" NOT NULL,'
        " window_start BIGINT NOT NULL, window_seconds INTEGER NOT NULL,"
        " count BIGINT NOT NULL, updated_at DOUBLE PRECISION NOT NULL,"
        " PRIMARY KEY (bucket_key, window_start)"
        ") PARTITION BY RANGE (window_start)",
        "CREATE INDEX ix_quota_counters_window_end ON quota_counters"
        " ((window_start + window_seconds))",
        f"CREATE {unlogged}TABLE {DEFAULT_PARTITION} PARTITION OF quota_counters DEFAULT"
        f" WITH ({STORAGE})",
    ]


def _bounds(start: int) -> str:
    return f"FROM ({start}) TO ({start + PARTITION_SECONDS})"


def create_partition_sql(start: int, logged: bool) -> str:
    """DDL of the partition holding window starts ``start .. start + PARTITION_SECONDS``."""
    unlogged = "" if logged else "UNLOGGED "
    return (
        f"CREATE {unlogged}TABLE IF NOT EXISTS {partition_name(start)} PARTITION OF quota_counters"
        f" FOR VALUES {_bounds(start)} WITH ({STORAGE})"
    )


#: Step 1 of `_create_partition` (``ONLY``: every hit reaches the partitions through it).
LOCK_PARENT = Statement("lock_parent", "LOCK TABLE ONLY quota_counters IN ACCESS EXCLUSIVE MODE")
#: The rows of the default partition in one partition's range; the first condition adds
#: nothing (a window ends after it starts) but lets the window-end index skip the ended ones.
_IN_RANGE = "window_start + window_seconds >= ? AND window_start >= ? AND window_start < ?"
#: Step 2 of `_create_partition`. Params: `_range_params`.
_DEFAULT_HOLDS_RANGE = Statement(
    "default_holds_range", f"SELECT 1 FROM {DEFAULT_PARTITION} WHERE {_IN_RANGE} LIMIT 1"
)


def _range_params(start: int) -> tuple[int, int, int]:
    return start, start, start + PARTITION_SECONDS


def starts_between(first: float, last: float) -> list[int]:
    """Starts of the partitions covering ``first .. last`` (epoch seconds)."""
    start = int(first) - int(first) % PARTITION_SECONDS
    return list(range(start, int(last) + 1, PARTITION_SECONDS))


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def maintain(now: float, cutoff: int) -> Generator[Step, Rows, int]:
    """Create partitions ahead and drop the expired ones; return the rows dropped with them.

    Does nothing (one catalog query) when the counters table is not
    partitioned. Runs without a transaction of its own, under cleanup's
    advisory lock; each DDL step commits on its own (`_ddl`, `_create_partition`).
    """
    rows = yield IS_PARTITIONED, ()
    if not rows:
        return 0
    rows = yield LIST_PARTITIONS, ()
    ranges: list[tuple[str, int, int]] = []
    logged = True
    for name, bound, persistence in rows:
        if str(bound) == "DEFAULT":
            logged = persistence != "u"  # new partitions take the default partition's kind
            continue
        match = _BOUND.search(str(bound))
        if match:
            ranges.append((str(name), int(match[1]), int(match[2])))
    existing = {low for _, low, _ in ranges}
    return (yield from _create_and_drop(ranges, existing, logged, now, cutoff))


#: Settings of one DDL statement's own transaction (``SET LOCAL``: nothing stays on the
#: connection, which may be shared through a transaction pooler). A DDL statement waiting
#: for the parent's lock queues every hit behind it: give up after a moment instead (the
#: next cleanup tries again). It holds the parent's lock until its commit returns: don't
#: make every hit wait for a WAL flush too; a crash can only undo the last partitions
#: created or dropped, which the next cleanup redoes.
DDL_SETTINGS = Statement(
    "ddl_settings",
    "SELECT set_config('lock_timeout', '2s', true), set_config('synchronous_commit', 'off', true)",
)
BEGIN = Statement("begin", "BEGIN")
COMMIT = Statement("commit", "COMMIT")
ROLLBACK = Statement("rollback", "ROLLBACK")


def _maintenance(sql: str) -> Statement:
    """A statement made up here: it names a partition (DDL, or a read of one partition)."""
    return Statement("partition_maintenance", sql)


def _transaction(body: Generator[Step, Rows, None]) -> Generator[Step, Rows, None]:
    """Run the statements of `body` in a transaction of their own, under `DDL_SETTINGS`."""
    yield BEGIN, ()
    try:
        yield DDL_SETTINGS, ()
        yield from body
    except BaseException:
        yield ROLLBACK, ()
        raise
    yield COMMIT, ()


def _statement(sql: str) -> Generator[Step, Rows, None]:
    yield _maintenance(sql), ()


def _ddl(sql: str) -> Generator[Step, Rows, None]:
    """Run one DDL statement in a transaction of its own, under `DDL_SETTINGS`."""
    yield from _transaction(_statement(sql))


def _create_partition(start: int, logged: bool) -> Generator[Step, Rows, None]:
    """Create the partition of `start`, taking over the default partition's rows of its range.

    ``CREATE TABLE … PARTITION OF`` refuses to create a partition while the
    default partition holds rows of its range (they would have to move). They
    do after a gap in maintenance longer than `AHEAD`: hits of the running
    hour found no partition. So, in one transaction (`_transaction`):

    1. ``LOCK TABLE ONLY quota_counters IN ACCESS EXCLUSIVE MODE``: waits (up
       to the ``lock_timeout`` of `DDL_SETTINGS`) for the hits running on the
       table, then holds every new one until the commit;
    2. looks for a default row of the range (window-end index, else a scan);
    3. none: ``CREATE TABLE … PARTITION OF``, as the migration does;
    4. some: creates the partition as a plain table (``LIKE quota_counters``,
       same kind and storage), moves the default's rows of the range into it
       in one statement (``DELETE … RETURNING`` feeding the ``INSERT``) and
       attaches it (which scans the new table and the default partition to
       check the bounds, and builds the primary key and window-end index).

    No hit is lost or counted twice. A hit already running when the lock is
    asked for ends first (the lock waits for it): its row is in the default
    partition by then, and moves with its count. A hit that begins later
    (queued behind the lock even while it is still waiting) waits on the
    parent, before its row is routed to a partition; once the transaction
    commits it sees the new partition, and its upsert lands there on the
    moved row (count + 1). Were only the locks of ``ATTACH`` taken (SHARE UPDATE
    EXCLUSIVE on the parent), such a hit would already have been routed to
    the default partition and, after waiting for it, fail its re-checked
    partition constraint. If anything fails (a lock wait given up, an error)
    the transaction rolls back whole: the rows stay in the default partition,
    where hits keep counting them, and the next cleanup tries again. A hit
    kept waiting past its own budget (the fallback's ``statement_timeout``)
    fails over as it would behind any lock.
    """
    yield LOCK_PARENT, ()
    rows = yield _DEFAULT_HOLDS_RANGE, _range_params(start)
    if not rows:
        yield _maintenance(create_partition_sql(start, logged)), ()
        return
    name, unlogged = partition_name(start), "" if logged else "UNLOGGED "
    yield (
        _maintenance(f"CREATE {unlogged}TABLE {name} (LIKE quota_counters) WITH ({STORAGE})"),
        (),
    )
    yield (
        _maintenance(
            f"WITH moved AS (DELETE FROM {DEFAULT_PARTITION} WHERE {_IN_RANGE} RETURNING *)"
            f" INSERT INTO {name} SELECT * FROM moved"
        ),
        _range_params(start),
    )
    yield (
        _maintenance(
            f"ALTER TABLE quota_counters ATTACH PARTITION {name} FOR VALUES {_bounds(start)}"
        ),
        (),
    )


#: The CHECK constraint `_create_ahead` puts on the default partition for a moment: no
#: row of the ranges it is about to create. Named, so that one left behind by a
#: cleanup that died halfway is dropped by the next.
AHEAD_CHECK = "quota_counters_default_ahead"
#: Seconds after now before which a range is created the plain way (`_create_partition`),
#: not behind `AHEAD_CHECK`: while that check stands, a hit that lands in the default
#: partition in one of its ranges fails, so it only covers ranges whose hits have not
#: begun (longer than a validation takes, plus the clock skew between instances).
CHECK_GUARD = 600
#: Whether `AHEAD_CHECK` is on the default partition. No params.
_HAS_AHEAD_CHECK = Statement(
    "has_ahead_check",
    "SELECT 1 FROM pg_constraint"
    f" WHERE conrelid = to_regclass('{DEFAULT_PARTITION}') AND conname = '{AHEAD_CHECK}'",
)
_DROP_AHEAD_CHECK = f"ALTER TABLE {DEFAULT_PARTITION} DROP CONSTRAINT IF EXISTS {AHEAD_CHECK}"


def _runs(starts: list[int]) -> list[list[int]]:
    """`starts` (sorted) cut into runs of adjacent partitions."""
    runs: list[list[int]] = []
    for start in starts:
        if runs and runs[-1][-1] + PARTITION_SECONDS == start:
            runs[-1].append(start)
        else:
            runs.append([start])
    return runs


def _create_ahead(starts: list[int], logged: bool) -> Generator[Step, Rows, None]:
    """Create the adjacent partitions of `starts`, of whose ranges the default holds no row,
    without scanning the default partition under the parent's lock.

    ``CREATE TABLE … PARTITION OF`` checks that the default partition holds no
    row of the new range: a scan of the whole default partition, under an
    ACCESS EXCLUSIVE lock on the parent that holds every hit meanwhile (half a
    second for 2M rows, and as many times as partitions are missing after a
    gap), unless a valid CHECK constraint of the default partition already
    rules those rows out. So:

    1. ``ADD CONSTRAINT … CHECK (window_start < low OR window_start >= high)
       NOT VALID`` on the default partition (a catalog update; new rows of
       the range are refused from here on, which is why `CHECK_GUARD`);
    2. ``VALIDATE CONSTRAINT``: the scan, under a SHARE UPDATE EXCLUSIVE lock
       of the default partition only, which hits do not wait for;
    3. each partition in a transaction of its own (`_create_partition`): the
       parent's lock is held for a catalog update, the check being implied;
    4. ``DROP CONSTRAINT``, also when anything above failed: a long window
       whose range is dropped later must find the default partition open.
    """
    low, high = starts[0], starts[-1] + PARTITION_SECONDS
    try:
        yield from _ddl(
            f"ALTER TABLE {DEFAULT_PARTITION} ADD CONSTRAINT {AHEAD_CHECK}"
            f" CHECK (window_start < {low} OR window_start >= {high}) NOT VALID"
        )
        yield from _ddl(f"ALTER TABLE {DEFAULT_PARTITION} VALIDATE CONSTRAINT {AHEAD_CHECK}")
        for start in starts:
            yield from _transaction(_create_partition(start, logged))
    finally:
        yield from _ddl(_DROP_AHEAD_CHECK)


def _create_missing(starts: list[int], logged: bool, now: float) -> Generator[Step, Rows, None]:
    """Create the partitions of `starts` (none exists yet).

    Those whose range the default partition holds rows of, or that begin
    within `CHECK_GUARD` seconds, one by one (`_create_partition`: a scan of
    the default partition under the parent's lock each); the others, in runs
    of adjacent ranges, behind a check constraint (`_create_ahead`: no scan
    under the lock). After a gap longer than `AHEAD` that is one scan under
    the lock (the running hour's, whose rows move) instead of one per hour.
    """
    ahead: list[int] = []
    for start in starts:
        if start >= now + CHECK_GUARD:
            rows = yield _DEFAULT_HOLDS_RANGE, _range_params(start)
            if not rows:
                ahead.append(start)
                continue
        yield from _transaction(_create_partition(start, logged))
    for run in _runs(ahead):
        yield from _create_ahead(run, logged)


def _create_and_drop(
    ranges: list[tuple[str, int, int]], existing: set[int], logged: bool, now: float, cutoff: int
) -> Generator[Step, Rows, int]:
    if (yield _HAS_AHEAD_CHECK, ()):
        yield from _ddl(_DROP_AHEAD_CHECK)  # left by a cleanup that died halfway
    missing = [s for s in starts_between(now, now + AHEAD) if s not in existing]
    if missing:
        yield from _create_missing(missing, logged, now)
    dropped = 0
    for name, _low, high in sorted(ranges, key=lambda r: r[1]):
        if high > cutoff:
            continue  # new windows may still start in its range
        table = _quote(name)
        rows = yield _maintenance(f"SELECT max(window_start + window_seconds) FROM {table}"), ()
        if rows[0][0] is not None and rows[0][0] >= cutoff:
            continue  # a window in it is still running: row cleanup deals with the rest
        yield from _ddl(f"ALTER TABLE quota_counters DETACH PARTITION {table}")
        # A live window that reached the partition after the check goes back
        # to the table (its range has no partition now: the default one).
        moved = yield (
            _maintenance(
                f"INSERT INTO quota_counters SELECT * FROM {table}"
                " WHERE window_start + window_seconds >= ?"
                " ON CONFLICT (bucket_key, window_start) DO UPDATE"
                " SET count = quota_counters.count + excluded.count,"
                " updated_at = GREATEST(quota_counters.updated_at, excluded.updated_at)"
                " RETURNING 1"
            ),
            (cutoff,),
        )
        rows = yield _maintenance(f"SELECT count(*) FROM {table}"), ()
        yield from _ddl(f"DROP TABLE {table}")
        dropped += int(rows[0][0]) - len(moved)
    return dropped
