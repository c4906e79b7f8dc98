"""The schema: no DDL at runtime, a `SchemaError` naming ``quota migrate``, and the migrations."""

from __future__ import annotations

import asyncio
import io
import os
import re
import shlex
import sqlite3
import subprocess
import sys
from collections.abc import Callable
from importlib import resources
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic.script import ScriptDirectory

import quota
from tests._support import POSTGRES_FACES, SQLITE_FACES, OpenBackend
from tests.conftest import SQL_DIALECTS, backend_params, dialect_of, new_sql_database

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def head() -> str:
    """The newest revision, read from the migration scripts that ship in the package."""
    script = ScriptDirectory(str(resources.files("quota._migrations")))
    revision = script.get_current_head()
    assert revision is not None
    return revision


def _sa_url(url: str) -> str:
    """The SQLAlchemy URL of a store URL, on a sync driver."""
    if url.startswith("postgresql://"):
        return "postgresql+psycopg://" + url.removeprefix("postgresql://")
    return url


def _tables(url: str) -> set[str]:
    engine = sa.create_engine(_sa_url(url), poolclass=sa.NullPool)
    try:
        return set(sa.inspect(engine).get_table_names())
    finally:
        engine.dispose()


# --- no DDL at runtime ------------------------------------------------------------------


@pytest.mark.parametrize("name", backend_params(*SQLITE_FACES, *POSTGRES_FACES))
def test_a_limiter_on_an_unmigrated_database_raises_schema_error_naming_quota_migrate(
    name: str,
    request: pytest.FixtureRequest,
    open_backend: OpenBackend,
) -> None:
    url = new_sql_database(request, dialect_of(name), revision=None)
    backend = open_backend(name, url)

    for call in (lambda: backend.rate_limit("k", 1, 60), lambda: backend.peek("k", 1, 60)):
        with pytest.raises(quota.SchemaError) as info:
            call()
        assert "quota migrate" in str(info.value)
        assert url in str(info.value)

    assert "quota_counters" not in _tables(url), "a limiter must not create tables"


@pytest.mark.parametrize(
    "name",
    backend_params(
        *SQLITE_FACES,
        *POSTGRES_FACES,
    ),
)
def test_a_missing_counters_table_is_a_schema_error_chained_to_the_driver_error(
    name: str,
    request: pytest.FixtureRequest,
    open_backend: OpenBackend,
) -> None:
    url = new_sql_database(request, dialect_of(name), revision=None)
    quota.migrate(url)
    engine = sa.create_engine(_sa_url(url), poolclass=sa.NullPool)
    with engine.begin() as conn:
        conn.execute(sa.text("DROP TABLE quota_counters"))
    engine.dispose()
    backend = open_backend(name, url)

    for call in (
        lambda: backend.rate_limit("k", 1, 60),
        lambda: backend.peek("k", 1, 60),
        lambda: backend.reset("k"),
    ):
        with pytest.raises(quota.SchemaError) as info:
            call()
        # The table is gone at head: `quota doctor` names the restore (the stores still
        # say `quota migrate` until they call missing_objects_error; see below).
        assert re.search(r"`quota (migrate|doctor) --url ", str(info.value)), str(info.value)
        cause = info.value.__cause__
        assert cause is not info.value
        assert cause is not None
        assert not isinstance(cause, quota.QuotaError)


# --- migrations -------------------------------------------------------------------------


