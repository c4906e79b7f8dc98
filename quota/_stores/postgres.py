"""PostgreSQL stores: `asyncpg` for the async face, `psycopg` 3 for the sync one.

Both faces borrow a connection from a bounded pool (at most ``pool_size``)
for one call and give it back clean: a connection that comes back from a
cancelled or failed call, or with a transaction still open, is rolled back
or closed before anyone reuses it. Statements run in autocommit, so a
decision is one round trip.

Two connection modes:

* **direct** (the default; also a session-mode pooler): each connection
  prepares its statements once (asyncpg prepared statements of the store's
  own; psycopg ``prepare_threshold=0``) and gets its session settings (the
  fallback's time budget, relaxed durability) by one ``SET`` right after it
  opens. Nothing but the database, user and password is sent at startup,
  so a pooler never refuses the connection.
* **transaction pooler** (``prepared_statements=False``, for PgBouncer's
  transaction mode and poolers like it): no named prepared statements and no
  session state at all, since consecutive statements may reach different
  server connections. The time budget is held by the client instead
  (asyncpg's per-call timeout; on the sync face a watchdog thread that
  cancels a statement past its deadline); settings a transaction needs are
  ``SET LOCAL``.

psycopg is an optional extra: ``pip install 'quota[postgres]'``.
"""

from __future__ import annotations

import asyncio
import contextlib
import select
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import asyncpg

from quota._core.errors import ConfigurationError, QuotaError, StorageError
from quota._core.redaction import redact
from quota._core.url import StoreURL
from quota._sql import partitions as _partitions
from quota._sql import statements as _sql
from quota._sql.schema import accepted_version, check_version, missing_objects_error
from quota._sql.statements import Statement
from quota._sql.steps import Op, Rows, adrive, drive
from quota._stores.base import StoreSettings, call_deadline
from quota._stores.pool import (
    DEFAULT_IDLE_TIMEOUT,
    SyncPool,
    busy_message,
    reap_period,
    stale_count,
)

if TYPE_CHECKING:
    import psycopg

T = TypeVar("T")
T2 = TypeVar("T2")

#: Inside a multi-statement transaction: lift the fallback's time budget.
UNBUDGETED_TRANSACTION = (
    "SELECT set_config('statement_timeout', '30s', true), set_config('lock_timeout', '30s', true)"
)
#: ... and, under ``durability="relaxed"``, keep durable quota commits synchronous.
DURABLE_TRANSACTION = "SET LOCAL synchronous_commit = on"
#: A maintenance operation under a fallback (``run(..., maintenance=True)``, no
#: transaction): the session's statement and lock timeouts back to what they are without
#: the fallback (the server's, the role's or the database's), until `budget_settings`
#: puts the budget back before the connection serves anything else.
UNBUDGETED_SESSION = (
    "SELECT set_config('statement_timeout',"
    " (SELECT reset_val FROM pg_settings WHERE name = 'statement_timeout'), false),"
    " set_config('lock_timeout',"
    " (SELECT reset_val FROM pg_settings WHERE name = 'lock_timeout'), false)"
)


def budget_settings(statement_timeout: float) -> str:
    """The statement that puts a fallback's time budget on a direct connection."""
    settings = session_settings(False, statement_timeout)
    assert settings is not None
    return settings


def session_settings(
    relaxed: bool, statement_timeout: float | None, schema: str | None = None
) -> str | None:
    """The statement a direct connection runs once when it opens: durability, time budget
    and the schema of quota's tables."""
    settings = [("synchronous_commit", "off")] if relaxed else []
    if statement_timeout:
        ms = str(max(1, int(statement_timeout * 1000)))
        settings += [("statement_timeout", ms), ("lock_timeout", ms)]
    if schema:
        settings.append(("search_path", f'"{schema}"'))
    if not settings:
        return None
    return "SELECT " + ", ".join(
        f"set_config('{name}', '{value}', false)" for name, value in settings
    )


def check_pooler_options(
    url: str, prepared_statements: bool, relaxed: bool, schema: str | None = None
) -> None:
    """Refuse what a transaction pooler cannot do: session-wide settings."""
    if prepared_statements:
        return
    if relaxed:
        raise ConfigurationError(
            f"durability='relaxed' with prepared_statements=False ({redact(url)}): behind a"
            " transaction pooler a session SET would reach other clients' connections; set it"
            " on the role instead (ALTER ROLE … SET synchronous_commit = off) and leave"
            " durability='full'"
        )
    if schema:
        raise ConfigurationError(
            f"schema={schema!r} with prepared_statements=False ({redact(url)}): behind a"
            " transaction pooler a session search_path would reach other clients' connections;"
            f' set it on the role instead (ALTER ROLE … SET search_path = "{schema}") and leave'
            " schema out of the URL (quota migrate still takes it)"
        )


def _is_undefined_table(exc: BaseException) -> bool:
    # asyncpg.UndefinedTableError and psycopg.errors.UndefinedTable both carry SQLSTATE 42P01.
    return getattr(exc, "sqlstate", None) == "42P01"


def _is_undefined_column(exc: BaseException) -> bool:
    # undefined_column: a column a later migration adds (`quota._sql.schema.COLUMN_REVISIONS`).
    return getattr(exc, "sqlstate", None) == "42703"


