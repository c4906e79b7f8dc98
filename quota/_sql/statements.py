"""Every statement a store runs: a `Statement`, SQL text under a stable name.

SQL stores render the text into their driver's parameter style once
(`Binder`: ``$1`` for asyncpg, ``%s`` for psycopg, ``?`` stays for sqlite3);
the memory and Redis stores run no SQL and look the statement's `name` up in
a table of handlers. The hot statement is the same on SQLite and PostgreSQL:
one ``INSERT … ON CONFLICT … DO UPDATE … RETURNING``, so a decision is one
atomic round trip.
"""

from __future__ import annotations

import functools
import operator
import re
from collections.abc import Callable, Sequence
from typing import Any

#: A ``:name`` parameter marker (not a ``::cast``).
_NAMED_PARAM = re.compile(r"(?<![:\w]):([a-z_]+)")


class Statement(str):
    """One statement: its SQL text, a stable `name`, and how its parameters are passed.

    Parameters always come as a tuple. With no `names`, the text marks them
    ``?`` and the tuple is in their order. With `names`, the text marks them
    ``:name`` (a name may be used several times) and the tuple is in the order
    of `names`; SQL stores compile it per driver (`compile_named`), stores
    without SQL read the parameters by name (`as_dict`).

    Stores use `name` and `sql`, never the text as a string: a statement is
    a `str` only so that code handing a constant straight to a driver (the
    bench's bare baselines, the doctor's probes) keeps working. Statements
    are equal when their texts are.
    """

    name: str
    """What the statement does, unique among the statements of one kind of store
    (``hit``, ``sliding_window``, ``pg_try_lock``); the memory and Redis stores
    dispatch on it."""
    sql: str
    """The text, as a plain `str`."""
    names: tuple[str, ...]
    """The ``:name`` parameters in the order a caller passes them; empty for ``?``."""

    def __new__(cls, name: str, sql: str, names: tuple[str, ...] = ()) -> Statement:
        self = super().__new__(cls, sql)
        self.name, self.sql, self.names = name, str(sql), names
        if names:
            missing = set(_NAMED_PARAM.findall(sql)) - set(names) - {"wsint"}  # wsint: SQL-only
            assert not missing, f"{name}: parameters {missing} have no place in {names}"
        return self

    def as_dict(self, params: Sequence[Any]) -> dict[str, Any]:
        """`params` by name (a statement with `names`)."""
        return dict(zip(self.names, params, strict=True))

    def __repr__(self) -> str:
        return f"Statement({self.name!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (Statement, (self.name, self.sql, self.names))


def as_statement(statement: str) -> Statement:
    """`statement`, or plain SQL text as an anonymous statement (name ``sql``) of ``?`` params.

    Only for callers that still hand a store bare text (`quota.http._runtime`,
    a few tests); SQL stores accept it, the memory and Redis stores refuse it.
    """
    if isinstance(statement, Statement):
        return statement
    return Statement("sql", statement)


COUNTERS = "quota_counters"
VERSION_TABLE = "quota_alembic_version"

#: Increment a window's counter by the hit's cost and return the new count.
#: Params: bucket_key, client_key, window_start, window_seconds, cost, updated_at.
HIT = Statement(
    "hit",
    "INSERT INTO quota_counters"
    " (bucket_key, client_key, window_start, window_seconds, count, updated_at)"
    " VALUES (?, ?, ?, ?, ?, ?)"
    " ON CONFLICT (bucket_key) DO UPDATE"
    " SET count = quota_counters.count + excluded.count, updated_at = excluded.updated_at"
    " RETURNING count",
)

#: As HIT, but a hit that would take the count over the limit is not counted:
#: the row is left alone and no row comes back. Extra last param: limit.
HIT_CAPPED = Statement(
    "hit_capped",
    "INSERT INTO quota_counters"
    " (bucket_key, client_key, window_start, window_seconds, count, updated_at)"
    " VALUES (?, ?, ?, ?, ?, ?)"
    " ON CONFLICT (bucket_key) DO UPDATE"
    " SET count = quota_counters.count + excluded.count, updated_at = excluded.updated_at"
    " WHERE quota_counters.count + excluded.count <= ?"
    " RETURNING count",
)

