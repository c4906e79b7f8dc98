"""`quota` as a storage backend for `limits`, and so for flask-limiter and slowapi.

Importing this module registers storage schemes with `limits`:

    import quota.contrib.limits  # noqa: F401  (registers the schemes)

    limiter = Limiter(get_remote_address, storage_uri="quota+postgresql://app@db/app")

* sync (`limits.strategies`, flask-limiter, slowapi): ``quota+sqlite:///path.db``,
  ``quota+postgresql://…`` (also ``quota+postgres://``, ``quota+postgresql+psycopg://``,
  ``quota+sqlite+pysqlite://``), built on `quota.connect`;
* async (`limits.aio.strategies`): ``async+quota+sqlite:///path.db``,
  ``async+quota+postgresql://…`` (also ``+aiosqlite``/``+asyncpg`` forms), built
  on `quota.connect_async`. An async storage belongs to the event loop that
  first uses it.

The part after ``quota+`` is a `quota.connect` URL; the tables must exist
(``quota migrate --url …``): nothing here runs DDL. Storage options (flask-limiter's
``storage_options``, slowapi's, or keywords to `storage_from_string`) are
``timeout``, ``pool_size``, ``idle_timeout`` and ``prepared_statements``, as for
`quota.connect` (strings from configuration are converted).

What is stored (all in ``quota_counters``, so ``quota cleanup`` sweeps it):

* **fixed window** (`incr`/`get`/`get_expiry`): one row per `limits` key. As in
  `limits`' own storages (``MemoryStorage``, Redis' ``INCRBY`` then
  ``EXPIRE``), a window starts at the hit that finds the key's count at 0 (its
  first hit, or the first after the window ended) and ends exactly `expiry`
  seconds later, to the fraction of a second: `get_expiry` is that instant.
  One atomic ``INSERT … ON CONFLICT DO UPDATE`` per hit, so concurrent
  processes never lose a count. The row keeps the exact end in
  ``updated_at``; ``window_start`` and ``window_seconds`` describe the window
  to whole seconds, both rounded up, so ``window_start + window_seconds`` is
  never before the exact end (for a whole-second expiry, less than a second
  after it): that is what ``quota cleanup`` and ``quota top`` read, so a row
  is never swept while its window runs.
  The row must be unique by ``bucket_key`` alone, so a PostgreSQL counters
  table migrated with ``--partitioned-counters`` is refused: the first `incr`
  raises `quota.ConfigurationError`.
* **sliding window counter** (`acquire_sliding_window_entry`,
  `get_sliding_window`): `limits`' two epoch-aligned windows per key, one row
  each, keyed by `limits.storage.base.TimestampedSlidingWindow.sliding_window_keys`
  (``"{key}/{window index}"``), which both storages declare, as limits' memory
  and memcached storages do: reset times repeat with the epoch-aligned windows,
  whatever the time of the first hit. The weighted
  check and the increment are one atomic statement, so there is no
  over-admission to undo (limits' memory storage increments, re-checks and
  decrements). Works on partitioned tables too (a row's key names its window).
* **moving window**: not supported (it needs a row per hit);
  `limits.strategies.MovingWindowRateLimiter` refuses this storage, as it does
  memcached.

Rows are keyed ``"limits:" + stored key`` in both ``bucket_key`` and
``client_key``. quota's own keys are stored as ``k:…``/``h:…`` (client) and
``{window}:…`` (bucket), so the two never meet; `reset` deletes the
``limits:`` rows only.

Time is the app's `time.time()`, as in `limits`. Errors are `quota.StorageError`
(`quota.SchemaError` when the tables are missing), the storage's
`base_exceptions`: ``wrap_exceptions=True`` turns them into
`limits.errors.StorageError`. `check()` answers False instead of raising.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from limits.aio.storage.base import SlidingWindowCounterSupport as AsyncSlidingWindowCounterSupport
from limits.aio.storage.base import Storage as AsyncStorage
from limits.storage.base import SlidingWindowCounterSupport, Storage, TimestampedSlidingWindow

from quota._core.decision import stored_key
from quota._core.errors import ConfigurationError, StorageError
from quota._core.parsing import parse_flag
from quota._core.url import KNOWN_SCHEMES, parse_url
from quota._limiter import AsyncLimiter, Limiter, connect, connect_async
from quota._sql.partitions import IS_PARTITIONED
from quota._sql.statements import Statement
from quota._sql.steps import Rows
from quota._stores.base import AsyncStore, SyncStore

__all__ = ["AsyncQuotaStorage", "QuotaStorage"]

T = TypeVar("T")

#: Prefix of every row this adapter writes, in ``bucket_key`` and ``client_key``.
PREFIX = "limits:"
#: The string just above every ``limits:`` key (":" + 1 == ";"), for a range delete.
_PREFIX_END = "limits;"
#: ``window_seconds`` is a 32-bit INTEGER column; a sliding window row keeps two windows.
MAX_EXPIRY = (2**31 - 1) // 2

# -- statements --------------------------------------------------------------------
#
# `quota._sql.statements.Statement`s with ``?`` parameters, rendered per driver by the quota
# stores; their names start with ``limits_``. Parameters whose type PostgreSQL
# cannot infer from a column are cast, so asyncpg and psycopg bind them alike.

# A fixed-window row keeps its window's exact end in ``updated_at``.

#: The row starts a new window: its window has ended at now, or its count is 0
#: (limits' storages start the window whenever an increment finds 0). Params: now.
_RESTART = "(quota_counters.updated_at <= CAST(? AS DOUBLE PRECISION) OR quota_counters.count = 0)"

#: Count `amount` hits on a key, starting a new window if `_RESTART`.
#: Params: key, key, whole-second start, whole seconds, amount, exact end,
#: now (once per `_RESTART`: four times). Returns the count.
INCR = Statement(
    "limits_incr",
    "INSERT INTO quota_counters"
    " (bucket_key, client_key, window_start, window_seconds, count, updated_at)"
    " VALUES (?, ?, ?, ?, ?, ?)"
    " ON CONFLICT (bucket_key) DO UPDATE SET"
    f" count = CASE WHEN {_RESTART} THEN excluded.count"
    " ELSE quota_counters.count + excluded.count END,"
    f" window_start = CASE WHEN {_RESTART} THEN excluded.window_start"
    " ELSE quota_counters.window_start END,"
    f" window_seconds = CASE WHEN {_RESTART} THEN excluded.window_seconds"
    " ELSE quota_counters.window_seconds END,"
    f" updated_at = CASE WHEN {_RESTART} THEN excluded.updated_at"
    " ELSE quota_counters.updated_at END"
    " RETURNING count",
)

#: A fixed window runs until its exact end. Params: key, now.
_FIXED_LIVE = "bucket_key = ? AND updated_at > CAST(? AS DOUBLE PRECISION)"
#: Params: key, now.
GET = Statement("limits_get", f"SELECT count FROM quota_counters WHERE {_FIXED_LIVE}")
#: Params: key, now.
GET_EXPIRY = Statement(
    "limits_get_expiry", f"SELECT updated_at FROM quota_counters WHERE {_FIXED_LIVE}"
)
# Deletes return a row per row deleted, as every quota statement that deletes
# does, so each driver hands back rows.
#: Params: key.
CLEAR = Statement("limits_clear", "DELETE FROM quota_counters WHERE bucket_key = ? RETURNING 1")
#: Every row of this adapter, and only those. Params: PREFIX, _PREFIX_END.
RESET = Statement(
    "limits_reset",
    "DELETE FROM quota_counters WHERE bucket_key >= ? AND bucket_key < ? RETURNING 1",
)
CHECK = Statement("limits_check", "SELECT 1")

#: A sliding-window row lives until its epoch-aligned end (whole seconds). Params: now.
_LIVE = "window_start + window_seconds > CAST(? AS DOUBLE PRECISION)"

#: limits' weighted count of the previous window, ``previous * ttl / expiry``,
#: in the same double arithmetic as `limits`. Params: previous key, now, ttl, expiry.
_PREVIOUS = (
    "COALESCE((SELECT p.count FROM quota_counters AS p WHERE p.bucket_key = ?"
    " AND p.window_start + p.window_seconds > CAST(? AS DOUBLE PRECISION)), 0)"
    " * CAST(? AS DOUBLE PRECISION) / CAST(? AS DOUBLE PRECISION)"
)
#: Take `amount` in the current window if ``floor(weighted) + amount <= limit``,
#: written ``weighted < limit - amount + 1`` (exact: the bound is a whole
#: number). The insert path is the empty current window; the update path
#: reads the locked row, so concurrent callers are serialised on it. A refusal
#: changes nothing and returns no row.
#: Params: current key (twice), window_start, 2 * expiry, amount, now,
#: previous-window params (see _PREVIOUS), bound, previous-window params, bound.
ACQUIRE_SLIDING = Statement(
    "limits_acquire_sliding",
    "INSERT INTO quota_counters"
    " (bucket_key, client_key, window_start, window_seconds, count, updated_at)"
    " SELECT CAST(? AS TEXT), CAST(? AS TEXT), CAST(? AS BIGINT), CAST(? AS INTEGER),"
    " CAST(? AS BIGINT), CAST(? AS DOUBLE PRECISION)"
    f" WHERE {_PREVIOUS} < CAST(? AS DOUBLE PRECISION)"
    " ON CONFLICT (bucket_key) DO UPDATE"
    " SET count = quota_counters.count + excluded.count, updated_at = excluded.updated_at"
    f" WHERE {_PREVIOUS} + quota_counters.count < CAST(? AS DOUBLE PRECISION)"
    " RETURNING count",
)
#: Params: previous key, current key, now.
GET_SLIDING = Statement(
    "limits_get_sliding",
    f"SELECT bucket_key, count FROM quota_counters WHERE bucket_key IN (?, ?) AND {_LIVE}",
)
#: Params: previous key, current key.
CLEAR_SLIDING = Statement(
    "limits_clear_sliding", "DELETE FROM quota_counters WHERE bucket_key IN (?, ?) RETURNING 1"
)


# -- the pure part: what to run, and what the rows mean ---------------------------


@dataclass(frozen=True, slots=True)
class _Call(Generic[T]):
    """One storage call: a statement (None: nothing to run) and how to read its rows."""

    statement: Statement | None
    params: tuple[Any, ...]
    decode: Callable[[Rows], T]
    writes_window: bool = False
    """It writes a fixed window's row: the table must not be partitioned (`unpartitioned`)."""