#: SQLSTATEs of prepared statements a transaction pooler lost or mixed up:
#: invalid_sql_statement_name ("does not exist") and duplicate_prepared_statement.
_POOLER_SQLSTATES = ("26000", "42P05")
#: SQLSTATE classes of an outage rather than of a statement: connection
#: exception, insufficient resources, operator intervention (shutdown, the
#: statement timeout's query_canceled), system error; and lock_not_available
#: (the lock timeout).
_OUTAGE_CLASSES = ("08", "53", "57", "58", "XX")


def is_outage(exc: BaseException) -> bool:
    """True when `exc` says the database is unreachable, overloaded or too slow, not that a
    statement is wrong: only such errors may mark a store down (`quota._wrappers.fallback`)."""
    sqlstate = getattr(exc, "sqlstate", None)
    if sqlstate is None:
        return True  # no answer from the server at all: a socket, a timeout, a closed connection
    return sqlstate[:2] in _OUTAGE_CLASSES or sqlstate == "55P03"


def _dead_on_arrival(exc: BaseException) -> bool:
    """True when asyncpg refused to start a call because the connection was not idle.

    A connection idle in the pool that the server terminates (a restart, a
    failover, ``pg_terminate_backend``) receives an error message it did not
    ask for; asyncpg then holds it in an error state until the socket's close
    arrives, and refuses the next operation before sending anything ("cannot
    switch to state …; another operation … is in progress"). Nothing reached
    the server, so the call may go to another connection.
    """
    return isinstance(exc, asyncpg.InternalClientError) and "cannot switch to state" in str(exc)


def wrap_error(exc: BaseException, url: str) -> QuotaError:
    """The `quota` error for a driver error: a missing table becomes `SchemaError`."""
    if isinstance(exc, QuotaError):
        return exc
    if _is_undefined_table(exc) or _is_undefined_column(exc):
        return missing_objects_error(url, str(exc), accepted_version(url))
    if _dead_on_arrival(exc):
        exc_text = (
            "the server closed the connection (a restart, a failover or a terminated backend)"
        )
        return StorageError(f"PostgreSQL error on {redact(url)}: {exc_text}")
    message = f"PostgreSQL error on {redact(url)}: {type(exc).__name__}: {exc}"
    if getattr(exc, "sqlstate", None) in _POOLER_SQLSTATES:
        message += (
            "; a transaction pooler (PgBouncer) in front of the database loses prepared"
            " statements: connect with prepared_statements=False (or ?prepared_statements=false)"
        )
    if isinstance(exc, TimeoutError) and not str(exc):
        message += "the call outlived its time budget"
    return StorageError(message, outage=is_outage(exc))


#: What a prepared statement raises once the schema changed under it.
_STALE_STATEMENT = (
    asyncpg.exceptions.InvalidCachedStatementError,
    asyncpg.exceptions.OutdatedSchemaCacheError,
)