#: The name of every group-commit batch of HIT (`quota._wrappers.batching`).
BATCH_HIT = "hit_batch"
#: Redis's batch: no SQL, its parameters the hits themselves (`HIT`'s parameters each); the
#: Redis store sends one script per hit in one pipeline.
BATCH_HIT_REDIS = Statement(BATCH_HIT, "-- one pipeline of fixed-window scripts, one per hit")

#: Params: bucket_key.
PEEK = Statement("peek", "SELECT count FROM quota_counters WHERE bucket_key = ?")

#: Every statement that deletes returns one row per row deleted, so the
#: count comes back the same way from every driver.
#: Params: client_key.
RESET_ALL = Statement("reset_all", "DELETE FROM quota_counters WHERE client_key = ? RETURNING 1")
#: Params: client_key, window_seconds.
RESET_WINDOW = Statement(
    "reset_window",
    "DELETE FROM quota_counters WHERE client_key = ? AND window_seconds = ? RETURNING 1",
)

#: Windows that ended before a cutoff. The expression matches the index
#: ``ix_quota_counters_window_end`` exactly, so the planner uses it.
_EXPIRED = "(window_start + window_seconds) < ?"
#: Params: cutoff.
COUNT_EXPIRED = Statement("count_expired", f"SELECT count(*) FROM quota_counters WHERE {_EXPIRED}")
#: Params: cutoff, batch size, cutoff.
DELETE_EXPIRED = Statement(
    "delete_expired",
    "DELETE FROM quota_counters WHERE bucket_key IN"
    f" (SELECT bucket_key FROM quota_counters WHERE {_EXPIRED} LIMIT ?)"
    f" AND {_EXPIRED} RETURNING 1",
)

#: PostgreSQL: `DELETE_EXPIRED` as a batch whose cost does not grow with the backlog. It
#: walks the table in ``ctid`` order from where the last batch stopped (a TID range scan
#: from `params[0]`, the ``(page,item)`` the previous batch returned, ``(0,0)`` first),
#: takes the next expired rows and deletes them by ``ctid`` (a TID scan). ``IN (SELECT
#: … LIMIT ?)`` hash-joined a sequential scan of the whole table every batch, and a
#: batch found through the window-end index walks past every entry the batches before
#: it deleted: either way each batch cost more than the one before. The outer
#: condition is checked again as in `DELETE_EXPIRED`; a row updated meanwhile has a new
#: ``ctid`` and is left alone, as is one inserted behind the scan (the next cleanup's).
#: Returns one row: the rows deleted and the last ``ctid`` (text) to go on from. A
#: partitioned counters table, whose ``ctid`` is per partition, gets the same statement
#: on ``bucket_key`` through the window-end index
#: (`quota._sql.partitions.partitioned_sql`). Params: after, cutoff, batch size, cutoff.
PG_DELETE_EXPIRED = Statement(
    "pg_delete_expired",
    "WITH swept AS (DELETE FROM quota_counters WHERE ctid = ANY(ARRAY("
    "SELECT ctid FROM quota_counters WHERE ctid > CAST(CAST(? AS text) AS tid)"
    f" AND {_EXPIRED} LIMIT ?)) AND {_EXPIRED} RETURNING ctid)"
    " SELECT count(*), CAST(max(ctid) AS text) FROM swept",
)
#: Where `PG_DELETE_EXPIRED` starts: before the first row of the first page.
PG_FIRST_CTID = "(0,0)"

#: The busiest keys in windows still running. Params: now, limit.
TOP = Statement(
    "top",
    "SELECT client_key, window_seconds, window_start, count FROM quota_counters"
    " WHERE (window_start + window_seconds) > ? ORDER BY count DESC, client_key LIMIT ?",
)

#: One key's windows still running, shortest first. Params: client_key, now.
KEY_WINDOWS = Statement(
    "key_windows",
    "SELECT client_key, window_seconds, window_start, count FROM quota_counters"
    " WHERE client_key = ? AND (window_start + window_seconds) > ?"
    " ORDER BY window_seconds, window_start",
)