def row_key(key: str) -> str:
    """The ``bucket_key`` (and ``client_key``) of a `limits` key."""
    return PREFIX + stored_key(key)


def _check_expiry(expiry: object) -> int:
    """`expiry` rounded up to whole seconds; raises `ConfigurationError` if out of range."""
    if isinstance(expiry, bool) or not isinstance(expiry, (int, float)) or not expiry > 0:
        raise ConfigurationError(f"expiry must be a positive number of seconds, got {expiry!r}")
    seconds = math.ceil(expiry)
    if seconds > MAX_EXPIRY:
        raise ConfigurationError(f"expiry must be at most {MAX_EXPIRY} seconds, got {expiry!r}")
    return seconds


def _check_amount(amount: object) -> int:
    if type(amount) is not int or amount < 0:
        raise ConfigurationError(f"amount must be an integer >= 0, got {amount!r}")
    return amount


def _first(rows: Rows) -> int:
    return int(rows[0][0]) if rows else 0


def _none(_rows: Rows) -> None:
    return None


def incr(key: str, expiry: float, amount: int, now: float) -> _Call[int]:
    """Count `amount` on `key`; a window started by this hit ends at ``now + expiry`` exactly.

    ``now + expiry`` is the float `limits`' memory storage computes, so the
    two agree to the last bit.
    """
    seconds = _check_expiry(expiry)
    k = row_key(key)
    end = now + expiry
    params = (k, k, math.ceil(now), seconds, _check_amount(amount), end, now, now, now, now)
    return _Call(INCR, params, _first, writes_window=True)


