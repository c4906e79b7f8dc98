"""State table for the sliding window, token bucket and GCRA algorithms.

Revision ID: 0003_algorithms
Revises: 0002_quotas
Create Date: 2026-11-29

One row per (algorithm, window length, key), updated in place by one atomic
statement per decision. Ephemeral like the counters: UNLOGGED on PostgreSQL
unless migrated with ``-x counters_logged=true`` (``quota migrate
--logged-counters``), with the same fillfactor for HOT updates. `expires_at`
is when a row has become the same as no row at all; cleanup deletes by it
(through an index on PostgreSQL only; see upgrade()).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context, op

from quota._sql import engines as _engines
from quota._sql.migrate import OPTION_COUNTERS_LOGGED, option

revision = "0003_algorithms"
down_revision = "0002_quotas"
branch_labels = None
depends_on = None


def upgrade() -> None:
    postgres = context.get_context().dialect.name == "postgresql"
    engine = _engines.engine_of(context)
    logged = option(context, OPTION_COUNTERS_LOGGED) or not engine.unlogged
    key = sa.Text(collation="C") if postgres and engine.c_collation else sa.Text()
    op.create_table(
        "quota_state",
        sa.Column("bucket_key", key, primary_key=True),
        sa.Column("client_key", key, nullable=False),
        sa.Column("window_seconds", sa.Integer, nullable=False),
        sa.Column("value", sa.Float, nullable=False),
        sa.Column("prev_value", sa.Float, nullable=False),
        sa.Column("stamp", sa.Float, nullable=False),
        sa.Column("allowed", sa.SmallInteger, nullable=False),
        sa.Column("expires_at", sa.Float, nullable=False),
        prefixes=["UNLOGGED"] if postgres and not logged else [],
        sqlite_with_rowid=False,
    )
    if postgres:
        # Cleanup's index. Expiry is rounded up to the hour, so an update
        # almost never changes it and PostgreSQL keeps updates HOT. SQLite
        # rewrites an index entry whenever its column is SET, equal or not
        # (measured: 20 µs of a 60 µs decision), so there cleanup scans
        # instead: the state table holds one row per active key.
        op.create_index("ix_quota_state_expires_at", "quota_state", ["expires_at"])
    if postgres and engine.storage_parameters:
        op.execute(
            "ALTER TABLE quota_state SET (fillfactor = 70,"
            " autovacuum_vacuum_scale_factor = 0.05, autovacuum_analyze_scale_factor = 0.05)"
        )


def downgrade() -> None:
    if context.get_context().dialect.name == "postgresql":
        op.drop_index("ix_quota_state_expires_at", table_name="quota_state")
    op.drop_table("quota_state")