class _Pool:
    """The async store's pool: idle connections on a stack, at most `size` open.

    asyncpg's own pool costs several coroutine hops, a proxy object and a
    reset per acquire/release: as much client CPU as the hot statement
    itself. The hot path holds a connection for exactly one statement, so a
    stack of idle connections and a queue of waiters is all it needs.

    Only a clean connection goes back on the stack (`release`): one that
    comes back from a cancelled call, an outage-class error or with a
    transaction open is closed instead (`discard`), and its slot reopens on
    demand, so no caller ever finds a connection mid-operation or
    mid-transaction. Connections idle for `idle_timeout` seconds are closed.
    """

    def __init__(
        self, dsn: str, size: int, timeout: float, wait_timeout: float, *,
        setup: str | None, prepared_statements: bool, idle_timeout: float,
    ) -> None:  # fmt: skip
        self._dsn = dsn
        self._setup = setup
        self._statement_cache = 100 if prepared_statements else 0
        self._size = size
        self._timeout = timeout
        self._wait_timeout = wait_timeout
        self._idle_timeout = idle_timeout
        #: Idle connections, most recently released last, with their release time.
        self._idle: list[tuple[asyncpg.Connection, float]] = []
        self._waiters: deque[asyncio.Future[asyncpg.Connection | None]] = deque()
        self._open = 0
        self._all: set[asyncpg.Connection] = set()
        self._reaper: asyncio.TimerHandle | None = None
        self._settling: set[asyncio.Task[None]] = set()
        self._closed = False
        #: Each open connection's prepared statements, by text (see `AsyncPostgresStore.execute`).
        self.prepared: dict[asyncpg.Connection, dict[str, Any]] = {}

    @property
    def open(self) -> int:
        """Connections open now, idle or lent."""
        return self._open

    def try_acquire(self) -> asyncpg.Connection | None:
        """An idle connection without awaiting anything, or None.

        One the server closed while it sat idle (a restart, a failover,
        ``pg_terminate_backend``, an idle timeout) is closed here instead of
        being lent: nothing is ever sent on it.
        """
        while self._idle:
            conn = self._idle.pop()[0]
            if not conn.is_closed():
                return conn
            self.discard(conn)
        return None

    async def acquire(self) -> asyncpg.Connection:
        conn = self.try_acquire()
        if conn is not None:
            return conn
        while True:
            if self._closed:
                raise StorageError("the connection pool is closed")
            if self._open < self._size:
                self._open += 1
                # A caller cancelled while the connection opens does not waste it:
                # it joins the pool when it is ready (asyncpg would also log an
                # unretrieved error for a connect cancelled half way).
                opening = asyncio.ensure_future(self.connect())
                try:
                    conn = await asyncio.shield(opening)
                except asyncio.CancelledError:
                    opening.add_done_callback(self._opened_late)
                    raise
                except BaseException:
                    self._open -= 1
                    self._wake(None)
                    raise
                self._adopt(conn)
                return conn
            waiter: asyncio.Future[asyncpg.Connection | None] = (
                asyncio.get_running_loop().create_future()
            )
            self._waiters.append(waiter)
            try:
                handed = await asyncio.wait_for(waiter, self._wait_timeout)
            except BaseException as exc:
                # Cancelled just as a connection was handed over: pass it on.
                if waiter.done() and not waiter.cancelled() and waiter.result() is not None:
                    self.release(waiter.result())
                if isinstance(exc, asyncio.TimeoutError):
                    raise StorageError(busy_message(self._size, self._wait_timeout)) from exc
                raise
            if handed is not None:
                return handed
            # None: a slot was freed by a dropped connection; go round and open one.

    def _adopt(self, conn: asyncpg.Connection) -> None:
        self._all.add(conn)
        self.prepared[conn] = {}

    def _opened_late(self, opening: asyncio.Future[asyncpg.Connection]) -> None:
        """A connection whose opener was cancelled: into the pool, or its slot freed."""
        if opening.cancelled() or opening.exception() is not None:
            self._open -= 1
            self._wake(None)
            return
        conn = opening.result()
        self._adopt(conn)
        self.release(conn)

    async def connect(self) -> asyncpg.Connection:
        """A new connection set up like the pool's, not counted in it: the caller closes it."""
        conn: asyncpg.Connection = await asyncpg.connect(
            self._dsn, timeout=self._timeout, statement_cache_size=self._statement_cache
        )
        if self._setup is not None:
            try:
                await asyncio.wait_for(conn.execute(self._setup), self._timeout)
            except BaseException:
                conn.terminate()
                raise
        return conn

    def release(self, conn: asyncpg.Connection) -> None:
        """Give back a connection whose last call ended cleanly (no transaction open).

        One the server closed is not handed to a waiter; one left idle is found
        out by `try_acquire` before it is lent again.
        """
        if self._closed or (self._waiters and conn.is_closed()):
            self.discard(conn)
        elif not (self._waiters and self._wake(conn)):
            self._idle.append((conn, time.monotonic()))
            if self._reaper is None:
                self._schedule_reap()

    def discard(self, conn: asyncpg.Connection) -> None:
        """Close a connection that must not be reused; its slot reopens on demand.

        `terminate` closes the socket at once (no await, so a cancelled
        caller can do it too); the server rolls back whatever the connection
        had open.
        """
        if conn in self._all:
            self._all.discard(conn)
            self.prepared.pop(conn, None)
            self._open -= 1
            self._wake(None)
        if not conn.is_closed():
            conn.terminate()

    def settle(self, conn: asyncpg.Connection) -> None:
        """Take back a connection whose call was cancelled or timed out, once it is idle again.

        asyncpg has sent the server a cancel request for the statement in
        flight. Closing the socket at once would drop that request, and a
        statement waiting on a lock would go on and commit later (a hit the
        caller was told nothing about, or counted twice once a fallback
        decided it too). A task waits for the cancel to land, rolls back
        whatever was left open and gives the connection back, or closes it if
        any of that fails; its slot stays taken meanwhile.
        """
        if conn.is_closed():
            self.discard(conn)
            return
        task = asyncio.get_running_loop().create_task(self._settle(conn))
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    async def _settle(self, conn: asyncpg.Connection) -> None:
        try:
            # asyncpg sends nothing before the cancel has been answered; a
            # ROLLBACK outside a transaction is only a warning.
            await asyncio.wait_for(conn.execute("ROLLBACK"), self._timeout)
        except BaseException:
            self.discard(conn)
            return
        self.release(conn)

    def _wake(self, conn: asyncpg.Connection | None) -> bool:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(conn)
                return True
        return False

    def _schedule_reap(self) -> None:
        loop = asyncio.get_running_loop()
        self._reaper = loop.call_later(reap_period(self._idle_timeout), self.reap)

    def reap(self) -> int:
        """Close connections idle for longer than `idle_timeout`; return how many."""
        self._reaper = None
        cutoff = time.monotonic() - self._idle_timeout
        stale = stale_count(self._idle, cutoff)
        for conn, _ in self._idle[:stale]:
            self.discard(conn)
        del self._idle[:stale]
        if self._idle and not self._closed:
            self._schedule_reap()
        return stale

    async def close(self) -> None:
        """Close the idle connections; each lent one is closed when it comes back."""
        self._closed = True
        if self._reaper is not None:
            self._reaper.cancel()
            self._reaper = None
        idle, self._idle = [conn for conn, _ in self._idle], []
        for conn in idle:
            self._all.discard(conn)
            self.prepared.pop(conn, None)
            self._open -= 1
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)
        for task in list(self._settling):
            task.cancel()  # its connection is closed
        await asyncio.gather(
            *(c.close(timeout=self._timeout) for c in idle), return_exceptions=True
        )
        for conn in idle:
            if not conn.is_closed():
                conn.terminate()


