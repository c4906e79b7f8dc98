"""The tables `quota` owns, and the check that they are there and current.

The migrations in ``migrations/versions`` create these tables; nothing here
runs DDL. `metadata` mirrors them for Alembic's autogenerate and for readers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa

from quota._errors import SchemaError

#: Every revision this code knows, oldest first.
REVISIONS: tuple[str, ...] = ("0001_counters", "0002_quotas", "0003_algorithms", "0004_policies")
#: The revision this code needs at least.
REQUIRED = REVISIONS[-1]

metadata = sa.MetaData()

counters = sa.Table(
    "quota_counters",
    metadata,
    sa.Column("bucket_key", sa.Text, primary_key=True),
    sa.Column("client_key", sa.Text, nullable=False),
    sa.Column("window_start", sa.BigInteger, nullable=False),
    sa.Column("window_seconds", sa.Integer, nullable=False),
    sa.Column("count", sa.BigInteger, nullable=False),
    sa.Column("updated_at", sa.Float, nullable=False),
)

state = sa.Table(
    "quota_state",
    metadata,
    sa.Column("bucket_key", sa.Text, primary_key=True),
    sa.Column("client_key", sa.Text, nullable=False),
    sa.Column("window_seconds", sa.Integer, nullable=False),
    sa.Column("value", sa.Float, nullable=False),
    sa.Column("prev_value", sa.Float, nullable=False),
    sa.Column("stamp", sa.Float, nullable=False),
    sa.Column("allowed", sa.SmallInteger, nullable=False),
    sa.Column("expires_at", sa.Float, nullable=False),
)

#: Durable quotas (revision 0002_quotas): usage per period, and the ledger.
quota_usage = sa.Table(
    "quota_usage",
    metadata,
    sa.Column("subject", sa.Text, nullable=False),
    sa.Column("name", sa.Text, nullable=False),
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
)

quota_ledger = sa.Table(
    "quota_ledger",
    metadata,
    sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True),
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
    sa.CheckConstraint(
        "kind IN ('consume', 'deny', 'refund', 'grant', 'rate_denied')",
        name="ck_quota_ledger_kind",
    ),
    sa.Index(
        "uq_quota_ledger_idempotency",
        "subject",
        "name",
        "idempotency_key",
        unique=True,
        sqlite_where=sa.text("kind = 'consume' AND refunded_at IS NULL"),
        postgresql_where=sa.text("kind = 'consume' AND refunded_at IS NULL"),
    ),
    sa.Index("ix_quota_ledger_subject_at", "subject", "at"),
    sa.Index("ix_quota_ledger_at", "at"),
)

#: Runtime policy overrides of the HTTP layer (revision 0004_policies); see quota.http._runtime.
quota_policies = sa.Table(
    "quota_policies",
    metadata,
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


def migrate_hint(url: str | None = None) -> str:
    """The command that brings the schema up to date, for error messages (password hidden)."""
    from quota._url import redact

    return "quota migrate" + (f" --url '{redact(url)}'" if url else "")


def check_version(rows: Sequence[Sequence[Any]] | None, url: str | None = None) -> None:
    """Raise `SchemaError` unless `rows` (from the version table) show a current schema.

    `rows` is None when the version table does not exist. A revision this
    code does not know is taken as newer and accepted.
    """
    if rows is None or not rows:
        raise SchemaError(
            f"the quota tables are missing from this database; run `{migrate_hint(url)}`"
        )
    found = str(rows[0][0])
    if found in REVISIONS and REVISIONS.index(found) < REVISIONS.index(REQUIRED):
        raise SchemaError(
            f"the quota schema is at revision {found}, this code needs {REQUIRED};"
            f" run `{migrate_hint(url)}`"
        )
