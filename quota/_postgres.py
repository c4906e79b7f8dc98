"""PostgreSQL stores: `asyncpg` for the async face, `psycopg` 3 for the sync one.

Statements are prepared once per connection (asyncpg: prepared statements
the store keeps per connection; psycopg with ``prepare_threshold=0``) and run in autocommit, so a decision is
one round trip. psycopg is an optional extra: ``pip install 'quota[postgres]'``.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Generator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import asyncpg

from quota import _partitions, _sql
from quota._errors import ConfigurationError, QuotaError, SchemaError, StorageError
from quota._schema import check_version, migrate_hint
from quota._sql import Named
from quota._store import Rows, Statement, adrive, drive
from quota._url import redact

if TYPE_CHECKING:
    import psycopg

T = TypeVar("T")

#: ``durability="relaxed"``: every connection commits without waiting for the WAL flush.
RELAXED_SETTINGS = {"synchronous_commit": "off"}
#: Inside a multi-statement transaction: lift the fallback's time budget.
UNBUDGETED_TRANSACTION = (
    "SELECT set_config('statement_timeout', '30s', true), set_config('lock_timeout', '30s', true)"
)


def _settings(relaxed: bool, statement_timeout: float | None) -> dict[str, str] | None:
    """Server settings of the async store's connections: durability and time budget."""
    settings = dict(RELAXED_SETTINGS) if relaxed else {}
    if statement_timeout:
        ms = str(max(1, int(statement_timeout * 1000)))
        settings.update(statement_timeout=ms, lock_timeout=ms)
    return settings or None


#: ... except inside a transaction of `run`: durable quotas keep every commit synchronous.
DURABLE_TRANSACTION = "SET LOCAL synchronous_commit = on"


def _is_undefined_table(exc: BaseException) -> bool:
    # asyncpg.UndefinedTableError and psycopg.errors.UndefinedTable both carry SQLSTATE 42P01.
    return getattr(exc, "sqlstate", None) == "42P01"


def wrap_error(exc: BaseException, url: str) -> QuotaError:
    """The `quota` error for a driver error: a missing table becomes `SchemaError`."""
    if isinstance(exc, QuotaError):
        return exc
    if _is_undefined_table(exc):
        return SchemaError(f"{exc}; the quota tables are missing, run `{migrate_hint(url)}`")
    return StorageError(f"PostgreSQL error on {redact(url)}: {type(exc).__name__}: {exc}")


#: What a prepared statement raises once the schema changed under it.
_STALE_STATEMENT = (
    asyncpg.exceptions.InvalidCachedStatementError,
    asyncpg.exceptions.OutdatedSchemaCacheError,
)


class _Pool:
    """The smallest connection pool that does the job: idle connections on a stack.

    asyncpg's own pool costs several coroutine hops, a proxy object and a
    reset per acquire/release: as much client CPU as the hot statement
    itself. The hot path holds a connection for exactly one statement, so a
    stack of idle connections and a queue of waiters is all it needs. A
    connection found closed on release is dropped; its slot reopens on demand.
    """

    def __init__(
        self, dsn: str, size: int, timeout: float, wait_timeout: float | None = None,
        server_settings: dict[str, str] | None = None,
    ) -> None:  # fmt: skip
        self._dsn = dsn
        self._server_settings = server_settings
        self._size = size
        self._timeout = timeout
        self._wait_timeout = wait_timeout
        self._idle: list[asyncpg.Connection] = []
        self._waiters: deque[asyncio.Future[asyncpg.Connection | None]] = deque()
        self._open = 0
        self._all: set[asyncpg.Connection] = set()
        #: Each open connection's prepared statements, by text (see `AsyncPostgresStore.execute`).
        self.prepared: dict[asyncpg.Connection, dict[str, Any]] = {}

    async def acquire(self) -> asyncpg.Connection:
        if self._idle:
            return self._idle.pop()
        while True:
            if self._open < self._size:
                self._open += 1
                try:
                    conn: asyncpg.Connection = await asyncpg.connect(
                        self._dsn, timeout=self._timeout, server_settings=self._server_settings
                    )
                except BaseException:
                    self._open -= 1
                    self._wake(None)
                    raise
                self._all.add(conn)
                self.prepared[conn] = {}
                return conn
            waiter: asyncio.Future[asyncpg.Connection | None] = (
                asyncio.get_running_loop().create_future()
            )
            self._waiters.append(waiter)
            try:
                if self._wait_timeout is None:
                    handed = await waiter
                else:  # all connections busy: a bounded wait under a fallback's budget
                    handed = await asyncio.wait_for(waiter, self._wait_timeout)
            except BaseException:
                # Cancelled just as a connection was handed over: pass it on.
                if waiter.done() and not waiter.cancelled() and waiter.result() is not None:
                    self.release(waiter.result())
                raise
            if handed is not None:
                return handed
            # None: a slot was freed by a dropped connection; go round and open one.

    def release(self, conn: asyncpg.Connection) -> None:
        if conn.is_closed():
            self._all.discard(conn)
            self.prepared.pop(conn, None)
            self._open -= 1
            self._wake(None)
        elif not self._wake(conn):
            self._idle.append(conn)

    def _wake(self, conn: asyncpg.Connection | None) -> bool:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(conn)
                return True
        return False

    async def close(self) -> None:
        conns, self._all, self._idle = list(self._all), set(), []
        self._open = 0
        self.prepared = {}
        await asyncio.gather(*(c.close() for c in conns), return_exceptions=True)