def get(key: str, now: float) -> _Call[int]:
    return _Call(GET, (row_key(key), now), _first)


def get_expiry(key: str, now: float) -> _Call[float]:
    return _Call(GET_EXPIRY, (row_key(key), now), lambda rows: float(rows[0][0]) if rows else now)


def clear(key: str) -> _Call[None]:
    return _Call(CLEAR, (row_key(key),), _none)


def reset() -> _Call[int]:
    return _Call(RESET, (PREFIX, _PREFIX_END), len)


def _refuse_partitioned(rows: Rows) -> None:
    if rows:
        raise ConfigurationError(
            "quota.contrib.limits cannot keep limits' fixed windows in a partitioned counters"
            " table: a window starts at its first hit, so its row must be unique by bucket_key"
            " alone, and a partitioned table is unique by (bucket_key, window_start). Use a"
            " database migrated without --partitioned-counters (the sliding window counter"
            " works on both)"
        )


class _TableCheck:
    """The check that the counters table is not partitioned, run before the first `incr`
    until it passes (PostgreSQL only: elsewhere it passes at once)."""

    def __init__(self) -> None:
        self.passed = False

    def before(self, call: _Call[Any], dialect: str) -> _Call[None] | None:
        """The check to run before `call`, or None."""
        if self.passed or not call.writes_window:
            return None
        return _Call(IS_PARTITIONED if dialect == "postgresql" else None, (), self._read)

    def _read(self, rows: Rows) -> None:
        _refuse_partitioned(rows)
        self.passed = True