SCHEMA_VERSION = Statement("schema_version", f"SELECT version_num FROM {VERSION_TABLE}")

#: PostgreSQL only: one cleanup at a time across every app instance.
#: The lock id is the first 8 bytes of sha256("quota.cleanup"), fixed forever.
CLEANUP_LOCK_ID = 0x3A1F_4C2B_9D0E_7A65 - 2**63
#: An operation run without a transaction yields these two to hold a lock across its
#: statements. The PostgreSQL stores take the lock in a transaction of its own on a
#: connection of its own, held open until `PG_UNLOCK` (or the operation's end) commits
#: it: transaction-scoped, so it works through a transaction pooler and can never leak.
#: That transaction idles by design while the sweep runs on other connections: it exempts
#: itself (``SET LOCAL``) from an ``idle_in_transaction_session_timeout`` set on the role
#: or database, which would otherwise end it, and so the lock, mid-sweep. It holds no
#: snapshot and no transaction id, so it holds back no vacuum; a cleanup that dies or
#: loses its connection still ends it at once.
#: Params: the lock id (both).
PG_TRY_LOCK = Statement(
    "pg_try_lock",
    "SELECT pg_try_advisory_xact_lock(?),"
    " set_config('idle_in_transaction_session_timeout', '0', true)",
)
PG_UNLOCK = Statement("pg_unlock", "COMMIT -- quota: ends the transaction of PG_TRY_LOCK")

#: SQLite only: an operation run without a transaction yields this to let other writers
#: in between two of its statements; the SQLite stores sleep ``params[0]`` seconds,
#: holding no lock. (A write waiting on SQLite's busy handler polls at intervals: a
#: writer that takes the lock again at once would starve it.)
PAUSE = Statement("pause", "-- quota: pause")

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
        return _PLACEHOLDER.sub("%s", text.replace("%", "%%"))
    if style == "numeric_dollar":
        counter = iter(range(1, 1000))
        return _PLACEHOLDER.sub(lambda _m: f"${next(counter)}", text)
    raise ValueError(f"unknown placeholder style {style!r}")  # pragma: no cover


# -- statements with named parameters ------------------------------------------------
#
# The algorithms beyond the fixed window use a parameter several times, so
# their statements are written with ``:name`` markers and compiled per driver
# by `compile_named` into the driver's style plus the order of the names. With
# the database clock (``clock="database"``), ``:now`` and the values derived
# from it become SQL expressions, so the database's time decides the window.

#: The database's "now" in epoch seconds, one value per statement.
DB_NOW = {
    "postgresql": "CAST(extract(epoch FROM statement_timestamp()) AS DOUBLE PRECISION)",
    # julianday('now') is fixed for the duration of one sqlite3_step().
    "sqlite": "((julianday('now') - 2440587.5) * 86400.0)",
}
_WHOLE_NOW = {"postgresql": "CAST(floor(:now) AS BIGINT)", "sqlite": "CAST(:now AS INTEGER)"}
#: Values the app clock computes in Python, as SQL for the database clock
#: (same arithmetic: `quota._core.algorithms.window_start` and `sliding_weight`).
_DERIVED = (
    ("weight", "((:window - (:now - :ws)) / CAST(:window AS DOUBLE PRECISION))"),
    ("ws", "CAST({s} - {s} % :window AS DOUBLE PRECISION)"),
    ("wsint", "({s} - {s} % :window)"),
    ("expires", "(:now + :horizon)"),
)


_PARAM_TYPES = {
    "bucket_key": "TEXT", "client_key": "TEXT", "window": "INTEGER",
    # Concurrency leases.
    "lease_key": "TEXT", "holder": "TEXT", "slot": "INTEGER", "slots": "INTEGER",
    "first": "INTEGER", "n": "INTEGER",
}  # fmt: skip


