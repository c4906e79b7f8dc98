"""The memory store (``memory://``): every algorithm, in this process, bounded in size.

It speaks the same statements as the SQL stores (the `Statement` objects of
`quota._sql.statements`) and answers with rows of the same shape, so the limiters, the
operations of `quota._sql.ops` and the fail-open fallback drive it unchanged.
Each statement is looked up by its name in a table of handlers; the
algorithms are the pure transitions of `quota._core.algorithms` (the very
functions the SQL and Lua spell out), so a memory store decides exactly as a
database would from the same trace.

Rows live in one ordered dict, least recently used first, guarded by one
lock held for a dictionary update or two (nothing in here waits on I/O, so
the async face calls the same code directly). The dict holds at most
`max_keys` rows: a new row first drops up to two least recently used rows
that expired more than `IDLE_GRACE` seconds ago (the same as no row at all:
two windows after a sliding window's start, a token bucket full again, a
GCRA arrival time passed), then, when still full, the least
recently used row, live or not.

``memory://`` gives every `quota.connect` a store of its own.
``memory://NAME`` names a store shared by every limiter of this process that
uses the same name (sync and async faces alike), for as long as one of them
holds it. ``?max_keys=N`` bounds the rows (default 100,000).
"""

from __future__ import annotations

import functools
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar
from urllib.parse import parse_qsl

from quota._core.algorithms import bucket_step, gcra_step, sliding_step, window_start
from quota._core.decision import check_int
from quota._core.errors import ConfigurationError
from quota._core.parsing import parse_whole
from quota._core.url import StoreURL
from quota._sql import statements as _sql
from quota._sql.statements import Statement
from quota._sql.steps import Op, Rows, drive
from quota._stores.base import StoreSettings, handlers, unsupported

T = TypeVar("T")

DEFAULT_MAX_KEYS = 100_000
#: Seconds past its expiry before an idle row may be dropped to make room:
#: covers a clock stepped back, and keeps a token bucket's refill exactly at
#: its capacity when its row is dropped.
IDLE_GRACE = 60.0

# One row is a list, indexed by these (a counter of the fixed window, or the
# state of another algorithm; the columns of quota_counters / quota_state):
_VALUE = 0  # count, or value
_EXPIRES = 1  # window end, or expires_at
_CLIENT = 2  # client_key
_WINDOW = 3  # window_seconds
_START = _PREV = 4  # window_start, or prev_value
_CREATED = _STAMP = 5  # when the window's row was made (nothing reads it), or stamp
_STATE = 6  # False for a counter, True for algorithm state


class _Table:
    """The rows of one store, its client index and its lock: what `memory://NAME` shares."""

    __slots__ = ("__weakref__", "clients", "leases", "lock", "max_keys", "rows")

    def __init__(self, max_keys: int) -> None:
        self.rows: OrderedDict[str, list[Any]] = OrderedDict()
        #: client_key -> bucket keys of its rows, so a reset never scans every row.
        self.clients: dict[str, set[str]] = {}
        self.lock = threading.Lock()
        self.max_keys = max_keys
        #: Concurrency leases: lease_key -> slot -> [holder, slots, acquired_at, expires_at]
        #: (the rows of quota_leases; outside `max_keys`, as each is held by a live block).
        self.leases: dict[str, dict[int, list[Any]]] = {}


_named: weakref.WeakValueDictionary[str, _Table] = weakref.WeakValueDictionary()
_named_lock = threading.Lock()


def _table(name: str, max_keys: int) -> _Table:
    if not name:
        return _Table(max_keys)
    with _named_lock:
        table = _named.get(name)
        if table is None:
            table = _named[name] = _Table(max_keys)
        elif table.max_keys != max_keys:
            raise ConfigurationError(
                f"memory store {name!r} already exists with max_keys={table.max_keys};"
                f" got max_keys={max_keys}"
            )
        return table


def parse_target(target: str) -> tuple[str, int]:
    """``NAME?max_keys=N`` (both optional) from a ``memory://`` URL, as (name, max_keys).

    Raises `ConfigurationError` for an unknown option or a bad `max_keys`.
    """
    name, _, query = target.partition("?")
    max_keys: object = DEFAULT_MAX_KEYS
    for option, value in parse_qsl(query, keep_blank_values=True):
        if option != "max_keys":
            raise ConfigurationError(
                f"unknown option {option!r} in memory://{target}; the only one is max_keys"
            )
        whole = parse_whole(value)
        max_keys = value if whole is None else whole
    return name.strip("/"), check_int("max_keys", max_keys, maximum=10**9)


