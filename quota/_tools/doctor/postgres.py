"""The PostgreSQL settings of the hot tables: UNLOGGED or logged, fillfactor, HOT updates
(a partitioned table's, read from its partitions)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from quota._tools.doctor.base import OK, WARN, Finding, Session, quoted

#: Tables updated on every decision, so their PostgreSQL settings matter.
HOT_TABLES = ("quota_counters", "quota_state")
#: Below this many updates the HOT ratio says nothing yet.
MIN_UPDATES_FOR_HOT = 1000
#: A HOT ratio under this gets a warning.
MIN_HOT_RATIO = 0.8
#: Fillfactors above this leave too little room on a page for HOT updates.
MAX_FILLFACTOR = 90

_TABLE_FACTS = (
    "SELECT c.relkind, c.relpersistence, c.reloptions, s.n_tup_upd, s.n_tup_hot_upd"
    " FROM pg_class c LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid"
    " WHERE c.oid = to_regclass(%s)"
)
#: The partitions of a partitioned table: the rows, and so the settings that matter, are theirs.
_PARTITION_FACTS = (
    "SELECT p.relname, pg_get_expr(p.relpartbound, p.oid) = 'DEFAULT', p.relpersistence,"
    " p.reloptions, s.n_tup_upd, s.n_tup_hot_upd"
    " FROM pg_inherits i JOIN pg_class p ON p.oid = i.inhrelid"
    " LEFT JOIN pg_stat_user_tables s ON s.relid = p.oid"
    " WHERE i.inhparent = to_regclass(%s) ORDER BY p.relname"
)


@dataclass(frozen=True, slots=True)
class Partition:
    """One partition of a partitioned table, as `partitioned_findings` judges it."""

    name: str
    default: bool
    relpersistence: str
    fillfactor: int
    updates: int = 0
    hot: int = 0


def table_settings(session: Session, table: str) -> list[Finding]:
    """The ``persistence``, ``fillfactor`` and ``hot_updates`` findings of `table` (of its
    partitions when it is partitioned); none when it does not exist."""
    rows = session.query(_TABLE_FACTS, (table,))
    if not rows:
        return []  # not created (yet): the schema finding says so
    relkind, persistence, options, updates, hot = rows[0]
    if relkind == "p":
        partitions = [
            Partition(
                str(name), bool(default), str(kind), fillfactor(opts), int(upd or 0), int(h or 0)
            )
            for name, default, kind, opts, upd, h in session.query(_PARTITION_FACTS, (table,))
        ]
        return partitioned_findings(table, partitions)
    return [
        persistence_finding(table, str(persistence)),
        fillfactor_finding(table, fillfactor(options)),
        hot_finding(table, int(updates or 0), int(hot or 0)),
    ]


#: At most this many partitions are named in one finding.
_NAMED = 5


def _names(partitions: Sequence[Partition]) -> str:
    names = [p.name for p in partitions[:_NAMED]]
    return ", ".join(names) + (
        f" and {len(partitions) - _NAMED} more" if partitions[_NAMED:] else ""
    )


def partitioned_findings(table: str, partitions: Sequence[Partition]) -> list[Finding]:
    """Persistence, fillfactor and HOT updates of a partitioned table, read from its partitions.

    The parent holds no rows and takes no storage settings (PostgreSQL refuses a
    fillfactor on it); new partitions take the DEFAULT partition's persistence and
    `quota._sql.partitions.STORAGE`. No partitions at all: the schema_drift check says so.
    """
    if not partitions:
        return []
    reference = next((p for p in partitions if p.default), partitions[0])
    odd = [p for p in partitions if p.relpersistence != reference.relpersistence]
    if odd:
        wanted = "UNLOGGED" if reference.relpersistence == "u" else "LOGGED"
        persistence = Finding(
            "persistence", WARN,
            f"the partitions of {table} disagree: {_names(odd)} are not {wanted} like"
            f" {reference.name}, whose kind new partitions take",
            quoted([f"ALTER TABLE {p.name} SET {wanted}" for p in odd]),
        )  # fmt: skip
    else:
        persistence = persistence_finding(table, reference.relpersistence, len(partitions))
    full = [p for p in partitions if p.fillfactor > MAX_FILLFACTOR]
    if full:
        fill = Finding(
            "fillfactor", WARN,
            f"{table}: fillfactor {', '.join(sorted({str(p.fillfactor) for p in full}))} in"
            f" {_names(full)}: pages fill up, so count updates stop being HOT and write every"
            " index",
            quoted([f"ALTER TABLE {p.name} SET (fillfactor = 70)" for p in full])
            + "; new pages use it at once (new partitions get 70 from `quota cleanup`)",
        )  # fmt: skip
    else:
        values = sorted({p.fillfactor for p in partitions})
        spread = str(values[0]) if len(values) == 1 else f"{values[0]} to {values[-1]}"
        fill = Finding(
            "fillfactor", OK, f"{table} fillfactor is {spread} in its {len(partitions)} partitions"
        )
    updates = sum(p.updates for p in partitions)
    return [persistence, fill, hot_finding(table, updates, sum(p.hot for p in partitions))]


def fillfactor(reloptions: Sequence[str] | None) -> int:
    """The fillfactor in a table's ``pg_class.reloptions`` (100 when not set)."""
    for option in reloptions or ():
        name, _, value = option.partition("=")
        if name == "fillfactor":
            return int(value)
    return 100


