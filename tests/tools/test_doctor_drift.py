"""``quota doctor``'s ``schema_drift`` check: what the migrations made, against what is there.

Each kind of drift is made on a freshly migrated throwaway database (SQLite and
PostgreSQL), found with its fix, and the fix's statement run: the drift is gone.
"""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner

import quota
from quota._cli import main
from quota._sql import schema as _schema
from quota._sql.schema import REVISIONS
from quota._tools.doctor import ERROR, OK, WARN
from quota._tools.doctor.drift import drift_findings
from quota._tools.doctor.live_schema import sqlite_index_shape
from quota._tools.doctor.postgres import Partition, partitioned_findings
from tests.conftest import SQL_DIALECTS

#: The newest revision of the migrations that ship with the package.
HEAD = REVISIONS[-1]

#: The `sql_database` fixture: ``sql_database()`` migrated to head, or ``sql_database(revision)``.
MakeUrl = Callable[..., str]


def _execute(url: str, sql: str) -> None:
    """Run `sql` (one statement or several, separated by ``;``) on the database at `url`."""
    if url.startswith("sqlite"):
        conn = sqlite3.connect(url.removeprefix("sqlite:///"))
        try:
            conn.executescript(sql)
        finally:
            conn.close()
        return
    import psycopg

    with psycopg.connect(url, autocommit=True) as pg:
        pg.execute(sql)  # several statements: no parameters, so psycopg sends them as one


def _drift(url: str) -> list[quota.Finding]:
    return [f for f in quota.diagnose(url) if f.check == "schema_drift"]


def _statement(fix: str) -> str:
    """The SQL a fix gives, between its first pair of backticks."""
    match = re.search(r"`([^`]+)`", fix)
    assert match is not None, fix
    return match.group(1)


def _cli(*args: str) -> int:
    return CliRunner().invoke(main, list(args), env={"QUOTA_DATABASE_URL": None}).exit_code


def _is_postgres(url: str) -> bool:
    return url.startswith("postgresql")


def _assert_restored_by_its_fix(url: str, finding: quota.Finding) -> None:
    _execute(url, _statement(finding.fix))
    drift = _drift(url)
    assert [(f.severity, f.message) for f in drift] == [(OK, drift[0].message)], drift
    assert HEAD in drift[0].message


# -- nothing drifted -----------------------------------------------------------------------


def test_a_freshly_migrated_database_has_no_drift(sql_database: MakeUrl) -> None:
    url = sql_database()
    (finding,) = _drift(url)
    assert finding.severity == OK
    assert f"revision {HEAD}" in finding.message


@pytest.mark.postgres
@pytest.mark.parametrize(
    ("logged", "partitioned"), [(True, False), (False, True)], ids=["logged", "partitioned"]
)
def test_the_counters_options_are_not_drift(
    pg_make_database: Callable[[], str], logged: bool, partitioned: bool
) -> None:
    url = pg_make_database()
    quota.migrate(url, counters_logged=logged, counters_partitioned=partitioned)
    findings = quota.diagnose(url)
    assert [f for f in findings if f.severity != OK] == []
    assert _cli("doctor", "--url", url, "--strict") == 0


# -- each kind of drift, with its fix ----------------------------------------------------------


def test_a_dropped_idempotency_index_is_an_error_fixed_by_the_migrations_statement(
    sql_database: MakeUrl,
) -> None:
    url = sql_database()
    _execute(url, "DROP INDEX uq_quota_ledger_idempotency")

    (finding,) = _drift(url)

    assert finding.severity == ERROR
    assert "unique index uq_quota_ledger_idempotency on quota_ledger is missing" in finding.message
    assert "idempotency key" in finding.message
    assert _statement(finding.fix) == (
        "CREATE UNIQUE INDEX uq_quota_ledger_idempotency ON quota_ledger"
        " (subject, name, idempotency_key) WHERE kind = 'consume' AND refunded_at IS NULL"
    )
    assert "0002_quotas" in finding.fix
    assert _cli("doctor", "--url", url) == 3
    _assert_restored_by_its_fix(url, finding)


def test_an_idempotency_index_without_its_predicate_is_an_error(sql_database: MakeUrl) -> None:
    url = sql_database()
    _execute(
        url,
        "DROP INDEX uq_quota_ledger_idempotency;"
        " CREATE UNIQUE INDEX uq_quota_ledger_idempotency ON quota_ledger"
        " (subject, name, idempotency_key)",
    )

    (finding,) = _drift(url)

    assert finding.severity == ERROR
    assert "is not the one the migrations make" in finding.message
    assert _statement(finding.fix).startswith(
        "DROP INDEX uq_quota_ledger_idempotency; CREATE UNIQUE INDEX uq_quota_ledger_idempotency"
    )
    _assert_restored_by_its_fix(url, finding)


