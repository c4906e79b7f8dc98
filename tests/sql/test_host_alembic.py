"""quota inside a host app that has its own Alembic history (its own models ``users`` and
``orders``, its own ``alembic init`` environment), on SQLite and PostgreSQL.

The host's env.py is the one docs/deploying.md shows: quota's hooks keep autogenerate off quota's
tables, and ``quota.migrate(connection)`` runs quota's migrations in the host's single
``alembic upgrade head``, before or after the host's own.
"""

from __future__ import annotations

import textwrap
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic import command
from alembic.config import Config

import quota
from quota._sql.schema import REVISIONS

HOST_REVISION = '''
"""host: users and orders"""
import sqlalchemy as sa
from alembic import op

revision = "h0001"
down_revision = None


def upgrade():
    op.create_table("users", sa.Column("id", sa.Integer, primary_key=True),
                    sa.Column("name", sa.String(50), nullable=False))
    op.create_table("orders", sa.Column("id", sa.Integer, primary_key=True),
                    sa.Column("user_id", sa.Integer, sa.ForeignKey("users.id"), nullable=False))


def downgrade():
    op.drop_table("orders")
    op.drop_table("users")
'''

HOST_ENV = """
import os

import sqlalchemy as sa
from alembic import context

import quota
import quota.alembic

host = sa.MetaData()
sa.Table("users", host, sa.Column("id", sa.Integer, primary_key=True),
         sa.Column("name", sa.String(50), nullable=False))
sa.Table("orders", host, sa.Column("id", sa.Integer, primary_key=True),
         sa.Column("user_id", sa.Integer, sa.ForeignKey("users.id"), nullable=False))

QUOTA = os.environ.get("HOST_QUOTA_ORDER", "")  # "", "before" or "after"

engine = sa.create_engine(context.config.get_main_option("sqlalchemy.url"), poolclass=sa.NullPool)
with engine.connect() as connection:
    context.configure(
        connection=connection, target_metadata=host,
        include_name=quota.alembic.include_name,
    )
    with context.begin_transaction():
        if QUOTA == "before":
            quota.migrate(connection)
        context.run_migrations()
        if QUOTA == "after":
            quota.migrate(connection)
    connection.commit()
engine.dispose()
"""


def _host_app(tmp_path: Path, url: str) -> Config:
    """A host app's Alembic environment in `tmp_path`, on `url` (a SQLAlchemy URL)."""
    root = tmp_path / "host"
    (root / "versions").mkdir(parents=True)
    (root / "env.py").write_text(textwrap.dedent(HOST_ENV))
    (root / "script.py.mako").write_text(
        Path(command.__file__).parent.joinpath("templates/generic/script.py.mako").read_text()
    )
    (root / "versions" / "h0001_host.py").write_text(textwrap.dedent(HOST_REVISION))
    cfg = Config()
    cfg.set_main_option("script_location", str(root))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def _sqlalchemy_url(url: str) -> str:
    return (
        url if url.startswith("sqlite") else url.replace("postgresql://", "postgresql+psycopg://")
    )


def _tables(url: str) -> set[str]:
    engine = sa.create_engine(_sqlalchemy_url(url), poolclass=sa.NullPool)
    try:
        return set(sa.inspect(engine).get_table_names())
    finally:
        engine.dispose()


def _both_work(url: str) -> None:
    assert {"users", "orders", "alembic_version"} <= _tables(url)
    assert quota.current_revision(url) == REVISIONS[-1]
    with quota.connect(url) as limiter:
        assert limiter.rate_limit(f"host-{uuid.uuid4().hex}", 1, 60).allowed
        assert limiter.consume_quota(f"acme-{uuid.uuid4().hex}", "calls", 10, "day").allowed


@pytest.mark.parametrize("order", ["quota first", "host first"])
def test_the_two_commands_in_either_order(
    tmp_path: Path, sql_empty_url: str, order: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOST_QUOTA_ORDER", "")
    cfg = _host_app(tmp_path, _sqlalchemy_url(sql_empty_url))
    if order == "quota first":
        quota.migrate(sql_empty_url)
        command.upgrade(cfg, "head")
    else:
        command.upgrade(cfg, "head")
        quota.migrate(sql_empty_url)
    _both_work(sql_empty_url)


@pytest.mark.parametrize("order", ["before", "after"])
def test_the_env_py_recipe_runs_both_in_one_upgrade_twice(
    tmp_path: Path, sql_empty_url: str, order: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOST_QUOTA_ORDER", order)
    cfg = _host_app(tmp_path, _sqlalchemy_url(sql_empty_url))
    command.upgrade(cfg, "head")  # main: KeyError 'config' / the host's tables never made
    _both_work(sql_empty_url)
    command.upgrade(cfg, "head")  # and again: nothing to do, nothing breaks
    _both_work(sql_empty_url)
    # The host's own history is untouched by quota's: its version table says h0001.
    engine = sa.create_engine(_sqlalchemy_url(sql_empty_url), poolclass=sa.NullPool)
    try:
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT version_num FROM alembic_version")).all() == [
                ("h0001",)
            ]
    finally:
        engine.dispose()


def test_autogenerate_with_the_filter_proposes_nothing_for_quota(
    tmp_path: Path, sql_empty_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOST_QUOTA_ORDER", "after")
    cfg = _host_app(tmp_path, _sqlalchemy_url(sql_empty_url))
    command.upgrade(cfg, "head")
    script = command.revision(cfg, message="routine", autogenerate=True)
    assert script is not None and not isinstance(script, list)
    text = Path(script.path).read_text()
    upgrade = text.split("def upgrade()", 1)[1].split("def downgrade()", 1)[0]
    assert "quota" not in upgrade, upgrade
    assert "op." not in upgrade, upgrade  # the host's models match: an empty revision


def test_the_hooks_name_quota_tables_only() -> None:
    import quota.alembic as qa

    for table in ("quota_counters", "quota_usage", "quota_alembic_version", "quota_counters_p0"):
        assert qa.is_quota_table(table)
        assert not qa.include_name(table, "table", {})
    for table in ("users", "quota", "quotas", "my_quota_counters"):
        assert qa.include_name(table, "table", {})
    assert not qa.include_name("ix_x", "index", {"table_name": "quota_ledger"})
    assert qa.include_name("ix_x", "index", {"table_name": "orders"})
    assert not qa.include_object(
        sa.Table("quota_state", sa.MetaData()), "quota_state", "table", True, None
    )
