"""Usage thresholds: an outbox of the events a quota's thresholds fire.

Revision ID: 0008_thresholds
Revises: 0007_reservations
Create Date: 2026-12-04

One row per time a threshold of a quota fired in a period (``consume_quota(...,
thresholds=...)``, a `quota.QuotaLimit` with thresholds), written in the same
transaction as the charge that crossed it. ``uq_quota_events_armed`` is a partial
unique index: among the events not re-armed (``rearmed_at IS NULL``) a (subject,
quota, period start, threshold) appears at most once, so concurrent charges fire a
threshold exactly once; a refund or grant that takes usage back below it sets
``rearmed_at``, and the threshold may fire again. The delivery columns are the
webhook worker's (``quota notify``): ``claimed_until`` is both a claim's lease and
the time a failed delivery is tried again. A normal (logged) table: an event is
owed to someone until it is delivered.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context, op

from quota._sql import engines as _engines

revision = "0008_thresholds"
down_revision = "0007_reservations"
branch_labels = None
depends_on = None

ARMED = "rearmed_at IS NULL"
UNDELIVERED = "delivered_at IS NULL"


def upgrade() -> None:
    postgres = context.get_context().dialect.name == "postgresql"
    engine = _engines.engine_of(context)
    text = sa.Text(collation="C") if postgres and engine.c_collation else sa.Text()
    op.create_table(
        "quota_events",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            primary_key=True,
            autoincrement=True,
        ),
        sa.Column("subject", text, nullable=False),
        sa.Column("quota", text, nullable=False),
        sa.Column("period_start", sa.BigInteger, nullable=False),
        sa.Column("threshold", sa.Text, nullable=False),
        sa.Column("used", sa.BigInteger, nullable=False),
        sa.Column("quota_limit", sa.BigInteger, nullable=False),
        sa.Column("at", sa.Float, nullable=False),
        sa.Column("rearmed_at", sa.Float, nullable=True),
        sa.Column("delivered_at", sa.Float, nullable=True),
        sa.Column("attempts", sa.Integer, nullable=False),
        sa.Column("claimed_until", sa.Float, nullable=True),
        sa.Column("claimed_by", sa.Text, nullable=True),
        sa.Column("last_error", sa.Text, nullable=True),
    )
    op.create_index(
        "uq_quota_events_armed",
        "quota_events",
        ["subject", "quota", "period_start", "threshold"],
        unique=True,
        sqlite_where=sa.text(ARMED),
        postgresql_where=sa.text(ARMED),
    )
    op.create_index(
        "ix_quota_events_undelivered",
        "quota_events",
        ["id"],
        sqlite_where=sa.text(UNDELIVERED),
        postgresql_where=sa.text(UNDELIVERED),
    )
    op.create_index("ix_quota_events_delivered_at", "quota_events", ["delivered_at"])


def downgrade() -> None:
    op.drop_index("ix_quota_events_delivered_at", table_name="quota_events")
    op.drop_index("ix_quota_events_undelivered", table_name="quota_events")
    op.drop_index("uq_quota_events_armed", table_name="quota_events")
    op.drop_table("quota_events")
