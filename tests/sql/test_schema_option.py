"""quota's tables in a PostgreSQL schema of the user's choice: ``?schema=NAME`` or
``schema=`` honoured by migrate, both faces, durable quotas, cleanup and downgrade."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import psycopg
import pytest
import sqlalchemy as sa

import quota
from quota._sql.schema import REVISIONS


def _tables(url: str, schema: str) -> set[str]:
    with psycopg.connect(url.split("?")[0], autocommit=True) as conn:
        rows = conn.execute(
            "SELECT tablename FROM pg_tables WHERE schemaname = %s", (schema,)
        ).fetchall()
    return {row[0] for row in rows}


@pytest.mark.postgres
def test_everything_runs_in_the_schema_the_url_names(pg_make_database: Callable[[], str]) -> None:
    plain = pg_make_database()
    url = plain + "?schema=limits"
    quota.migrate(url)
    assert {"quota_counters", "quota_usage", "quota_alembic_version"} <= _tables(plain, "limits")
    assert not {t for t in _tables(plain, "public") if t.startswith("quota_")}
    assert quota.current_revision(url) == REVISIONS[-1]
    assert quota.current_revision(plain) is None

    with quota.connect(url) as limiter:
        assert limiter.rate_limit("k", 2, 3600).count == 1
        assert limiter.consume_quota("acme", "calls", 10, "day", cost=3).allowed
        assert limiter.cleanup().deleted == 0

    async def async_face() -> int:
        async with quota.connect_async(plain, schema="limits") as limiter:
            return (await limiter.rate_limit("k", 2, 3600)).count

    assert asyncio.run(async_face()) == 2
    with psycopg.connect(plain, autocommit=True) as conn:
        assert conn.execute("SELECT sum(count) FROM limits.quota_counters").fetchone() == (2,)
        assert conn.execute("SELECT used FROM limits.quota_usage").fetchone() == (3,)

    # public holds no quota tables
    with pytest.raises(quota.SchemaError, match="quota migrate"), quota.connect(plain) as limiter:
        limiter.rate_limit("k", 2, 3600)

    with pytest.raises(quota.ConfigurationError, match="quota_usage"):
        quota.downgrade(url, revision="0001_counters")
    quota.downgrade(url, revision="base", drop_data=True)
    assert _tables(plain, "limits") == {"quota_alembic_version"}  # Alembic keeps it, empty


@pytest.mark.postgres
def test_migrate_on_a_host_connection_gives_its_search_path_back(
    pg_make_database: Callable[[], str],
) -> None:
    plain = pg_make_database()
    engine = sa.create_engine(plain.replace("postgresql://", "postgresql+psycopg://"))
    try:
        with engine.connect() as conn:
            quota.migrate(conn, schema="limits")
            assert conn.execute(sa.text("SHOW search_path")).scalar_one() == '"$user", public'
            conn.execute(sa.text("CREATE TABLE host_table (id int)"))  # the host's, in public
            conn.commit()
    finally:
        engine.dispose()
    assert "host_table" in _tables(plain, "public")
    assert quota.current_revision(plain, schema="limits") == REVISIONS[-1]


def test_bad_schemas_are_configuration_errors(tmp_path: object) -> None:
    for bad in ("", "a-b", 'x"; DROP TABLE y; --', "1abc", 7):
        with pytest.raises(quota.ConfigurationError, match="schema"):
            quota.connect("postgresql://u@h.invalid/db", schema=bad)  # type: ignore[arg-type]
    with pytest.raises(quota.ConfigurationError, match="schema"):
        quota.connect("postgresql://u@h.invalid/db?schema=a-b")
    with pytest.raises(quota.ConfigurationError, match="has no schemas"):
        quota.connect("sqlite:///x.db", schema="limits")
    with pytest.raises(quota.ConfigurationError, match="ALTER ROLE"):
        quota.connect("postgresql://u@h.invalid/db?schema=limits&prepared_statements=false")


@pytest.mark.postgres
def test_the_libpq_options_search_path_form_works_everywhere(
    pg_make_database: Callable[[], str],
) -> None:
    plain = pg_make_database()
    with psycopg.connect(plain, autocommit=True) as conn:
        conn.execute("CREATE SCHEMA limits")
    url = plain + "?options=-csearch_path%3Dlimits"
    quota.migrate(url)  # main: TypeError: connect() got an unexpected keyword argument 'options'
    assert "quota_counters" in _tables(plain, "limits")
    with quota.connect(url) as limiter:
        assert limiter.rate_limit("k", 2, 3600).allowed

    async def async_face() -> bool:
        async with quota.connect_async(url) as limiter:
            return (await limiter.rate_limit("k", 2, 3600)).allowed

    assert asyncio.run(async_face())
    assert all(f.severity != "error" for f in quota.diagnose(url)), quota.diagnose(url)
