"""Counters table for fixed rate windows.

Revision ID: 0001_counters
Revises:
Create Date: 2026-11-29

One row per (window length, window start, key). On PostgreSQL the table is
UNLOGGED: counters are ephemeral, writes skip the WAL, and a database crash
(not a clean restart) empties the table, which hands every client a fresh
window once. Run with ``-x counters_logged=true`` (``quota migrate
--logged-counters``) to keep it a normal table. A fillfactor below 100 leaves
room on each page so count updates stay HOT (no index update per hit).

With ``-x counters_partitioned=true`` (``quota migrate --partitioned-counters``)
the PostgreSQL table is range-partitioned by window start instead, with the
partitions of the hour behind and the day ahead; see `quota._sql.partitions`.
"""

from __future__ import annotations

import time

import sqlalchemy as sa
from alembic import context, op

from quota._sql import engines as _engines
from quota._sql import partitions as _partitions
from quota._sql.migrate import OPTION_COUNTERS_LOGGED, OPTION_COUNTERS_PARTITIONED, option

revision = "0001_counters"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    postgres = context.get_context().dialect.name == "postgresql"
    engine = _engines.engine_of(context)
    logged = option(context, OPTION_COUNTERS_LOGGED) or not engine.unlogged
    if postgres and option(context, OPTION_COUNTERS_PARTITIONED):
        _engines.check_partitioning(engine)
        for statement in _partitions.create_table_sql(logged):
            op.execute(statement)
        now = time.time()
        for start in _partitions.starts_between(now - _partitions.BEHIND, now + _partitions.AHEAD):
            op.execute(_partitions.create_partition_sql(start, logged))
        return
    # "C" collation: keys compare as bytes, the fastest btree order on PostgreSQL.
    key = sa.Text(collation="C") if postgres and engine.c_collation else sa.Text()
    op.create_table(
        "quota_counters",
        sa.Column("bucket_key", key, primary_key=True),
        sa.Column("client_key", key, nullable=False),
        sa.Column("window_start", sa.BigInteger, nullable=False),
        sa.Column("window_seconds", sa.Integer, nullable=False),
        sa.Column("count", sa.BigInteger, nullable=False),
        sa.Column("updated_at", sa.Float, nullable=False),
        prefixes=["UNLOGGED"] if postgres and not logged else [],
        sqlite_with_rowid=False,
    )
    # Cleanup deletes by window end; the statement uses this exact expression.
    op.create_index(
        "ix_quota_counters_window_end",
        "quota_counters",
        [sa.text("(window_start + window_seconds)")],
    )
    if postgres and engine.storage_parameters:
        op.execute(
            "ALTER TABLE quota_counters SET (fillfactor = 70,"
            " autovacuum_vacuum_scale_factor = 0.05, autovacuum_analyze_scale_factor = 0.05)"
        )


def downgrade() -> None:
    op.drop_index("ix_quota_counters_window_end", table_name="quota_counters")
    op.drop_table("quota_counters")