def sliding_indexes(expiry: int, now: float) -> tuple[int, int]:
    """The previous and current window numbers, as `limits` computes them for its keys."""
    return int((now - expiry) / expiry), int(now / expiry)


def sliding_window_keys(key: str, expiry: int, now: float) -> tuple[str, str]:
    """The previous and current window's `limits` keys: `TimestampedSlidingWindow`'s own."""
    return TimestampedSlidingWindow.sliding_window_keys(key, expiry, now)


def sliding_ttls(expiry: int, now: float) -> tuple[float, float]:
    """Seconds the previous window still weighs and the current one still lives, as in `limits`."""
    previous = (1 - (((now - expiry) / expiry) % 1)) * expiry
    current = (1 - ((now / expiry) % 1)) * expiry + expiry
    return previous, current


def _sliding_keys(key: str, expiry: int, now: float) -> tuple[str, str, int]:
    """The two rows' keys and the current window's number."""
    previous, current = sliding_window_keys(key, expiry, now)
    return row_key(previous), row_key(current), sliding_indexes(expiry, now)[1]


def acquire_sliding(key: str, limit: int, expiry: int, amount: int, now: float) -> _Call[bool]:
    seconds = _check_expiry(expiry)
    if _check_amount(amount) > limit:
        return _Call(None, (), lambda _rows: False)
    previous_key, current_key, index = _sliding_keys(key, seconds, now)
    ttl, _ = sliding_ttls(seconds, now)
    weighing = (previous_key, now, ttl, seconds)
    bound = limit - amount + 1
    params = (
        current_key, current_key, index * seconds, 2 * seconds, amount, now,
        *weighing, bound, *weighing, bound,
    )  # fmt: skip
    return _Call(ACQUIRE_SLIDING, params, bool)


def get_sliding(key: str, expiry: int, now: float) -> _Call[tuple[int, float, int, float]]:
    seconds = _check_expiry(expiry)
    previous_key, current_key, _ = _sliding_keys(key, seconds, now)

    def decode(rows: Rows) -> tuple[int, float, int, float]:
        counts = {str(k): int(c) for k, c in rows}
        previous, current = counts.get(previous_key, 0), counts.get(current_key, 0)
        previous_ttl, current_ttl = sliding_ttls(seconds, now)
        return previous, (previous_ttl if previous else 0.0), current, current_ttl

    return _Call(GET_SLIDING, (previous_key, current_key, now), decode)


def clear_sliding(key: str, expiry: int, now: float) -> _Call[None]:
    previous_key, current_key, _ = _sliding_keys(key, _check_expiry(expiry), now)
    return _Call(CLEAR_SLIDING, (previous_key, current_key), _none)


# -- URIs and options -----------------------------------------------------------------

