"""Runtime settings for the HTTP layer: tier multipliers and the abuse alert threshold.

Revision ID: 0005_settings
Revises: 0004_policies
Create Date: 2026-12-06

One row per setting: ``tier_multiplier.<tier>`` (a number, the scale of that
tier's limits) or ``abuse_threshold`` (a whole number, 0 for no alerts). A
NULL value is a deletion: the setting is back to the value the code gives it
(the row stays a while, stamped, so every middleware drops the setting at the
same moment). The middlewares read the table with ``quota_policies``;
``quota policy multiplier/abuse-threshold/settings/unset`` edits it. A
normal (logged) table: settings are configuration, not ephemeral counters.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005_settings"
down_revision = "0004_policies"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "quota_settings",
        sa.Column("name", sa.Text, nullable=False),
        sa.Column("value", sa.Text, nullable=True),
        sa.Column("note", sa.Text, nullable=True),
        sa.Column("updated_at", sa.Float, nullable=False),
        sa.PrimaryKeyConstraint("name", name="pk_quota_settings"),
    )


def downgrade() -> None:
    op.drop_table("quota_settings")
