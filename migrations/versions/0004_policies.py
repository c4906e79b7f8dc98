"""Runtime policy overrides for the HTTP layer.

Revision ID: 0004_policies
Revises: 0003_algorithms
Create Date: 2026-11-29

One row per (route class, subject): ``*`` for the whole class, ``tier:<name>``,
``tenant:<id>``, or one caller's PII-free subject (``ip:<keyed hash>``,
``tok:<keyed hash>``, ``key:<key id>``). NULL columns keep the value the code
gives the class. The middlewares read the table through a short cache;
``quota policy list/set/delete`` edits it. A normal (logged) table: overrides
are configuration, not ephemeral counters.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004_policies"
down_revision = "0003_algorithms"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "quota_policies",
        sa.Column("route", sa.Text, nullable=False),
        sa.Column("subject", sa.Text, nullable=False, server_default="*"),
        sa.Column("rates", sa.Text, nullable=True),
        sa.Column("algorithm", sa.Text, nullable=True),
        sa.Column("cost", sa.Integer, nullable=True),
        sa.Column("fail_open", sa.Boolean, nullable=True),
        sa.Column("exempt", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.Column("note", sa.Text, nullable=True),
        sa.Column("updated_at", sa.Float, nullable=False),
        sa.PrimaryKeyConstraint("route", "subject", name="pk_quota_policies"),
        sa.CheckConstraint("cost IS NULL OR cost >= 1", name="ck_quota_policies_cost"),
    )


def downgrade() -> None:
    op.drop_table("quota_policies")