@functools.cache
def compile_named(
    text: str, style: str, dialect: str, db_clock: bool
) -> tuple[str, tuple[str, ...]]:
    """`text` in the driver's `style` for `dialect`, and the names of its parameters in order.

    ``GREATEST``/``LEAST`` become SQLite's two-argument ``max``/``min``. For
    ``numeric_dollar`` each name is one parameter; for ``qmark`` and
    ``format`` every occurrence is, so names may repeat.
    """
    if dialect == "sqlite":
        text = text.replace("GREATEST(", "max(").replace("LEAST(", "min(")
    if not db_clock and text.endswith(RETURN_NOW):
        text = text.removesuffix(RETURN_NOW)
    if db_clock:
        whole = _WHOLE_NOW[dialect]
        for name, expression in _DERIVED:
            text = re.sub(rf"(?<![:\w]):{name}\b", expression.replace("{s}", whole), text)
        text = re.sub(r"(?<![:\w]):now\b", f"({DB_NOW[dialect]})", text)
    if style == "format":
        text = text.replace("%", "%%")  # psycopg: a literal % is written %%
    names: list[str] = []

    def placeholder(match: re.Match[str]) -> str:
        name = match.group(1)
        if style in ("numeric_dollar", "qmark"):
            # One parameter per name: $n for asyncpg, ?n for SQLite.
            if name not in names:
                names.append(name)
            marker = f"{'$' if style == 'numeric_dollar' else '?'}{names.index(name) + 1}"
        else:
            names.append(name)
            marker = "%s"
        if dialect == "postgresql":
            # PostgreSQL infers a parameter's type from its first use, which
            # fails for `:a - :b`; state every type instead.
            return f"CAST({marker} AS {_PARAM_TYPES.get(name, 'DOUBLE PRECISION')})"
        return marker

    return _NAMED_PARAM.sub(placeholder, text), tuple(names)


Picker = Callable[[Sequence[Any]], tuple[Any, ...]]


def positional(
    statement: Statement, style: str, dialect: str, db_clock: bool
) -> tuple[str, Picker]:
    """`statement` (with ``:name`` parameters) compiled for the driver, and what picks the
    driver's parameters from a call's.

    A store compiles each statement once and keeps the pair: a call then costs
    one `operator.itemgetter` over the parameter tuple.
    """
    text, used = compile_named(statement.sql, style, dialect, db_clock)
    indices = [statement.names.index(name) for name in used]
    if len(indices) == 1:  # itemgetter of one index returns the item, not a tuple
        index = indices[0]
        return text, lambda params: (params[index],)
    return text, operator.itemgetter(*indices)


#: Most statements a `Binder` keeps: far more than quota's own, so only statements made
#: up at run time (partition DDL names an hour) ever make it start over.
BINDER_SIZE = 4096


class Binder:
    """A SQL store's statements in its driver's form, each made once, on first use.

    A ``?`` statement is rendered (`render`); one with ``:name`` parameters is
    compiled for the dialect and the clock (`positional`).
    """

    __slots__ = ("_compiled", "_db_clock", "_dialect", "_style", "plain")

    def __init__(self, style: str, dialect: str, db_clock: bool) -> None:
        self._style, self._dialect, self._db_clock = style, dialect, db_clock
        self._compiled: dict[str, tuple[str, Picker | None]] = {}
        #: The text of each statement made so far whose parameters go to the driver as
        #: they come: a store's hot path looks its statement up here, and calls the
        #: binder only when it is missing.
        self.plain: dict[str, str] = {}

    def __call__(self, statement: Statement, params: Sequence[Any]) -> tuple[str, Sequence[Any]]:
        """`statement`'s text for the driver, and `params` in the driver's order."""
        compiled = self._compiled.get(statement)
        if compiled is None:
            compiled = self._compile(statement)
        text, pick = compiled
        return text, params if pick is None else pick(params)

    def _compile(self, statement: str) -> tuple[str, Picker | None]:
        known = as_statement(statement)
        compiled: tuple[str, Picker | None]
        if known.names:
            compiled = positional(known, self._style, self._dialect, self._db_clock)
        else:
            compiled = render(known.sql, self._style), None
        if len(self._compiled) >= BINDER_SIZE:
            self._compiled.clear()
            self.plain.clear()
        self._compiled[known] = compiled
        if compiled[1] is None:
            self.plain[known] = compiled[0]
        return compiled