def test_a_dropped_cleanup_index_is_a_warning(sql_database: MakeUrl) -> None:
    url = sql_database()
    _execute(url, "DROP INDEX ix_quota_counters_window_end")

    (finding,) = _drift(url)

    assert finding.severity == WARN
    assert "ix_quota_counters_window_end on quota_counters is missing" in finding.message
    assert "cleanup" in finding.message
    assert _statement(finding.fix) == (
        "CREATE INDEX ix_quota_counters_window_end ON quota_counters"
        " ((window_start + window_seconds))"
    )
    assert _cli("doctor", "--url", url, "--strict") == 3
    _assert_restored_by_its_fix(url, finding)


@pytest.mark.postgres
def test_the_postgresql_only_cleanup_index(pg_make_database: Callable[[], str]) -> None:
    url = pg_make_database()
    quota.migrate(url)
    _execute(url, "DROP INDEX ix_quota_state_expires_at")

    (finding,) = _drift(url)

    assert finding.severity == WARN
    assert _statement(finding.fix) == (
        "CREATE INDEX ix_quota_state_expires_at ON quota_state (expires_at)"
    )
    assert _cli("doctor", "--url", url) == 0  # slow, not wrong
    _assert_restored_by_its_fix(url, finding)


def test_a_dropped_counters_column_is_an_error_fixed_by_recreating_the_table(
    sql_database: MakeUrl,
) -> None:
    url = sql_database()
    _execute(url, "ALTER TABLE quota_counters DROP COLUMN updated_at")

    (finding,) = _drift(url)

    assert finding.severity == ERROR
    assert "column quota_counters.updated_at is missing" in finding.message
    assert "updated_at FLOAT NOT NULL" in finding.message
    statement = _statement(finding.fix)
    assert statement.startswith("DROP TABLE quota_counters; CREATE ")
    assert ("CREATE UNLOGGED TABLE" in statement) == _is_postgres(url)
    _assert_restored_by_its_fix(url, finding)
    with quota.connect(url) as limiter:
        assert limiter.rate_limit("k", 1, 60).allowed


def test_a_dropped_nullable_column_is_added_back(sql_database: MakeUrl) -> None:
    url = sql_database()
    _execute(url, "ALTER TABLE quota_usage DROP COLUMN tz")

    (finding,) = _drift(url)

    assert finding.severity == ERROR
    assert _statement(finding.fix) == "ALTER TABLE quota_usage ADD COLUMN tz TEXT"
    _assert_restored_by_its_fix(url, finding)


def test_a_dropped_not_null_column_of_a_durable_table(sql_database: MakeUrl) -> None:
    url = sql_database()
    _execute(url, "ALTER TABLE quota_ledger DROP COLUMN cost")

    (finding,) = _drift(url)

    assert finding.severity == ERROR
    assert "column quota_ledger.cost is missing" in finding.message
    assert "ALTER TABLE quota_ledger ADD COLUMN cost BIGINT`" in finding.fix
    assert "fill it" in finding.fix


def test_a_dropped_table_is_an_error_fixed_by_the_migrations_statements(
    sql_database: MakeUrl,
) -> None:
    url = sql_database()
    _execute(url, "DROP TABLE quota_state")

    (finding,) = _drift(url)

    assert finding.severity == ERROR
    assert "table quota_state is missing" in finding.message
    assert f"at revision {HEAD}" in finding.message
    assert "0003_algorithms" in finding.fix
    assert ("CREATE UNLOGGED TABLE quota_state" in finding.fix) == _is_postgres(url)
    assert ("CREATE INDEX ix_quota_state_expires_at" in finding.fix) == _is_postgres(url)
    _assert_restored_by_its_fix(url, finding)


@pytest.mark.postgres
@pytest.mark.parametrize(
    ("table", "constraint", "statement"),
    [
        ("quota_usage", "pk_quota_usage", "ALTER TABLE quota_usage ADD CONSTRAINT pk_quota_usage"
         " PRIMARY KEY (subject, name, period_start)"),
        ("quota_counters", "quota_counters_pkey",
         "ALTER TABLE quota_counters ADD PRIMARY KEY (bucket_key)"),
    ],
)  # fmt: skip
def test_a_dropped_primary_key_is_an_error(
    pg_make_database: Callable[[], str], table: str, constraint: str, statement: str
) -> None:
    url = pg_make_database()
    quota.migrate(url)
    _execute(url, f"ALTER TABLE {table} DROP CONSTRAINT {constraint}")

    (finding,) = _drift(url)

    assert finding.severity == ERROR
    assert f"table {table} has no primary key" in finding.message
    assert "upserts fail" in finding.message
    assert _statement(finding.fix) == statement
    _assert_restored_by_its_fix(url, finding)


