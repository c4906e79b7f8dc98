"""quota inside a host app's own Alembic: keep its tables out of your autogenerate.

quota's tables live beside yours but are migrated by quota (its own revisions
and its own version table, ``quota_alembic_version``). Your autogenerate
compares your models with the whole database, so without a filter it would
propose dropping quota's tables. Pass these hooks in your ``env.py``:

    import quota
    import quota.alembic

    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        include_name=quota.alembic.include_name,
    )
    with context.begin_transaction():
        context.run_migrations()
        quota.migrate(connection)  # quota's tables, in the same `alembic upgrade head`

`include_object` does the same for an ``include_object`` hook; to combine
with a filter of your own, call both (``quota.alembic.include_name(...) and
mine(...)``). `quota.migrate(connection)` may run before or after your own
migrations, and leaves your Alembic context as it found it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from quota._sql.schema import metadata
from quota._sql.statements import VERSION_TABLE

__all__ = ["TABLES", "include_name", "include_object", "is_quota_table"]

TABLES: frozenset[str] = frozenset(metadata.tables) | {VERSION_TABLE}
"""Every table quota's migrations create, its version table included."""
#: Partitions of a partitioned counters table (created by cleanup, not by a migration).
_PARTITION_PREFIX = "quota_counters_"


def is_quota_table(name: str | None) -> bool:
    """True for a table of quota's (or a partition of its counters table)."""
    return bool(name) and (name in TABLES or str(name).startswith(_PARTITION_PREFIX))


def include_name(name: str | None, type_: str, parent_names: Mapping[str, Any]) -> bool:
    """Alembic's ``include_name`` hook: False for quota's tables and everything on them."""
    if type_ == "table":
        return not is_quota_table(name)
    return not is_quota_table(parent_names.get("table_name"))


def include_object(
    obj: Any, name: str | None, type_: str, reflected: bool, compare_to: Any
) -> bool:
    """Alembic's ``include_object`` hook: False for quota's tables and everything on them."""
    if type_ == "table":
        return not is_quota_table(name)
    table = getattr(obj, "table", None)
    return not is_quota_table(getattr(table, "name", None))