#: The algorithms' statements end by returning the time they decided at: the
#: database's with ``clock="database"``. With the app clock the caller knows
#: it already, so `compile_named` leaves it out (a column and, for the
#: sliding window, a parameter less).
RETURN_NOW = ", CAST(:now AS DOUBLE PRECISION)"

_STATE_COLUMNS = (
    "INSERT INTO quota_state"
    " (bucket_key, client_key, window_seconds, value, prev_value, stamp, allowed, expires_at)"
)

# When a state row has become the same as no row, rounded up to the hour
# (`quota._core.algorithms.expiry`): within the hour the indexed value does not
# change, so PostgreSQL updates the row in place (HOT) without touching the
# index that cleanup reads. Never lowered, whatever a lagging clock says.
_EXPIRES = "GREATEST(quota_state.expires_at, :expires)"

# Sliding-window counter. The SET expressions all read the row as it was.
_SW_CURRENT = "(CASE WHEN quota_state.stamp >= :ws THEN quota_state.value ELSE 0.0 END)"
_SW_PREVIOUS = (
    "(CASE WHEN quota_state.stamp >= :ws THEN quota_state.prev_value"
    " WHEN quota_state.stamp = :ws - :window THEN quota_state.value ELSE 0.0 END)"
)
# A late call (the row's window is newer than the call's) weighs the previous
# window in full, as at the start of the row's window (`sliding_step`).
_SW_WEIGHT = (
    "(CASE WHEN quota_state.stamp > :ws THEN CAST(1.0 AS DOUBLE PRECISION) ELSE :weight END)"
)
_SW_ALLOWED = f"({_SW_PREVIOUS} * {_SW_WEIGHT} + {_SW_CURRENT} + :cost <= :limit)"
SLIDING_WINDOW = Statement(
    "sliding_window",
    _STATE_COLUMNS + " VALUES (:bucket_key, :client_key, :window, :cost, 0.0, :ws, 1, :expires)"
    " ON CONFLICT (bucket_key) DO UPDATE SET"
    f" value = CASE WHEN {_SW_ALLOWED} THEN {_SW_CURRENT} + :cost ELSE {_SW_CURRENT} END,"
    f" prev_value = {_SW_PREVIOUS},"
    " stamp = GREATEST(quota_state.stamp, :ws),"
    f" allowed = CASE WHEN {_SW_ALLOWED} THEN 1 ELSE 0 END,"
    f" expires_at = {_EXPIRES}"
    " RETURNING value, prev_value, stamp, allowed" + RETURN_NOW,
    ("bucket_key", "client_key", "window", "cost", "now", "ws", "weight", "limit", "horizon",
     "expires"),
)  # fmt: skip

# Token bucket: refill by elapsed time, capped; take `cost` tokens if there are enough.
_TB_REFILL = "LEAST(:capacity, quota_state.value + GREATEST(0.0, :now - quota_state.stamp) * :rate)"
TOKEN_BUCKET = Statement(
    "token_bucket",
    _STATE_COLUMNS + " VALUES (:bucket_key, :client_key, :window, :capacity - :cost, 0.0, :now, 1,"
    " :expires)"
    " ON CONFLICT (bucket_key) DO UPDATE SET"
    f" value = CASE WHEN {_TB_REFILL} >= :cost THEN {_TB_REFILL} - :cost ELSE {_TB_REFILL} END,"
    " stamp = GREATEST(quota_state.stamp, :now),"
    f" allowed = CASE WHEN {_TB_REFILL} >= :cost THEN 1 ELSE 0 END,"
    f" expires_at = {_EXPIRES}"
    " RETURNING value, allowed" + RETURN_NOW,
    ("bucket_key", "client_key", "window", "cost", "now", "capacity", "rate", "horizon",
     "expires"),
)  # fmt: skip