def test_a_sqlite_table_rebuilt_without_its_primary_key(tmp_path: Path) -> None:
    """SQLite cannot drop a primary key; a table rebuilt by hand can lack one."""
    url = f"sqlite:///{tmp_path / 'nokey.db'}"
    quota.migrate(url)
    _execute(
        url,
        "DROP TABLE quota_policies; CREATE TABLE quota_policies (route TEXT NOT NULL,"
        " subject TEXT DEFAULT '*' NOT NULL, rates TEXT, algorithm TEXT, cost INTEGER,"
        " fail_open BOOLEAN, exempt BOOLEAN DEFAULT 0 NOT NULL, note TEXT,"
        " updated_at FLOAT NOT NULL)",
    )

    (finding,) = _drift(url)

    assert finding.severity == ERROR
    assert "table quota_policies has no primary key" in finding.message
    assert "CONSTRAINT pk_quota_policies PRIMARY KEY (route, subject)" in finding.fix
    assert "rebuild" in finding.fix


@pytest.mark.postgres
def test_a_changed_column_type_and_nullability(pg_make_database: Callable[[], str]) -> None:
    url = pg_make_database()
    quota.migrate(url)
    _execute(
        url,
        "ALTER TABLE quota_usage ALTER COLUMN used TYPE integer,"
        " ALTER COLUMN tz SET NOT NULL, ALTER COLUMN period_end DROP NOT NULL",
    )

    by_message = {f.message: f for f in _drift(url)}

    used = next(f for m, f in by_message.items() if "quota_usage.used" in m)
    assert used.severity == ERROR
    assert "is integer; the migrations make it bigint" in used.message
    assert used.fix.startswith("`ALTER TABLE quota_usage ALTER COLUMN used TYPE bigint`")
    tz = next(f for m, f in by_message.items() if "quota_usage.tz" in m)
    assert tz.severity == ERROR
    assert _statement(tz.fix) == "ALTER TABLE quota_usage ALTER COLUMN tz DROP NOT NULL"
    period_end = next(f for m, f in by_message.items() if "quota_usage.period_end" in m)
    assert period_end.severity == WARN
    for finding in (used, tz, period_end):
        _execute(url, _statement(finding.fix))
    assert [f.severity for f in _drift(url)] == [OK]


def test_an_extra_index_on_a_hot_table_warns(sql_database: MakeUrl) -> None:
    url = sql_database()
    _execute(url, "CREATE INDEX ix_mine ON quota_counters (count)")

    (finding,) = _drift(url)

    assert finding.severity == WARN
    assert "index ix_mine on quota_counters (count) is not one the migrations make" in (
        finding.message
    )
    assert "HOT" in finding.message
    _assert_restored_by_its_fix(url, finding)


def test_an_extra_index_on_the_ledger_is_the_apps_business(sql_database: MakeUrl) -> None:
    url = sql_database()
    _execute(url, "CREATE INDEX ix_reporting ON quota_ledger (name, at)")
    assert [f.severity for f in _drift(url)] == [OK]


def test_a_renamed_index_works_but_warns(sql_database: MakeUrl) -> None:
    url = sql_database()
    _execute(
        url,
        "DROP INDEX ix_quota_ledger_at; CREATE INDEX ix_renamed ON quota_ledger (at)",
    )

    (finding,) = _drift(url)

    assert finding.severity == WARN
    assert "ix_quota_ledger_at on quota_ledger is there as ix_renamed" in finding.message
    _assert_restored_by_its_fix(url, finding)


def test_a_dropped_version_table_is_an_error_that_says_which_revision_to_record(
    sql_database: MakeUrl,
) -> None:
    url = sql_database()
    _execute(url, "DROP TABLE quota_alembic_version")

    findings = quota.diagnose(url)

    schema = next(f for f in findings if f.check == "schema")
    assert schema.severity == ERROR
    assert "yet quota tables are here" in schema.message
    (finding,) = [f for f in findings if f.check == "schema_drift"]
    assert finding.severity == ERROR
    assert "the version table quota_alembic_version is missing" in finding.message
    assert f"INSERT INTO quota_alembic_version (version_num) VALUES ('{HEAD}')" in finding.fix
    _assert_restored_by_its_fix(url, finding)
    assert quota.current_revision(url) == HEAD