def _interrupted(exc: BaseException) -> bool:
    """A call cancelled, or past asyncpg's client-side timeout: a cancel request is on its way."""
    return isinstance(exc, (asyncio.CancelledError, TimeoutError))


def _state_known(exc: BaseException) -> bool:
    """True when an operation failed with its connection in a known state: the operation
    itself gave up (a `QuotaError` of its own, not from the driver) or the server answered."""
    if not isinstance(exc, Exception):
        return False
    origin = exc.__cause__ if isinstance(exc, StorageError) else exc
    return origin is None or isinstance(origin, QuotaError) or _reusable(origin)


def _reusable(exc: BaseException) -> bool:
    """True when the connection a call failed on may be reused: the server answered the
    statement with an error and asyncpg read its answer to the end (a timeout, a lock
    wait given up, a constraint), not a lost or closing connection."""
    if not isinstance(exc, asyncpg.PostgresError):
        return False  # a socket error, a client-side timeout, a cancellation: state unknown
    state = exc.sqlstate or "XX000"
    return state[:2] not in ("08", "58", "XX") and not state.startswith("57P")


class _PostgresServer:
    """What both PostgreSQL faces share: the server, the settings, the statements in the
    driver's form. Each face sets up the rest in `_configure`."""

    dialect = "postgresql"
    #: No fallback answers for this store itself (`quota._wrappers.fallback` wraps it for one).
    up = True
    #: The driver's placeholder style (`quota._sql.statements.render`).
    _style: str

    def __init__(
        self, dsn: str, url: str, *, pool_size: int = 10, connect_timeout: float = 10.0,
        db_clock: bool = False, statement_timeout: float | None = None, relaxed: bool = False,
        prepared_statements: bool = True, idle_timeout: float = DEFAULT_IDLE_TIMEOUT,
        schema: str | None = None,
    ) -> None:  # fmt: skip
        check_pooler_options(url, prepared_statements, relaxed, schema)
        self.url = url
        self.db_clock = db_clock
        self._bind = _sql.Binder(self._style, "postgresql", db_clock)
        #: The statements' texts that need no binding (`quota._sql.statements.Binder.plain`).
        self._plain = self._bind.plain
        self._dsn = dsn
        self._pool_size = pool_size
        self._connect_timeout = connect_timeout
        self._idle_timeout = idle_timeout
        self._prepared_statements = prepared_statements
        #: A fallback's time budget (None without one).
        self._statement_timeout = statement_timeout
        # durability="relaxed": the session commits without waiting for the WAL flush.
        self._relaxed = relaxed
        self._schema = schema
        #: Whether quota_counters is partitioned, learned on the first connection.
        self._partitioned = False
        self._configure()

    def _configure(self) -> None:
        raise NotImplementedError

    def __repr__(self) -> str:
        # Short and without the URL (it may hold a password): `flask limiter config` prints it.
        return f"<{type(self).__name__}>"

    def _lifts_budget(self, transaction: bool, maintenance: bool) -> bool:
        """Whether `run` lifts a fallback's budget set on the session for its operation.

        A transaction lifts it with ``SET LOCAL`` (`UNBUDGETED_TRANSACTION`); behind a
        transaction pooler the budget is held by the client, never in `run`.
        """
        return (
            maintenance
            and not transaction
            and self._statement_timeout is not None
            and self._prepared_statements
        )