def test_upgrade_downgrade_upgrade(
    sql_empty_url: str, head: str, open_backend: OpenBackend
) -> None:
    name = "postgresql-sync" if sql_empty_url.startswith("postgresql") else "sqlite-sync"
    assert quota.current_revision(sql_empty_url) is None

    quota.migrate(sql_empty_url)
    assert quota.current_revision(sql_empty_url) == head
    assert {"quota_counters", "quota_alembic_version"} <= _tables(sql_empty_url)
    first = open_backend(name, sql_empty_url)
    assert first.rate_limit("k", 1, 60).allowed
    first.close()

    quota.downgrade(sql_empty_url, revision="base")
    assert quota.current_revision(sql_empty_url) is None
    assert "quota_counters" not in _tables(sql_empty_url)
    with pytest.raises(quota.SchemaError, match="quota migrate"):
        open_backend(name, sql_empty_url).rate_limit("k", 1, 60)

    quota.migrate(sql_empty_url)
    assert quota.current_revision(sql_empty_url) == head
    again = open_backend(name, sql_empty_url).rate_limit("k", 1, 60)
    assert again.allowed
    assert again.count == 1


def test_upgrading_again_is_a_no_op_that_keeps_counters(
    sql_empty_url: str, head: str, open_backend: OpenBackend
) -> None:
    name = "postgresql-sync" if sql_empty_url.startswith("postgresql") else "sqlite-sync"
    quota.migrate(sql_empty_url)
    backend = open_backend(name, sql_empty_url)
    for _ in range(3):
        backend.rate_limit("k", 10, 60)

    quota.migrate(sql_empty_url)
    quota.migrate(sql_empty_url, revision="head")

    assert quota.current_revision(sql_empty_url) == head
    assert backend.peek("k", 10, 60).count == 3


def test_our_version_table_leaves_the_host_apps_alembic_history_alone(
    sql_empty_url: str, head: str
) -> None:
    engine = sa.create_engine(_sa_url(sql_empty_url), poolclass=sa.NullPool)
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE alembic_version (version_num VARCHAR(32) NOT NULL)"))
        conn.execute(sa.text("INSERT INTO alembic_version VALUES ('hostapp0042')"))

    quota.migrate(sql_empty_url)

    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT version_num FROM alembic_version")).all() == [
            ("hostapp0042",)
        ]
        assert conn.execute(sa.text("SELECT version_num FROM quota_alembic_version")).all() == [
            (head,)
        ]
    engine.dispose()


def test_migrate_takes_a_sqlalchemy_connection_and_leaves_it_open(
    sql_empty_url: str, head: str, open_backend: OpenBackend
) -> None:
    name = "postgresql-sync" if sql_empty_url.startswith("postgresql") else "sqlite-sync"
    engine = sa.create_engine(_sa_url(sql_empty_url), poolclass=sa.NullPool)
    try:
        with engine.connect() as conn:
            quota.migrate(conn)
            assert not conn.closed
            assert quota.current_revision(conn) == head
            conn.commit()
    finally:
        engine.dispose()

    assert quota.current_revision(sql_empty_url) == head
    assert open_backend(name, sql_empty_url).rate_limit("k", 1, 60).allowed


def test_rendering_sql_for_sqlite_runs_nothing(tmp_path: Path) -> None:
    path = tmp_path / "never.db"
    output = io.StringIO()

    quota.migrate(f"sqlite:///{path}", sql=True, output=output)

    sql = output.getvalue()
    assert "CREATE TABLE quota_counters" in sql
    assert "quota_alembic_version" in sql
    assert "UNLOGGED" not in sql
    assert not path.exists()


# Port 1 on localhost refuses connections: rendering SQL must not need the server.
OFFLINE_PG_URL = "postgresql://nobody@127.0.0.1:1/nowhere"


def test_rendering_sql_for_postgresql_makes_an_unlogged_table_without_connecting() -> None:
    output = io.StringIO()
    quota.migrate(OFFLINE_PG_URL, sql=True, output=output)
    sql = output.getvalue()

    assert "CREATE UNLOGGED TABLE quota_counters" in sql
    assert "fillfactor = 70" in sql
    assert "quota_alembic_version" in sql


def test_rendering_sql_with_logged_counters_makes_a_normal_table() -> None:
    output = io.StringIO()
    quota.migrate(OFFLINE_PG_URL, sql=True, counters_logged=True, output=output)
    sql = output.getvalue()

    assert "CREATE TABLE quota_counters" in sql
    assert "UNLOGGED" not in sql