# GCRA: one theoretical arrival time per key.
_GCRA_ARRIVAL = "(GREATEST(quota_state.value, :now) + :increment)"
#: `quota._core.algorithms.gcra_step`: GREATEST(tat - now, 0) + increment is exact where
#: (GREATEST(tat, now) + increment) - now rounds.
_GCRA_ALLOWED = "(GREATEST(quota_state.value - :now, 0.0) + :increment <= :tolerance)"
GCRA = Statement(
    "gcra",
    _STATE_COLUMNS + " VALUES (:bucket_key, :client_key, :window, :now + :increment, 0.0, 0.0, 1,"
    " :expires)"
    " ON CONFLICT (bucket_key) DO UPDATE SET"
    f" value = CASE WHEN {_GCRA_ALLOWED} THEN {_GCRA_ARRIVAL} ELSE quota_state.value END,"
    f" allowed = CASE WHEN {_GCRA_ALLOWED} THEN 1 ELSE 0 END,"
    f" expires_at = {_EXPIRES}"
    " RETURNING value, allowed" + RETURN_NOW,
    ("bucket_key", "client_key", "window", "cost", "now", "increment", "tolerance", "horizon",
     "expires"),
)  # fmt: skip

#: The fixed window with the database clock: the bucket key is built in SQL
#: from the database's time. Returns the count, window start and time used.
_HIT_DB = (
    "INSERT INTO quota_counters"
    " (bucket_key, client_key, window_start, window_seconds, count, updated_at)"
    " VALUES (CAST(CAST(:window AS INTEGER) AS TEXT) || ':' || CAST(:wsint AS TEXT) || ':' || :client_key,"
    " :client_key, :wsint, :window, :cost, :now)"
    " ON CONFLICT (bucket_key) DO UPDATE"
    " SET count = quota_counters.count + excluded.count, updated_at = excluded.updated_at"
)
_HIT_DB_NAMES = ("client_key", "window", "cost", "now", "limit")
HIT_DB_CLOCK = Statement(
    "fixed_window", _HIT_DB + " RETURNING count, window_start, updated_at", _HIT_DB_NAMES
)
HIT_DB_CLOCK_CAPPED = Statement(
    "fixed_window_capped",
    _HIT_DB + " WHERE quota_counters.count + excluded.count <= :limit"
    " RETURNING count, window_start, updated_at",
    _HIT_DB_NAMES,
)

# -- giving a hit back: `Limiter.acquire` with several rates ---------------------------------
#
# An attempt that one rate denies gives back what the rates before it took, where each took
# it; a row gone meanwhile stays gone. No time is read, so the database clock changes nothing.

#: The fixed window: the counter of the window the hit was counted in, never below 0.
UNDO_FIXED_WINDOW = Statement(
    "undo_fixed_window",
    "UPDATE quota_counters SET count = GREATEST(count - CAST(:cost AS INTEGER), 0)"
    " WHERE bucket_key = :bucket_key RETURNING count",
    ("bucket_key", "cost"),
)
#: The sliding window: the count of the window (starting at `stamp`) the hit was counted
#: in, as current or, once the next window began, as previous; never below 0.
UNDO_SLIDING_WINDOW = Statement(
    "undo_sliding_window",
    "UPDATE quota_state SET"
    " value = CASE WHEN stamp = :stamp THEN GREATEST(value - :cost, 0.0) ELSE value END,"
    " prev_value = CASE WHEN stamp = :stamp + :window"
    " THEN GREATEST(prev_value - :cost, 0.0) ELSE prev_value END"
    " WHERE bucket_key = :bucket_key RETURNING value",
    ("bucket_key", "cost", "stamp", "window"),
)
#: The token bucket: the tokens back, up to its capacity.
UNDO_TOKEN_BUCKET = Statement(
    "undo_token_bucket",
    "UPDATE quota_state SET value = LEAST(value + :cost, :capacity)"
    " WHERE bucket_key = :bucket_key RETURNING value",
    ("bucket_key", "cost", "capacity"),
)
#: GCRA: the theoretical arrival time back by the hit's increment.
UNDO_GCRA = Statement(
    "undo_gcra",
    "UPDATE quota_state SET value = value - :increment WHERE bucket_key = :bucket_key"
    " RETURNING value",
    ("bucket_key", "increment"),
)