class AsyncPostgresStore(_PostgresServer):
    """Async PostgreSQL store on a bounded pool of `asyncpg` connections."""

    _style = "numeric_dollar"

    def _configure(self) -> None:
        # A fallback's time budget. Direct: enforced by the server
        # (statement_timeout and lock_timeout set on each connection), since
        # asyncpg's client-side timeout= costs about 10 µs a query, as much as
        # the rest of the limiter. Behind a transaction pooler no session
        # setting can be made, so the client holds the budget (`_budget`).
        self._budget = None if self._prepared_statements else self._statement_timeout
        self._pool: _Pool | None = None
        self._starting: asyncio.Lock | None = None

    async def _start(self) -> _Pool:
        if self._starting is None:
            self._starting = asyncio.Lock()
        async with self._starting:
            if self._pool is not None:
                return self._pool
            pool = _Pool(
                self._dsn, self._pool_size, self._connect_timeout,
                self._statement_timeout or self._connect_timeout,
                setup=session_settings(self._relaxed, self._statement_timeout, self._schema)
                if self._prepared_statements else None,
                prepared_statements=self._prepared_statements, idle_timeout=self._idle_timeout,
            )  # fmt: skip
            try:
                check_version(await self._read_version(pool), self.url)
            except BaseException as exc:
                await pool.close()
                if isinstance(exc, Exception) and not isinstance(exc, QuotaError):
                    raise wrap_error(exc, self.url) from exc
                raise
            self._pool = pool
            return pool

    async def _read_version(self, pool: _Pool) -> Rows | None:
        """The version table's rows (None without one); learns whether counters are partitioned."""
        for _ in range(self._pool_size):
            conn = await pool.acquire()
            try:
                rows: Rows | None = await conn.fetch(_sql.SCHEMA_VERSION.sql)
                self._partitioned = bool(await conn.fetchval(_partitions.IS_PARTITIONED.sql))
            except asyncpg.UndefinedTableError:
                rows = None
            except BaseException as exc:
                pool.discard(conn)
                if _dead_on_arrival(exc):  # terminated while it opened: take another
                    continue
                raise
            pool.release(conn)
            return rows
        raise StorageError(f"PostgreSQL on {redact(self.url)} closed every connection offered")

    async def _acquire(self) -> tuple[_Pool, asyncpg.Connection]:
        pool = self._pool or await self._start()
        try:
            return pool, await pool.acquire()
        except Exception as exc:
            raise wrap_error(exc, self.url) from exc

    async def execute(self, statement: Statement, params: Sequence[Any]) -> Rows:
        sql = self._plain.get(statement)
        if sql is None:
            sql, params = self._bind(statement, params)
        pool = self._pool
        # The hot path lends an idle connection without awaiting; the first call
        # also finds out whether the table is partitioned.
        if pool is None or (conn := pool.try_acquire()) is None:
            pool, conn = await self._acquire()
        if self._partitioned:
            sql = _partitions.partitioned_sql(sql)
        tries = self._pool_size
        while tries:
            tries -= 1
            try:
                if not self._prepared_statements:
                    rows = await conn.fetch(sql, *params, timeout=self._budget)
                else:
                    # A prepared statement of our own per connection and text: asyncpg's
                    # `fetch(text)` path (statement cache, timers) costs ~5 µs of client
                    # CPU a call more, a tenth of a decision.
                    prepared = pool.prepared[conn].get(sql)
                    if prepared is None:
                        prepared = pool.prepared[conn][sql] = await conn.prepare(sql)
                    try:
                        rows = await prepared.fetch(*params)
                    except _STALE_STATEMENT:
                        # The schema changed under the statement (a migration): drop
                        # it; asyncpg's own path prepares afresh and retries.
                        pool.prepared[conn].pop(sql, None)
                        rows = await conn.fetch(sql, *params)
            except BaseException as exc:
                if _reusable(exc) and not conn.is_in_transaction():
                    pool.release(conn)
                elif _interrupted(exc):
                    pool.settle(conn)
                else:
                    pool.discard(conn)
                if _dead_on_arrival(exc):  # nothing was sent: another connection takes it
                    pool, conn = await self._acquire()
                    continue
                if isinstance(exc, Exception):
                    raise wrap_error(exc, self.url) from exc
                raise
            pool.release(conn)
            return rows
        pool.discard(conn)
        raise StorageError(f"PostgreSQL on {redact(self.url)} closed every connection offered")

    execute_strict = execute

    async def run(self, op: Op[T], *, transaction: bool, maintenance: bool = False) -> T:
        # Maintenance without a transaction lifts the session's budget for the operation;
        # the connection gets it back after, or is closed.
        unbudgeted = self._lifts_budget(transaction, maintenance)
        pool, conn = await self._acquire()
        holder: list[asyncpg.Connection] = []  # the transaction holding `_sql.PG_TRY_LOCK`
        locks: dict[str, Callable[[Sequence[Any]], Awaitable[Rows]]] = {
            _sql.PG_TRY_LOCK.name: lambda params: self._take_lock(pool, holder, params),
            _sql.PG_UNLOCK.name: lambda params: self._release_lock(holder),
        }
        fresh = True  # nothing sent on `conn` yet: a connection dead on arrival may be swapped

        async def first_use(call: Callable[[], Awaitable[T2]]) -> T2:
            """`call()` on `conn`; while nothing was sent yet, a dead connection is replaced."""
            nonlocal pool, conn, fresh
            for _ in range(self._pool_size):
                try:
                    result = await call()
                except Exception as exc:
                    if not (fresh and _dead_on_arrival(exc)):
                        raise
                    pool.discard(conn)
                    pool, conn = await self._acquire()
                    continue
                fresh = False
                return result
            raise StorageError(f"PostgreSQL on {redact(self.url)} closed every connection offered")

        async def execute(statement: Statement, params: Sequence[Any]) -> Rows:
            lock = locks.get(statement.name) if isinstance(statement, Statement) else None
            if lock is not None:
                try:
                    return await lock(params)
                except Exception as exc:
                    raise wrap_error(exc, self.url) from exc
            text, params = self._bind(statement, params)
            if self._partitioned:
                text = _partitions.partitioned_sql(text)
            try:
                return await first_use(lambda: conn.fetch(text, *params))
            except Exception as exc:
                raise wrap_error(exc, self.url) from exc

        try:
            if unbudgeted:
                await first_use(lambda: conn.execute(UNBUDGETED_SESSION))
                result = await adrive(op, execute)
                assert self._statement_timeout is not None
                await conn.execute(budget_settings(self._statement_timeout))
            elif not transaction:
                result = await adrive(op, execute)
            else:
                # Not `async with conn.transaction()`: whatever ends the block early
                # (an error, a cancellation, even inside BEGIN) is rolled back below.
                await first_use(lambda: conn.execute("BEGIN"))
                if self._relaxed:
                    await conn.execute(DURABLE_TRANSACTION)
                if self._statement_timeout:
                    # The fallback's budget is for decisions in a request path;
                    # a durable quota transaction may wait its turn.
                    await conn.execute(UNBUDGETED_TRANSACTION)
                result = await adrive(op, execute)
                await conn.execute("COMMIT")
        except BaseException as exc:
            # Cancelled or failed anywhere: a connection whose state is known is
            # rolled back and reused; a cancelled one once its cancel has landed
            # (`_Pool.settle`); any other is closed, and the server rolls back what
            # it had open. One whose budget was lifted is closed.
            if unbudgeted:
                pool.discard(conn)
            elif _state_known(exc):
                await self._give_back(pool, conn)
            elif _interrupted(exc):
                pool.settle(conn)
            else:
                pool.discard(conn)
            if isinstance(exc, Exception) and not isinstance(exc, QuotaError):
                raise wrap_error(exc, self.url) from exc
            raise
        finally:
            for lock in holder:  # not committed by PG_UNLOCK: the server rolls it back
                lock.terminate()
        await self._give_back(pool, conn)
        return result

    async def _take_lock(
        self, pool: _Pool, holder: list[asyncpg.Connection], params: Sequence[Any]
    ) -> Rows:
        """`_sql.PG_TRY_LOCK` in a transaction of its own on a connection of its own
        (one more than the pool's, for the operation's length); `_release_lock` commits it."""
        lock = await pool.connect()
        holder.append(lock)
        await lock.execute("BEGIN")
        text, params = self._bind(_sql.PG_TRY_LOCK, params)
        taken = bool(await lock.fetchval(text, *params))
        if not taken:
            holder.remove(lock)
            lock.terminate()
        return [(taken,)]

    @staticmethod
    async def _release_lock(holder: list[asyncpg.Connection]) -> Rows:
        """`_sql.PG_UNLOCK`: commit the transaction of `_take_lock`, releasing its lock."""
        lock = holder.pop()
        await lock.execute("COMMIT")
        await lock.close()
        return [(True,)]

    @staticmethod
    async def _give_back(pool: _Pool, conn: asyncpg.Connection) -> None:
        """Release `conn`, rolling back a transaction an operation left open (or closing it)."""
        if conn.is_in_transaction():
            try:
                await conn.execute("ROLLBACK")
            except BaseException:
                pool.discard(conn)
                raise
        pool.release(conn)

    async def aclose(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            await pool.close()


#: A sync call under a fallback whose connection has not answered by this many budgets
#: has its socket shut down: the server would have answered within one (its statement
#: timeout), so the network path itself stopped forwarding.
HUNG_AFTER_BUDGETS = 2


class _Watchdog:
    """Holds sync statements to the fallback's time budget when the server cannot.

    A call registers its connection with a deadline. Behind a transaction
    pooler (no session ``statement_timeout``) a statement still running at
    one budget is cancelled (PostgreSQL's cancel request, which poolers
    forward). In every mode a connection with no answer at
    `HUNG_AFTER_BUDGETS` budgets (a network path that stopped forwarding, its
    sockets still open; a cancel request would hang on it too) has its socket
    shut down: the blocked call fails at once with an outage error and the
    connection is closed; so has one whose call's own deadline passes first
    (`quota._stores.base.call_deadline`: a call that queued for a batch before
    sending it). The thread sleeps on an event while nothing is in flight.
    """

    def __init__(self, budget: float, *, cancel: bool) -> None:
        self._budget = budget
        self._cancel = cancel
        #: id(conn) -> (conn, next step's time, cancelled yet, time to cut)
        self._due: dict[int, tuple[psycopg.Connection[Any], float, bool, float]] = {}
        self._busy = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    def watch(self, conn: psycopg.Connection[Any]) -> None:
        now = time.monotonic()
        cut = now + HUNG_AFTER_BUDGETS * self._budget
        deadline = call_deadline.get()
        if deadline is not None and deadline < cut:
            cut = deadline
        if self._cancel:
            self._due[id(conn)] = (conn, min(now + self._budget, cut), False, cut)
        else:
            self._due[id(conn)] = (conn, cut, True, cut)
        if not self._busy.is_set():
            if self._thread is None:
                self._start()
            self._busy.set()

    def done(self, conn: psycopg.Connection[Any]) -> None:
        self._due.pop(id(conn), None)

    def _start(self) -> None:
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._loop, name="quota-watchdog", daemon=True
                )
                self._thread.start()

    def _loop(self) -> None:
        quiet = 0  # ticks in a row with nothing in flight
        while not self._closed:
            time.sleep(self._budget / 4)
            if not self._due:
                # Only after a whole quiet tick: under load calls come and go between
                # ticks, and waking this thread for each would cost every call.
                quiet += 1
                if quiet >= 2:
                    self._busy.clear()
                    if not self._due:  # registered between the look and the clear: go round
                        self._busy.wait()
                    quiet = 0
                continue
            quiet = 0
            now = time.monotonic()
            for key, (conn, due, cancelled, cut) in list(self._due.items()):
                if due > now:
                    continue
                if not cancelled and cut > now:
                    # Cancelled from a thread of its own: on a hung path it would hang too.
                    self._due[key] = (conn, cut, True, cut)
                    threading.Thread(target=_cancel, args=(conn, self._budget), daemon=True).start()
                elif self._due.pop(key, None) is not None:
                    _cut(conn)

    def close(self) -> None:
        self._closed = True
        self._busy.set()

    def renewed(self) -> _Watchdog:
        """A watchdog like this one, not started (this one closed, say)."""
        return _Watchdog(self._budget, cancel=self._cancel)


