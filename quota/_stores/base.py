"""What a store is, and how operations run on one.

A store talks to one database and nothing else: it runs statements
(`quota._sql.statements.Statement`) and hands rows back. It never decides. A SQL store renders a
statement's text for its driver; the memory and Redis stores look its
``name`` up in a table of handlers.

Two kinds of work reach a store:

* the hot path calls ``execute(statement, params)`` directly: one statement,
  one round trip, autocommit;
* everything else is an *operation* (`Op`): a generator that yields
  ``(statement, params)`` steps and receives each statement's rows back (the
  shape of httpx's ``auth_flow``; see `quota._sql.steps`). The same generator is
  driven by `drive` for the sync stores and by `adrive` for the async ones, so no
  logic is written twice. ``run(op, transaction=True)`` wraps the whole operation in
  one transaction; with ``transaction=False`` each statement commits on its
  own, but all run on one connection (a session lock taken by the first
  statement is released by the last).

Under a fallback (`quota._wrappers.fallback`) ``execute`` may be answered from
memory while the database is down; ``execute_strict`` never is: it raises
`quota.StoreDown` instead. On a store without a fallback the two are one.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, cast, runtime_checkable

from quota._core.errors import ConfigurationError
from quota._core.url import StoreURL
from quota._sql import statements as _sql
from quota._sql.statements import PG_TRY_LOCK, PG_UNLOCK, Statement
from quota._sql.steps import Op, Rows

# The operation protocol is the SQL layer's (`quota._sql.steps`); stores drive it.

T = TypeVar("T")
H = TypeVar("H")

#: The `time.monotonic` time by which the sync store call running in this thread is to be
#: decided, set by the fallback (`quota._wrappers.fallback.ResilientStore`) for the length
#: of the call: the sync batcher stops waiting for a batch at it, and the sync PostgreSQL
#: store cuts a connection that has not answered by it. None: no deadline.
call_deadline: ContextVar[float | None] = ContextVar("quota_call_deadline", default=None)


class SyncStore(Protocol):
    """A store driven from synchronous code. Safe to share between threads."""

    dialect: str

    @property
    def up(self) -> bool:
        """False while a fallback answers for the store (always True without one)."""
        ...

    def execute(self, statement: Statement, params: Sequence[Any]) -> Rows:
        """Run one statement in its own transaction and return its rows.

        Raises `StorageError` when the database fails (`SchemaError` for missing
        tables), `ConfigurationError` for a statement this kind of store cannot run.
        """
        ...

    def execute_strict(self, statement: Statement, params: Sequence[Any]) -> Rows:
        """`execute`, never answered by a fallback: raises `quota.StoreDown` while the
        store is down. The same as `execute` on a store without a fallback."""
        ...

    def run(self, op: Op[T], *, transaction: bool, maintenance: bool = False) -> T:
        """Drive `op` on one connection, in one transaction if `transaction`.

        Operations always reach the database, never a fallback: an operation
        that must be refused while the store is down (and held to the
        fallback's budget) is driven over `execute_strict` instead
        (``drive(op, store.execute_strict)``). A `maintenance` operation
        (cleanup) is no request-path call: under a fallback it runs without
        the fallback's time budget, with the timeouts the store has without
        one (PostgreSQL's own statement and lock timeouts; SQLite's busy
        timeout of a durable quota transaction).
        """
        ...

    def close(self) -> None:
        """Close every connection the store opened."""
        ...


class AsyncStore(Protocol):
    """A store driven from asyncio code. Safe to share between tasks of one loop."""

    dialect: str

    @property
    def up(self) -> bool:
        """See `SyncStore.up`."""
        ...

    async def execute(self, statement: Statement, params: Sequence[Any]) -> Rows:
        """See `SyncStore.execute`."""
        ...

    async def execute_strict(self, statement: Statement, params: Sequence[Any]) -> Rows:
        """See `SyncStore.execute_strict`."""
        ...

    async def run(self, op: Op[T], *, transaction: bool, maintenance: bool = False) -> T:
        """See `SyncStore.run`."""
        ...

    async def aclose(self) -> None:
        """Close every connection the store opened."""
        ...


@runtime_checkable
class InlineStore(AsyncStore, Protocol):
    """An async store whose statements may finish without yielding to the loop.

    `quota._wrappers.batching.AsyncBatchingStore` gathers calls by loop turn for such a
    store (the async SQLite store runs a statement on the loop's thread while
    the file is free).
    """

    def try_inline(self, statement: Statement, params: Sequence[Any]) -> Rows | None:
        """Run `statement` now, without yielding; None when it must be awaited instead."""
        ...


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreSettings:
    """What a store is opened with: the limiter's options, as the stores read them."""

    timeout: float
    """Seconds to wait: SQLite's busy timeout, Redis's socket timeout (the fallback's
    budget under one)."""
    connect_timeout: float
    """PostgreSQL: seconds to wait for a new connection."""
    statement_timeout: float | None
    """PostgreSQL: the server cuts a statement after this many seconds (None: never)."""
    db_clock: bool
    """Every statement takes the database's time."""
    serialize: bool
    """SQLite, sync face: one statement at a time (under a fallback)."""
    pool_size: int
    """Most connections the store opens."""
    idle_timeout: float
    """Seconds a pooled connection may stay idle."""
    relaxed: bool
    """PostgreSQL: commit without waiting for the WAL flush."""
    prepared_statements: bool | None
    """PostgreSQL: named prepared statements (None: as the URL says)."""
    schema: str | None
    """PostgreSQL: the schema of quota's tables (None: as the URL says)."""


def open_sync(parsed: StoreURL, settings: StoreSettings) -> SyncStore:
    """The sync store of `parsed`, opened by the module its declaration names
    (`quota._core.url.Dialect.module`)."""
    opener = importlib.import_module(parsed.kind.module).open_sync
    return cast(SyncStore, opener(parsed, settings))


def open_async(parsed: StoreURL, settings: StoreSettings) -> AsyncStore:
    """The async store of `parsed` (see `open_sync`)."""
    opener = importlib.import_module(parsed.kind.module).open_async
    return cast(AsyncStore, opener(parsed, settings))


#: What a store without SQL says it cannot run, by statement name (default: the statement).
_CANNOT = {
    PG_TRY_LOCK.name: "PostgreSQL advisory locks",
    PG_UNLOCK.name: "PostgreSQL advisory locks",
}


def unsupported(store: str, statement: object) -> ConfigurationError:
    """The error of a store without SQL (`store`: ``memory``, ``Redis``) for a statement
    it has no handler for."""
    name = getattr(statement, "name", None)
    if name is None:  # bare text (`quota._sql.statements.as_statement`)
        what = f"statement {str(statement)[:60]!r}…"
    else:
        what = _CANNOT.get(name, f"statement {name!r}")
    return ConfigurationError(
        f"the {store} store cannot run {what}: it keeps rate limits only (every algorithm);"
        " durable quotas and other SQL-only features need sqlite:// or postgresql://"
    )


#: The statements the memory and Redis stores run alike, each by the store's method of
#: that name (with these keywords). The two differ in the rest: resets, expiry, undo and
#: the hot hit.
_SHARED: tuple[tuple[Statement, str, dict[str, Any]], ...] = (
    (_sql.PEEK, "_peek", {}),
    (_sql.STATE_PEEK, "_state_peek", {}),
    (_sql.TOP, "_top", {}),
    (_sql.SLIDING_WINDOW, "_sliding", {}),
    (_sql.TOKEN_BUCKET, "_bucket", {}),
    (_sql.GCRA, "_gcra", {}),
    (_sql.HIT_DB_CLOCK, "_fixed", {"capped": False}),
    (_sql.HIT_DB_CLOCK_CAPPED, "_fixed", {"capped": True}),
    (_sql.LEASE_ACQUIRE, "_lease_acquire", {}),
    (_sql.LEASE_RENEW, "_lease_renew", {}),
    (_sql.LEASE_RELEASE, "_lease_release", {}),
    (_sql.LEASE_ABANDON, "_lease_abandon", {}),
    (_sql.LEASE_HOLDERS, "_lease_holders", {}),
    (_sql.LEASE_TOP, "_lease_top", {}),
    (_sql.PAUSE_SET, "_pause_set", {}),
    (_sql.PAUSE_LEFT, "_pause_left", {}),
)


def handlers(
    store: object, own: Mapping[Statement, Callable[[Any], H]]
) -> dict[str, Callable[[Sequence[Any]], H]]:
    """The handlers of a store without SQL by statement name, for dispatch on the name.

    The statements every such store runs alike (`_SHARED`) go to `store`'s methods
    of the same names; `own` maps each other statement the store keeps to its
    handler. A handler takes the statement's parameters: a tuple, or a mapping by
    name for a statement with ``:name`` parameters (wrapped here to read them so).
    """
    table: dict[Statement, Callable[[Any], H]] = {
        statement: functools.partial(getattr(store, method), **keywords)
        if keywords
        else getattr(store, method)
        for statement, method, keywords in _SHARED
    }
    assert not table.keys() & own.keys(), "a statement both stores run alike, given again"
    table.update(own)
    by_name: dict[str, Callable[[Sequence[Any]], H]] = {}
    for statement, handler in table.items():
        assert statement.name not in by_name, f"two statements named {statement.name!r}"
        by_name[statement.name] = _reading_names(statement, handler) if statement.names else handler
    return by_name


def _reading_names(
    statement: Statement, handler: Callable[[Any], H]
) -> Callable[[Sequence[Any]], H]:
    as_dict = statement.as_dict
    return lambda params: handler(as_dict(params))
