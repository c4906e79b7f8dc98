"""Concurrency leases: at most N holders of a key at once, across processes and hosts.

Revision ID: 0006_leases
Revises: 0005_settings
Create Date: 2026-12-03

One row per slot of a key while it is held (``Limiter.concurrency``): slots are
numbered 0..limit-1 and the primary key (lease_key, slot) is what keeps two
sessions taking a slot at the same moment from both getting the same one. A
holder renews its row's `expires_at` while inside its block; a row whose
expiry passed is a free slot (the next taker overwrites it, ``quota cleanup``
deletes it). A normal (logged) table on PostgreSQL: a crash must not free the
slots of holders still inside their blocks.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context, op

from quota._sql import engines as _engines

revision = "0006_leases"
down_revision = "0005_settings"
branch_labels = None
depends_on = None


def upgrade() -> None:
    postgres = context.get_context().dialect.name == "postgresql"
    engine = _engines.engine_of(context)
    key = sa.Text(collation="C") if postgres and engine.c_collation else sa.Text()
    op.create_table(
        "quota_leases",
        sa.Column("lease_key", key, nullable=False),
        sa.Column("slot", sa.Integer, nullable=False),
        sa.Column("holder", sa.Text, nullable=False),
        sa.Column("slots", sa.Integer, nullable=False),
        sa.Column("acquired_at", sa.Float, nullable=False),
        sa.Column("expires_at", sa.Float, nullable=False),
        sa.PrimaryKeyConstraint("lease_key", "slot", name="pk_quota_leases"),
        sqlite_with_rowid=False,
    )
    op.create_index("ix_quota_leases_expires_at", "quota_leases", ["expires_at"])


def downgrade() -> None:
    op.drop_index("ix_quota_leases_expires_at", table_name="quota_leases")
    op.drop_table("quota_leases")