def _cancel(conn: psycopg.Connection[Any], budget: float) -> None:
    with contextlib.suppress(Exception):
        conn.cancel_safe(timeout=max(budget, 1.0))


def _cut(conn: psycopg.Connection[Any]) -> None:
    """Shut the connection's socket down under the thread blocked on it (which then fails)."""
    import socket

    with contextlib.suppress(Exception):
        fd = conn.pgconn.socket
        dup = socket.fromfd(fd, socket.AF_INET, socket.SOCK_STREAM)
        try:
            dup.shutdown(socket.SHUT_RDWR)
        finally:
            dup.close()  # the duplicate only; psycopg closes its own


class PostgresStore(_PostgresServer):
    """Sync PostgreSQL store: threads borrow `psycopg` connections from a bounded pool."""

    _style = "format"

    def _configure(self) -> None:
        try:
            import psycopg
        except ImportError as exc:
            raise ConfigurationError(
                f"url {redact(self.url)!r} needs psycopg 3 for the sync face:"
                " pip install 'quota[postgres]'"
                " (or use quota.connect_async() with asyncpg)"
            ) from exc
        self._psycopg = psycopg
        budget = self._statement_timeout
        # Direct: the fallback's budget (and relaxed durability) is set on each
        # connection as it opens; behind a transaction pooler, a watchdog holds it.
        self._setup = (
            session_settings(self._relaxed, budget, self._schema)
            if self._prepared_statements
            else None
        )
        self._watchdog = _Watchdog(budget, cancel=not self._prepared_statements) if budget else None
        self._budgeted = budget is not None
        self._wait_timeout = budget or self._connect_timeout
        self._schema_checked = False
        self._pool = self._new_pool()

    def _new_pool(self) -> SyncPool[psycopg.Connection[Any]]:
        # A call waits at most one budget (without a fallback, the timeout) for a new
        # connection: libpq's connect_timeout cannot go below 2 s, and it holds for
        # each attempt (sslmode=prefer makes two on a server that never answers).
        return SyncPool(
            self._open, _close_quietly, size=self._pool_size, wait_timeout=self._wait_timeout,
            idle_timeout=self._idle_timeout, open_timeout=self._wait_timeout, alive=_alive,
        )  # fmt: skip

    def _open(self) -> psycopg.Connection[Any]:
        try:
            conn = self._psycopg.connect(
                self._dsn, autocommit=True,
                prepare_threshold=0 if self._prepared_statements else None,
                connect_timeout=max(1, int(self._connect_timeout)),
            )  # fmt: skip
        except Exception as exc:
            raise wrap_error(exc, self.url) from exc
        try:
            if self._setup is not None:
                conn.execute(self._setup)
            if not self._schema_checked:
                try:
                    rows: Rows | None = conn.execute(_sql.SCHEMA_VERSION.sql).fetchall()
                    self._partitioned = (
                        conn.execute(_partitions.IS_PARTITIONED.sql).fetchone() is not None
                    )
                except Exception as exc:
                    if not _is_undefined_table(exc):
                        raise
                    rows = None
                check_version(rows, self.url)
                self._schema_checked = True
        except BaseException as exc:
            conn.close()
            if isinstance(exc, Exception) and not isinstance(exc, QuotaError):
                raise wrap_error(exc, self.url) from exc
            raise
        return conn

    def _give_back(
        self, pool: SyncPool[psycopg.Connection[Any]], conn: psycopg.Connection[Any],
        exc: BaseException | None = None,
    ) -> None:  # fmt: skip
        """Return `conn` to `pool` clean: roll back what a failed call left open, or close it."""
        if exc is not None and not isinstance(exc, Exception):
            pool.discard(conn)  # interrupted mid-call (KeyboardInterrupt…): state unknown
            return
        if conn.broken or conn.closed:
            pool.discard(conn)
            return
        if conn.info.transaction_status != 0:  # not IDLE: a transaction is open or failed
            try:
                conn.rollback()
            except Exception:
                pool.discard(conn)
                return
        pool.release(conn)

    def execute(self, statement: Statement, params: Sequence[Any]) -> Rows:
        sql = self._plain.get(statement)
        if sql is None:
            sql, params = self._bind(statement, params)
        pool = self._pool
        try:
            conn = pool.acquire()
        except Exception as exc:
            raise wrap_error(exc, self.url) from exc
        if self._partitioned:
            sql = _partitions.partitioned_sql(sql)
        watchdog = self._watchdog
        try:
            if watchdog is None:
                rows = conn.execute(sql, params).fetchall()
            else:
                watchdog.watch(conn)
                try:
                    rows = conn.execute(sql, params).fetchall()
                finally:
                    watchdog.done(conn)
        except BaseException as exc:
            self._give_back(pool, conn, exc)
            if isinstance(exc, Exception):
                raise wrap_error(exc, self.url) from exc
            raise
        pool.release(conn)
        return rows

    execute_strict = execute

    def run(self, op: Op[T], *, transaction: bool, maintenance: bool = False) -> T:
        # See `AsyncPostgresStore.run`.
        unbudgeted = self._lifts_budget(transaction, maintenance)
        pool = self._pool
        try:
            conn = pool.acquire()
        except Exception as exc:
            raise wrap_error(exc, self.url) from exc
        holder: list[psycopg.Connection[Any]] = []  # the transaction holding `_sql.PG_TRY_LOCK`
        locks: dict[str, Callable[[Sequence[Any]], Rows]] = {
            _sql.PG_TRY_LOCK.name: lambda params: self._take_lock(holder, params),
            _sql.PG_UNLOCK.name: lambda params: self._release_lock(holder),
        }

        def execute(statement: Statement, params: Sequence[Any]) -> Rows:
            lock = locks.get(statement.name) if isinstance(statement, Statement) else None
            if lock is not None:
                try:
                    return lock(params)
                except Exception as exc:
                    raise wrap_error(exc, self.url) from exc
            text, params = self._bind(statement, params)
            if self._partitioned:
                text = _partitions.partitioned_sql(text)
            try:
                cursor = conn.execute(text, params)
                # DDL (partition maintenance) returns no rows at all.
                return cursor.fetchall() if cursor.description is not None else []
            except Exception as exc:
                raise wrap_error(exc, self.url) from exc

        try:
            if unbudgeted:
                conn.execute(UNBUDGETED_SESSION)
                result = drive(op, execute)
                assert self._statement_timeout is not None
                conn.execute(budget_settings(self._statement_timeout))
            elif not transaction:
                result = drive(op, execute)
            else:
                with conn.transaction():
                    if self._relaxed:
                        conn.execute(DURABLE_TRANSACTION)
                    if self._budgeted:
                        conn.execute(UNBUDGETED_TRANSACTION)
                    result = drive(op, execute)
        except BaseException as exc:
            if unbudgeted:
                pool.discard(conn)  # its budget lifted: closed, not reused
            else:
                self._give_back(pool, conn, exc)
            if isinstance(exc, Exception) and not isinstance(exc, QuotaError):
                raise wrap_error(exc, self.url) from exc
            raise
        finally:
            for lock in holder:  # not committed by PG_UNLOCK: closing rolls it back
                _close_quietly(lock)
        self._give_back(pool, conn)
        return result

    def _take_lock(self, holder: list[psycopg.Connection[Any]], params: Sequence[Any]) -> Rows:
        """`_sql.PG_TRY_LOCK` in a transaction of its own on a connection of its own
        (one more than the pool's, for the operation's length); `_release_lock` commits it."""
        lock = self._open()
        holder.append(lock)
        lock.execute("BEGIN")
        text, params = self._bind(_sql.PG_TRY_LOCK, params)
        row = lock.execute(text, params).fetchone()
        taken = bool(row and row[0])
        if not taken:
            holder.remove(lock)
            lock.close()
        return [(taken,)]

    @staticmethod
    def _release_lock(holder: list[psycopg.Connection[Any]]) -> Rows:
        """`_sql.PG_UNLOCK`: commit the transaction of `_take_lock`, releasing its lock."""
        lock = holder.pop()
        lock.execute("COMMIT")
        lock.close()
        return [(True,)]

    @property
    def pool(self) -> SyncPool[psycopg.Connection[Any]]:
        """The connection pool (for tests and diagnostics)."""
        return self._pool

    def close(self) -> None:
        """Close every connection; the store opens new ones if it is used again."""
        pool, self._pool = self._pool, self._new_pool()
        pool.close()
        if self._watchdog is not None:
            self._watchdog.close()
            self._watchdog = self._watchdog.renewed()