class MemoryStore:
    """Sync memory store; thread-safe. See the module docstring."""

    dialect = "memory"

    def __init__(
        self, *, max_keys: int = DEFAULT_MAX_KEYS, name: str = "", db_clock: bool = False
    ) -> None:
        check_int("max_keys", max_keys, maximum=10**9)
        table = _table(name, max_keys)
        self.name = name
        self.db_clock = db_clock
        self._table = table  # keeps a named table alive while this store lives
        self._rows = table.rows
        self._get = table.rows.get  # bound once: the hot path calls them per decision
        self._touch = table.rows.move_to_end
        self._clients = table.clients
        self._lock = table.lock
        self._max_keys = max_keys
        statements: dict[Statement, Callable[[Any], Rows]] = {
            _sql.HIT: self._hit,
            _sql.HIT_CAPPED: self._hit_capped,
            _sql.RESET_ALL: functools.partial(self._reset, state=False),
            _sql.RESET_WINDOW: functools.partial(self._reset, state=False),
            _sql.STATE_RESET_ALL: functools.partial(self._reset, state=True),
            _sql.STATE_RESET_WINDOW: functools.partial(self._reset, state=True),
            _sql.COUNT_EXPIRED: functools.partial(self._count_expired, state=False),
            _sql.STATE_COUNT_EXPIRED: functools.partial(self._count_expired, state=True),
            _sql.DELETE_EXPIRED: functools.partial(self._delete_expired, state=False),
            _sql.STATE_DELETE_EXPIRED: functools.partial(self._delete_expired, state=True),
            _sql.SCHEMA_VERSION: self._schema_version,
            _sql.LEASE_COUNT_EXPIRED: self._lease_count_expired,
            _sql.LEASE_DELETE_EXPIRED: self._lease_delete_expired,
        }
        for statement, (state, give_back) in _UNDO.items():
            statements[statement] = functools.partial(self._undo, state, give_back)
        self._leases = table.leases
        #: Statement name -> handler: every statement this store keeps.
        self._handlers = handlers(self, statements)

    def __len__(self) -> int:
        """Rows held: counters and algorithm state."""
        return len(self._rows)

    #: No fallback answers for a memory store.
    up = True

    def execute(self, statement: Statement, params: Sequence[Any]) -> Rows:
        """Run one statement of `quota._sql.statements` atomically; see `quota._stores.base.SyncStore.execute`.

        Raises `ConfigurationError` for a statement the memory store does not keep.
        """
        # `_dispatch`, inline: one call less on the hot path.
        try:
            handler = self._handlers[statement.name]
        except (KeyError, AttributeError):  # AttributeError: bare text, no statement
            raise unsupported("memory", statement) from None
        lock = self._lock
        lock.acquire()
        try:
            return handler(params)
        finally:
            lock.release()

    execute_strict = execute

    def run(self, op: Op[T], *, transaction: bool, maintenance: bool = False) -> T:
        """Drive `op`; with `transaction`, under the lock, so no other call interleaves.
        (`maintenance` changes nothing: memory has no time budget.)"""
        if not transaction:
            return drive(op, self.execute)
        with self._lock:
            return drive(op, self._dispatch)

    def close(self) -> None:
        """Nothing to close: the rows stay, as a database's would, until the store is dropped."""

    # -- statements (the lock is held) ----------------------------------------------------

    def _dispatch(self, statement: Statement, params: Sequence[Any]) -> Rows:
        try:
            handler = self._handlers[statement.name]
        except (KeyError, AttributeError):
            raise unsupported("memory", statement) from None
        return handler(params)

    def _insert(self, bucket_key: str, row: list[Any], now: float) -> None:
        rows = self._rows
        if rows:
            # Idle rows expire first (the least recently used sit at the front).
            for _ in range(2):
                head = next(iter(rows))
                if rows[head][_EXPIRES] + IDLE_GRACE >= now:
                    break
                self._drop(head)
                if not rows:
                    break
            if len(rows) >= self._max_keys:
                self._drop(next(iter(rows)))
        rows[bucket_key] = row
        client = row[_CLIENT]
        keys = self._clients.get(client)
        if keys is None:
            self._clients[client] = {bucket_key}
        else:
            keys.add(bucket_key)

    def _drop(self, bucket_key: str) -> None:
        row = self._rows.pop(bucket_key)
        client = row[_CLIENT]
        keys = self._clients[client]
        keys.discard(bucket_key)
        if not keys:
            del self._clients[client]

    def _hit(self, params: Sequence[Any]) -> Rows:
        # The hot path: a running window is one lookup, one move and one add.
        bucket_key = params[0]
        row = self._get(bucket_key)
        if row is None:
            _, client_key, start, window, cost, now = params[:6]
            self._insert(bucket_key, [cost, start + window, client_key, window, start, now, False], now)  # fmt: skip
            return ((cost,),)
        self._touch(bucket_key)
        count = row[_VALUE] = row[_VALUE] + params[4]
        return ((count,),)

    def _hit_capped(self, params: Sequence[Any]) -> Rows:
        """As SQL: a new window takes the hit; a running one only while it stays within `limit`."""
        row = self._rows.get(params[0])
        if row is not None and row[_VALUE] + params[4] > params[6]:
            return ()
        return self._hit(params)

    def _peek(self, params: Sequence[Any]) -> Rows:
        row = self._rows.get(params[0])
        return () if row is None or row[_STATE] else ((row[_VALUE],),)

    def _state_peek(self, params: Sequence[Any]) -> Rows:
        row = self._rows.get(params[0])
        return () if row is None or not row[_STATE] else ((row[_VALUE], row[_PREV], row[_STAMP]),)

    def _reset(self, params: Sequence[Any], *, state: bool) -> Rows:
        """Params: client_key (and window_seconds)."""
        client_key, window = params[0], params[1] if len(params) > 1 else None
        doomed = [
            bucket_key
            for bucket_key in self._clients.get(client_key, ())
            if self._rows[bucket_key][_STATE] is state
            and (window is None or self._rows[bucket_key][_WINDOW] == window)
        ]
        for bucket_key in doomed:
            self._drop(bucket_key)
        return [(1,)] * len(doomed)

    def _expired(self, cutoff: float, *, state: bool) -> list[str]:
        return [
            bucket_key
            for bucket_key, row in self._rows.items()
            if row[_STATE] is state and row[_EXPIRES] < cutoff
        ]

    def _count_expired(self, params: Sequence[Any], *, state: bool) -> Rows:
        """Params: cutoff."""
        return ((len(self._expired(params[0], state=state)),),)

    def _delete_expired(self, params: Sequence[Any], *, state: bool) -> Rows:
        """Params: cutoff, batch size (and cutoff)."""
        doomed = self._expired(params[0], state=state)[: params[1]]
        for bucket_key in doomed:
            self._drop(bucket_key)
        return [(1,)] * len(doomed)

    def _top(self, params: Sequence[Any]) -> Rows:
        now, limit = params
        live = [
            (row[_CLIENT], row[_WINDOW], row[_START], row[_VALUE])
            for row in self._rows.values()
            if not row[_STATE] and row[_EXPIRES] > now
        ]
        live.sort(key=lambda r: (-r[3], r[0]))
        return live[:limit]

    def _schema_version(self, params: Sequence[Any]) -> Rows:
        # A memory store is always "migrated": the fallback's health probe asks this.
        from quota._sql.schema import REQUIRED

        return ((REQUIRED,),)

    # -- the algorithms: quota._core.algorithms' transitions, as the SQL runs them -------------

    def _now(self, params: Mapping[str, Any]) -> float:
        return time.time() if self.db_clock else float(params["now"])

    def _state(self, params: Mapping[str, Any]) -> list[Any] | None:
        row = self._rows.get(params["bucket_key"])
        if row is not None:
            self._rows.move_to_end(params["bucket_key"])
        return row

    def _store(self, params: Mapping[str, Any], row: list[Any] | None, value: float,
               prev: float, stamp: float, expires: float, now: float) -> None:  # fmt: skip
        if row is None:
            new = [value, expires, params["client_key"], params["window"], prev, stamp, True]
            self._insert(params["bucket_key"], new, now)
        else:
            row[_VALUE], row[_PREV], row[_STAMP], row[_EXPIRES] = value, prev, stamp, expires

    def _sliding(self, params: Mapping[str, Any]) -> Rows:
        now, window = self._now(params), params["window"]
        row = self._state(params)
        state = None if row is None else (row[_VALUE], row[_PREV], row[_STAMP])
        (value, prev, stamp), allowed = sliding_step(
            state, now, window, params["limit"], params["cost"]
        )
        self._store(params, row, value, prev, stamp, stamp + 2 * window, now)
        return ((value, prev, stamp, int(allowed), now),)

    def _bucket(self, params: Mapping[str, Any]) -> Rows:
        now, capacity, rate = self._now(params), params["capacity"], params["rate"]
        row = self._state(params)
        state = None if row is None else (row[_VALUE], row[_STAMP])
        (tokens, stamp), allowed = bucket_step(state, now, capacity, rate, params["cost"])
        # Full again then; the same as no row from that moment on.
        self._store(params, row, tokens, 0.0, stamp, stamp + (capacity - tokens) / rate, now)
        return ((tokens, int(allowed), now),)

    def _gcra(self, params: Mapping[str, Any]) -> Rows:
        now = self._now(params)
        row = self._state(params)
        tat, allowed = gcra_step(
            None if row is None else row[_VALUE], now, params["increment"], params["tolerance"]
        )
        self._store(params, row, tat, 0.0, 0.0, tat, now)
        return ((tat, int(allowed), now),)

    def _fixed(self, params: Mapping[str, Any], *, capped: bool) -> Rows:
        """The fixed window as a named statement (the database clock's form): key built here."""
        now, window, client_key = self._now(params), params["window"], params["client_key"]
        start = int(window_start(now, window))
        hit = (f"{window}:{start}:{client_key}", client_key, start, window, params["cost"], now)
        rows = self._hit_capped((*hit, params["limit"])) if capped else self._hit(hit)
        return ((rows[0][0], start, now),) if rows else ()

    # -- pauses: quota._sql.statements' PAUSE_* as the SQL runs them ----------------------------

    def _pause_set(self, params: Mapping[str, Any]) -> Rows:
        now = self._now(params)
        until = now + params["horizon"] if self.db_clock else params["expires"]
        row = self._state(params)
        if row is None:
            value = until
            self._insert(
                params["bucket_key"], [until, until, params["client_key"], 0, 0.0, now, True], now
            )
        else:
            row[_VALUE] = value = max(row[_VALUE], until)
            row[_STAMP], row[_EXPIRES] = now, max(row[_EXPIRES], until)
        return ((value, now),)

    def _pause_left(self, params: Mapping[str, Any]) -> Rows:
        now = self._now(params)
        row = self._rows.get(params["bucket_key"])
        return () if row is None or row[_VALUE] <= now else ((row[_VALUE] - now,),)

    # -- giving a hit back: quota._sql.statements' UNDO_* as the SQL runs them -------------------

    def _undo(self, state: bool, give_back: _GiveBack, params: Mapping[str, Any]) -> Rows:
        """Give a hit back to the row of `params` (`give_back`, one per algorithm): the
        value after, or no row when there is none of that kind (`state`)."""
        row = self._rows.get(params["bucket_key"])
        if row is None or row[_STATE] is not state:
            return ()
        give_back(row, params)
        return ((row[_VALUE],),)

    # -- concurrency leases: quota._sql.statements' LEASE_* as the SQL runs them ---------------

    def _lease_acquire(self, params: Mapping[str, Any]) -> Rows:
        now, slots, first = self._now(params), params["slots"], params["first"]
        held = self._leases.setdefault(params["lease_key"], {})
        if sum(1 for lease in held.values() if lease[3] > now) >= slots:
            return ()
        for n in range(slots):
            slot = (n + first) % slots
            lease = held.get(slot)
            if lease is None or lease[3] <= now:
                expires = now + params["horizon"] if self.db_clock else params["expires"]
                held[slot] = [params["holder"], slots, now, expires]
                return ((slot,),)
        return ()  # pragma: no cover - the count above found a free slot

    def _lease(self, key: str, slot: int, holder: str) -> list[Any] | None:
        lease = self._leases.get(key, {}).get(slot)
        return lease if lease is not None and lease[0] == holder else None

    def _lease_renew(self, params: Mapping[str, Any]) -> Rows:
        lease = self._lease(params["lease_key"], params["slot"], params["holder"])
        if lease is None:
            return ()
        now = self._now(params)
        lease[3] = now + params["horizon"] if self.db_clock else params["expires"]
        return ((params["slot"],),)

    def _lease_release(self, params: Sequence[Any]) -> Rows:
        key, slot, holder = params
        if self._lease(key, slot, holder) is None:
            return ()
        self._drop_lease(key, slot)
        return ((1,),)

    def _drop_lease(self, key: str, slot: int) -> None:
        held = self._leases[key]
        del held[slot]
        if not held:
            del self._leases[key]

    def _lease_abandon(self, params: Sequence[Any]) -> Rows:
        key, holder = params
        doomed = [slot for slot, lease in self._leases.get(key, {}).items() if lease[0] == holder]
        for slot in doomed:
            self._drop_lease(key, slot)
        return [(1,)] * len(doomed)

    def _lease_holders(self, params: Mapping[str, Any]) -> Rows:
        now = self._now(params)
        held = self._leases.get(params["lease_key"], {})
        return [(slot, *held[slot]) for slot in sorted(held) if held[slot][3] > now]

    def _lease_top(self, params: Mapping[str, Any]) -> Rows:
        now = self._now(params)
        rows = []
        for key, held in self._leases.items():
            live = [lease for lease in held.values() if lease[3] > now]
            if live:
                rows.append(
                    (
                        key,
                        len(live),
                        max(lease[1] for lease in live),
                        min(lease[3] for lease in live),
                    )
                )
        rows.sort(key=lambda r: (-r[1], r[0]))
        return rows[: params["n"]]

    def _dead_leases(self, cutoff: float) -> list[tuple[str, int]]:
        return [
            (key, slot)
            for key, held in self._leases.items()
            for slot, lease in held.items()
            if lease[3] < cutoff
        ]

    def _lease_count_expired(self, params: Sequence[Any]) -> Rows:
        """Params: cutoff."""
        return ((len(self._dead_leases(params[0])),),)

    def _lease_delete_expired(self, params: Sequence[Any]) -> Rows:
        """Params: cutoff, batch size (and cutoff)."""
        doomed = self._dead_leases(params[0])[: params[1]]
        for key, slot in doomed:
            self._drop_lease(key, slot)
        return [(1,)] * len(doomed)


