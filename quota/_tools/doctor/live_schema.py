"""Reading the live schema: the quota tables of a SQLite or PostgreSQL database as they
are, as `quota._sql.schema.TableShape` values the drift check compares."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from quota._sql.schema import ColumnShape, IndexShape, TableShape, normalize_sql
from quota._tools.doctor.base import Query


def _sqlite_quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def split_top_level(text: str) -> list[str]:
    """`text` split at the commas outside parentheses."""
    parts, depth, current = [], 0, ""
    for char in text:
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
            continue
        depth += (char == "(") - (char == ")")
        current += char
    return [*parts, current]


def closing(text: str, opened: int) -> int | None:
    """Where the parenthesis opened at `opened` closes."""
    depth = 0
    for at in range(max(opened, 0), len(text)):
        depth += (text[at] == "(") - (text[at] == ")")
        if depth == 0:
            return at
    return None


def sqlite_index_shape(name: str, sql: str, unique: bool) -> IndexShape | None:
    """An index from its ``CREATE INDEX`` in ``sqlite_master`` (None when it cannot be read)."""
    match = re.search(r"\sON\s+(\"[^\"]+\"|[^\s(]+)\s*\(", sql, re.IGNORECASE)
    if not match:
        return None
    opened = match.end() - 1
    end = closing(sql, opened)
    if end is None:
        return None
    keys = tuple(normalize_sql(k) for k in split_top_level(sql[opened + 1 : end]))
    where = re.match(r"\s*WHERE\s+(.*)$", sql[end + 1 :], re.IGNORECASE | re.DOTALL)
    return IndexShape(name, keys, unique, normalize_sql(where[1]) if where else "")


def sqlite_schema(query: Query, tables: Sequence[str]) -> dict[str, TableShape]:
    """The `tables` that exist in a SQLite database, as they are."""
    master = {
        (str(kind), str(name)): (str(table), str(sql or ""))
        for kind, name, table, sql in query("SELECT type, name, tbl_name, sql FROM sqlite_master")
    }
    shapes = {}
    for table in tables:
        if ("table", table) not in master:
            continue
        info = query(f"PRAGMA table_info({_sqlite_quote(table)})")
        rowless = bool(re.search(r"\)\s*WITHOUT\s+ROWID\s*$", master[("table", table)][1], re.I))
        # A WITHOUT ROWID table's key columns are NOT NULL, declared so or not.
        columns = tuple(
            ColumnShape(
                str(name), " ".join(str(type_).upper().split()),
                not notnull and not (pk and rowless), has_default=default is not None,
            )
            for _cid, name, type_, notnull, default, pk in info
        )  # fmt: skip
        primary_key = tuple(str(row[1]) for row in sorted(info, key=lambda r: r[5]) if row[5])
        indexes = []
        for _seq, name, unique, origin, _partial in query(
            f"PRAGMA index_list({_sqlite_quote(table)})"
        ):
            if origin == "pk":
                continue
            sql = master.get(("index", str(name)), ("", ""))[1]
            shape = sqlite_index_shape(str(name), sql, bool(unique)) if sql else None
            if shape is None:  # a UNIQUE constraint of the table: its columns only
                keys = query(f"PRAGMA index_info({_sqlite_quote(str(name))})")
                shape = IndexShape(str(name), tuple(str(k[2]) for k in keys), bool(unique))
            indexes.append(shape)
        shapes[table] = TableShape(
            table, columns, primary_key, tuple(indexes), without_rowid=rowless
        )
    return shapes


#: Per table: its kind, its persistence (a partitioned table's: its DEFAULT partition's, else
#: any partition's) and its DEFAULT partition.
_PG_TABLES = (
    "SELECT t.name, c.relkind, coalesce(d.relpersistence, c.relpersistence),"
    " CASE WHEN d.is_default THEN d.relname END"
    " FROM unnest(%s::text[]) AS t(name) JOIN pg_class c ON c.oid = to_regclass(t.name)"
    " LEFT JOIN LATERAL (SELECT p.relname::text, p.relpersistence,"
    "  pg_get_expr(p.relpartbound, p.oid) = 'DEFAULT' AS is_default"
    "  FROM pg_inherits i JOIN pg_class p ON p.oid = i.inhrelid WHERE i.inhparent = c.oid"
    "  ORDER BY 3 DESC LIMIT 1) d ON true"
)
_PG_COLUMNS = (
    "SELECT c.relname, a.attname, format_type(a.atttypid, a.atttypmod), NOT a.attnotnull,"
    " CASE WHEN a.attcollation <> y.typcollation THEN l.collname END, a.atthasdef"
    " FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid"
    " JOIN pg_type y ON y.oid = a.atttypid LEFT JOIN pg_collation l ON l.oid = a.attcollation"
    " WHERE a.attrelid IN (SELECT to_regclass(n) FROM unnest(%s::text[]) AS n)"
    " AND a.attnum > 0 AND NOT a.attisdropped ORDER BY c.relname, a.attnum"
)
_PG_INDEXES = (
    "SELECT c.relname, i.relname, x.indisunique, x.indisprimary, x.indisvalid,"
    " ARRAY(SELECT pg_get_indexdef(x.indexrelid, k, true)"
    "  FROM generate_series(1, x.indnkeyatts) AS k ORDER BY k),"
    " pg_get_expr(x.indpred, x.indrelid, true)"
    " FROM pg_index x JOIN pg_class i ON i.oid = x.indexrelid JOIN pg_class c ON c.oid = x.indrelid"
    " WHERE x.indrelid IN (SELECT to_regclass(n) FROM unnest(%s::text[]) AS n)"
    " ORDER BY c.relname, i.relname"
)


def postgres_schema(
    query: Callable[..., Sequence[Sequence[Any]]], tables: Sequence[str]
) -> dict[str, TableShape]:
    """The `tables` that exist in a PostgreSQL database (on its search path), as they are."""
    names = list(tables)
    found = {str(r[0]): r for r in query(_PG_TABLES, (names,))}
    columns: dict[str, list[ColumnShape]] = {}
    for table, name, type_, nullable, collation, default in query(_PG_COLUMNS, (names,)):
        columns.setdefault(str(table), []).append(
            ColumnShape(str(name), str(type_), bool(nullable), collation, bool(default))
        )
    indexes: dict[str, list[IndexShape]] = {}
    primary: dict[str, tuple[str, tuple[str, ...]]] = {}
    for table, name, unique, is_primary, valid, keys, where in query(_PG_INDEXES, (names,)):
        normalized = tuple(normalize_sql(str(k)) for k in keys)
        if is_primary:
            primary[str(table)] = (str(name), normalized)
            continue
        indexes.setdefault(str(table), []).append(
            IndexShape(
                str(name), normalized, bool(unique), normalize_sql(str(where or "")), bool(valid)
            )
        )
    shapes = {}
    for table, (_, relkind, persistence, default) in found.items():
        pk_name, pk = primary.get(table, ("", ()))
        shapes[table] = TableShape(
            table, tuple(columns.get(table, ())), pk, tuple(indexes.get(table, ())),
            primary_key_name=pk_name, partitioned=relkind == "p",
            unlogged=persistence == "u", default_partition=str(default or ""),
        )  # fmt: skip
    return shapes