#: Params: bucket_key.
STATE_PEEK = Statement(
    "state_peek", "SELECT value, prev_value, stamp FROM quota_state WHERE bucket_key = ?"
)
#: Params: client_key (and window_seconds).
STATE_RESET_ALL = Statement(
    "state_reset_all", "DELETE FROM quota_state WHERE client_key = ? RETURNING 1"
)
STATE_RESET_WINDOW = Statement(
    "state_reset_window",
    "DELETE FROM quota_state WHERE client_key = ? AND window_seconds = ? RETURNING 1",
)
#: Params: cutoff, batch size.
#: The outer condition is checked again on the row as it is when the delete gets it: on
#: PostgreSQL a delete that waited for an in-flight update (a token bucket's, say) sees the
#: updated row, and must not delete it if that update made it live again.
STATE_DELETE_EXPIRED = Statement(
    "state_delete_expired",
    "DELETE FROM quota_state WHERE bucket_key IN"
    " (SELECT bucket_key FROM quota_state WHERE expires_at < ? LIMIT ?)"
    " AND expires_at < ? RETURNING 1",
)
#: PostgreSQL: `STATE_DELETE_EXPIRED` in ``ctid`` order from where the last batch
#: stopped (see `PG_DELETE_EXPIRED`). Params: after, cutoff, batch size, cutoff.
PG_STATE_DELETE_EXPIRED = Statement(
    "pg_state_delete_expired",
    "WITH swept AS (DELETE FROM quota_state WHERE ctid = ANY(ARRAY("
    "SELECT ctid FROM quota_state WHERE ctid > CAST(CAST(? AS text) AS tid)"
    " AND expires_at < ? LIMIT ?)) AND expires_at < ? RETURNING ctid)"
    " SELECT count(*), CAST(max(ctid) AS text) FROM swept",
)
#: The cleanup deletes that go on from the ``ctid`` the previous batch returned.
PG_KEYSET_DELETES = frozenset({PG_DELETE_EXPIRED.name, PG_STATE_DELETE_EXPIRED.name})
STATE_COUNT_EXPIRED = Statement(
    "state_count_expired", "SELECT count(*) FROM quota_state WHERE expires_at < ?"
)


# -- pauses: a key held back until a moment, in quota_state --------------------------------
#
# A provider answering 429 with Retry-After pauses a key for every process at once
# (`quota.contrib` outbound transports). A pause is rate state, as ephemeral as a window:
# one quota_state row per key (bucket key ``pause:0:<stored key>``, window_seconds 0),
# its value the moment it ends, swept by cleanup once that has passed. A pause only
# grows: a shorter one set while a longer one runs leaves the longer.

#: Pause until now + `horizon` seconds (`expires` on the app clock); returns the moment
#: the pause ends (and the time used, with the database clock).
PAUSE_SET = Statement(
    "pause_set",
    _STATE_COLUMNS + " VALUES (:bucket_key, :client_key, 0, :expires, 0.0, :now, 0, :expires)"
    " ON CONFLICT (bucket_key) DO UPDATE SET"
    " value = GREATEST(quota_state.value, excluded.value), stamp = excluded.stamp,"
    " expires_at = GREATEST(quota_state.expires_at, excluded.expires_at)"
    " RETURNING value" + RETURN_NOW,
    ("bucket_key", "client_key", "now", "horizon", "expires"),
)
#: Seconds the key's pause has left: a row while it runs, none otherwise.
PAUSE_LEFT = Statement(
    "pause_left",
    "SELECT value - :now FROM quota_state WHERE bucket_key = :bucket_key AND value > :now",
    ("bucket_key", "now"),
)

# -- concurrency leases (quota_leases, revision 0006_leases) -----------------------------
#
# A key's leases are slots numbered 0..limit-1, one row each while held: the primary key
# (lease_key, slot) is what keeps the holders at `limit` when two sessions take a slot at
# once, even under PostgreSQL's READ COMMITTED (where each would count the other's row
# as absent). A lease whose expires_at has passed is free: the next taker overwrites it.

