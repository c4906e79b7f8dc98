"""The tables `quota` owns, and the check that they are there and current.

The migrations in ``migrations/versions`` create these tables; nothing here
runs DDL. `metadata` describes exactly what they create at head, on SQLite
and on PostgreSQL (the plain, unpartitioned counters table): Alembic's
autogenerate compares it with a database (`include_object` names the two
things it cannot compare), and ``quota doctor`` reads the expected schema
from it. ``tests/sql/test_schema.py`` holds the two to each other.

What the metadata cannot say, because it is not a property SQLAlchemy
models or it depends on a ``quota migrate`` option, is said here beside it:
`EPHEMERAL_TABLES` (UNLOGGED on PostgreSQL unless ``--logged-counters``,
fillfactor 70) and `PARTITIONED_COUNTERS_PRIMARY_KEY` (``--partitioned-counters``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from quota._core.errors import ConfigurationError, SchemaError
from quota._core.redaction import redact
from quota._sql.statements import VERSION_TABLE

#: Every revision this code knows, oldest first.
REVISIONS: tuple[str, ...] = (
    "0001_counters", "0002_quotas", "0003_algorithms", "0004_policies", "0005_settings",
    "0006_leases", "0007_reservations", "0008_thresholds",
)  # fmt: skip
#: The revision this code needs at least. A database at it works; the later revisions add
#: what runs without them (0005_settings: the runtime settings of the HTTP middlewares,
#: which keep their configured values until the table is there; 0006_leases: concurrency
#: leases, whose calls say to migrate until it is there; 0007_reservations: reserve and
#: settle, and the columns durable quotas then read, whose calls say to migrate;
#: 0008_thresholds: the outbox of usage thresholds, whose calls say to migrate until it
#: is there).
REQUIRED = "0004_policies"
#: The newest revision this code knows: what ``quota migrate`` upgrades to.
HEAD = REVISIONS[-1]

#: Updated in place by every decision and emptied by cleanup: UNLOGGED on PostgreSQL
#: (a normal table with ``quota migrate --logged-counters``), fillfactor 70.
EPHEMERAL_TABLES = ("quota_counters", "quota_state")
#: The counters' primary key when migrated with ``--partitioned-counters``: PostgreSQL
#: wants the partition key in it (see `quota._sql.partitions`).
PARTITIONED_COUNTERS_PRIMARY_KEY = ("bucket_key", "window_start")
#: Objects a migration creates on one dialect only, by name: compared on that dialect only.
DIALECT_ONLY: dict[str, str] = {
    # 0003_algorithms: SQLite cleanup scans instead (an index there costs every update).
    "ix_quota_state_expires_at": "postgresql",
}
#: Expression indexes, by name and dialect, that SQLAlchemy cannot reflect there, so
#: autogenerate cannot compare them (it skips them with a warning); ``quota doctor``
#: compares them itself, from ``sqlite_master``.
UNREFLECTED_INDEXES: dict[str, frozenset[str]] = {
    "ix_quota_counters_window_end": frozenset({"sqlite"}),
}
#: Partitions of a ``--partitioned-counters`` table: made and dropped by ``quota cleanup``
#: (`quota._sql.partitions`), so no migration, and no metadata, names them.
COUNTERS_PARTITION = re.compile(r"quota_counters_(p\d+|default)")

#: "C" collation on PostgreSQL: keys compare as bytes, the fastest btree order.
_KEY = sa.Text().with_variant(sa.Text(collation="C"), "postgresql")


def _only_on(index: sa.Index) -> sa.Index:
    dialect = DIALECT_ONLY.get(str(index.name))
    return index.ddl_if(dialect=dialect) if dialect else index


metadata = sa.MetaData()

#: Fixed windows (revision 0001_counters).
counters = sa.Table(
    "quota_counters",
    metadata,
    sa.Column("bucket_key", _KEY, primary_key=True),
    sa.Column("client_key", _KEY, nullable=False),
    sa.Column("window_start", sa.BigInteger, nullable=False),
    sa.Column("window_seconds", sa.Integer, nullable=False),
    sa.Column("count", sa.BigInteger, nullable=False),
    sa.Column("updated_at", sa.Float, nullable=False),
    # Cleanup deletes by window end (`quota._sql.statements.DELETE_EXPIRED`, the same expression).
    sa.Index("ix_quota_counters_window_end", sa.text("(window_start + window_seconds)")),
    sqlite_with_rowid=False,
)

#: Sliding window, token bucket and GCRA (revision 0003_algorithms).
state = sa.Table(
    "quota_state",
    metadata,
    sa.Column("bucket_key", _KEY, primary_key=True),
    sa.Column("client_key", _KEY, nullable=False),
    sa.Column("window_seconds", sa.Integer, nullable=False),
    sa.Column("value", sa.Float, nullable=False),
    sa.Column("prev_value", sa.Float, nullable=False),
    sa.Column("stamp", sa.Float, nullable=False),
    sa.Column("allowed", sa.SmallInteger, nullable=False),
    sa.Column("expires_at", sa.Float, nullable=False),
    _only_on(sa.Index("ix_quota_state_expires_at", "expires_at")),
    sqlite_with_rowid=False,
)

#: The ledger's idempotency index covers the charges not refunded (revision 0002_quotas).
HELD = "kind = 'consume' AND refunded_at IS NULL"

#: Durable quotas (revision 0002_quotas): usage per period, and the ledger.
quota_usage = sa.Table(
    "quota_usage",
    metadata,
    sa.Column("subject", _KEY, nullable=False),
    sa.Column("name", _KEY, nullable=False),
    sa.Column("period_start", sa.BigInteger, nullable=False),
    sa.Column("period_end", sa.BigInteger, nullable=False),
    sa.Column("period", sa.Text, nullable=False),
    sa.Column("tz", sa.Text, nullable=True),
    sa.Column("quota_limit", sa.BigInteger, nullable=True),
    sa.Column("used", sa.BigInteger, nullable=False),
    sa.Column("granted", sa.BigInteger, nullable=False),
    sa.Column("updated_at", sa.Float, nullable=False),
    # Revision 0007_reservations: what live reservations hold, and the earliest expiry among them.
    sa.Column("reserved", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("next_expiry", sa.Float, nullable=True),
    sa.PrimaryKeyConstraint("subject", "name", "period_start", name="pk_quota_usage"),
    sa.CheckConstraint("used >= 0", name="ck_quota_usage_used"),
    sa.CheckConstraint("granted >= 0", name="ck_quota_usage_granted"),
    sqlite_with_rowid=False,
)

quota_ledger = sa.Table(
    "quota_ledger",
    metadata,
    sa.Column(
        "id",
        sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
        primary_key=True,
        autoincrement=True,
    ),
    sa.Column("at", sa.Float, nullable=False),
    sa.Column("subject", _KEY, nullable=False),
    sa.Column("name", _KEY, nullable=False),
    sa.Column("kind", sa.Text, nullable=False),
    sa.Column("cost", sa.BigInteger, nullable=False),
    sa.Column("idempotency_key", _KEY, nullable=True),
    sa.Column("period_start", sa.BigInteger, nullable=True),
    sa.Column("period_end", sa.BigInteger, nullable=True),
    sa.Column("quota_limit", sa.BigInteger, nullable=True),
    sa.Column("used", sa.BigInteger, nullable=True),
    sa.Column("remaining", sa.BigInteger, nullable=True),
    sa.Column("refunded_at", sa.Float, nullable=True),
    # Revision 0007_reservations.
    sa.Column("reservation_id", _KEY, nullable=True),
    sa.Column("reserved", sa.BigInteger, nullable=True),
    sa.CheckConstraint(
        "kind IN ('consume', 'deny', 'refund', 'grant', 'rate_denied', 'reserve', 'settle',"
        " 'release')",
        name="ck_quota_ledger_kind",
    ),
    sa.Index(
        "uq_quota_ledger_idempotency",
        "subject",
        "name",
        "idempotency_key",
        unique=True,
        sqlite_where=sa.text(HELD),
        postgresql_where=sa.text(HELD),
    ),
    sa.Index("ix_quota_ledger_subject_at", "subject", "at"),
    sa.Index("ix_quota_ledger_at", "at"),
)

#: Runtime policy overrides of the HTTP layer (revision 0004_policies); see quota._sql.policies.
quota_policies = sa.Table(
    "quota_policies",
    metadata,
    sa.Column("route", sa.Text, nullable=False),
    sa.Column("subject", sa.Text, nullable=False, server_default="*"),
    sa.Column("rates", sa.Text, nullable=True),
    sa.Column("algorithm", sa.Text, nullable=True),
    sa.Column("cost", sa.Integer, nullable=True),
    sa.Column("fail_open", sa.Boolean, nullable=True),
    sa.Column("exempt", sa.Boolean, nullable=False, server_default=sa.false()),
    sa.Column("note", sa.Text, nullable=True),
    sa.Column("updated_at", sa.Float, nullable=False),
    sa.PrimaryKeyConstraint("route", "subject", name="pk_quota_policies"),
    sa.CheckConstraint("cost IS NULL OR cost >= 1", name="ck_quota_policies_cost"),
)

#: Runtime settings of the HTTP layer (revision 0005_settings): tier multipliers and the
#: abuse threshold; a NULL value is a deletion. See quota._sql.policies.
quota_settings = sa.Table(
    "quota_settings",
    metadata,
    sa.Column("name", sa.Text, nullable=False),
    sa.Column("value", sa.Text, nullable=True),
    sa.Column("note", sa.Text, nullable=True),
    sa.Column("updated_at", sa.Float, nullable=False),
    sa.PrimaryKeyConstraint("name", name="pk_quota_settings"),
)

#: Concurrency leases (revision 0006_leases): one row per slot of a key while it is held
#: (`quota._sql.statements.LEASE_ACQUIRE`). Logged on PostgreSQL: a crash must not free
#: the slots of holders still inside their blocks.
quota_leases = sa.Table(
    "quota_leases",
    metadata,
    sa.Column("lease_key", _KEY, nullable=False),
    sa.Column("slot", sa.Integer, nullable=False),
    sa.Column("holder", sa.Text, nullable=False),
    sa.Column("slots", sa.Integer, nullable=False),
    sa.Column("acquired_at", sa.Float, nullable=False),
    sa.Column("expires_at", sa.Float, nullable=False),
    sa.PrimaryKeyConstraint("lease_key", "slot", name="pk_quota_leases"),
    # Cleanup and the downgrade guard find dead (or live) leases by expiry.
    sa.Index("ix_quota_leases_expires_at", "expires_at"),
    sqlite_with_rowid=False,
)

#: Reservations of durable quotas (revision 0007_reservations): one row per hold, kept
#: after it ends (``settled`` or ``released`` at its expiry) so a settle can be replayed.
quota_reservations = sa.Table(
    "quota_reservations",
    metadata,
    sa.Column("id", _KEY, nullable=False),
    sa.Column("subject", _KEY, nullable=False),
    sa.Column("name", _KEY, nullable=False),
    sa.Column("period_start", sa.BigInteger, nullable=False),
    sa.Column("period_end", sa.BigInteger, nullable=False),
    sa.Column("period", sa.Text, nullable=False),
    sa.Column("tz", sa.Text, nullable=True),
    sa.Column("quota_limit", sa.BigInteger, nullable=False),
    sa.Column("amount", sa.BigInteger, nullable=False),
    sa.Column("idempotency_key", _KEY, nullable=True),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("expires_at", sa.Float, nullable=False),
    sa.Column("state", sa.Text, nullable=False),
    sa.Column("ended_at", sa.Float, nullable=True),
    sa.Column("outcome", sa.Text, nullable=True),
    sa.Column("thresholds", sa.Text, nullable=True),
    sa.PrimaryKeyConstraint("id", name="pk_quota_reservations"),
    sa.CheckConstraint(
        "state IN ('held', 'settled', 'released')", name="ck_quota_reservations_state"
    ),
    sa.Index(
        "ix_quota_reservations_live",
        "subject",
        "name",
        "period_start",
        "expires_at",
        sqlite_where=sa.text("state = 'held'"),
        postgresql_where=sa.text("state = 'held'"),
    ),
    sa.Index("ix_quota_reservations_expires_at", "expires_at"),
    sa.Index(
        "uq_quota_reservations_idempotency",
        "subject",
        "name",
        "idempotency_key",
        unique=True,
        sqlite_where=sa.text("idempotency_key IS NOT NULL"),
        postgresql_where=sa.text("idempotency_key IS NOT NULL"),
    ),
)

#: The outbox of usage thresholds (revision 0008_thresholds): one row per time a
#: threshold fired, unique among those not re-armed (`quota._sql.events`).
quota_events = sa.Table(
    "quota_events",
    metadata,
    sa.Column(
        "id",
        sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
        primary_key=True,
        autoincrement=True,
    ),
    sa.Column("subject", _KEY, nullable=False),
    sa.Column("quota", _KEY, nullable=False),
    sa.Column("period_start", sa.BigInteger, nullable=False),
    sa.Column("threshold", sa.Text, nullable=False),
    sa.Column("used", sa.BigInteger, nullable=False),
    sa.Column("quota_limit", sa.BigInteger, nullable=False),
    sa.Column("at", sa.Float, nullable=False),
    sa.Column("rearmed_at", sa.Float, nullable=True),
    sa.Column("delivered_at", sa.Float, nullable=True),
    sa.Column("attempts", sa.Integer, nullable=False),
    sa.Column("claimed_until", sa.Float, nullable=True),
    sa.Column("claimed_by", sa.Text, nullable=True),
    sa.Column("last_error", sa.Text, nullable=True),
    sa.Index(
        "uq_quota_events_armed",
        "subject",
        "quota",
        "period_start",
        "threshold",
        unique=True,
        sqlite_where=sa.text("rearmed_at IS NULL"),
        postgresql_where=sa.text("rearmed_at IS NULL"),
    ),
    # The worker's claim scans the undelivered events only.
    sa.Index(
        "ix_quota_events_undelivered",
        "id",
        sqlite_where=sa.text("delivered_at IS NULL"),
        postgresql_where=sa.text("delivered_at IS NULL"),
    ),
    # Cleanup finds the events delivered long ago.
    sa.Index("ix_quota_events_delivered_at", "delivered_at"),
)

#: Alembic's version table, as Alembic creates it (``version_table=VERSION_TABLE``).
#: An Alembic context configured with that version table leaves it out of autogenerate.
version = sa.Table(
    VERSION_TABLE,
    metadata,
    sa.Column("version_num", sa.String(32), nullable=False),
    sa.PrimaryKeyConstraint("version_num", name=f"{VERSION_TABLE}_pkc"),
)

#: Every table the migrations make, the version table included.
TABLES: tuple[str, ...] = tuple(metadata.tables)


def include_name(name: str | None, type_: str, parent_names: object) -> bool:
    """Autogenerate's name filter: quota's tables only, and not the counters' partitions.

    The host app's tables are not ours to compare; partitions come and go with
    ``quota cleanup`` (`COUNTERS_PARTITION`).
    """
    if type_ != "table":
        return True
    table = name or ""
    return table.startswith("quota_") and not COUNTERS_PARTITION.fullmatch(table)


def include_object(dialect: str) -> Callable[[Any, str | None, str, bool, Any], bool]:
    """Autogenerate's object filter for a `dialect` database.

    Leaves out, by name, the indexes `DIALECT_ONLY` keeps to another dialect and
    the `UNREFLECTED_INDEXES` SQLAlchemy cannot reflect on this one (Alembic
    skips the latter itself, with a warning; the filter makes the exclusion ours).
    """

    def include(obj: Any, name: str | None, type_: str, reflected: bool, compare_to: Any) -> bool:
        if type_ != "index" or name is None:
            return True
        only = DIALECT_ONLY.get(name)
        if only is not None and only != dialect:
            return False
        return dialect not in UNREFLECTED_INDEXES.get(name, frozenset())

    return include


# -- the schema as data: what the migrations make, and what a database holds -------------


@dataclass(frozen=True, slots=True)
class ColumnShape:
    """One column, as a dialect spells it."""

    name: str
    type: str
    """The type as the database reports it: ``BIGINT`` (SQLite's declared type),
    ``bigint`` (PostgreSQL's ``format_type``)."""
    nullable: bool
    collation: str | None = None
    """PostgreSQL: the column's collation when it is not the database default."""
    has_default: bool = False


@dataclass(frozen=True, slots=True)
class IndexShape:
    """One index (or unique constraint), primary keys excepted."""

    name: str
    keys: tuple[str, ...]
    """Column names, or expressions as `normalize_sql` leaves them."""
    unique: bool = False
    where: str = ""
    """The predicate of a partial index, as `normalize_sql` leaves it."""
    valid: bool = True
    """PostgreSQL: False for an index a failed ``CREATE INDEX CONCURRENTLY`` left behind."""

    def same_definition(self, other: IndexShape) -> bool:
        return (self.keys, self.unique, self.where) == (other.keys, other.unique, other.where)


@dataclass(frozen=True, slots=True)
class TableShape:
    """One table: columns in order, primary key, indexes, and how it is stored."""

    name: str
    columns: tuple[ColumnShape, ...]
    primary_key: tuple[str, ...]
    indexes: tuple[IndexShape, ...]
    primary_key_name: str = ""
    partitioned: bool = False
    """PostgreSQL: range-partitioned (``relkind = 'p'``)."""
    without_rowid: bool | None = None
    """SQLite: a ``WITHOUT ROWID`` table; None on PostgreSQL."""
    unlogged: bool = False
    """PostgreSQL: UNLOGGED (for a partitioned table: its DEFAULT partition is)."""
    default_partition: str = ""
    """PostgreSQL: the name of a partitioned table's DEFAULT partition, if it has one."""

    def column(self, name: str) -> ColumnShape | None:
        return next((c for c in self.columns if c.name == name), None)

    def index(self, name: str) -> IndexShape | None:
        return next((i for i in self.indexes if i.name == name), None)


_CAST = re.compile(
    r"::(double precision|character varying|time(stamp)? with(out)? time zone|\"?[a-z_][a-z0-9_]*\"?)"
    r"(\(\d+(,\s*\d+)?\))?(\[\])*"
)


def normalize_sql(text: str) -> str:
    """An index expression or predicate, reduced so that the text a migration wrote and
    the text a database gives back compare equal: lower case, no casts, parentheses,
    quotes or spaces (``((kind = 'consume'::text) AND …)`` and ``kind = 'consume' AND …``
    both become ``kind='consume'and…``)."""
    text = _CAST.sub("", text.lower())
    return re.sub(r"[\s()\"]", "", text)


def _type_name(compiled: str, dialect: str) -> tuple[str, str | None]:
    """A compiled type (``TEXT COLLATE "C"``) as the dialect's catalog reports it, and its collation."""
    spelled, _, collation = compiled.partition(" COLLATE ")
    if dialect == "sqlite":
        return spelled.upper(), None
    spelled = spelled.lower().replace("varchar", "character varying")
    return {"float": "double precision"}.get(spelled, spelled), collation.strip('"') or None


def expected_schema(dialect: str, *, partitioned_counters: bool = False) -> dict[str, TableShape]:
    """The tables the migrations make on `dialect` (``sqlite`` or ``postgresql``), from `metadata`.

    `partitioned_counters`: the counters table as ``--partitioned-counters`` makes it
    (PostgreSQL): partitioned, with `PARTITIONED_COUNTERS_PRIMARY_KEY`.
    """
    from sqlalchemy.dialects.postgresql.base import PGDialect
    from sqlalchemy.dialects.sqlite.base import SQLiteDialect

    compiler = SQLiteDialect() if dialect == "sqlite" else PGDialect()  # type: ignore[no-untyped-call]
    shapes: dict[str, TableShape] = {}
    for table in metadata.sorted_tables:
        columns = []
        for column in table.columns:
            spelled, collation = _type_name(column.type.compile(dialect=compiler), dialect)
            columns.append(
                ColumnShape(
                    column.name, spelled, bool(column.nullable), collation,
                    column.server_default is not None,
                )
            )  # fmt: skip
        indexes = []
        for index in sorted(table.indexes, key=lambda i: str(i.name)):
            only = DIALECT_ONLY.get(str(index.name))
            if only is not None and only != dialect:
                continue
            where = index.dialect_options[dialect].get("where")
            indexes.append(
                IndexShape(
                    str(index.name),
                    tuple(
                        e.name if isinstance(e, sa.Column) else normalize_sql(str(e))
                        for e in index.expressions
                    ),
                    bool(index.unique),
                    normalize_sql(str(where)) if where is not None else "",
                )
            )
        primary_key = tuple(c.name for c in table.primary_key.columns)
        partitioned = partitioned_counters and table.name == "quota_counters"
        if partitioned:
            primary_key = PARTITIONED_COUNTERS_PRIMARY_KEY
        shapes[table.name] = TableShape(
            table.name, tuple(columns), primary_key, tuple(indexes),
            primary_key_name=str(table.primary_key.name or ""),
            partitioned=partitioned,
            without_rowid=(
                not table.dialect_options["sqlite"]["with_rowid"] if dialect == "sqlite" else None
            ),
        )  # fmt: skip
    return shapes


#: The revision whose migration creates each table.
TABLE_REVISIONS: dict[str, str] = {
    VERSION_TABLE: REVISIONS[0],
    "quota_counters": "0001_counters",
    "quota_usage": "0002_quotas",
    "quota_ledger": "0002_quotas",
    "quota_state": "0003_algorithms",
    "quota_policies": "0004_policies",
    "quota_settings": "0005_settings",
    "quota_leases": "0006_leases",
    "quota_reservations": "0007_reservations",
    "quota_events": "0008_thresholds",
}

#: Columns a revision after their table's adds, by (table, column).
COLUMN_REVISIONS: dict[tuple[str, str], str] = {
    ("quota_usage", "reserved"): "0007_reservations",
    ("quota_usage", "next_expiry"): "0007_reservations",
    ("quota_ledger", "reservation_id"): "0007_reservations",
    ("quota_ledger", "reserved"): "0007_reservations",
}


def migrate_hint(url: str | None = None) -> str:
    """The command that brings the schema up to date, for error messages (password hidden)."""
    return "quota migrate" + (f" --url '{redact(url)}'" if url else "")


def doctor_hint(url: str | None = None) -> str:
    """The command that names what is missing from the schema and how to restore it."""
    return "quota doctor" + (f" --url '{redact(url)}'" if url else "")


def missing_sqlite_file(path: str, url: str | None, *, creating: bool = False) -> Exception | None:
    """The error for SQLite file `path` that does not exist; None when it does.

    Only ``quota migrate`` (`creating`) makes a database file, and never a
    directory: for it a missing directory is a `ConfigurationError` naming it
    (and a missing file no error). Anything else gets a `SchemaError` naming the
    path and the command that creates the file, so a mistyped path is reported
    instead of becoming an empty database. A ``file:`` URI is left to SQLite.
    """
    import os

    if path.startswith("file:") or os.path.exists(path):
        return None
    where = os.path.abspath(path)
    folder = os.path.dirname(where)
    if not os.path.isdir(folder):
        if creating:
            return ConfigurationError(
                f"no directory {folder} for the SQLite file {where}: migrating creates the"
                " database file, not its directory; create the directory (or check the path)"
            )
        return SchemaError(
            f"the database does not exist: no SQLite file at {where}, nor its directory"
            f" {folder}; create the directory, then run `{migrate_hint(url)}` (or check the path)"
        )
    if creating:
        return None
    return SchemaError(
        f"the database does not exist: no SQLite file at {where}; create it with"
        f" `{migrate_hint(url)}` (or check the path)"
    )


def missing_objects_error(
    url: str | None, detail: str, rows: Sequence[Sequence[Any]] | None
) -> SchemaError:
    """The `SchemaError` for a statement that found a quota table missing.

    `detail` is the driver's message (``no such table: quota_state``, ``relation
    "quota_state" does not exist``); `rows` the version table's rows, read after
    the error (None when there is no version table, or it could not be read).
    Missing or behind, migrating is the fix and the message says to run ``quota
    migrate``. At the revision this code needs (or a newer one) migrating does
    nothing: the schema drifted from what the migrations made, and the message
    says so and points at ``quota doctor``, which names what is missing and the
    statements that restore it; unless the table is one a later revision makes
    (a database at `REQUIRED` but not at head), when migrating is the fix again.
    """
    revision = str(rows[0][0]) if rows else None
    if revision is None:
        return SchemaError(f"{detail}; the quota tables are missing, run `{migrate_hint(url)}`")
    if revision in REVISIONS and REVISIONS.index(revision) < REVISIONS.index(REQUIRED):
        return SchemaError(
            f"{detail}; the quota schema is at revision {revision}, this code needs {REQUIRED};"
            f" run `{migrate_hint(url)}`"
        )
    if revision not in REVISIONS:
        return SchemaError(
            f"the database is at revision {revision}, newer than this code ({HEAD}), and"
            f" {detail}; upgrade quota on this host to the version that migrated it, then run"
            f" `{doctor_hint(url)}`"
        )
    later = _made_later(detail, revision)
    if later is not None:
        # A table this code can do without (see `REQUIRED`), not migrated yet: no outage.
        return SchemaError(
            f"{detail}; the quota schema is at revision {revision}, and {later[0]} comes with"
            f" revision {later[1]}: run `{migrate_hint(url)}`",
            outage=False,
        )
    at = "head" if revision == HEAD else f"this code needs {REQUIRED}"
    # No outage: the database answers; a fallback keeps it up (and says so in its log)
    # rather than probe for a table that will not come back by itself.
    return SchemaError(
        f"schema drift: the database is at revision {revision} ({at}) but {detail};"
        f" `{doctor_hint(url)}` names what is missing and how to restore it",
        outage=False,
    )


def _made_later(detail: str, revision: str) -> tuple[str, str] | None:
    """(table or column, revision) when `detail` names a table or column a migration
    after `revision` makes."""
    for table, created_in in TABLE_REVISIONS.items():
        if REVISIONS.index(created_in) > REVISIONS.index(revision) and re.search(
            rf"\b{table}\b", detail
        ):
            return table, created_in
    for (table, column), created_in in COLUMN_REVISIONS.items():
        if REVISIONS.index(created_in) > REVISIONS.index(revision) and re.search(
            rf"\bcolumn\b.*\b{column}\b|\bcolumn: {column}\b", detail
        ):
            return f"column {table}.{column}", created_in
    return None


def check_version(rows: Sequence[Sequence[Any]] | None, url: str | None = None) -> None:
    """Raise `SchemaError` unless `rows` (from the version table) show a current schema.

    `rows` is None when the version table does not exist. A revision this
    code does not know is taken as newer and accepted.
    """
    if rows is None or not rows:
        raise SchemaError(
            f"the quota tables are missing from this database; run `{migrate_hint(url)}`"
        )
    found = str(rows[0][0])
    if found in REVISIONS and REVISIONS.index(found) < REVISIONS.index(REQUIRED):
        raise SchemaError(
            f"the quota schema is at revision {found}, this code needs {REQUIRED};"
            f" run `{migrate_hint(url)}`"
        )
    if url is not None:
        _accepted[url] = ((found,),)


#: The revision `check_version` last accepted for each store URL.
_accepted: dict[str, Sequence[Sequence[Any]]] = {}


def accepted_version(url: str) -> Sequence[Sequence[Any]] | None:
    """The version rows `check_version` last accepted for `url` in this process (None if never).

    What a store that cannot query at the moment (a sync error path on an async
    connection, a transaction already aborted) passes to `missing_objects_error`: the
    revision the database was at when the store started, which a running app only
    sees change if the schema is downgraded under it.
    """
    return _accepted.get(url)
