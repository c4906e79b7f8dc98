"""Reserve, then settle: holds against durable quotas.

Revision ID: 0007_reservations
Revises: 0006_leases
Create Date: 2026-12-04

``quota_usage`` gains ``reserved`` (the units live reservations hold in the
period) and ``next_expiry`` (the earliest expiry among them; NULL when there
are none): a charge compares ``next_expiry`` with its own time, so it learns in
its one statement whether a hold is due to be released first. One row per
reservation in ``quota_reservations``, kept after it ends (settled or
released) so that a settle can be replayed; ledger retention deletes ended
ones with the ledger. The ledger gains the kinds ``reserve``, ``settle`` and
``release`` and the columns ``reservation_id`` and ``reserved``.

On SQLite the ledger's kind constraint is changed by copying the table (SQLite
cannot alter a constraint); its indexes are made again afterwards.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context, op

from quota._sql import engines as _engines

revision = "0007_reservations"
down_revision = "0006_leases"
branch_labels = None
depends_on = None

OLD_KINDS = ("consume", "deny", "refund", "grant", "rate_denied")
KINDS = (*OLD_KINDS, "reserve", "settle", "release")
HELD = "kind = 'consume' AND refunded_at IS NULL"
LIVE = "state = 'held'"
KEYED = "idempotency_key IS NOT NULL"


def _kinds(kinds: tuple[str, ...]) -> str:
    return "kind IN (" + ", ".join(f"'{k}'" for k in kinds) + ")"


def _sqlite_ledger(kinds: tuple[str, ...], *, reservations: bool) -> sa.Table:
    """The SQLite ledger as it stands before a table copy (batch mode copies from it
    rather than reflect it, so ``quota migrate --sql`` can print the copy too)."""
    columns = [
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("at", sa.Float, nullable=False),
        sa.Column("subject", sa.Text, nullable=False),
        sa.Column("name", sa.Text, nullable=False),
        sa.Column("kind", sa.Text, nullable=False),
        sa.Column("cost", sa.BigInteger, nullable=False),
        sa.Column("idempotency_key", sa.Text, nullable=True),
        sa.Column("period_start", sa.BigInteger, nullable=True),
        sa.Column("period_end", sa.BigInteger, nullable=True),
        sa.Column("quota_limit", sa.BigInteger, nullable=True),
        sa.Column("used", sa.BigInteger, nullable=True),
        sa.Column("remaining", sa.BigInteger, nullable=True),
        sa.Column("refunded_at", sa.Float, nullable=True),
    ]
    if reservations:
        columns += [
            sa.Column("reservation_id", sa.Text, nullable=True),
            sa.Column("reserved", sa.BigInteger, nullable=True),
        ]
    return sa.Table(
        "quota_ledger",
        sa.MetaData(),
        *columns,
        sa.CheckConstraint(_kinds(kinds), name="ck_quota_ledger_kind"),
    )


def _sqlite_ledger_indexes(create: bool) -> None:
    if not create:
        op.drop_index("uq_quota_ledger_idempotency", table_name="quota_ledger")
        op.drop_index("ix_quota_ledger_subject_at", table_name="quota_ledger")
        op.drop_index("ix_quota_ledger_at", table_name="quota_ledger")
        return
    op.create_index(
        "uq_quota_ledger_idempotency",
        "quota_ledger",
        ["subject", "name", "idempotency_key"],
        unique=True,
        sqlite_where=sa.text(HELD),
    )
    op.create_index("ix_quota_ledger_subject_at", "quota_ledger", ["subject", "at"])
    op.create_index("ix_quota_ledger_at", "quota_ledger", ["at"])


def upgrade() -> None:
    postgres = context.get_context().dialect.name == "postgresql"
    engine = _engines.engine_of(context)
    text = sa.Text(collation="C") if postgres and engine.c_collation else sa.Text()
    op.add_column(
        "quota_usage", sa.Column("reserved", sa.BigInteger, nullable=False, server_default="0")
    )
    op.add_column("quota_usage", sa.Column("next_expiry", sa.Float, nullable=True))
    if postgres:
        op.add_column("quota_ledger", sa.Column("reservation_id", text, nullable=True))
        op.add_column("quota_ledger", sa.Column("reserved", sa.BigInteger, nullable=True))
        op.drop_constraint("ck_quota_ledger_kind", "quota_ledger", type_="check")
        op.create_check_constraint("ck_quota_ledger_kind", "quota_ledger", _kinds(KINDS))
    else:
        # SQLite cannot alter a constraint: a copy of the table, its indexes made again.
        _sqlite_ledger_indexes(create=False)
        old = _sqlite_ledger(OLD_KINDS, reservations=False)
        with op.batch_alter_table("quota_ledger", recreate="always", copy_from=old) as batch:
            batch.add_column(sa.Column("reservation_id", sa.Text, nullable=True))
            batch.add_column(sa.Column("reserved", sa.BigInteger, nullable=True))
            batch.drop_constraint("ck_quota_ledger_kind", type_="check")
            batch.create_check_constraint("ck_quota_ledger_kind", _kinds(KINDS))
        _sqlite_ledger_indexes(create=True)
    op.create_table(
        "quota_reservations",
        sa.Column("id", text, nullable=False),
        sa.Column("subject", text, nullable=False),
        sa.Column("name", text, nullable=False),
        sa.Column("period_start", sa.BigInteger, nullable=False),
        sa.Column("period_end", sa.BigInteger, nullable=False),
        sa.Column("period", sa.Text, nullable=False),
        sa.Column("tz", sa.Text, nullable=True),
        sa.Column("quota_limit", sa.BigInteger, nullable=False),
        sa.Column("amount", sa.BigInteger, nullable=False),
        sa.Column("idempotency_key", text, nullable=True),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("expires_at", sa.Float, nullable=False),
        sa.Column("state", sa.Text, nullable=False),
        sa.Column("ended_at", sa.Float, nullable=True),
        sa.Column("outcome", sa.Text, nullable=True),
        # The thresholds its settle fires (comma-separated decimals), or NULL.
        sa.Column("thresholds", sa.Text, nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_quota_reservations"),
        sa.CheckConstraint(
            "state IN ('held', 'settled', 'released')", name="ck_quota_reservations_state"
        ),
    )
    # The live holds of one usage row, by expiry: its next_expiry, and the ones due.
    op.create_index(
        "ix_quota_reservations_live",
        "quota_reservations",
        ["subject", "name", "period_start", "expires_at"],
        sqlite_where=sa.text(LIVE),
        postgresql_where=sa.text(LIVE),
    )
    # `quota cleanup` finds the holds due anywhere; retention the ended ones.
    op.create_index("ix_quota_reservations_expires_at", "quota_reservations", ["expires_at"])
    op.create_index(
        "uq_quota_reservations_idempotency",
        "quota_reservations",
        ["subject", "name", "idempotency_key"],
        unique=True,
        sqlite_where=sa.text(KEYED),
        postgresql_where=sa.text(KEYED),
    )


def downgrade() -> None:
    op.drop_index("uq_quota_reservations_idempotency", table_name="quota_reservations")
    op.drop_index("ix_quota_reservations_expires_at", table_name="quota_reservations")
    op.drop_index("ix_quota_reservations_live", table_name="quota_reservations")
    op.drop_table("quota_reservations")
    # The old constraint would refuse the new kinds: their entries go with the revision
    # (the downgrade guard refuses while reservations, and so settles, are there).
    op.execute("DELETE FROM quota_ledger WHERE kind IN ('reserve', 'settle', 'release')")
    if context.get_context().dialect.name == "postgresql":
        op.drop_constraint("ck_quota_ledger_kind", "quota_ledger", type_="check")
        op.create_check_constraint("ck_quota_ledger_kind", "quota_ledger", _kinds(OLD_KINDS))
        op.drop_column("quota_ledger", "reserved")
        op.drop_column("quota_ledger", "reservation_id")
        op.drop_column("quota_usage", "next_expiry")
        op.drop_column("quota_usage", "reserved")
        return
    _sqlite_ledger_indexes(create=False)
    new = _sqlite_ledger(KINDS, reservations=True)
    with op.batch_alter_table("quota_ledger", recreate="always", copy_from=new) as batch:
        batch.drop_column("reserved")
        batch.drop_column("reservation_id")
        batch.drop_constraint("ck_quota_ledger_kind", type_="check")
        batch.create_check_constraint("ck_quota_ledger_kind", _kinds(OLD_KINDS))
    _sqlite_ledger_indexes(create=True)
    # SQLite 3.35+ drops a column in place.
    op.drop_column("quota_usage", "next_expiry")
    op.drop_column("quota_usage", "reserved")