LEASES = "quota_leases"

#: Take a free slot of `slots`, trying from slot `first` on (a random start spreads
#: concurrent takers over the slots); return it, or no row when all are held. A slot
#: another session takes at the same moment makes this one find it held: no row, though
#: another slot may be free (the caller tries again). The count keeps a key whose limit
#: was lowered at the new limit once the holders above it leave.
LEASE_ACQUIRE = Statement(
    "lease_acquire",
    "WITH RECURSIVE quota_slots(n) AS"
    " (SELECT 0 UNION ALL SELECT n + 1 FROM quota_slots WHERE n + 1 < :slots)"
    " INSERT INTO quota_leases (lease_key, slot, holder, slots, acquired_at, expires_at)"
    " SELECT :lease_key, (n + :first) % :slots, :holder, :slots, :now, :expires FROM quota_slots"
    " WHERE (SELECT count(*) FROM quota_leases"
    " WHERE lease_key = :lease_key AND expires_at > :now) < :slots"
    " AND NOT EXISTS (SELECT 1 FROM quota_leases WHERE lease_key = :lease_key"
    " AND slot = (n + :first) % :slots AND expires_at > :now)"
    " LIMIT 1"
    " ON CONFLICT (lease_key, slot) DO UPDATE SET holder = excluded.holder,"
    " slots = excluded.slots, acquired_at = excluded.acquired_at,"
    " expires_at = excluded.expires_at"
    " WHERE quota_leases.expires_at <= excluded.acquired_at"
    " RETURNING slot",
    ("lease_key", "slots", "first", "holder", "now", "horizon", "expires"),
)  # fmt: skip

#: Move a held lease's expiry on; no row when the lease is no longer this holder's.
LEASE_RENEW = Statement(
    "lease_renew",
    "UPDATE quota_leases SET expires_at = :expires"
    " WHERE lease_key = :lease_key AND slot = :slot AND holder = :holder RETURNING slot",
    ("lease_key", "slot", "holder", "now", "horizon", "expires"),
)

#: Params: lease_key, slot, holder. Frees the slot if this holder still has it.
LEASE_RELEASE = Statement(
    "lease_release",
    "DELETE FROM quota_leases WHERE lease_key = ? AND slot = ? AND holder = ? RETURNING 1",
)

#: Params: lease_key, holder. Frees whatever slot `holder` took (a take interrupted before
#: its answer came back); holders are unique, so never another's.
LEASE_ABANDON = Statement(
    "lease_abandon", "DELETE FROM quota_leases WHERE lease_key = ? AND holder = ? RETURNING 1"
)

#: The live leases of one key: slot, holder, limit taken under, acquired_at, expires_at.
LEASE_HOLDERS = Statement(
    "lease_holders",
    "SELECT slot, holder, slots, acquired_at, expires_at FROM quota_leases"
    " WHERE lease_key = :lease_key AND expires_at > :now ORDER BY slot",
    ("lease_key", "now"),
)

#: The keys with the most live leases: lease_key, holders, limit, next expiry.
LEASE_TOP = Statement(
    "lease_top",
    "SELECT lease_key, count(*), max(slots), min(expires_at) FROM quota_leases"
    " WHERE expires_at > :now GROUP BY lease_key ORDER BY count(*) DESC, lease_key LIMIT :n",
    ("now", "n"),
)

#: Params: cutoff.
LEASE_COUNT_EXPIRED = Statement(
    "lease_count_expired", "SELECT count(*) FROM quota_leases WHERE expires_at < ?"
)
#: Params: cutoff, batch size, cutoff. A lease renewed while the delete waited stays.
LEASE_DELETE_EXPIRED = Statement(
    "lease_delete_expired",
    "DELETE FROM quota_leases WHERE (lease_key, slot) IN"
    " (SELECT lease_key, slot FROM quota_leases WHERE expires_at < ? LIMIT ?)"
    " AND expires_at < ? RETURNING 1",
)