def test_a_schema_behind_says_to_migrate(sql_database: MakeUrl) -> None:
    url = sql_database(revision=REVISIONS[1])

    (finding,) = _drift(url)

    assert finding.severity == ERROR
    assert "quota_policies" in finding.message
    assert "quota_state" in finding.message
    assert f"at revision {REVISIONS[1]}" in finding.message
    assert finding.fix == f"run `quota --url '{url}' migrate`"


def test_an_unmigrated_database_leaves_drift_to_the_schema_finding(tmp_path: Path) -> None:
    path = tmp_path / "empty.db"
    sqlite3.connect(path).close()
    assert _drift(f"sqlite:///{path}") == []


# -- partitioned counters ---------------------------------------------------------------------


@pytest.mark.postgres
def test_a_partitioned_deployment_passes_strict(pg_make_database: Callable[[], str]) -> None:
    url = pg_make_database()
    quota.migrate(url, counters_partitioned=True)

    findings = quota.diagnose(url)

    counters = {f.check: f for f in findings if f.message.startswith("quota_counters")}
    assert counters["persistence"].severity == OK
    assert "UNLOGGED" in counters["persistence"].message
    assert "partitions" in counters["persistence"].message
    assert counters["fillfactor"].severity == OK
    assert "fillfactor is 70" in counters["fillfactor"].message
    assert [f for f in findings if f.severity != OK] == []
    assert _cli("doctor", "--url", url, "--strict") == 0


@pytest.mark.postgres
def test_logged_partitioned_counters_are_reported_logged(
    pg_make_database: Callable[[], str],
) -> None:
    url = pg_make_database()
    quota.migrate(url, counters_partitioned=True, counters_logged=True)
    findings = quota.diagnose(url)
    persistence = next(
        f for f in findings if f.check == "persistence" and "quota_counters" in f.message
    )
    assert "logged table" in persistence.message
    assert _cli("doctor", "--url", url, "--strict") == 0


@pytest.mark.postgres
def test_a_partition_with_a_full_fillfactor_is_named_in_the_fix(
    pg_make_database: Callable[[], str],
) -> None:
    url = pg_make_database()
    quota.migrate(url, counters_partitioned=True)
    _execute(url, "ALTER TABLE quota_counters_default SET (fillfactor = 100)")

    fill = next(
        f
        for f in quota.diagnose(url)
        if f.check == "fillfactor" and f.message.startswith("quota_counters")
    )

    assert fill.severity == WARN
    assert _statement(fill.fix) == "ALTER TABLE quota_counters_default SET (fillfactor = 70)"
    assert "ALTER TABLE quota_counters SET" not in fill.fix  # PostgreSQL refuses it on the parent
    _execute(url, _statement(fill.fix))
    assert _cli("doctor", "--url", url, "--strict") == 0


@pytest.mark.postgres
def test_a_partitioned_table_without_its_default_partition(
    pg_make_database: Callable[[], str],
) -> None:
    url = pg_make_database()
    quota.migrate(url, counters_partitioned=True)
    _execute(url, "DROP TABLE quota_counters_default")

    (finding,) = _drift(url)

    assert finding.severity == ERROR
    assert "no DEFAULT partition" in finding.message
    assert _statement(finding.fix).startswith(
        "CREATE UNLOGGED TABLE quota_counters_default PARTITION OF quota_counters DEFAULT"
    )
    _assert_restored_by_its_fix(url, finding)


@pytest.mark.postgres
def test_a_partitioned_table_missing_a_column_is_recreated_partitioned(
    pg_make_database: Callable[[], str],
) -> None:
    url = pg_make_database()
    quota.migrate(url, counters_partitioned=True)
    _execute(url, "ALTER TABLE quota_counters DROP COLUMN updated_at")

    (finding,) = _drift(url)

    assert finding.severity == ERROR
    assert "PARTITION BY RANGE (window_start)" in finding.fix
    assert "quota cleanup" in finding.fix
    _assert_restored_by_its_fix(url, finding)


@pytest.mark.postgres
def test_a_durable_table_made_unlogged_is_an_error(pg_make_database: Callable[[], str]) -> None:
    url = pg_make_database()
    quota.migrate(url)
    _execute(url, "ALTER TABLE quota_ledger SET UNLOGGED")

    (finding,) = _drift(url)

    assert finding.severity == ERROR
    assert "quota_ledger is UNLOGGED" in finding.message
    _assert_restored_by_its_fix(url, finding)


