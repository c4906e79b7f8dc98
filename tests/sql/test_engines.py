"""PostgreSQL-compatible engines: detection, and what the migrations leave out on each.

The PostgreSQL path is held to a golden copy of its offline SQL
(``tests/golden/``, rendered by ``quota migrate --sql`` before the migrations
learnt about other engines); the other engines' path is rendered offline with
the detection answered as that engine would answer ``SELECT version()``.
"""

from __future__ import annotations

import io
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import quota
from quota._sql import engines

GOLDEN = Path(__file__).parents[1] / "golden"
URL = "postgresql://u@localhost/db"

VERSIONS = {
    "PostgreSQL 15.20 (Debian 15.20-0+deb12u1) on x86_64-pc-linux-gnu, compiled by gcc 12.2.0,"
    " 64-bit": engines.POSTGRESQL,
    "PostgreSQL 16.4 on aarch64-unknown-linux-gnu, compiled by clang, 64-bit": engines.POSTGRESQL,
    "CockroachDB CCL v23.1.11 (x86_64-pc-linux-gnu, built 2023/09/27 01:53:43, go1.19.10)":
        engines.COCKROACHDB,
    "PostgreSQL 11.2-YB-2.20.1.0-b0 on x86_64-pc-linux-gnu, compiled by clang version 16.0.6,"
    " 64-bit": engines.YUGABYTEDB,
    "PostgreSQL 15.2-YB-2025.1.0.0-b0 on x86_64-pc-linux-gnu": engines.YUGABYTEDB,
}  # fmt: skip


@pytest.mark.parametrize("version", list(VERSIONS))
def test_detect_reads_the_version_string(version: str) -> None:
    assert engines.detect(version).name == VERSIONS[version]


def test_offline_is_postgresql() -> None:
    assert engines.detect(None) == engines.ENGINES[engines.POSTGRESQL]


def test_postgresql_keeps_every_feature() -> None:
    pg = engines.ENGINES[engines.POSTGRESQL]
    assert (pg.unlogged, pg.storage_parameters, pg.c_collation, pg.partitioning) == (
        True, True, True, True,
    )  # fmt: skip


class _Bind:
    def __init__(self, version: str) -> None:
        self.version = version
        self.sent: list[str] = []

    def exec_driver_sql(self, sql: str) -> Any:
        self.sent.append(sql)
        return SimpleNamespace(scalar=lambda: self.version)


def _context(dialect: str, offline: bool, bind: _Bind) -> Any:
    migration = SimpleNamespace(dialect=SimpleNamespace(name=dialect))
    return SimpleNamespace(
        is_offline_mode=lambda: offline, get_context=lambda: migration, get_bind=lambda: bind
    )


@pytest.mark.parametrize("version", list(VERSIONS))
def test_engine_of_asks_the_connection_online(version: str) -> None:
    bind = _Bind(version)
    assert engines.engine_of(_context("postgresql", False, bind)).name == VERSIONS[version]
    assert bind.sent == ["SELECT version()"]


@pytest.mark.parametrize(("dialect", "offline"), [("postgresql", True), ("sqlite", False)])
def test_engine_of_asks_nothing_offline_or_on_sqlite(dialect: str, offline: bool) -> None:
    bind = _Bind("CockroachDB CCL v23.1.11")
    assert engines.engine_of(_context(dialect, offline, bind)).name == engines.POSTGRESQL
    assert bind.sent == []


def _offline_sql(**options: bool) -> str:
    out = io.StringIO()
    quota.migrate(URL, sql=True, output=out, **options)
    return out.getvalue()


@pytest.mark.parametrize(
    ("options", "golden"),
    [({}, "postgresql_offline.sql"), ({"counters_logged": True}, "postgresql_offline_logged.sql")],
)
def test_postgresql_sql_is_unchanged(options: dict[str, bool], golden: str) -> None:
    assert _offline_sql(**options) == (GOLDEN / golden).read_text()


def _as(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    monkeypatch.setattr(engines, "engine_of", lambda _context: engines.ENGINES[name])


def test_cockroachdb_leaves_out_what_it_lacks(monkeypatch: pytest.MonkeyPatch) -> None:
    _as(monkeypatch, engines.COCKROACHDB)
    sql = _offline_sql()
    assert "UNLOGGED" not in sql
    assert 'COLLATE "C"' not in sql
    assert "fillfactor" not in sql and "autovacuum" not in sql
    # Everything else is as on PostgreSQL: same tables, indexes and statements otherwise.
    golden = (GOLDEN / "postgresql_offline.sql").read_text()
    assert sql.count("CREATE TABLE") == golden.count("CREATE TABLE") + 2  # UNLOGGED ones
    assert sql.count("CREATE INDEX") == golden.count("CREATE INDEX")
    assert sql.count("CREATE UNIQUE INDEX") == golden.count("CREATE UNIQUE INDEX")


def test_yugabytedb_keeps_the_c_collation(monkeypatch: pytest.MonkeyPatch) -> None:
    _as(monkeypatch, engines.YUGABYTEDB)
    sql = _offline_sql()
    assert "UNLOGGED" not in sql and "fillfactor" not in sql
    assert sql.count('COLLATE "C"') == (GOLDEN / "postgresql_offline.sql").read_text().count(
        'COLLATE "C"'
    )


def test_partitioned_counters_are_refused_without_partitioning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _as(monkeypatch, engines.COCKROACHDB)
    with pytest.raises(quota.ConfigurationError, match="--partitioned-counters"):
        _offline_sql(counters_partitioned=True)
