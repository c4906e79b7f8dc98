"""The ``schema_drift`` check: the live tables against what the migrations made.

The revision in the version table says which migrations ran, not that what they made
is still there: a dropped index, column or table (a hand-run "cleanup", a restore that
skipped UNLOGGED tables, a host app's migration that touched ours) leaves the revision
at head. `drift_findings` compares the live tables with what the migrations make
(`quota._sql.schema.expected_schema`, from the metadata the tests hold to the
migrations) and takes every fix it offers from the migrations' own SQL, rendered
offline (`quota._tools.doctor.fixes.migration_ddl`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from quota._sql.partitions import DEFAULT_PARTITION
from quota._sql.schema import (
    COLUMN_REVISIONS,
    EPHEMERAL_TABLES,
    REQUIRED,
    REVISIONS,
    TABLE_REVISIONS,
    ColumnShape,
    IndexShape,
    TableShape,
)
from quota._sql.statements import VERSION_TABLE
from quota._tools.doctor.base import ERROR, OK, WARN, Finding, migrate_command, quoted
from quota._tools.doctor.fixes import MigrationDdl, migration_ddl
from quota._tools.doctor.live_schema import closing, split_top_level

#: Tables updated in place on every decision or charge: an index on them that quota does
#: not make costs every update (and HOT updates), so one is worth a warning.
UPDATED_IN_PLACE = ("quota_counters", "quota_state", "quota_usage")
#: Tables that hold money or configuration: they must survive a crash.
DURABLE_TABLES = (
    "quota_usage", "quota_ledger", "quota_policies", "quota_settings", VERSION_TABLE,
)  # fmt: skip

#: What breaks without a table.
_TABLE_ROLE = {
    "quota_counters": "fixed-window decisions fail",
    "quota_state": "sliding-window, token-bucket and GCRA decisions fail",
    "quota_usage": "durable quotas fail",
    "quota_ledger": "durable quotas fail",
    "quota_policies": "runtime policy overrides (`quota policy`, the HTTP middlewares) fail",
    "quota_settings": (
        "the HTTP middlewares keep their configured tier multipliers and abuse threshold"
        " (`quota policy multiplier`, `quota policy abuse-threshold` fail)"
    ),
    "quota_leases": "concurrency blocks (`limiter.concurrency`) fail",
    "quota_reservations": "durable quotas fail until migrated",
    VERSION_TABLE: "quota cannot tell which migrations ran",
}
#: What breaks without an index.
_INDEX_ROLE = {
    "uq_quota_ledger_idempotency": (
        "charges with an idempotency key fail (their INSERT … ON CONFLICT has no unique"
        " index to infer), and nothing stops a key from being charged twice"
    ),
    "ix_quota_counters_window_end": "cleanup scans the whole counters table",
    "ix_quota_state_expires_at": "cleanup scans the whole state table",
    "ix_quota_ledger_subject_at": "`quota ledger SUBJECT --since` scans the whole ledger",
    "ix_quota_ledger_at": "ledger retention by age scans the whole ledger",
    "ix_quota_leases_expires_at": "cleanup scans the whole leases table",
}
#: Tables whose primary key is an upsert's ON CONFLICT target.
_UPSERTED = (
    "quota_counters", "quota_state", "quota_usage", "quota_policies", "quota_settings",
    "quota_leases",
)  # fmt: skip

_SQLITE_REBUILD = "https://www.sqlite.org/lang_altertable.html#otheralter"


def drift_findings(
    expected: dict[str, TableShape],
    live: dict[str, TableShape],
    *,
    dialect: str,
    revision: str | None,
    url: str,
    ddl: Callable[[], MigrationDdl] | None = None,
) -> list[Finding]:
    """Every difference between the `live` tables and the `expected` ones, with its fix.

    `revision` is the one in the version table (None without one); objects a migration
    not run yet would make are left to the schema finding, in one finding saying to
    migrate. Pure, but for the migrations rendered offline when a fix needs a statement
    (`ddl`, default `migration_ddl`).
    """
    if revision is not None and revision not in REVISIONS:
        return []  # newer code migrated it: the schema finding says so; no head to compare to
    logged = any(not t.unlogged for n, t in live.items() if n in EPHEMERAL_TABLES)
    counters = live.get("quota_counters")
    partitioned = counters is not None and counters.partitioned
    drift = _Drift(
        dialect, logged,
        ddl or (lambda: migration_ddl(dialect, logged=logged, partitioned=partitioned)),
    )  # fmt: skip
    present = [name for name in expected if name in live and name != VERSION_TABLE]
    if revision is None:
        if present:
            return [drift.version_table_missing(present, empty=VERSION_TABLE in live)]
        return []  # nothing migrated: the schema finding says to migrate
    later = [
        name for name in expected
        if name not in live and _behind(revision, TABLE_REVISIONS.get(name, ""))
    ]  # fmt: skip
    findings = _later_tables(drift, later, revision, url)
    for name, want in expected.items():
        have = live.get(name)
        if have is None:
            if name not in later:
                findings.append(drift.table_missing(name, revision))
            continue
        findings += drift.storage(want, have)
        findings += drift.columns(want, have, revision)
        findings += drift.primary_key(want, have)
        findings += drift.indexes(want, have, revision)
    if not findings:
        findings.append(
            Finding(
                "schema_drift", OK,
                f"the tables, columns, indexes and primary keys are those revision {revision}"
                " makes",
            )
        )  # fmt: skip
    return findings


def _later_tables(drift: _Drift, later: Sequence[str], revision: str, url: str) -> list[Finding]:
    """The finding of the tables that migrations after `revision` make (none when there
    are none): an error when this code needs one of them."""
    if any(not _behind(REQUIRED, TABLE_REVISIONS[name]) for name in later):
        return [
            drift.error(
                f"the schema is at revision {revision}, so {', '.join(later)} (made by later"
                " migrations) are not here yet",
                f"run `{migrate_command(url)}`",
            )
        ]
    if later:  # only tables this code runs without (see `quota._sql.schema.REQUIRED`)
        return [
            drift.warn(
                f"the schema is at revision {revision}, so {', '.join(later)} (made by a later"
                f" migration) {'is' if len(later) == 1 else 'are'} not here yet: "
                + "; ".join(_TABLE_ROLE.get(name, "unused") for name in later),
                f"run `{migrate_command(url)}`",
            )
        ]
    return []


def _behind(revision: str | None, created_in: str) -> bool:
    """True when the migration `created_in` has not run yet on a database at `revision`."""
    if revision is None or revision not in REVISIONS or created_in not in REVISIONS:
        return False
    return REVISIONS.index(created_in) > REVISIONS.index(revision)


@dataclass(frozen=True)
class _Drift:
    """Builds the findings of one comparison: the fixes need the dialect and the DDL."""

    dialect: str
    logged: bool
    """Whether the ephemeral tables that are there are logged (--logged-counters)."""
    ddl: Callable[[], MigrationDdl]

    @property
    def postgres(self) -> bool:
        return self.dialect == "postgresql"

    def error(self, message: str, fix: str) -> Finding:
        return Finding("schema_drift", ERROR, message, fix)

    def warn(self, message: str, fix: str) -> Finding:
        return Finding("schema_drift", WARN, message, fix)

    def recreate(self, table: str) -> str:
        """The fix that drops a table and makes it again, for a table whose rows may go."""
        revision, statements = self.ddl().table(table)
        partitioned = any(" PARTITION OF " in s for s in statements)
        return (
            f"its rows are ephemeral (every client gets a fresh window once), so recreate it"
            f" as migration {revision} made it: {quoted([f'DROP TABLE {table}', *statements])}"
            + ("; then `quota cleanup` makes the partitions ahead" if partitioned else "")
        )

    def rebuild(self, table: str) -> str:
        """The fix for a durable table SQLite cannot alter in place."""
        revision, statements = self.ddl().table(table)
        if table in EPHEMERAL_TABLES:
            return self.recreate(table)
        return (
            f"rebuild it as migration {revision} made it, keeping its rows ({_SQLITE_REBUILD}):"
            f" create it under a new name from {quoted(statements[:1])}, copy the rows"
            " over, drop the old table, rename the new one"
            + (f", then run {quoted(statements[1:])}" if statements[1:] else "")
        )

    def table_missing(self, table: str, revision: str) -> Finding:
        created_in, statements = self.ddl().table(table)
        unlogged = self.postgres and table in EPHEMERAL_TABLES and not self.logged
        return self.error(
            f"table {table} is missing although the schema is at revision {revision}:"
            f" {_TABLE_ROLE.get(table, 'quota cannot use it')}",
            f"restore it as migration {created_in} made it: {quoted(statements)}"
            + (" (without UNLOGGED if it was migrated with --logged-counters)" if unlogged else ""),
        )

    def version_table_missing(self, present: Sequence[str], empty: bool) -> Finding:
        _, statements = self.ddl().table(VERSION_TABLE)
        stamp = REVISIONS[0]
        for revision in REVISIONS:
            if all(
                t in present
                for t, r in TABLE_REVISIONS.items()
                if r == revision and t != VERSION_TABLE
            ):
                stamp = revision
        insert = f"INSERT INTO {VERSION_TABLE} (version_num) VALUES ('{stamp}')"
        said = "is empty" if empty else "is missing"
        return self.error(
            f"the version table {VERSION_TABLE} {said}, yet quota tables are here"
            f" ({', '.join(sorted(present))}): `quota migrate` would try to create them again",
            f"record the revision those tables match ({stamp}):"
            f" {quoted([insert] if empty else [*statements, insert])}; then run"
            " `quota doctor` again",
        )

    def columns(self, want: TableShape, have: TableShape, revision: str) -> list[Finding]:
        findings = []
        table = want.name
        for column in want.columns:
            live = have.column(column.name)
            if live is None:
                if _behind(revision, COLUMN_REVISIONS.get((table, column.name), "")):
                    continue  # a later migration adds it: the schema finding says to migrate
                findings.append(self.column_missing(want, column))
            else:
                findings += self.column(table, column, live)
        known = {c.name for c in want.columns}
        for live in have.columns:
            if live.name not in known and not live.nullable and not live.has_default:
                findings.append(
                    self.error(
                        f"column {table}.{live.name} is not one the migrations make, and is"
                        " NOT NULL without a default: every row quota inserts fails",
                        f"`ALTER TABLE {table} DROP COLUMN {live.name}` (or give it a default)",
                    )
                )
        return findings

    def column(self, table: str, column: ColumnShape, live: ColumnShape) -> list[Finding]:
        """`column` as the migrations make it against the `live` one: type, collation,
        NULL or NOT NULL."""
        findings = []
        spelled = f"{column.type}" + (f' COLLATE "{column.collation}"' if column.collation else "")
        if live.type != column.type:
            fix = (
                f"`ALTER TABLE {table} ALTER COLUMN {column.name} TYPE {spelled}`"
                " (rewrites the table under a lock)"
                if self.postgres
                else self.rebuild(table)
            )
            findings.append(
                self.error(
                    f"column {table}.{column.name} is {live.type}; the migrations make it"
                    f" {column.type}",
                    fix,
                )
            )
        elif live.collation != column.collation:
            findings.append(
                self.warn(
                    f"column {table}.{column.name} has collation"
                    f" {live.collation or 'default'}; the migrations give it"
                    f" {column.collation or 'the default'} (keys compare as bytes: the"
                    " fastest btree order)",
                    f"`ALTER TABLE {table} ALTER COLUMN {column.name} TYPE {spelled}`"
                    " (rewrites the table under a lock)",
                )
            )
        if live.nullable and not column.nullable:
            findings.append(
                self.warn(
                    f"column {table}.{column.name} accepts NULL; the migrations make it NOT NULL",
                    f"`ALTER TABLE {table} ALTER COLUMN {column.name} SET NOT NULL`"
                    if self.postgres
                    else self.rebuild(table),
                )
            )
        elif not live.nullable and column.nullable:
            findings.append(
                self.error(
                    f"column {table}.{column.name} is NOT NULL; the migrations let it be"
                    " NULL, and quota writes rows that leave it NULL",
                    f"`ALTER TABLE {table} ALTER COLUMN {column.name} DROP NOT NULL`"
                    if self.postgres
                    else self.rebuild(table),
                )
            )
        return findings

    def column_missing(self, want: TableShape, column: ColumnShape) -> Finding:
        table = want.name
        revision, statements = self.ddl().table(table)
        definition = _column_definition(statements[0] if statements else "", column.name)
        message = (
            f"column {table}.{column.name} is missing (migration {revision} makes it"
            f" `{definition}`): statements that use it fail"
        )
        if table in EPHEMERAL_TABLES:
            return self.error(message, self.recreate(table))
        if column.nullable:
            return self.error(message, f"`ALTER TABLE {table} ADD COLUMN {definition}`")
        nullable = definition.replace(" NOT NULL", "")
        fix = f"add it back with `ALTER TABLE {table} ADD COLUMN {nullable}`, fill it, then " + (
            f"`ALTER TABLE {table} ALTER COLUMN {column.name} SET NOT NULL`"
            if self.postgres
            else "make it NOT NULL by a rebuild: " + self.rebuild(table)
        )
        return self.error(message, fix)

    def primary_key(self, want: TableShape, have: TableShape) -> list[Finding]:
        if have.primary_key == want.primary_key:
            return []
        table = want.name
        columns = ", ".join(want.primary_key)
        role = (
            "its upserts fail (their ON CONFLICT target has no unique index)"
            if table in _UPSERTED
            else "its rows lose their key"
        )
        said = (
            f"has no primary key; the migrations make it ({columns})"
            if not have.primary_key
            else f"has the primary key ({', '.join(have.primary_key)}); the migrations make it"
            f" ({columns})"
        )
        if self.postgres:
            add = (
                f"ADD CONSTRAINT {want.primary_key_name} PRIMARY KEY ({columns})"
                if want.primary_key_name
                else f"ADD PRIMARY KEY ({columns})"
            )
            drop = f"DROP CONSTRAINT {have.primary_key_name}, " if have.primary_key else ""
            fix = f"`ALTER TABLE {table} {drop}{add}`"
        else:
            fix = self.rebuild(table)
        return [self.error(f"table {table} {said}: {role}", fix)]

    def indexes(self, want: TableShape, have: TableShape, revision: str | None) -> list[Finding]:
        findings: list[Finding] = []
        matched: set[str] = set()
        for index in want.indexes:
            findings += self.index(want.name, index, have, revision, matched)
        return findings + self.extra_indexes(want.name, have, matched)

    def index(
        self, table: str, index: IndexShape, have: TableShape, revision: str | None,
        matched: set[str],
    ) -> list[Finding]:  # fmt: skip
        """One index the migrations make against `have`'s (the live index it matches is
        added to `matched`)."""
        live = have.index(index.name)
        severity = ERROR if index.unique else WARN
        kind = "unique index" if index.unique else "index"
        role = _INDEX_ROLE.get(index.name, "queries that use it slow down")
        if live is None:
            twin = next((i for i in have.indexes if i.same_definition(index) and i.valid), None)
            if twin is not None:
                matched.add(twin.name)
                return [
                    self.warn(
                        f"{kind} {index.name} on {table} is there as {twin.name}: it works,"
                        " but `quota downgrade` looks for it by its name",
                        f"`ALTER INDEX {twin.name} RENAME TO {index.name}`"
                        if self.postgres
                        else quoted([f"DROP INDEX {twin.name}", self.create(index.name)]),
                    )
                ]
            created_in, statement = self.ddl().index(index.name) or ("", "")
            if _behind(revision, created_in):
                return []  # the migration has not run yet: the schema finding says so
            return [
                Finding(
                    "schema_drift", severity, f"{kind} {index.name} on {table} is missing: {role}",
                    f"recreate it as migration {created_in} made it: `{statement}`",
                )
            ]  # fmt: skip
        matched.add(live.name)
        if not live.valid:
            return [
                Finding(
                    "schema_drift", severity,
                    f"{kind} {index.name} on {table} is INVALID (a CREATE INDEX"
                    f" CONCURRENTLY that failed?), so PostgreSQL does not use it: {role}",
                    f"`REINDEX INDEX {index.name}`"
                    + (
                        " (if it fails on duplicate keys, those rows are what the index"
                        " is there to prevent: resolve them first)"
                        if index.unique
                        else ""
                    ),
                )
            ]  # fmt: skip
        if not live.same_definition(index):
            return [
                Finding(
                    "schema_drift", severity,
                    f"{kind} {index.name} on {table} is not the one the migrations make"
                    f" ({_index_words(live, True)} instead of {_index_words(index, True)}):"
                    f" {role}",
                    quoted([f"DROP INDEX {index.name}", self.create(index.name)]),
                )
            ]  # fmt: skip
        return []

    def extra_indexes(self, table: str, have: TableShape, matched: set[str]) -> list[Finding]:
        """The live indexes of `table` no migration makes, where they cost something."""
        findings = []
        for live in have.indexes:
            if live.name in matched:
                continue
            if live.unique:
                findings.append(
                    self.warn(
                        f"unique index {live.name} on {table} {_index_words(live)} is not one"
                        " the migrations make: it may reject rows quota writes",
                        f"`DROP INDEX {live.name}` unless something else needs it",
                    )
                )
            elif table in UPDATED_IN_PLACE:
                findings.append(
                    self.warn(
                        f"index {live.name} on {table} {_index_words(live)} is not one the"
                        " migrations make: every update of a column it covers writes it too"
                        " (no HOT update)",
                        f"`DROP INDEX {live.name}` unless something else needs it",
                    )
                )
        return findings

    def create(self, index: str) -> str:
        return (self.ddl().index(index) or ("", ""))[1]

    def storage(self, want: TableShape, have: TableShape) -> list[Finding]:
        table = want.name
        findings = []
        if have.partitioned and not want.partitioned:
            fix = self.recreate(table) if table in EPHEMERAL_TABLES else self.rebuild(table)
            findings.append(
                self.error(
                    f"table {table} is partitioned; no migration makes it so, and quota's"
                    " statements need it plain",
                    fix,
                )
            )
        if want.partitioned and not have.default_partition:
            _, statements = self.ddl().table(table)
            default = [s for s in statements if " PARTITION OF " in s]
            findings.append(
                self.error(
                    f"the partitioned {table} has no DEFAULT partition {DEFAULT_PARTITION}:"
                    " a window outside every partition cannot be counted",
                    f"restore it as the migration made it: {quoted(default)}",
                )
            )
        if self.postgres and have.unlogged and table in DURABLE_TABLES:
            findings.append(
                self.error(
                    f"table {table} is UNLOGGED: a database crash empties it, and standbys do"
                    " not have it; the migrations make it a logged table",
                    f"`ALTER TABLE {table} SET LOGGED` (rewrites the table under a lock)",
                )
            )
        if want.without_rowid and have.without_rowid is False:
            findings.append(
                self.warn(
                    f"table {table} is a rowid table; the migrations make it WITHOUT ROWID, so"
                    " a lookup by key reads one b-tree instead of two",
                    self.rebuild(table),
                )
            )
        return findings


def _index_words(index: IndexShape, unique: bool = False) -> str:
    """``(subject, at)``, ``UNIQUE (…) WHERE …`` (UNIQUE only when `unique`)."""
    words = ("UNIQUE " if unique and index.unique else "") + f"({', '.join(index.keys)})"
    return words + (f" WHERE {index.where}" if index.where else "")


def _column_definition(create_table: str, column: str) -> str:
    """The definition of `column` in a one-line ``CREATE TABLE`` (``count BIGINT NOT NULL``)."""
    opened = create_table.find("(")
    end = closing(create_table, opened)
    for item in split_top_level(create_table[opened + 1 : end] if end else ""):
        if item.strip().startswith(f"{column} "):
            return item.strip()
    return column
