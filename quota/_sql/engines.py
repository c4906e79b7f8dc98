"""Which PostgreSQL-compatible engine a migration runs on, and what of PostgreSQL's it lacks.

The migrations write PostgreSQL's DDL. A few of its clauses only tune
PostgreSQL's own heap (UNLOGGED, ``fillfactor`` and autovacuum storage
parameters) or spell out what another engine does by default (the ``"C"``
collation: CockroachDB compares strings bytewise already and refuses ``COLLATE
"C"`` on a column); on an engine without that heap they change nothing, so the
migrations leave them out there (`Engine`). Declarative partitioning is a
choice, not tuning: an engine without it is refused with a `ConfigurationError`.

The engine is read from ``SELECT version()`` on the migration's connection
(`engine_of`); offline (``quota migrate --sql``) there is none, and the SQL is
PostgreSQL's, as it always was.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from quota._core.errors import ConfigurationError

POSTGRESQL = "postgresql"
COCKROACHDB = "cockroachdb"
YUGABYTEDB = "yugabytedb"


@dataclass(frozen=True, slots=True)
class Engine:
    """What the migrations may use on one engine."""

    name: str
    unlogged: bool = True
    """``CREATE UNLOGGED TABLE`` means something (PostgreSQL's WAL is skipped)."""
    storage_parameters: bool = True
    """``fillfactor`` and the autovacuum parameters tune a heap this engine has."""
    c_collation: bool = True
    """A column may be declared ``COLLATE "C"``."""
    partitioning: bool = True
    """``CREATE TABLE … PARTITION BY RANGE`` / ``PARTITION OF``, and ``pg_inherits``."""


ENGINES = {
    POSTGRESQL: Engine(POSTGRESQL),
    # Bytewise string order by default; no PostgreSQL heap, WAL or declarative partitions.
    COCKROACHDB: Engine(
        COCKROACHDB,
        unlogged=False,
        storage_parameters=False,
        c_collation=False,
        partitioning=False,
    ),
    # PostgreSQL's query layer over its own storage: no PostgreSQL heap or WAL.
    YUGABYTEDB: Engine(YUGABYTEDB, unlogged=False, storage_parameters=False),
}


def detect(version: str | None) -> Engine:
    """The engine whose ``SELECT version()`` says `version` (None: offline, PostgreSQL)."""
    text = (version or "").lower()
    if "cockroachdb" in text:
        return ENGINES[COCKROACHDB]
    if "-yb-" in text or "yugabyte" in text:
        return ENGINES[YUGABYTEDB]
    return ENGINES[POSTGRESQL]


def engine_of(context: Any) -> Engine:
    """The engine an Alembic migration `context` (``alembic.context``) runs on.

    Offline, or on a dialect other than PostgreSQL, this asks nothing: PostgreSQL.
    """
    if context.is_offline_mode() or context.get_context().dialect.name != "postgresql":
        return ENGINES[POSTGRESQL]
    return detect(context.get_bind().exec_driver_sql("SELECT version()").scalar())


def check_partitioning(engine: Engine) -> None:
    """Refuse ``--partitioned-counters`` on an engine without declarative partitioning."""
    if not engine.partitioning:
        raise ConfigurationError(
            f"partitioned counters need PostgreSQL's declarative partitioning, which"
            f" {engine.name} does not have: migrate without --partitioned-counters"
        )