@pytest.mark.postgres
@pytest.mark.parametrize(
    ("counters_logged", "persistence"), [(False, "u"), (True, "p")], ids=["unlogged", "logged"]
)
def test_the_postgresql_counters_table_persistence_and_fillfactor(
    pg_make_database: Callable[[], str], counters_logged: bool, persistence: str
) -> None:
    import psycopg

    url = pg_make_database()
    quota.migrate(url, counters_logged=counters_logged)

    with psycopg.connect(url) as conn:
        row = conn.execute(
            "SELECT relpersistence, reloptions FROM pg_class"
            " WHERE relname = 'quota_counters' AND relkind = 'r'"
        ).fetchone()
    assert row is not None
    relpersistence, reloptions = row
    assert relpersistence == persistence
    assert "fillfactor=70" in (reloptions or [])


def test_alembic_upgrade_head_from_the_checkout(tmp_path: Path, head: str) -> None:
    url = f"sqlite:///{tmp_path / 'alembic.db'}"
    env = {**os.environ, "QUOTA_DATABASE_URL": url}

    done = subprocess.run(
        [sys.executable, "-m", "alembic", "upgrade", "head"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )

    assert done.returncode == 0, done.stderr
    assert quota.current_revision(url) == head
    with sqlite3.connect(tmp_path / "alembic.db") as conn:
        tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master")}
    conn.close()
    assert {"quota_counters", "quota_alembic_version"} <= tables


def test_the_command_a_schema_error_names_fixes_the_database(tmp_path: Path, head: str) -> None:
    from click.testing import CliRunner

    from quota._cli import main

    url = f"sqlite:///{tmp_path / 'advice.db'}"
    with quota.connect(url) as limiter, pytest.raises(quota.SchemaError) as info:
        limiter.rate_limit("k", 1, 60)
    advice = re.search(r"`(quota [^`]*)`", str(info.value))
    assert advice is not None, str(info.value)
    program, *args = shlex.split(advice.group(1))
    assert program == "quota"

    # Point the environment elsewhere: the advised command must carry the URL itself.
    decoy = f"sqlite:///{tmp_path / 'decoy.db'}"
    result = CliRunner().invoke(main, args, env={"QUOTA_DATABASE_URL": decoy})

    assert result.exit_code == 0, result.output
    assert quota.current_revision(url) == head


@pytest.mark.postgres
def test_the_async_postgres_store_survives_a_schema_change_under_its_prepared_statements(
    pg_make_database: Callable[[], str],
) -> None:
    """The store keeps prepared statements per connection; a migration that changes a
    result type invalidates them, and the next call prepares afresh instead of failing."""
    import asyncio

    import psycopg

    url = pg_make_database()
    quota.migrate(url)

    async def scenario() -> list[int]:
        async with quota.connect_async(url, pool_size=1) as limiter:
            first = await limiter.rate_limit("k", 10, 3600)
            with psycopg.connect(url, autocommit=True) as conn:
                # RETURNING count changes from bigint to integer: the plan is stale.
                conn.execute("ALTER TABLE quota_counters ALTER COLUMN count TYPE integer")
            second = await limiter.rate_limit("k", 10, 3600)
            third = await limiter.rate_limit("k", 10, 3600)
            return [first.count, second.count, third.count]

    assert asyncio.run(scenario()) == [1, 2, 3]


# --- the metadata is what the migrations make ---------------------------------------------
#
# `quota._sql.schema.metadata` is Alembic's target_metadata and the source of what
# `quota doctor` expects. Autogenerate compares it with a freshly migrated database;
# where autogenerate is blind (an expression index SQLAlchemy cannot reflect on SQLite,
# storage options, primary keys), the SQL the migrations write offline is compared with
# the DDL the metadata compiles to.


def _autogenerate_diff(url: str) -> list[object]:
    """Autogenerate's differences between a migrated database and the metadata.

    Configured as a plain `MigrationContext` (so the version table is compared too),
    with quota's own filters: the host app's tables, the counters' partitions and the
    indexes `DIALECT_ONLY` keeps to another dialect are left out.
    """
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    from quota._sql import schema as _schema

    engine = sa.create_engine(_sa_url(url), poolclass=sa.NullPool)
    try:
        with engine.connect() as conn:
            context = MigrationContext.configure(
                conn,
                opts={
                    "compare_type": True,
                    "compare_server_default": True,
                    "include_name": _schema.include_name,
                    "include_object": _schema.include_object(conn.dialect.name),
                },
            )
            return list(compare_metadata(context, _schema.metadata))
    finally:
        engine.dispose()


# SQLAlchemy cannot reflect an expression index on SQLite, so Alembic cannot compare
# ix_quota_counters_window_end there: both say so, naming it. Everything else is compared;
# test_the_metadata_compiles_to_the_migrations_ddl covers that index on SQLite.
_SQLITE_BLIND = [
    "ignore:Skipped unsupported reflection of expression-based index"
    " ix_quota_counters_window_end:sqlalchemy.exc.SAWarning",
    "ignore:autogenerate skipping metadata-specified expression-based index"
    " 'ix_quota_counters_window_end':UserWarning",
]


@pytest.mark.filterwarnings(*_SQLITE_BLIND)
def test_autogenerate_finds_no_difference_on_a_migrated_database(sql_empty_url: str) -> None:
    quota.migrate(sql_empty_url)
    assert _autogenerate_diff(sql_empty_url) == []


@pytest.mark.postgres
@pytest.mark.parametrize(
    ("logged", "partitioned"), [(True, False), (False, True)], ids=["logged", "partitioned"]
)
def test_autogenerate_finds_no_difference_with_the_counters_options(
    pg_make_database: Callable[[], str], logged: bool, partitioned: bool
) -> None:
    """UNLOGGED or not is not something autogenerate compares; a partitioned table is,
    but for its partitions (left out by name: `quota cleanup` makes and drops them) and
    its primary key (autogenerate never compares primary keys: `quota doctor` does)."""
    url = pg_make_database()
    quota.migrate(url, counters_logged=logged, counters_partitioned=partitioned)
    assert _autogenerate_diff(url) == []


@pytest.mark.postgres
def test_autogenerate_without_filters_on_postgresql(pg_make_database: Callable[[], str]) -> None:
    """On PostgreSQL, with nothing but quota's tables in the database, the plain call
    (no filter, no option) finds no difference either."""
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    from quota._sql.schema import metadata

    url = pg_make_database()
    quota.migrate(url)
    engine = sa.create_engine(_sa_url(url), poolclass=sa.NullPool)
    try:
        with engine.connect() as conn:
            assert compare_metadata(MigrationContext.configure(conn), metadata) == []
    finally:
        engine.dispose()


def _one_line(ddl: object) -> str:
    text = " ".join(str(ddl).split())
    return text.replace("( ", "(").replace(" )", ")")


def _offline_sql(dialect: str) -> list[str]:
    """The statements ``quota migrate --sql`` writes, on one line each."""
    url = "sqlite:///never.db" if dialect == "sqlite" else OFFLINE_PG_URL
    output = io.StringIO()
    quota.migrate(url, sql=True, output=output)
    lines = (line for line in output.getvalue().splitlines() if not line.startswith("--"))
    return [_one_line(s) for s in "\n".join(lines).split(";\n") if s.strip()]


def _create_all_sql(dialect: str) -> list[str]:
    """The statements ``metadata.create_all`` would run on `dialect`."""
    from quota._sql.schema import metadata

    emitted: list[str] = []

    def executor(sql: sa.schema.ExecutableDDLElement, *args: object, **kwargs: object) -> None:
        emitted.append(_one_line(sql.compile(dialect=engine.dialect)))

    engine = sa.create_mock_engine(f"{dialect}://", executor)
    metadata.create_all(engine, checkfirst=False)
    return emitted


@pytest.mark.parametrize("dialect", SQL_DIALECTS)
def test_the_metadata_creates_what_the_migrations_create(dialect: str) -> None:
    """Every table and index, as the migrations create them (UNLOGGED and the storage
    settings aside: the metadata does not model them), and nothing more. Covers what
    autogenerate cannot compare: the expression index on SQLite, primary keys."""
    migrations = {
        s.replace("CREATE UNLOGGED TABLE", "CREATE TABLE")
        for s in _as_created(_offline_sql(dialect))
        if s.startswith("CREATE")
    }
    assert set(_create_all_sql(dialect)) == migrations


_ADD_COLUMN = re.compile(r"ALTER TABLE (\w+) ADD COLUMN (.+)")
_ADD_CHECK = re.compile(r"ALTER TABLE (\w+) ADD CONSTRAINT (\w+) (CHECK .+)")
_RENAME = re.compile(r"ALTER TABLE _alembic_tmp_(\w+) RENAME TO (\w+)")


def _as_created(statements: list[str]) -> list[str]:
    """`statements` with what later migrations alter folded into the CREATE TABLE they
    alter: a column added goes after the last column, a CHECK constraint added replaces
    the one of its name, and a table copied (SQLite's batch mode) replaces the original."""
    creates: dict[str, int] = {}
    out = list(statements)
    for i, statement in enumerate(statements):
        created = re.match(r"CREATE (?:UNLOGGED )?TABLE (\w+) \(", statement)
        if created:
            creates[created.group(1)] = i
        elif added := _ADD_COLUMN.fullmatch(statement):
            table, column = added.groups()
            at = creates[table]
            parts = re.split(r", (?=CONSTRAINT |PRIMARY KEY )", out[at], maxsplit=1)
            out[at] = (
                f"{parts[0]}, {column}, {parts[1]}"
                if len(parts) == 2
                else f"{parts[0][:-1]}, {column})"
            )
            out[i] = ""
        elif check := _ADD_CHECK.fullmatch(statement):
            table, name, body = check.groups()
            at = creates[table]
            out[at] = re.sub(rf"CONSTRAINT {name} CHECK \(.*?\)\)(?=, CONSTRAINT|\)$)",
                             f"CONSTRAINT {name} {body}", out[at])  # fmt: skip
            out[i] = ""
        elif renamed := _RENAME.fullmatch(statement):
            copy, table = renamed.groups()
            out[creates[table]] = ""
            at = creates.pop(f"_alembic_tmp_{copy}")
            out[at] = out[at].replace(
                f"CREATE TABLE _alembic_tmp_{copy} ", f"CREATE TABLE {table} "
            )
            creates[table] = at
    return [s for s in out if s]


def test_the_table_revisions_are_the_migrations() -> None:
    from quota._sql.schema import TABLE_REVISIONS, TABLES
    from quota._tools.doctor.fixes import migration_ddl

    ddl = migration_ddl("sqlite")
    assert set(TABLE_REVISIONS) == set(TABLES)
    assert {table: ddl.table(table)[0] for table in TABLES} == TABLE_REVISIONS


def test_the_autogenerate_filters() -> None:
    from quota._sql.schema import include_name, include_object

    assert include_name("quota_counters", "table", {})
    assert not include_name("quota_counters_p1796180400", "table", {})
    assert not include_name("quota_counters_default", "table", {})
    assert not include_name("orders", "table", {})
    assert include_name("anything", "column", {})
    on_sqlite, on_postgres = include_object("sqlite"), include_object("postgresql")
    assert not on_sqlite(None, "ix_quota_state_expires_at", "index", False, None)
    assert on_postgres(None, "ix_quota_state_expires_at", "index", False, None)
    assert not on_sqlite(None, "ix_quota_counters_window_end", "index", False, None)
    assert on_postgres(None, "ix_quota_counters_window_end", "index", False, None)
    assert on_sqlite(None, "uq_quota_ledger_idempotency", "index", False, None)


# --- SchemaError when a table is missing: migrate, or drift --------------------------------


def test_a_missing_table_without_a_version_table_says_to_migrate() -> None:
    from quota._sql.schema import missing_objects_error

    error = missing_objects_error("sqlite:///q.db", "no such table: quota_state", None)
    assert isinstance(error, quota.SchemaError)
    assert str(error) == (
        "no such table: quota_state; the quota tables are missing,"
        " run `quota migrate --url 'sqlite:///q.db'`"
    )
    assert "quota migrate" in str(missing_objects_error(None, "x", []))


def test_a_missing_table_behind_head_says_to_migrate() -> None:
    from quota._sql.schema import REQUIRED, REVISIONS, missing_objects_error

    error = missing_objects_error(
        "postgresql://app:pw@db/app", 'relation "quota_state" does not exist', [(REVISIONS[1],)]
    )
    assert str(error) == (
        f'relation "quota_state" does not exist; the quota schema is at revision {REVISIONS[1]},'
        f" this code needs {REQUIRED}; run `quota migrate --url 'postgresql://app:***@db/app'`"
    )


def test_a_missing_table_at_head_is_drift_and_points_at_doctor(head: str) -> None:
    from quota._sql.schema import missing_objects_error

    error = missing_objects_error(
        "postgresql://app:pw@db/app", 'relation "quota_state" does not exist', [(head,)]
    )
    assert str(error) == (
        f"schema drift: the database is at revision {head} (head) but relation"
        " \"quota_state\" does not exist; `quota doctor --url 'postgresql://app:***@db/app'`"
        " names what is missing and how to restore it"
    )
    assert "quota migrate" not in str(error)  # a no-op at head: no advice to loop on


def test_a_missing_table_under_newer_code_says_to_upgrade_quota() -> None:
    from quota._sql.schema import missing_objects_error

    error = missing_objects_error(None, "no such table: quota_state", [("9999_future",)])
    assert "9999_future" in str(error)
    assert "upgrade quota" in str(error)
    assert "quota migrate" not in str(error)


def test_the_command_a_drift_error_names_reports_the_missing_table(
    tmp_path: Path, head: str
) -> None:
    """The advice leads somewhere: `quota doctor` names the table and its restore."""
    from click.testing import CliRunner

    from quota._cli import main
    from quota._sql.schema import missing_objects_error

    url = f"sqlite:///{tmp_path / 'drift.db'}"
    quota.migrate(url)
    with sqlite3.connect(tmp_path / "drift.db") as conn:
        conn.execute("DROP TABLE quota_state")
    conn.close()
    error = missing_objects_error(url, "no such table: quota_state", [(head,)])
    advice = re.search(r"`(quota [^`]*)`", str(error))
    assert advice is not None
    _, *args = shlex.split(advice.group(1))

    result = CliRunner().invoke(main, args, env={"QUOTA_DATABASE_URL": None})

    assert result.exit_code == 3
    assert "table quota_state is missing" in result.output
    assert "CREATE TABLE quota_state" in result.output


@pytest.mark.parametrize("name", backend_params(*SQLITE_FACES, *POSTGRES_FACES))
def test_a_table_missing_at_head_is_schema_drift_pointing_at_doctor(
    name: str,
    request: pytest.FixtureRequest,
    open_backend: OpenBackend,
    head: str,
) -> None:
    url = new_sql_database(request, dialect_of(name), revision=None)
    quota.migrate(url)
    engine = sa.create_engine(_sa_url(url), poolclass=sa.NullPool)
    with engine.begin() as conn:
        conn.execute(sa.text("DROP TABLE quota_state"))
        conn.execute(sa.text("DROP TABLE quota_usage"))
    engine.dispose()
    backend = open_backend(name, url)
    assert backend.rate_limit("k", 1, 60).allowed  # the counters are there

    calls = (
        lambda: backend.rate_limit("k", 5, 60, algorithm="sliding_window"),
        lambda: backend._run_value(backend.limiter.consume_quota("s", "q", 10, "day")),
    )
    for call in calls:
        with pytest.raises(quota.SchemaError) as info:
            call()
        assert str(info.value).startswith(f"schema drift: the database is at revision {head}")
        assert "quota doctor --url" in str(info.value)
        assert "quota migrate" not in str(info.value)
        assert info.value.__cause__ is not None


# --- A SQLite file that does not exist: only `migrate` creates one, never directories ------


def _files_under(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.parametrize("face", ["sync", "async"])
@pytest.mark.parametrize("where", ["missing.db", "no/such/dir/q.db"])
def test_a_mistyped_sqlite_path_creates_nothing_and_says_to_migrate(
    tmp_path: Path, face: str, where: str
) -> None:
    path = tmp_path / where
    url = f"sqlite:///{path}"
    before = _files_under(tmp_path)
    if face == "sync":
        limiter = quota.connect(url)
        with pytest.raises(quota.SchemaError) as caught:
            limiter.rate_limit("k", 1, 60)
        limiter.close()
    else:

        async def first_use() -> None:
            limiter = quota.connect_async(url)
            try:
                await limiter.rate_limit("k", 1, 60)
            finally:
                await limiter.aclose()

        with pytest.raises(quota.SchemaError) as caught:
            asyncio.run(first_use())
    assert f"no SQLite file at {path}" in str(caught.value)
    assert "quota migrate" in str(caught.value)
    assert _files_under(tmp_path) == before


def test_migrate_creates_the_file_but_not_its_directory(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from quota._cli import main

    path = tmp_path / "nonexistent" / "dir" / "q.db"
    url = f"sqlite:///{path}"
    with pytest.raises(quota.ConfigurationError, match=re.escape(str(path.parent))):
        quota.migrate(url)
    result = CliRunner().invoke(main, ["--url", url, "migrate"])
    assert result.exit_code != 0 and str(path.parent) in result.output, result.output
    assert _files_under(tmp_path) == []
    assert quota.current_revision(f"sqlite:///{tmp_path / 'missing.db'}") is None
    with pytest.raises(quota.SchemaError, match="quota migrate"):
        quota.downgrade(f"sqlite:///{tmp_path / 'missing.db'}", revision="base")
    assert _files_under(tmp_path) == []
    path.parent.mkdir(parents=True)
    quota.migrate(url)
    assert quota.connect(url).rate_limit("k", 1, 60).allowed


@pytest.mark.parametrize("value", ["ture", "2", "", "maybe"])
def test_a_migration_option_that_is_no_true_or_false_word_is_refused(value: str) -> None:
    """``alembic -x counters_logged=ture`` stops with the option named instead of
    migrating as if it were false; true and false words in any case are taken."""
    from alembic.config import main as alembic_main

    ini = str(Path(__file__).resolve().parents[2] / "alembic.ini")
    argv = ["-c", ini, "-x", f"counters_logged={value}", "upgrade", "head", "--sql"]
    with pytest.raises(quota.ConfigurationError, match=f"counters_logged .*got '{value}'"):
        alembic_main(argv=argv)
    with pytest.raises(quota.ConfigurationError, match="counters_partitioned"):
        quota.migrate(OFFLINE_PG_URL, sql=True, counters_partitioned=value, output=io.StringIO())  # type: ignore[arg-type]
    output = io.StringIO()
    quota.migrate(OFFLINE_PG_URL, sql=True, counters_logged="YES", output=output)  # type: ignore[arg-type]
    assert "UNLOGGED" not in output.getvalue()