def _alive(conn: psycopg.Connection[Any]) -> bool:
    """False for an idle connection the server closed (or that has anything to read).

    An idle connection in autocommit has nothing to read; a server that closed
    it (a restart, a failover, ``pg_terminate_backend``, an idle timeout) has
    sent its error and end of stream, which a poll that does not wait sees
    before anything is sent on it.
    """
    if conn.closed:
        return False
    try:
        readable, _, _ = select.select([conn.pgconn.socket], [], [], 0)
    except Exception:  # no socket any more (psycopg's OperationalError), or a bad one
        return False
    return not readable


def _close_quietly(conn: Any) -> None:
    with contextlib.suppress(Exception):
        conn.close()


def _settings(parsed: StoreURL, settings: StoreSettings) -> dict[str, Any]:
    """The keywords of either PostgreSQL store: the URL's own parameters, then `settings`."""
    prepared = settings.prepared_statements
    return {
        "dsn": parsed.target, "url": parsed.url, "pool_size": settings.pool_size,
        "connect_timeout": settings.connect_timeout, "db_clock": settings.db_clock,
        "statement_timeout": settings.statement_timeout, "relaxed": settings.relaxed,
        "idle_timeout": settings.idle_timeout,
        "prepared_statements": parsed.prepared_statements if prepared is None else prepared,
        "schema": settings.schema or parsed.schema,
    }  # fmt: skip


def open_sync(parsed: StoreURL, settings: StoreSettings) -> PostgresStore:
    """The sync store of a ``postgresql://`` URL (`quota._core.url.DIALECTS`)."""
    return PostgresStore(**_settings(parsed, settings))


def open_async(parsed: StoreURL, settings: StoreSettings) -> AsyncPostgresStore:
    """The async store of a ``postgresql://`` URL."""
    return AsyncPostgresStore(**_settings(parsed, settings))