def persistence_finding(table: str, relpersistence: str, partitions: int = 0) -> Finding:
    """UNLOGGED (the default) or logged: both are deliberate choices, so both are ok.

    `partitions`: how many partitions of a partitioned `table` share that persistence.
    """
    where = f" (all {partitions} of its partitions)" if partitions else ""
    if relpersistence == "u":
        return Finding(
            "persistence", OK,
            f"{table} is UNLOGGED{where}: writes skip the WAL (about twice the write rate); a crash"
            " empties it and standbys do not have it",
        )  # fmt: skip
    return Finding(
        "persistence", OK,
        f"{table} is a logged table{where} (created with --logged-counters): it survives a crash and"
        " is replicated, at about half the write rate of UNLOGGED",
    )  # fmt: skip


def fillfactor_finding(table: str, value: int) -> Finding:
    """A fillfactor leaving room on each page, so count updates can stay HOT."""
    if value <= MAX_FILLFACTOR:
        return Finding("fillfactor", OK, f"{table} fillfactor is {value}")
    return Finding(
        "fillfactor", WARN,
        f"{table} fillfactor is {value}: pages fill up, so count updates stop being HOT"
        " and write every index",
        f"ALTER TABLE {table} SET (fillfactor = 70); new pages use it at once, existing"
        f" ones after VACUUM FULL {table} (locks the table) or pg_repack",
    )  # fmt: skip


def hot_finding(table: str, updates: int, hot: int) -> Finding:
    """The share of updates PostgreSQL made HOT (no index write), from pg_stat_user_tables."""
    if updates < MIN_UPDATES_FOR_HOT:
        return Finding(
            "hot_updates", OK,
            f"{table}: {updates} updates so far, too few to judge the HOT ratio",
        )  # fmt: skip
    ratio = hot / updates
    if ratio >= MIN_HOT_RATIO:
        return Finding("hot_updates", OK, f"{table}: {ratio:.0%} of {updates} updates were HOT")
    return Finding(
        "hot_updates", WARN,
        f"{table}: only {ratio:.0%} of {updates} updates were HOT; the rest wrote every index",
        f"lower the fillfactor (ALTER TABLE {table} SET (fillfactor = 70)), schedule"
        " `quota cleanup` so pages keep free room, and check that no index was added on"
        " a column the updates change",
    )  # fmt: skip
