"""SQLite stores: `sqlite3` for the sync face, `aiosqlite` for the async one.

Every connection runs in autocommit mode with WAL, ``synchronous=NORMAL`` and
a busy timeout, so several processes can share one file: writers queue on
SQLite's lock instead of failing with "database is locked".
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import Callable, Generator, Mapping, Sequence
from typing import Any, TypeVar

import aiosqlite

from quota import _sql
from quota._errors import ConfigurationError, SchemaError, StorageError
from quota._schema import check_version, migrate_hint
from quota._sql import Named
from quota._store import Rows, Statement, adrive, drive

T = TypeVar("T")

#: Busy timeout of a durable quota transaction under a fallback's budget.
UNBUDGETED_BUSY_MS = 30_000

#: INSERT … RETURNING arrived in SQLite 3.35.0 (2021-03).
MIN_SQLITE = (3, 35, 0)


def _check_sqlite_version() -> None:
    if sqlite3.sqlite_version_info < MIN_SQLITE:
        raise ConfigurationError(
            f"SQLite {sqlite3.sqlite_version} is too old: quota needs 3.35 or newer"
            " (for INSERT … RETURNING); upgrade the SQLite your Python links against"
        )


def pragmas(busy_timeout: float) -> tuple[str, ...]:
    """The PRAGMAs every connection gets, busy timeout first so the others can wait."""
    return (
        f"PRAGMA busy_timeout = {int(busy_timeout * 1000)}",
        "PRAGMA journal_mode = WAL",
        "PRAGMA synchronous = NORMAL",
    )


def wrap_error(exc: Exception, url: str) -> StorageError:
    """The `quota` error for a sqlite3 error: missing tables become `SchemaError`."""
    if isinstance(exc, sqlite3.OperationalError) and "no such table" in str(exc):
        return SchemaError(f"{exc}; the quota tables are missing, run `{migrate_hint(url)}`")
    return StorageError(f"SQLite error on {url}: {exc}")


def _version_rows(execute: Any) -> Rows | None:
    try:
        rows: Rows = execute(_sql.SCHEMA_VERSION)
    except sqlite3.OperationalError as exc:
        if "no such table" in str(exc):
            return None
        raise
    return rows


class SQLiteStore:
    """Sync SQLite store: one `sqlite3` connection per thread."""

    dialect = "sqlite"

    def __init__(
        self, path: str, url: str, *, busy_timeout: float = 5.0, db_clock: bool = False,
        serialize: bool = False,
    ) -> None:  # fmt: skip
        _check_sqlite_version()
        self.url = url
        self.db_clock = db_clock
        self._bind = _sql.Binder("qmark", "sqlite", db_clock)
        self._path = path
        self._busy_timeout = busy_timeout
        self._local = threading.local()
        self._lock = threading.Lock()
        self._connections: list[sqlite3.Connection] = []
        self._serialize: threading.Lock | None = None
        if serialize:
            # Under a short busy timeout (a fallback's budget), threads of one
            # process queue on this lock (fair, no sleeping) instead of on
            # SQLite's busy handler, whose backoff sleeps can starve a thread
            # past the budget and fake an outage. Processes still share the
            # file through SQLite's own locking, within the budget.
            self._serialize = threading.Lock()
            self.execute = self._execute_one_at_a_time  # type: ignore[method-assign]
        self._schema_checked = False

    def _open(self) -> sqlite3.Connection:
        try:
            conn = sqlite3.connect(
                self._path, timeout=self._busy_timeout, isolation_level=None,
                check_same_thread=False,
            )  # fmt: skip
            for pragma in pragmas(self._busy_timeout):
                conn.execute(pragma)
            if not self._schema_checked:
                check_version(_version_rows(lambda sql: conn.execute(sql).fetchall()), self.url)
                self._schema_checked = True
        except sqlite3.Error as exc:
            raise wrap_error(exc, self.url) from exc
        with self._lock:
            self._connections.append(conn)
        self._local.conn = conn
        self._local.cursor = conn.cursor()
        return conn

    def _conn(self) -> sqlite3.Connection:
        try:
            conn: sqlite3.Connection = self._local.conn
        except AttributeError:
            conn = self._open()
        return conn

    def execute(self, sql: str | Named, params: Sequence[Any] | Mapping[str, Any]) -> Rows:
        try:  # `_conn`, inlined: this runs once per decision
            cursor: sqlite3.Cursor = self._local.cursor  # one per thread, reused
        except AttributeError:
            self._open()
            cursor = self._local.cursor
        if sql.__class__ is not str:
            sql, params = self._bind(sql, params)  # type: ignore[arg-type]
        try:
            return cursor.execute(sql, params).fetchall()
        except sqlite3.Error as exc:
            raise wrap_error(exc, self.url) from exc

    def _execute_one_at_a_time(
        self, sql: str | Named, params: Sequence[Any] | Mapping[str, Any]
    ) -> Rows:
        assert self._serialize is not None
        with self._serialize:
            return SQLiteStore.execute(self, sql, params)

    def run(self, op: Generator[Statement, Rows, T], *, transaction: bool) -> T:
        conn = self._conn()

        def execute(sql: str, params: Sequence[Any]) -> Rows:
            try:
                return conn.execute(sql, params).fetchall()
            except sqlite3.Error as exc:
                raise wrap_error(exc, self.url) from exc

        if not transaction:
            return drive(op, execute)
        if self._serialize is None:
            return self._transaction(conn, op, execute)
        # Under a fallback's short busy timeout: a durable quota transaction is
        # no request-path decision, so it queues with this process's writers
        # and may wait its turn on other processes for the usual time.
        with self._serialize:
            conn.execute(f"PRAGMA busy_timeout = {UNBUDGETED_BUSY_MS}")
            try:
                return self._transaction(conn, op, execute)
            finally:
                conn.execute(f"PRAGMA busy_timeout = {int(self._busy_timeout * 1000)}")

    @staticmethod
    def _transaction(
        conn: sqlite3.Connection,
        op: Generator[Statement, Rows, T],
        execute: Callable[[str, Sequence[Any]], Rows],
    ) -> T:
        # IMMEDIATE takes the write lock up front, so two writers never both
        # read and then deadlock upgrading to write.
        execute("BEGIN IMMEDIATE", ())
        try:
            result = drive(op, execute)
        except BaseException:
            conn.rollback()
            raise
        execute("COMMIT", ())
        return result

    def close(self) -> None:
        with self._lock:
            connections, self._connections = self._connections, []
        for conn in connections:
            conn.close()
        self._local = threading.local()


class AsyncSQLiteStore:
    """Async SQLite store: one `aiosqlite` connection, used by one task at a time.

    SQLite admits one writer at a time anyway; a single connection keeps
    statements of one task's transaction from interleaving with another's.
    """

    dialect = "sqlite"

    def __init__(
        self, path: str, url: str, *, busy_timeout: float = 5.0, db_clock: bool = False
    ) -> None:
        _check_sqlite_version()
        self.url = url
        self.db_clock = db_clock
        self._bind = _sql.Binder("qmark", "sqlite", db_clock)
        self._path = path
        self._busy_timeout = busy_timeout
        self._conn: aiosqlite.Connection | None = None
        self._lock: asyncio.Lock | None = None

    async def _open(self) -> aiosqlite.Connection:
        try:
            pending = aiosqlite.connect(
                self._path, timeout=self._busy_timeout, isolation_level=None
            )
            # aiosqlite's worker thread is not a daemon: a store nobody closed
            # (the module-level default limiter, say) would keep the process
            # from exiting. SQLite recovers an unclosed WAL file on next open.
            worker = getattr(pending, "_thread", None)
            if worker is not None and not worker.is_alive():
                worker.daemon = True
            conn = await pending
        except sqlite3.Error as exc:
            raise wrap_error(exc, self.url) from exc
        try:
            for pragma in pragmas(self._busy_timeout):
                await conn.execute(pragma)
            try:
                rows: Rows | None = list(await conn.execute_fetchall(_sql.SCHEMA_VERSION))
            except sqlite3.OperationalError as exc:
                if "no such table" not in str(exc):
                    raise
                rows = None
            check_version(rows, self.url)
        except BaseException as exc:
            await conn.close()
            if isinstance(exc, sqlite3.Error):
                raise wrap_error(exc, self.url) from exc
            raise
        self._conn = conn
        return conn

    async def execute(self, sql: str | Named, params: Sequence[Any] | Mapping[str, Any]) -> Rows:
        conn = self._conn or await self._start()
        if sql.__class__ is not str:
            sql, params = self._bind(sql, params)  # type: ignore[arg-type]
        assert self._lock is not None
        async with self._lock:
            try:
                return list(await conn.execute_fetchall(sql, params))
            except sqlite3.Error as exc:
                raise wrap_error(exc, self.url) from exc

    async def _start(self) -> aiosqlite.Connection:
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._conn is None:
                return await self._open()
            return self._conn

    async def run(self, op: Generator[Statement, Rows, T], *, transaction: bool) -> T:
        conn = self._conn or await self._start()
        assert self._lock is not None

        async def execute(sql: str, params: Sequence[Any]) -> Rows:
            try:
                return list(await conn.execute_fetchall(sql, params))
            except sqlite3.Error as exc:
                raise wrap_error(exc, self.url) from exc

        async with self._lock:
            if not transaction:
                return await adrive(op, execute)
            await execute("BEGIN IMMEDIATE", ())
            try:
                result = await adrive(op, execute)
            except BaseException:
                await conn.rollback()
                raise
            await execute("COMMIT", ())
            return result

    async def aclose(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            await conn.close()