_GiveBack = Callable[[list[Any], Mapping[str, Any]], None]


def _undo_fixed(row: list[Any], params: Mapping[str, Any]) -> None:
    row[_VALUE] = max(row[_VALUE] - params["cost"], 0)


def _undo_sliding(row: list[Any], params: Mapping[str, Any]) -> None:
    if row[_STAMP] == params["stamp"]:
        row[_VALUE] = max(row[_VALUE] - params["cost"], 0.0)
    elif row[_STAMP] == params["stamp"] + params["window"]:
        row[_PREV] = max(row[_PREV] - params["cost"], 0.0)


def _undo_bucket(row: list[Any], params: Mapping[str, Any]) -> None:
    row[_VALUE] = min(row[_VALUE] + params["cost"], params["capacity"])


def _undo_gcra(row: list[Any], params: Mapping[str, Any]) -> None:
    row[_VALUE] = row[_VALUE] - params["increment"]


#: Each UNDO_* statement: whether it gives back to algorithm state (else to a counter), and how.
_UNDO: dict[Statement, tuple[bool, _GiveBack]] = {
    _sql.UNDO_FIXED_WINDOW: (False, _undo_fixed),
    _sql.UNDO_SLIDING_WINDOW: (True, _undo_sliding),
    _sql.UNDO_TOKEN_BUCKET: (True, _undo_bucket),
    _sql.UNDO_GCRA: (True, _undo_gcra),
}


