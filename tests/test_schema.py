"""The schema: no DDL at runtime, a `SchemaError` naming ``quota migrate``, and the migrations."""

from __future__ import annotations

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

REPO = Path(__file__).resolve().parents[1]


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


@pytest.fixture(
    params=[
        pytest.param("sqlite", id="sqlite"),
        pytest.param("postgresql", id="postgresql", marks=pytest.mark.postgres),
    ]
)
def empty_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A database without the quota tables: a new SQLite file, or a new PostgreSQL database."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'fresh.db'}"
    make: Callable[[], str] = request.getfixturevalue("pg_make_database")
    return make()


def _faces(*names: str, xfail: dict[str, str] | None = None) -> list[object]:
    params = []
    for name in names:
        marks: list[pytest.MarkDecorator] = []
        if name in POSTGRES_FACES:
            marks.append(pytest.mark.postgres)
        if xfail and name in xfail:
            marks.append(pytest.mark.xfail(strict=True, reason=xfail[name]))
        params.append(pytest.param(name, id=name, marks=marks))
    return params


def _empty_url_for(name: str, request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if name in SQLITE_FACES:
        return f"sqlite:///{tmp_path / 'fresh.db'}"
    make: Callable[[], str] = request.getfixturevalue("pg_make_database")
    return make()


# --- no DDL at runtime ------------------------------------------------------------------


@pytest.mark.parametrize("name", _faces(*SQLITE_FACES, *POSTGRES_FACES))
def test_a_limiter_on_an_unmigrated_database_raises_schema_error_naming_quota_migrate(
    name: str,
    request: pytest.FixtureRequest,
    tmp_path: Path,
    open_backend: OpenBackend,
) -> None:
    url = _empty_url_for(name, request, tmp_path)
    backend = open_backend(name, url)

    for call in (lambda: backend.rate_limit("k", 1, 60), lambda: backend.peek("k", 1, 60)):
        with pytest.raises(quota.SchemaError) as info:
            call()
        assert "quota migrate" in str(info.value)
        assert url in str(info.value)

    assert "quota_counters" not in _tables(url), "a limiter must not create tables"


@pytest.mark.parametrize(
    "name",
    _faces(
        *SQLITE_FACES,
        *POSTGRES_FACES,
    ),
)
def test_a_missing_counters_table_is_a_schema_error_chained_to_the_driver_error(
    name: str,
    request: pytest.FixtureRequest,
    tmp_path: Path,
    open_backend: OpenBackend,
) -> None:
    url = _empty_url_for(name, request, tmp_path)
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
        assert "quota migrate" in str(info.value)
        cause = info.value.__cause__
        assert cause is not info.value
        assert cause is not None
        assert not isinstance(cause, quota.QuotaError)


# --- migrations -------------------------------------------------------------------------


def test_upgrade_downgrade_upgrade(empty_url: str, head: str, open_backend: OpenBackend) -> None:
    name = "postgresql-sync" if empty_url.startswith("postgresql") else "sqlite-sync"
    assert quota.current_revision(empty_url) is None

    quota.migrate(empty_url)
    assert quota.current_revision(empty_url) == head
    assert {"quota_counters", "quota_alembic_version"} <= _tables(empty_url)
    first = open_backend(name, empty_url)
    assert first.rate_limit("k", 1, 60).allowed
    first.close()

    quota.downgrade(empty_url, revision="base")
    assert quota.current_revision(empty_url) is None
    assert "quota_counters" not in _tables(empty_url)
    with pytest.raises(quota.SchemaError, match="quota migrate"):
        open_backend(name, empty_url).rate_limit("k", 1, 60)

    quota.migrate(empty_url)
    assert quota.current_revision(empty_url) == head
    again = open_backend(name, empty_url).rate_limit("k", 1, 60)
    assert again.allowed
    assert again.count == 1


def test_upgrading_again_is_a_no_op_that_keeps_counters(
    empty_url: str, head: str, open_backend: OpenBackend
) -> None:
    name = "postgresql-sync" if empty_url.startswith("postgresql") else "sqlite-sync"
    quota.migrate(empty_url)
    backend = open_backend(name, empty_url)
    for _ in range(3):
        backend.rate_limit("k", 10, 60)

    quota.migrate(empty_url)
    quota.migrate(empty_url, revision="head")

    assert quota.current_revision(empty_url) == head
    assert backend.peek("k", 10, 60).count == 3


def test_our_version_table_leaves_the_host_apps_alembic_history_alone(
    empty_url: str, head: str
) -> None:
    engine = sa.create_engine(_sa_url(empty_url), poolclass=sa.NullPool)
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE alembic_version (version_num VARCHAR(32) NOT NULL)"))
        conn.execute(sa.text("INSERT INTO alembic_version VALUES ('hostapp0042')"))

    quota.migrate(empty_url)

    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT version_num FROM alembic_version")).all() == [
            ("hostapp0042",)
        ]
        assert conn.execute(sa.text("SELECT version_num FROM quota_alembic_version")).all() == [
            (head,)
        ]
    engine.dispose()


def test_migrate_takes_a_sqlalchemy_connection_and_leaves_it_open(
    empty_url: str, head: str, open_backend: OpenBackend
) -> None:
    name = "postgresql-sync" if empty_url.startswith("postgresql") else "sqlite-sync"
    engine = sa.create_engine(_sa_url(empty_url), poolclass=sa.NullPool)
    try:
        with engine.connect() as conn:
            quota.migrate(conn)
            assert not conn.closed
            assert quota.current_revision(conn) == head
            conn.commit()
    finally:
        engine.dispose()

    assert quota.current_revision(empty_url) == head
    assert open_backend(name, empty_url).rate_limit("k", 1, 60).allowed


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