SYNC_PREFIX = "quota+"
ASYNC_PREFIX = "async+quota+"


def _schemes(asynchronous: bool) -> list[str]:
    """Every quota URL scheme the face can open, with this adapter's prefix."""
    schemes = []
    for scheme in KNOWN_SCHEMES:
        parsed = parse_url(f"{scheme}:///probe")
        if parsed.dialect not in ("sqlite", "postgresql"):
            continue
        try:
            parsed.driver_for(asynchronous=asynchronous)
        except ConfigurationError:
            continue
        schemes.append((ASYNC_PREFIX if asynchronous else SYNC_PREFIX) + scheme)
    return schemes


def quota_url(uri: str, prefix: str) -> str:
    """The `quota.connect` URL inside a `limits` storage URI."""
    if not isinstance(uri, str) or not uri.startswith(prefix):
        raise ConfigurationError(f"storage uri must start with {prefix!r}, got {uri!r}")
    return uri[len(prefix) :]


def _flag(value: str) -> bool:
    flag = parse_flag(value)
    if flag is None:
        raise ValueError(value)
    return flag


#: Storage options and how a string from configuration converts to each.
_OPTIONS: dict[str, Any] = {
    "timeout": float, "pool_size": int, "idle_timeout": float, "prepared_statements": _flag,
}  # fmt: skip


def _connect_options(options: dict[str, Any]) -> dict[str, Any]:
    """`quota.connect` keywords from storage options (which may arrive as strings from config)."""
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise ConfigurationError(
            f"unknown storage option(s) {', '.join(unknown)}; known: {', '.join(sorted(_OPTIONS))}"
        )
    converted: dict[str, Any] = {}
    for name, value in options.items():
        try:
            converted[name] = _OPTIONS[name](value) if isinstance(value, str) else value
        except ValueError as exc:
            raise ConfigurationError(f"storage option {name}={value!r} is not valid") from exc
    return converted


def _now() -> float:
    return time.time()


# -- the two faces: thin drivers ----------------------------------------------------


class _QuotaErrors:
    """What both storages raise for a failing store: limits wraps it when asked
    (``wrap_exceptions=True``)."""

    @property
    def base_exceptions(self) -> type[Exception] | tuple[type[Exception], ...]:
        return StorageError


class QuotaStorage(_QuotaErrors, Storage, SlidingWindowCounterSupport, TimestampedSlidingWindow):
    """A `limits` storage on a `quota` database, for synchronous code. Thread-safe.

    Built by `limits.storage.storage_from_string` from ``quota+<quota url>``.
    Raises `quota.ConfigurationError` for a URI or option `quota.connect`
    would refuse.
    """

    STORAGE_SCHEME = _schemes(asynchronous=False)

    def __init__(self, uri: str, wrap_exceptions: bool = False, **options: Any) -> None:
        super().__init__(uri, wrap_exceptions=wrap_exceptions)
        self.limiter: Limiter = connect(quota_url(uri, SYNC_PREFIX), **_connect_options(options))
        """The quota limiter whose store holds the counters."""
        self._table = _TableCheck()

    @property
    def storage(self) -> SyncStore:
        """The quota store that runs the statements, as limits' storages name their client
        here (flask-limiter's ``flask limiter config`` prints it as the backend)."""
        return self.limiter.store

    def _run(self, call: _Call[T]) -> T:
        check = self._table.before(call, self.limiter.store.dialect)
        if check is not None:
            self._run(check)
        if call.statement is None:
            return call.decode(())
        return call.decode(self.limiter.store.execute(call.statement, call.params))

    def incr(self, key: str, expiry: int, amount: int = 1) -> int:
        """Count `amount` hits on `key` and return its count.

        A hit that finds the count at 0 (no window running) starts a window
        that ends `expiry` seconds later, as in `limits`' own storages.
        """
        return self._run(incr(key, expiry, amount, _now()))

    def get(self, key: str) -> int:
        """`key`'s count in its running window (0 when none runs)."""
        return self._run(get(key, _now()))

    def get_expiry(self, key: str) -> float:
        """Epoch time at which `key`'s window ends (now when none runs)."""
        return self._run(get_expiry(key, _now()))

    def check(self) -> bool:
        """True when the database answers and the quota tables are current."""
        try:
            self.limiter.store.execute(CHECK, ())
        except StorageError:
            return False
        return True

    def reset(self) -> int | None:
        """Delete every counter this adapter wrote (and none of quota's own); return how many."""
        return self._run(reset())

    def clear(self, key: str) -> None:
        """Forget `key`'s fixed window."""
        self._run(clear(key))

    def acquire_sliding_window_entry(
        self, key: str, limit: int, expiry: int, amount: int = 1
    ) -> bool:
        """Take `amount` if the weighted count of the two windows stays within `limit`."""
        return self._run(acquire_sliding(key, limit, expiry, amount, _now()))

    def get_sliding_window(self, key: str, expiry: int) -> tuple[int, float, int, float]:
        """(previous count, previous TTL, current count, current TTL), as `limits` defines them."""
        return self._run(get_sliding(key, expiry, _now()))

    def clear_sliding_window(self, key: str, expiry: int) -> None:
        """Forget both windows of `key`."""
        self._run(clear_sliding(key, expiry, _now()))

    def close(self) -> None:
        """Close the database connections (they reopen if the storage is used again)."""
        self.limiter.close()


