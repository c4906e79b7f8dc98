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
REVISIONS: tuple[str, ...] = ("0001_counters",)
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


def migrate_hint(url: str | None = None) -> str:
    """The command that brings the schema up to date, for error messages."""
    return "quota migrate" + (f" --url '{url}'" if url else "")


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
