"""SQL text of every statement a store runs, written once with ``?`` placeholders.

Each store renders these into its driver's parameter style once, at start-up
(``$1`` for asyncpg, ``%s`` for psycopg, ``?`` stays for sqlite3). The hot
statement is the same on SQLite and PostgreSQL: one ``INSERT … ON CONFLICT …
DO UPDATE … RETURNING``, so a decision is one atomic round trip.
"""

from __future__ import annotations

import functools
import re

COUNTERS = "quota_counters"
VERSION_TABLE = "quota_alembic_version"

#: Increment a window's counter by the hit's cost and return the new count.
#: Params: bucket_key, client_key, window_start, window_seconds, cost, updated_at.
HIT = (
    "INSERT INTO quota_counters"
    " (bucket_key, client_key, window_start, window_seconds, count, updated_at)"
    " VALUES (?, ?, ?, ?, ?, ?)"
    " ON CONFLICT (bucket_key) DO UPDATE"
    " SET count = quota_counters.count + excluded.count, updated_at = excluded.updated_at"
    " RETURNING count"
)

#: As HIT, but a hit that would take the count over the limit is not counted:
#: the row is left alone and no row comes back. Extra last param: limit.
HIT_CAPPED = (
    "INSERT INTO quota_counters"
    " (bucket_key, client_key, window_start, window_seconds, count, updated_at)"
    " VALUES (?, ?, ?, ?, ?, ?)"
    " ON CONFLICT (bucket_key) DO UPDATE"
    " SET count = quota_counters.count + excluded.count, updated_at = excluded.updated_at"
    " WHERE quota_counters.count + excluded.count <= ?"
    " RETURNING count"
)

#: Params: bucket_key.
PEEK = "SELECT count FROM quota_counters WHERE bucket_key = ?"

#: Every statement that deletes returns one row per row deleted, so the
#: count comes back the same way from every driver.
#: Params: client_key.
RESET_ALL = "DELETE FROM quota_counters WHERE client_key = ? RETURNING 1"
#: Params: client_key, window_seconds.
RESET_WINDOW = "DELETE FROM quota_counters WHERE client_key = ? AND window_seconds = ? RETURNING 1"

#: Windows that ended before a cutoff. The expression matches the index
#: ``ix_quota_counters_window_end`` exactly, so the planner uses it.
_EXPIRED = "(window_start + window_seconds) < ?"
#: Params: cutoff.
COUNT_EXPIRED = f"SELECT count(*) FROM quota_counters WHERE {_EXPIRED}"
#: Params: cutoff, batch size.
DELETE_EXPIRED = (
    "DELETE FROM quota_counters WHERE bucket_key IN"
    f" (SELECT bucket_key FROM quota_counters WHERE {_EXPIRED} LIMIT ?)"
    " RETURNING 1"
)

#: The busiest keys in windows still running. Params: now, limit.
TOP = (
    "SELECT client_key, window_seconds, window_start, count FROM quota_counters"
    " WHERE (window_start + window_seconds) > ? ORDER BY count DESC, client_key LIMIT ?"
)

SCHEMA_VERSION = f"SELECT version_num FROM {VERSION_TABLE}"

#: PostgreSQL only: one cleanup at a time across every app instance.
#: The lock id is the first 8 bytes of sha256("quota.cleanup"), fixed forever.
CLEANUP_LOCK_ID = 0x3A1F_4C2B_9D0E_7A65 - 2**63
PG_TRY_LOCK = "SELECT pg_try_advisory_lock(?)"
PG_UNLOCK = "SELECT pg_advisory_unlock(?)"

_PLACEHOLDER = re.compile(r"\?")


@functools.cache
def render(text: str, style: str) -> str:
    """`text` with its ``?`` placeholders in the driver's `style`.

    Styles: ``qmark`` (sqlite3, aiosqlite), ``format`` (psycopg),
    ``numeric_dollar`` (asyncpg). Cached: each statement is rendered once.
    """
    if style == "qmark":
        return text
    if style == "format":
        return _PLACEHOLDER.sub("%s", text)
    if style == "numeric_dollar":
        counter = iter(range(1, 1000))
        return _PLACEHOLDER.sub(lambda _m: f"${next(counter)}", text)
    raise ValueError(f"unknown placeholder style {style!r}")  # pragma: no cover