class AsyncQuotaStorage(
    _QuotaErrors, AsyncStorage, AsyncSlidingWindowCounterSupport, TimestampedSlidingWindow
):
    """A `limits.aio` storage on a `quota` database; see `QuotaStorage`.

    Built from ``async+quota+<quota url>``. It belongs to the event loop that
    first uses it.
    """

    STORAGE_SCHEME = _schemes(asynchronous=True)

    def __init__(self, uri: str, wrap_exceptions: bool = False, **options: Any) -> None:
        super().__init__(uri, wrap_exceptions=wrap_exceptions)
        self.limiter: AsyncLimiter = connect_async(
            quota_url(uri, ASYNC_PREFIX), **_connect_options(options)
        )
        """The quota limiter whose store holds the counters."""
        self._table = _TableCheck()

    @property
    def storage(self) -> AsyncStore:
        """See `QuotaStorage.storage`."""
        return self.limiter.store

    async def _run(self, call: _Call[T]) -> T:
        check = self._table.before(call, self.limiter.store.dialect)
        if check is not None:
            await self._run(check)
        if call.statement is None:
            return call.decode(())
        return call.decode(await self.limiter.store.execute(call.statement, call.params))

    async def incr(self, key: str, expiry: int, amount: int = 1) -> int:
        """See `QuotaStorage.incr`."""
        return await self._run(incr(key, expiry, amount, _now()))

    async def get(self, key: str) -> int:
        """See `QuotaStorage.get`."""
        return await self._run(get(key, _now()))

    async def get_expiry(self, key: str) -> float:
        """See `QuotaStorage.get_expiry`."""
        return await self._run(get_expiry(key, _now()))

    async def check(self) -> bool:
        """See `QuotaStorage.check`."""
        try:
            await self.limiter.store.execute(CHECK, ())
        except StorageError:
            return False
        return True

    async def reset(self) -> int | None:
        """See `QuotaStorage.reset`."""
        return await self._run(reset())

    async def clear(self, key: str) -> None:
        """See `QuotaStorage.clear`."""
        await self._run(clear(key))

    async def acquire_sliding_window_entry(
        self, key: str, limit: int, expiry: int, amount: int = 1
    ) -> bool:
        """See `QuotaStorage.acquire_sliding_window_entry`."""
        return await self._run(acquire_sliding(key, limit, expiry, amount, _now()))

    async def get_sliding_window(self, key: str, expiry: int) -> tuple[int, float, int, float]:
        """See `QuotaStorage.get_sliding_window`."""
        return await self._run(get_sliding(key, expiry, _now()))

    async def clear_sliding_window(self, key: str, expiry: int) -> None:
        """See `QuotaStorage.clear_sliding_window`."""
        await self._run(clear_sliding(key, expiry, _now()))

    async def aclose(self) -> None:
        """Close the database connections."""
        await self.limiter.aclose()
