"""Durable quotas: usage per period and an append-only ledger.

Revision ID: 0002_quotas
Revises: 0001_counters
Create Date: 2026-11-29

Both tables are ordinary logged tables on every database (never UNLOGGED,
whatever ``counters_logged`` says): a quota is money, and must survive a
crash. ``quota cleanup`` never touches them; ledger retention is its own,
explicit option.

``uq_quota_ledger_idempotency`` is a partial unique index: among the charges
(``kind = 'consume'``) not refunded, an idempotency key appears at most once
per (subject, name). A refund frees the key, so a retry of work that failed
and was refunded is charged again, once. SQLite 3.8+ and PostgreSQL both
support it, and both accept it as an ``ON CONFLICT`` target.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context, op

from quota._sql import engines as _engines

revision = "0002_quotas"
down_revision = "0001_counters"
branch_labels = None
depends_on = None

KINDS = ("consume", "deny", "refund", "grant", "rate_denied")
HELD = "kind = 'consume' AND refunded_at IS NULL"


def upgrade() -> None:
    postgres = context.get_context().dialect.name == "postgresql"
    engine = _engines.engine_of(context)
    # "C" collation: names compare as bytes, the fastest btree order on PostgreSQL.
    text = sa.Text(collation="C") if postgres and engine.c_collation else sa.Text()
    op.create_table(
        "quota_usage",
        sa.Column("subject", text, nullable=False),
        sa.Column("name", text, nullable=False),
        sa.Column("period_start", sa.BigInteger, nullable=False),
        sa.Column("period_end", sa.BigInteger, nullable=False),
        sa.Column("period", sa.Text, nullable=False),
        sa.Column("tz", sa.Text, nullable=True),
        sa.Column("quota_limit", sa.BigInteger, nullable=True),
        sa.Column("used", sa.BigInteger, nullable=False),
        sa.Column("granted", sa.BigInteger, nullable=False),
        sa.Column("updated_at", sa.Float, nullable=False),
        sa.PrimaryKeyConstraint("subject", "name", "period_start", name="pk_quota_usage"),
        sa.CheckConstraint("used >= 0", name="ck_quota_usage_used"),
        sa.CheckConstraint("granted >= 0", name="ck_quota_usage_granted"),
        sqlite_with_rowid=False,
    )
    op.create_table(
        "quota_ledger",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            primary_key=True,
            autoincrement=True,
        ),
        sa.Column("at", sa.Float, nullable=False),
        sa.Column("subject", text, nullable=False),
        sa.Column("name", text, nullable=False),
        sa.Column("kind", sa.Text, nullable=False),
        sa.Column("cost", sa.BigInteger, nullable=False),
        sa.Column("idempotency_key", text, nullable=True),
        sa.Column("period_start", sa.BigInteger, nullable=True),
        sa.Column("period_end", sa.BigInteger, nullable=True),
        sa.Column("quota_limit", sa.BigInteger, nullable=True),
        sa.Column("used", sa.BigInteger, nullable=True),
        sa.Column("remaining", sa.BigInteger, nullable=True),
        sa.Column("refunded_at", sa.Float, nullable=True),
        sa.CheckConstraint(
            "kind IN (" + ", ".join(f"'{k}'" for k in KINDS) + ")", name="ck_quota_ledger_kind"
        ),
    )
    op.create_index(
        "uq_quota_ledger_idempotency",
        "quota_ledger",
        ["subject", "name", "idempotency_key"],
        unique=True,
        sqlite_where=sa.text(HELD),
        postgresql_where=sa.text(HELD),
    )
    # `quota ledger SUBJECT --since`, and retention by age.
    op.create_index("ix_quota_ledger_subject_at", "quota_ledger", ["subject", "at"])
    op.create_index("ix_quota_ledger_at", "quota_ledger", ["at"])
    if postgres and engine.storage_parameters:
        # Room on each page so a usage update stays HOT (its key never changes).
        op.execute("ALTER TABLE quota_usage SET (fillfactor = 80)")


def downgrade() -> None:
    op.drop_index("ix_quota_ledger_at", table_name="quota_ledger")
    op.drop_index("ix_quota_ledger_subject_at", table_name="quota_ledger")
    op.drop_index("uq_quota_ledger_idempotency", table_name="quota_ledger")
    op.drop_table("quota_ledger")
    op.drop_table("quota_usage")