class AsyncMemoryStore:
    """The async face of `MemoryStore`: the same core, called directly (nothing in it waits)."""

    dialect = "memory"

    def __init__(
        self, *, max_keys: int = DEFAULT_MAX_KEYS, name: str = "", db_clock: bool = False
    ) -> None:
        self.sync = MemoryStore(max_keys=max_keys, name=name, db_clock=db_clock)

    def __len__(self) -> int:
        return len(self.sync)

    up = True

    async def execute(self, statement: Statement, params: Sequence[Any]) -> Rows:
        """See `MemoryStore.execute`."""
        return self.sync.execute(statement, params)

    execute_strict = execute

    async def run(self, op: Op[T], *, transaction: bool, maintenance: bool = False) -> T:
        """See `MemoryStore.run`."""
        return self.sync.run(op, transaction=transaction)

    async def aclose(self) -> None:
        """See `MemoryStore.close`."""
        self.sync.close()


def open_sync(parsed: StoreURL, settings: StoreSettings) -> MemoryStore:
    """The sync store of a ``memory://`` URL (`quota._core.url.DIALECTS`)."""
    name, max_keys = parse_target(parsed.target)
    return MemoryStore(max_keys=max_keys, name=name, db_clock=settings.db_clock)


def open_async(parsed: StoreURL, settings: StoreSettings) -> AsyncMemoryStore:
    """The async store of a ``memory://`` URL."""
    name, max_keys = parse_target(parsed.target)
    return AsyncMemoryStore(max_keys=max_keys, name=name, db_clock=settings.db_clock)