# -- pure parts, without a database ---------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "normal"),
    [
        ("kind = 'consume' AND refunded_at IS NULL", "kind='consume'andrefunded_atisnull"),
        ("((kind = 'consume'::text) AND (refunded_at IS NULL))", "kind='consume'andrefunded_atisnull"),
        ("(window_start + window_seconds)", "window_start+window_seconds"),
        ('"count"', "count"),
        ("x::double precision", "x"),
        ("y::character varying(32)", "y"),
    ],
)  # fmt: skip
def test_normalize_sql(text: str, normal: str) -> None:
    assert _schema.normalize_sql(text) == normal


def test_a_sqlite_index_is_read_from_its_create_statement() -> None:
    shape = sqlite_index_shape(
        "uq",
        "CREATE UNIQUE INDEX uq ON quota_ledger (subject, name, idempotency_key)"
        " WHERE kind = 'consume' AND refunded_at IS NULL",
        True,
    )
    assert shape is not None
    assert shape.keys == ("subject", "name", "idempotency_key")
    assert shape.where == "kind='consume'andrefunded_atisnull"
    expression = sqlite_index_shape(
        "ix", 'CREATE INDEX "ix" ON "quota_counters" ((window_start + window_seconds))', False
    )
    assert expression is not None
    assert expression.keys == ("window_start+window_seconds",)


@pytest.mark.parametrize("dialect", SQL_DIALECTS)
def test_drift_is_judged_from_the_shapes_alone(dialect: str) -> None:
    """No database: the live schema is the expected one with the idempotency index gone."""
    from dataclasses import replace

    expected = _schema.expected_schema(dialect)
    live = dict(expected)
    ledger = live["quota_ledger"]
    live["quota_ledger"] = replace(ledger, indexes=tuple(i for i in ledger.indexes if not i.unique))

    findings = drift_findings(expected, live, dialect=dialect, revision=HEAD, url="sqlite:///x.db")

    assert [(f.check, f.severity) for f in findings] == [("schema_drift", ERROR)]
    assert "CREATE UNIQUE INDEX uq_quota_ledger_idempotency" in findings[0].fix
    assert (
        drift_findings(expected, expected, dialect=dialect, revision=HEAD, url="sqlite:///x.db")[
            0
        ].severity
        == OK
    )


def test_a_newer_schema_is_not_compared() -> None:
    expected = _schema.expected_schema("sqlite")
    assert (
        drift_findings(expected, {}, dialect="sqlite", revision="9999_future", url="sqlite:///x.db")
        == []
    )


def test_partitions_that_disagree_warn() -> None:
    partitions = [
        Partition("quota_counters_default", True, "u", 70),
        Partition("quota_counters_p0", False, "p", 70, updates=600, hot=600),
        Partition("quota_counters_p3600", False, "u", 70, updates=600, hot=0),
    ]
    persistence, fill, hot = partitioned_findings("quota_counters", partitions)
    assert persistence.severity == WARN
    assert _statement(persistence.fix) == "ALTER TABLE quota_counters_p0 SET UNLOGGED"
    assert fill.severity == OK
    assert hot.severity == WARN  # 600 HOT of 1,200 updates, summed over the partitions
    assert partitioned_findings("quota_counters", []) == []


@pytest.mark.postgres
def test_tables_in_the_schema_the_url_names(pg_make_database: Callable[[], str]) -> None:
    url = pg_make_database() + "?schema=limits"
    quota.migrate(url)

    assert [f for f in quota.diagnose(url) if f.severity != OK] == []

    _execute(url.removesuffix("?schema=limits"), "DROP INDEX limits.uq_quota_ledger_idempotency")
    (finding,) = _drift(url)
    assert finding.severity == ERROR
    assert "uq_quota_ledger_idempotency" in finding.message


@pytest.mark.postgres
def test_an_invalid_index_is_rebuilt(pg_make_database: Callable[[], str]) -> None:
    """What a failed CREATE INDEX CONCURRENTLY leaves: there, but never used."""
    url = pg_make_database()
    quota.migrate(url)
    _execute(
        url,
        "UPDATE pg_index SET indisvalid = false"
        " WHERE indexrelid = 'ix_quota_ledger_subject_at'::regclass",
    )

    (finding,) = _drift(url)

    assert finding.severity == WARN
    assert "INVALID" in finding.message
    assert _statement(finding.fix) == "REINDEX INDEX ix_quota_ledger_subject_at"
    _assert_restored_by_its_fix(url, finding)