class AsyncPostgresStore:
    """Async PostgreSQL store on a small pool of `asyncpg` connections."""

    dialect = "postgresql"

    def __init__(
        self, dsn: str, url: str, *, pool_size: int = 10, connect_timeout: float = 10.0,
        db_clock: bool = False, statement_timeout: float | None = None, relaxed: bool = False,
    ) -> None:  # fmt: skip
        self.url = url
        self.db_clock = db_clock
        self._bind = _sql.Binder("numeric_dollar", "postgresql", db_clock)
        # durability="relaxed": the session commits without waiting for the WAL flush.
        self._relaxed = relaxed
        self._partitioned = False
        self._dsn = dsn
        # A fallback's time budget, enforced by the server (statement_timeout
        # and lock_timeout on every connection): asyncpg's client-side
        # timeout= costs about 10 µs a query, as much as the rest of the
        # limiter. A server that stops answering altogether is caught at
        # connect time (the fallback's warm-up and probe).
        self._statement_timeout = statement_timeout
        self._pool_size = pool_size
        self._connect_timeout = connect_timeout
        self._pool: _Pool | None = None
        self._starting: asyncio.Lock | None = None

    async def _start(self) -> _Pool:
        if self._starting is None:
            self._starting = asyncio.Lock()
        async with self._starting:
            if self._pool is not None:
                return self._pool
            pool = _Pool(
                self._dsn, self._pool_size, self._connect_timeout, self._statement_timeout,
                server_settings=_settings(self._relaxed, self._statement_timeout),
            )  # fmt: skip
            try:
                conn = await pool.acquire()
                try:
                    rows: Rows | None = await conn.fetch(_sql.SCHEMA_VERSION)
                    self._partitioned = bool(await conn.fetchval(_partitions.IS_PARTITIONED))
                except asyncpg.UndefinedTableError:
                    rows = None
                finally:
                    pool.release(conn)
                check_version(rows, self.url)
            except BaseException as exc:
                await pool.close()
                if isinstance(exc, Exception) and not isinstance(exc, QuotaError):
                    raise wrap_error(exc, self.url) from exc
                raise
            self._pool = pool
            return pool

    async def _acquire(self) -> tuple[_Pool, asyncpg.Connection]:
        pool = self._pool or await self._start()
        try:
            return pool, await pool.acquire()
        except Exception as exc:
            raise wrap_error(exc, self.url) from exc

    async def execute(self, sql: str | Named, params: Sequence[Any] | Mapping[str, Any]) -> Rows:
        if sql.__class__ is str:
            sql = _sql.render(sql, "numeric_dollar")
        else:
            sql, params = self._bind(sql, params)  # type: ignore[arg-type]
        pool = self._pool
        if pool is not None and pool._idle:  # the hot path: an idle connection, no awaits
            conn = pool._idle.pop()
        else:  # the first call also finds out whether the table is partitioned
            pool, conn = await self._acquire()
        if self._partitioned:
            sql = _partitions.partitioned_sql(sql)
        try:
            # A prepared statement of our own per connection and text: asyncpg's
            # `fetch(text)` path (statement cache, timers) costs ~5 µs of client
            # CPU a call more, a tenth of a decision.
            prepared = pool.prepared[conn]
            statement = prepared.get(sql)
            if statement is None:
                statement = prepared[sql] = await conn.prepare(sql)
            try:
                return await statement.fetch(*params)  # type: ignore[no-any-return]
            except _STALE_STATEMENT:
                # The schema changed under the statement (a migration): drop
                # it; asyncpg's own path prepares afresh and retries.
                prepared.pop(sql, None)
                return await conn.fetch(sql, *params)  # type: ignore[no-any-return]
        except Exception as exc:
            raise wrap_error(exc, self.url) from exc
        finally:
            pool.release(conn)

    async def run(self, op: Generator[Statement, Rows, T], *, transaction: bool) -> T:
        pool, conn = await self._acquire()

        async def execute(sql: str, params: Sequence[Any]) -> Rows:
            text = _sql.render(sql, "numeric_dollar")
            if self._partitioned:
                text = _partitions.partitioned_sql(text)
            try:
                return await conn.fetch(text, *params)  # type: ignore[no-any-return]
            except Exception as exc:
                raise wrap_error(exc, self.url) from exc

        try:
            if not transaction:
                return await adrive(op, execute)
            async with conn.transaction():
                if self._relaxed:
                    await conn.execute(DURABLE_TRANSACTION)
                if self._statement_timeout:
                    # The fallback's budget is for decisions in a request path;
                    # a durable quota transaction may wait its turn.
                    await conn.execute(UNBUDGETED_TRANSACTION)
                return await adrive(op, execute)
        except QuotaError:
            raise
        except Exception as exc:
            raise wrap_error(exc, self.url) from exc
        finally:
            pool.release(conn)

    async def aclose(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            await pool.close()


class PostgresStore:
    """Sync PostgreSQL store: one `psycopg` connection per thread."""

    dialect = "postgresql"

    def __init__(
        self, dsn: str, url: str, *, connect_timeout: float = 10.0, db_clock: bool = False,
        statement_timeout: float | None = None, relaxed: bool = False,
    ) -> None:  # fmt: skip
        try:
            import psycopg
        except ImportError as exc:
            raise ConfigurationError(
                f"url {url!r} needs psycopg 3 for the sync face: pip install 'quota[postgres]'"
                " (or use quota.connect_async() with asyncpg)"
            ) from exc
        self._psycopg = psycopg
        self.url = url
        self.db_clock = db_clock
        self._bind = _sql.Binder("format", "postgresql", db_clock)
        self._dsn = dsn
        self._connect_timeout = connect_timeout
        # Server-side bound on each statement (and lock wait), for the fallback's time budget.
        self._options = (
            f"-c statement_timeout={max(1, int(statement_timeout * 1000))}"
            f" -c lock_timeout={max(1, int(statement_timeout * 1000))}"
            if statement_timeout
            else None
        )
        if relaxed:
            self._options = " ".join(
                [*([self._options] if self._options else []), "-c synchronous_commit=off"]
            )
        self._relaxed = relaxed
        self._budgeted = statement_timeout is not None
        self._partitioned = False
        self._local = threading.local()
        self._lock = threading.Lock()
        self._connections: list[psycopg.Connection[Any]] = []
        self._schema_checked = False

    def _open(self) -> psycopg.Connection[Any]:
        try:
            extra: dict[str, Any] = {"options": self._options} if self._options else {}
            conn = self._psycopg.connect(
                self._dsn, autocommit=True, prepare_threshold=0,
                connect_timeout=max(1, int(self._connect_timeout)), **extra,
            )  # fmt: skip
        except Exception as exc:
            raise wrap_error(exc, self.url) from exc
        if not self._schema_checked:
            try:
                rows: Rows | None = conn.execute(_sql.SCHEMA_VERSION).fetchall()
                self._partitioned = conn.execute(_partitions.IS_PARTITIONED).fetchone() is not None
            except Exception as exc:
                if not _is_undefined_table(exc):
                    conn.close()
                    raise wrap_error(exc, self.url) from exc
                rows = None
            try:
                check_version(rows, self.url)
            except SchemaError:
                conn.close()
                raise
            self._schema_checked = True
        with self._lock:
            self._connections.append(conn)
        self._local.conn = conn
        return conn

    def _conn(self) -> psycopg.Connection[Any]:
        conn: psycopg.Connection[Any] | None = getattr(self._local, "conn", None)
        if conn is None or conn.closed:
            conn = self._open()
        return conn

    def _fail(self, conn: psycopg.Connection[Any], exc: Exception) -> QuotaError:
        if conn.broken or conn.closed:
            # Drop it: the next call on this thread reconnects.
            self._local.conn = None
            with self._lock:
                if conn in self._connections:
                    self._connections.remove(conn)
            conn.close()
        return wrap_error(exc, self.url)

    def execute(self, sql: str | Named, params: Sequence[Any] | Mapping[str, Any]) -> Rows:
        if sql.__class__ is str:
            sql = _sql.render(sql, "format")
        else:
            sql, params = self._bind(sql, params)  # type: ignore[arg-type]
        conn = self._conn()
        if self._partitioned:
            sql = _partitions.partitioned_sql(sql)
        try:
            return conn.execute(sql, params).fetchall()
        except Exception as exc:
            raise self._fail(conn, exc) from exc

    def run(self, op: Generator[Statement, Rows, T], *, transaction: bool) -> T:
        conn = self._conn()

        def execute(sql: str, params: Sequence[Any]) -> Rows:
            text = _sql.render(sql, "format")
            if self._partitioned:
                text = _partitions.partitioned_sql(text)
            try:
                cursor = conn.execute(text, params)
                # DDL (partition maintenance) returns no rows at all.
                return cursor.fetchall() if cursor.description is not None else []
            except Exception as exc:
                raise self._fail(conn, exc) from exc

        if not transaction:
            return drive(op, execute)
        try:
            with conn.transaction():
                if self._relaxed:
                    conn.execute(DURABLE_TRANSACTION)
                if self._budgeted:
                    conn.execute(UNBUDGETED_TRANSACTION)
                return drive(op, execute)
        except QuotaError:
            raise
        except Exception as exc:
            raise self._fail(conn, exc) from exc

    def close(self) -> None:
        with self._lock:
            connections, self._connections = self._connections, []
        for conn in connections:
            conn.close()
        self._local = threading.local()
