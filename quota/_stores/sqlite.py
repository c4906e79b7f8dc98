"""SQLite stores: `sqlite3` for the sync face; for the async one, `sqlite3` on the
event loop while the file is free and `aiosqlite`'s worker thread when it is not.

Every connection runs in autocommit mode with WAL, ``synchronous=NORMAL`` and
a busy timeout, so several processes can share one file: writers queue on
SQLite's lock instead of failing with "database is locked".
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import aiosqlite

from quota._core.errors import ConfigurationError, StorageError
from quota._core.url import StoreURL
from quota._sql import statements as _sql
from quota._sql.schema import check_version, missing_objects_error, missing_sqlite_file
from quota._sql.statements import Statement
from quota._sql.steps import Op, Rows, adrive, drive
from quota._stores.base import StoreSettings
from quota._stores.pool import DEFAULT_IDLE_TIMEOUT, SyncPool

T = TypeVar("T")

#: The statements the SQLite stores run themselves instead of sending them: sleep
#: ``params[0]`` seconds (`quota._sql.statements.PAUSE`).
_PAUSES = frozenset({_sql.PAUSE.name})

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


#: The size SQLite cuts the WAL file back to when it starts it over (``journal_size_limit``).
JOURNAL_SIZE_LIMIT = 4 * 1024 * 1024
#: Past this size, the next check runs a TRUNCATE checkpoint (see `SQLiteStore`).
WAL_TRUNCATE_BYTES = 16 * 1024 * 1024
#: A sync store looks at the WAL's size once every this many statements.
WAL_CHECK_EVERY = 256
#: The longest a TRUNCATE checkpoint waits, for readers and for another checkpoint to end
#: (seconds; the busy timeout when shorter). Writers wait for it meanwhile.
WAL_TRUNCATE_WAIT = 0.25
#: Seconds between tries while another connection holds the checkpoint lock.
_CHECKPOINT_RETRY = 0.001
#: Waits for readers and writers of other processes, then copies the WAL back and empties it.
_TRUNCATE = "PRAGMA wal_checkpoint(TRUNCATE)"


def pragmas(busy_timeout: float) -> tuple[str, ...]:
    """The PRAGMAs every connection gets, busy timeout first so the others can wait.

    WAL, a property of the file, is set apart (`set_up`): only when the file
    is not in WAL yet.
    """
    return (
        f"PRAGMA busy_timeout = {int(busy_timeout * 1000)}",
        "PRAGMA synchronous = NORMAL",
        f"PRAGMA journal_size_limit = {JOURNAL_SIZE_LIMIT}",
    )


def wal_size(path: str) -> int:
    """The size of `path`'s WAL file in bytes (0 when there is none)."""
    try:
        return os.stat(path + "-wal").st_size
    except OSError:
        return 0


_JOURNAL_MODE = "PRAGMA journal_mode"
_SET_WAL = "PRAGMA journal_mode = WAL"
#: Seconds between tries to switch a file to WAL while another connection holds it.
_WAL_RETRY = 0.005


def set_up(conn: sqlite3.Connection, busy_timeout: float) -> None:
    """Give a new `sqlite3` connection its `pragmas`, and the file WAL if it has not got it.

    Switching a file to WAL needs it to itself, and SQLite answers "database
    is locked" at once, without its busy handler, while another connection
    holds it: threads opening their first connections to a new file together
    did. So the mode is read first (no lock needed once the file is in WAL),
    and the switch retried within the busy timeout.
    """
    for pragma in pragmas(busy_timeout):
        conn.execute(pragma).fetchall()  # each stepped to its end: none left open
    deadline = time.monotonic() + busy_timeout
    while conn.execute(_JOURNAL_MODE).fetchall()[0][0] != "wal":
        try:
            conn.execute(_SET_WAL).fetchall()
        except sqlite3.OperationalError as exc:
            if not _busy(exc) or time.monotonic() > deadline:
                raise
            time.sleep(_WAL_RETRY)


async def aset_up(conn: aiosqlite.Connection, busy_timeout: float) -> None:
    """`set_up` for an `aiosqlite` connection."""
    for pragma in pragmas(busy_timeout):
        await conn.execute_fetchall(pragma)  # each stepped to its end: none left open
    deadline = time.monotonic() + busy_timeout
    while next(iter(await conn.execute_fetchall(_JOURNAL_MODE)))[0] != "wal":
        try:
            await conn.execute_fetchall(_SET_WAL)
        except sqlite3.OperationalError as exc:
            if not _busy(exc) or time.monotonic() > deadline:
                raise
            await asyncio.sleep(_WAL_RETRY)


def wrap_error(exc: Exception, url: str) -> StorageError:
    """The `quota` error for a sqlite3 error: missing tables become `SchemaError`."""
    if isinstance(exc, sqlite3.OperationalError) and any(
        missing in str(exc) for missing in ("no such table", "no such column", "has no column")
    ):
        return missing_objects_error(url, str(exc), _version_after_error(url))
    return StorageError(f"SQLite error on {url}: {exc}")


def _version_after_error(url: str) -> Rows | None:
    """The version table's rows, read on a read-only connection of its own: only after a
    "no such table" (one open and one SELECT on the error path); None if unreadable."""
    from pathlib import Path

    from quota._core.url import parse_url

    try:
        uri = Path(parse_url(url).target).absolute().as_uri() + "?mode=ro"
        with contextlib.closing(sqlite3.connect(uri, uri=True, timeout=1.0)) as conn:
            return _version_rows(lambda sql: conn.execute(sql).fetchall())
    except sqlite3.Error:
        return None


def _version_rows(execute: Callable[[str], Rows]) -> Rows | None:
    try:
        rows: Rows = execute(_sql.SCHEMA_VERSION.sql)
    except sqlite3.OperationalError as exc:
        if "no such table" in str(exc):
            return None
        raise
    return rows


class _SQLiteFile:
    """What both SQLite faces share: the file, its URL, the statements in sqlite3's form."""

    dialect = "sqlite"
    #: No fallback answers for this store itself (`quota._wrappers.fallback` wraps it for one).
    up = True

    def __init__(self, path: str, url: str, *, busy_timeout: float, db_clock: bool) -> None:
        _check_sqlite_version()
        self.url = url
        self.db_clock = db_clock
        self._bind = _sql.Binder("qmark", "sqlite", db_clock)
        self._plain = self._bind.plain
        self._path = path
        self._busy_timeout = busy_timeout
        self._truncate_at = WAL_TRUNCATE_BYTES

    def _truncate_due(self) -> int:
        """The WAL's size when a TRUNCATE checkpoint is due, else 0."""
        size = wal_size(self._path)
        return size if size >= self._truncate_at else 0

    def _truncated(self, busy: bool, size: int) -> None:
        # One that could not finish (a reader elsewhere holding an old snapshot) is
        # tried again only once the WAL has grown by another WAL_TRUNCATE_BYTES, so
        # a reader that stays does not hold up every writer again and again.
        self._truncate_at = size + WAL_TRUNCATE_BYTES if busy else WAL_TRUNCATE_BYTES

    def _truncate_pragmas(self) -> tuple[str, str]:
        """The busy timeout for a TRUNCATE checkpoint, and the one to set back after it."""
        wait = min(self._busy_timeout, WAL_TRUNCATE_WAIT)
        return (
            f"PRAGMA busy_timeout = {int(wait * 1000)}",
            f"PRAGMA busy_timeout = {int(self._busy_timeout * 1000)}",
        )

    def _truncate_now(self, conn: sqlite3.Connection, size: int) -> None:
        """A TRUNCATE checkpoint on `conn`, the WAL being `size` bytes.

        SQLite's automatic checkpoint (PASSIVE, every 1000 pages) copies the
        WAL back but can start it over only at a moment when no other
        connection reads from it: with several processes writing without a
        pause, that moment never comes and the WAL grows by every write (about
        100 MB in 5 s from four processes). A TRUNCATE checkpoint waits (within
        the busy timeout) for that moment, making the others' writes wait the
        few milliseconds it takes, then empties the file. SQLite answers busy
        at once, without waiting, while another connection checkpoints (their
        automatic checkpoints, after each write while the WAL is big): that is
        retried for at most `WAL_TRUNCATE_WAIT`.
        """
        (short, usual), busy = self._truncate_pragmas(), 1
        deadline = time.monotonic() + min(self._busy_timeout, WAL_TRUNCATE_WAIT)
        try:
            conn.execute(short)
            while (busy := conn.execute(_TRUNCATE).fetchall()[0][0]) and (
                time.monotonic() < deadline
            ):
                time.sleep(_CHECKPOINT_RETRY)  # another connection is checkpointing
        except sqlite3.Error:
            pass
        finally:
            with contextlib.suppress(sqlite3.Error):
                conn.execute(usual)
        self._truncated(bool(busy), size)

    def _require_file(self) -> None:
        """Raise `SchemaError` if the file is missing: connecting would create it empty."""
        missing = missing_sqlite_file(self._path, self.url)
        if missing is not None:
            raise missing

    def __repr__(self) -> str:
        # Short and without the URL: `flask limiter config` prints it in an 80-column table.
        return f"<{type(self).__name__}>"

    def _busy_pragmas(self, transaction: bool, maintenance: bool) -> tuple[str, str] | None:
        """For a maintenance operation without a transaction under a busy timeout shorter
        than a durable quota transaction's (a fallback's budget): the PRAGMAs that lift
        it for the operation and put it back after. None otherwise."""
        own = int(self._busy_timeout * 1000)
        if not maintenance or transaction or own >= UNBUDGETED_BUSY_MS:
            return None
        return f"PRAGMA busy_timeout = {UNBUDGETED_BUSY_MS}", f"PRAGMA busy_timeout = {own}"


class SQLiteStore(_SQLiteFile):
    """Sync SQLite store: threads borrow `sqlite3` connections from a bounded pool.

    A connection (with its reused cursor) is lent for one call; at most
    ``pool_size`` are open, whatever the number of threads, so a
    thread-per-request server holds a few file descriptors, not two per
    thread that ever called.
    """

    def __init__(
        self, path: str, url: str, *, busy_timeout: float = 5.0, db_clock: bool = False,
        serialize: bool = False, pool_size: int = 10, idle_timeout: float = DEFAULT_IDLE_TIMEOUT,
    ) -> None:  # fmt: skip
        super().__init__(path, url, busy_timeout=busy_timeout, db_clock=db_clock)
        self._pool_size = pool_size
        self._idle_timeout = idle_timeout
        self._serialize: threading.Lock | None = None
        if serialize:
            # Under a short busy timeout (a fallback's budget), threads of one
            # process queue on this lock (fair, no sleeping) instead of on
            # SQLite's busy handler, whose backoff sleeps can starve a thread
            # past the budget and fake an outage. Processes still share the
            # file through SQLite's own locking, within the budget.
            self._serialize = threading.Lock()
        self._schema_checked = False
        self._statements = 0
        self._pool = self._new_pool()

    def _new_pool(self) -> SyncPool[sqlite3.Cursor]:
        # Threads of one process wait for a connection at most the busy timeout.
        return SyncPool(
            self._open, _close_cursor, size=self._pool_size, wait_timeout=self._busy_timeout,
            idle_timeout=self._idle_timeout,
        )  # fmt: skip

    def _open(self) -> sqlite3.Cursor:
        self._require_file()
        conn = None
        try:
            conn = sqlite3.connect(
                self._path, timeout=self._busy_timeout, isolation_level=None,
                check_same_thread=False,
            )  # fmt: skip
            set_up(conn, self._busy_timeout)
            if not self._schema_checked:
                check_version(_version_rows(lambda sql: conn.execute(sql).fetchall()), self.url)
                self._schema_checked = True
        except BaseException as exc:
            if conn is not None:
                conn.close()
            if isinstance(exc, sqlite3.Error):
                raise wrap_error(exc, self.url) from exc
            raise
        return conn.cursor()

    def _borrow(self) -> tuple[SyncPool[sqlite3.Cursor], sqlite3.Cursor]:
        pool = self._pool
        try:
            return pool, pool.acquire()
        except sqlite3.Error as exc:
            raise wrap_error(exc, self.url) from exc

    @staticmethod
    def _give_back(
        pool: SyncPool[sqlite3.Cursor], cursor: sqlite3.Cursor, exc: BaseException | None
    ) -> None:
        if exc is not None and not isinstance(exc, Exception):
            pool.discard(cursor)  # interrupted mid-call: state unknown
            return
        if cursor.connection.in_transaction:
            try:
                cursor.connection.rollback()
            except sqlite3.Error:
                pool.discard(cursor)
                return
        pool.release(cursor)

    def execute(self, statement: Statement, params: Sequence[Any]) -> Rows:
        # The hot path, in one frame: every call it makes costs a tenth of a statement.
        sql = self._plain.get(statement)
        if sql is None:
            sql, params = self._bind(statement, params)
        serialize = self._serialize
        if serialize is not None:
            serialize.acquire()
        try:
            pool = self._pool
            try:
                cursor = pool.acquire()
            except sqlite3.Error as exc:
                raise wrap_error(exc, self.url) from exc
            try:
                rows = cursor.execute(sql, params).fetchall()
            except BaseException as exc:
                self._give_back(pool, cursor, exc)
                if isinstance(exc, sqlite3.Error):
                    raise wrap_error(exc, self.url) from exc
                raise
            self._statements += 1  # counted loosely across threads: it only paces the check
            if self._statements % WAL_CHECK_EVERY == 0:
                self._bound_wal(cursor)
            pool.release(cursor)
            return rows
        finally:
            if serialize is not None:
                serialize.release()

    execute_strict = execute

    def _bound_wal(self, cursor: sqlite3.Cursor) -> None:
        """Empty the WAL if it has outgrown `WAL_TRUNCATE_BYTES` (`_truncate_now`).

        Run by the one statement in `WAL_CHECK_EVERY` that finds the WAL too big,
        after its own answer is in; a checkpoint that cannot finish is left to the next.
        """
        size = self._truncate_due()
        if size:
            self._truncate_now(cursor.connection, size)

    def run(self, op: Op[T], *, transaction: bool, maintenance: bool = False) -> T:
        lift = self._busy_pragmas(transaction, maintenance)
        pool, cursor = self._borrow()
        conn = cursor.connection

        def execute(statement: Statement, params: Sequence[Any]) -> Rows:
            if isinstance(statement, Statement) and statement.name in _PAUSES:
                time.sleep(params[0])
                return []
            sql, params = self._bind(statement, params)
            try:
                return conn.execute(sql, params).fetchall()
            except sqlite3.Error as exc:
                raise wrap_error(exc, self.url) from exc

        try:
            if lift is not None:
                # Maintenance (cleanup) is no request-path call: it waits its turn
                # on the file for as long as a durable quota transaction does.
                conn.execute(lift[0])
                try:
                    result = drive(op, execute)
                finally:
                    conn.execute(lift[1])
            elif not transaction:
                result = drive(op, execute)
            elif self._serialize is None:
                result = self._transaction(conn, op, execute)
            else:
                # Under a fallback's short busy timeout: a durable quota transaction is
                # no request-path decision, so it queues with this process's writers
                # and may wait its turn on other processes for the usual time.
                with self._serialize:
                    conn.execute(f"PRAGMA busy_timeout = {UNBUDGETED_BUSY_MS}")
                    try:
                        result = self._transaction(conn, op, execute)
                    finally:
                        conn.execute(f"PRAGMA busy_timeout = {int(self._busy_timeout * 1000)}")
        except BaseException as exc:
            self._give_back(pool, cursor, exc)
            raise
        self._give_back(pool, cursor, None)
        return result

    def _transaction(
        self,
        conn: sqlite3.Connection,
        op: Op[T],
        execute: Callable[[Statement, Sequence[Any]], Rows],
    ) -> T:
        # IMMEDIATE takes the write lock up front, so two writers never both
        # read and then deadlock upgrading to write.
        self._control(conn, "BEGIN IMMEDIATE")
        try:
            result = drive(op, execute)
        except BaseException:
            conn.rollback()
            raise
        self._control(conn, "COMMIT")
        return result

    def _control(self, conn: sqlite3.Connection, sql: str) -> None:
        """``BEGIN IMMEDIATE`` or ``COMMIT``, its failure a `StorageError`."""
        try:
            conn.execute(sql)
        except sqlite3.Error as exc:
            raise wrap_error(exc, self.url) from exc

    @property
    def pool(self) -> SyncPool[sqlite3.Cursor]:
        """The connection pool (for tests and diagnostics)."""
        return self._pool

    def close(self) -> None:
        """Close every connection; the store opens new ones if it is used again."""
        pool, self._pool = self._pool, self._new_pool()
        pool.close()


def _close_cursor(cursor: sqlite3.Cursor) -> None:
    with contextlib.suppress(sqlite3.Error):
        cursor.connection.close()


#: The inline connection's own automatic checkpoint is off (it would fsync on
#: the event loop). Every this many inline statements the store looks at the
#: WAL's size instead, and past `WAL_CHECKPOINT_BYTES` (SQLite's own default:
#: 1000 pages of 4 KiB) checkpoints it on the worker thread.
INLINE_CHECKPOINT_EVERY = 256
WAL_CHECKPOINT_BYTES = 4 * 1024 * 1024


def _busy(exc: sqlite3.Error) -> bool:
    """True for "database is locked" (SQLITE_BUSY and its extended codes)."""
    code = getattr(exc, "sqlite_errorcode", None)
    if code is None:  # Python 3.10: no error codes on exceptions, only the message
        return "database is locked" in str(exc)
    return bool(code & 0xFF == _SQLITE_BUSY)


#: Rows aiosqlite fetches per trip when iterating a cursor (its default).
_ITER_CHUNK_SIZE = 64

#: ``sqlite3.SQLITE_BUSY`` (the constant is missing before Python 3.11).
_SQLITE_BUSY = 5


async def _wait_out(job: asyncio.Future[T]) -> T:
    """`job`'s result; if the caller is cancelled meanwhile, it still waits for `job` to end.

    For work on aiosqlite's worker thread: the worker hands every result to
    the event loop, so work abandoned half-way would hand it to a loop that may
    be closed by then. The cancellation is raised once `job` is done, however
    often it comes (anyio's cancel scopes cancel again every loop turn).
    """
    try:
        return await asyncio.shield(job)
    except asyncio.CancelledError:
        while not job.done():
            with contextlib.suppress(BaseException):
                await asyncio.shield(job)
        raise


class _Connection(aiosqlite.Connection):
    """`aiosqlite.Connection`, keeping the future of its worker's stop.

    When connecting fails or is cancelled, aiosqlite stops its worker thread
    itself and waits for nothing: `stopping` lets the store wait until the
    worker has handed back its last result.
    """

    stopping: asyncio.Future[Any] | None = None

    def stop(self) -> asyncio.Future[Any] | None:
        future: asyncio.Future[Any] | None = super().stop()
        if future is not None:
            self.stopping = future
        return future

    async def stopped(self) -> None:
        """Wait for the worker to finish its last job, if it was told to stop."""
        if self.stopping is not None:
            with contextlib.suppress(Exception):
                await _wait_out(self.stopping)


class AsyncSQLiteStore(_SQLiteFile):
    """Async SQLite store: statements run on the event loop when the file is free.

    A single statement on a free SQLite file takes ~15 µs; handing it to a
    worker thread and back costs several times that in CPU. So each statement
    first runs **inline**, on a plain `sqlite3` connection of the loop's thread
    whose busy timeout is zero: it never waits. If another writer holds the
    lock (another process, a transaction of this store), SQLite answers busy
    at once, before changing anything, and the statement goes to the
    `aiosqlite` worker instead, which waits its turn with the full busy
    timeout off the loop. Multi-statement transactions (`run`) always go to
    the worker, one at a time. The inline connection never checkpoints on the
    loop (that would fsync there); the worker checkpoints the WAL once it
    outgrows `WAL_CHECKPOINT_BYTES`, this store's statements queuing on the
    worker meanwhile.

    Close the store (`aclose`) before its event loop closes: the worker hands
    its results to that loop, and closing waits for whatever it still has to
    do (statements of calls cancelled meanwhile, a connection being opened).
    Opening the connection, a transaction and closing run to their end on the
    worker even when their caller is cancelled; the cancellation is raised
    once they are done.
    """

    def __init__(
        self, path: str, url: str, *, busy_timeout: float = 5.0, db_clock: bool = False
    ) -> None:
        super().__init__(path, url, busy_timeout=busy_timeout, db_clock=db_clock)
        self._conn: aiosqlite.Connection | None = None
        self._opening: asyncio.Future[aiosqlite.Connection] | None = None
        self._lock: asyncio.Lock | None = None
        self._inline: sqlite3.Cursor | None = None
        self._inline_thread = 0
        self._inline_count = 0
        self._checkpoint: asyncio.Task[None] | None = None
        self._checkpointing = False
        self._checkpoint_asked = 0
        self._worker_count = 0

    async def _open(self) -> aiosqlite.Connection:
        """Connect, set the file up and check its schema; `self._conn` once done.

        Runs as a task of its own (`_start`), which a cancelled caller waits out.
        """
        self._require_file()
        path, timeout = self._path, self._busy_timeout
        pending = _Connection(
            lambda: sqlite3.connect(path, timeout=timeout, isolation_level=None),
            _ITER_CHUNK_SIZE,
        )
        # aiosqlite's worker thread is not a daemon: a store nobody closed
        # (the module-level default limiter, say) would keep the process
        # from exiting. SQLite recovers an unclosed WAL file on next open.
        worker = getattr(pending, "_thread", None)
        if worker is not None and not worker.is_alive():
            worker.daemon = True
        try:
            conn = await pending
        except BaseException as exc:
            # aiosqlite has told its worker to stop: wait until it has, so
            # that it hands nothing more to this loop once the call is over.
            await pending.stopped()
            if isinstance(exc, sqlite3.Error):
                raise wrap_error(exc, self.url) from exc
            raise
        try:
            await aset_up(conn, self._busy_timeout)
            try:
                rows: Rows | None = list(await conn.execute_fetchall(_sql.SCHEMA_VERSION.sql))
            except sqlite3.OperationalError as exc:
                if "no such table" not in str(exc):
                    raise
                rows = None
            check_version(rows, self.url)
        except BaseException as exc:
            await _wait_out(asyncio.ensure_future(conn.close()))
            if isinstance(exc, sqlite3.Error):
                raise wrap_error(exc, self.url) from exc
            raise
        self._conn = conn
        self._open_inline()
        return conn

    def _open_inline(self) -> None:
        """The loop thread's own connection: never waits, never checkpoints."""
        try:
            inline = sqlite3.connect(
                self._path, timeout=0, isolation_level=None, check_same_thread=False
            )
        except sqlite3.Error:
            return  # the worker does everything
        try:
            # WAL is a property of the file, set by the worker's connection.
            inline.execute("PRAGMA synchronous = NORMAL")
            inline.execute("PRAGMA wal_autocheckpoint = 0")
            inline.execute(f"PRAGMA journal_size_limit = {JOURNAL_SIZE_LIMIT}")
        except sqlite3.Error:
            inline.close()
            return
        self._inline = inline.cursor()
        self._inline_thread = threading.get_ident()

    def try_inline(self, statement: Statement, params: Sequence[Any]) -> Rows | None:
        """Run `statement` now, on the loop's thread; None if it must go to the worker.

        It makes this store a `quota._stores.base.InlineStore`: it tells
        `quota._wrappers.batching.AsyncBatchingStore` that statements of this store finish
        without yielding, so it gathers calls by loop turn.

        None when the store is not open yet, when called off the loop's
        thread, or when another writer holds the file (nothing was changed).
        """
        sql, params = self._bind(statement, params)
        return self._try_inline(sql, params)

    def _try_inline(self, sql: str, params: Sequence[Any]) -> Rows | None:
        inline = self._inline
        if inline is None or self._checkpointing or threading.get_ident() != self._inline_thread:
            return None
        try:
            rows = inline.execute(sql, params).fetchall()
        except sqlite3.Error as exc:
            if _busy(exc):
                return None
            raise wrap_error(exc, self.url) from exc
        self._inline_count += 1
        if self._inline_count % INLINE_CHECKPOINT_EVERY == 0:
            self._maybe_checkpoint()
        return rows

    async def execute(self, statement: Statement, params: Sequence[Any]) -> Rows:
        conn = self._conn or await self._start()
        sql, params = self._bind(statement, params)
        rows = self._try_inline(sql, params)
        if rows is not None:
            return rows
        # Another writer holds the file: wait for it off the loop.
        assert self._lock is not None
        async with self._lock:
            try:
                rows = list(await conn.execute_fetchall(sql, params))
            except sqlite3.Error as exc:
                raise wrap_error(exc, self.url) from exc
        # Other processes keep the file busy: their writes grow the WAL too.
        self._worker_count += 1
        if self._worker_count % WAL_CHECK_EVERY == 0:
            self._maybe_checkpoint()
        return rows

    execute_strict = execute

    def _maybe_checkpoint(self) -> None:
        try:
            size = os.stat(self._path + "-wal").st_size
        except OSError:
            return
        if size < WAL_CHECKPOINT_BYTES:
            return
        if self._checkpoint is None or self._checkpoint.done():
            self._checkpoint = asyncio.get_running_loop().create_task(self._checkpoint_wal())
            self._checkpoint_asked = self._inline_count
        elif self._inline_count - self._checkpoint_asked >= 4 * INLINE_CHECKPOINT_EVERY:
            # Asked for long ago and not started: the loop has not turned since
            # (a task deciding in a tight loop). Checkpoint here rather than let
            # the WAL grow; this task holds the loop anyway.
            assert self._inline is not None
            due = self._truncate_due()
            if due:  # past WAL_TRUNCATE_BYTES a PASSIVE one would not start the WAL over
                self._truncate_now(self._inline.connection, due)
            else:
                with contextlib.suppress(sqlite3.Error):
                    self._inline.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
            self._checkpoint_asked = self._inline_count

    async def _checkpoint_wal(self) -> None:
        """Copy the WAL back into the database, on the worker, with this store's writes paused.

        PASSIVE never waits for anyone (a long reader elsewhere only leaves
        part of the WAL for next time), but it can only finish if no write of
        ours lands meanwhile: while it runs, statements go to the worker and
        queue behind it instead of running inline. Once it has copied every
        frame, the next write starts the WAL over from its beginning. Past
        `WAL_TRUNCATE_BYTES` (other processes writing without a pause leave
        PASSIVE no moment to start the WAL over), it is TRUNCATE instead, as in
        `SQLiteStore._bound_wal`.
        """
        conn = self._conn
        if conn is None or self._lock is None:
            return
        self._checkpointing = True
        try:
            async with self._lock:
                # Closed meanwhile, or failed: the next one will do.
                with contextlib.suppress(sqlite3.Error, ValueError):
                    # Stepped to its end: a statement left open on its row would
                    # keep the worker's read snapshot, and its reads stale.
                    size = self._truncate_due()
                    if not size:
                        await conn.execute_fetchall("PRAGMA wal_checkpoint(PASSIVE)")
                        return
                    await self._truncate(conn, size)
        finally:
            self._checkpointing = False

    async def _truncate(self, conn: aiosqlite.Connection, size: int) -> None:
        """A TRUNCATE checkpoint on the worker (see `SQLiteStore._bound_wal`)."""
        (short, usual), busy = self._truncate_pragmas(), 1
        deadline = time.monotonic() + min(self._busy_timeout, WAL_TRUNCATE_WAIT)
        try:
            await conn.execute_fetchall(short)
            while (busy := next(iter(await conn.execute_fetchall(_TRUNCATE)))[0]) and (
                time.monotonic() < deadline
            ):
                await asyncio.sleep(_CHECKPOINT_RETRY)
        finally:
            await conn.execute_fetchall(usual)
            self._truncated(bool(busy), size)

    async def _start(self) -> aiosqlite.Connection:
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._conn is None:
                # A caller cancelled meanwhile waits for the opening to end (a
                # connection opened is kept for the next call, or `aclose`).
                self._opening = asyncio.ensure_future(self._open())
                return await _wait_out(self._opening)
            return self._conn

    async def run(self, op: Op[T], *, transaction: bool, maintenance: bool = False) -> T:
        lift = self._busy_pragmas(transaction, maintenance)
        conn = self._conn or await self._start()
        assert self._lock is not None

        async def execute(statement: Statement, params: Sequence[Any]) -> Rows:
            if isinstance(statement, Statement) and statement.name in _PAUSES:
                await asyncio.sleep(params[0])
                return []
            sql, params = self._bind(statement, params)
            try:
                return list(await conn.execute_fetchall(sql, params))
            except sqlite3.Error as exc:
                raise wrap_error(exc, self.url) from exc

        async with self._lock:
            if lift is not None:  # see `SQLiteStore.run`
                await conn.execute_fetchall(lift[0])
                try:
                    return await adrive(op, execute)
                finally:
                    await asyncio.shield(conn.execute_fetchall(lift[1]))
            if not transaction:
                return await adrive(op, execute)
            # The whole transaction runs as one job on the worker thread: a
            # task cancelled while awaiting it leaves the worker to finish,
            # and the job itself always ends in COMMIT or ROLLBACK, so no
            # write lock is ever left held between BEGIN and its cleanup.
            # If the caller gives up, the job goes on to its COMMIT or ROLLBACK
            # (at most the busy timeout) and the call waits for it, so that the
            # lock, and the worker, are free when it ends.
            return await _wait_out(asyncio.ensure_future(self._transaction(conn, op, execute)))

    async def _transaction(
        self,
        conn: aiosqlite.Connection,
        op: Op[T],
        execute: Callable[[Statement, Sequence[Any]], Awaitable[Rows]],
    ) -> T:
        try:
            await self._control(conn, "BEGIN IMMEDIATE")
            result = await adrive(op, execute)
            await self._control(conn, "COMMIT")
        except BaseException:
            if conn.in_transaction:
                await asyncio.shield(conn.rollback())
            raise
        return result

    async def _control(self, conn: aiosqlite.Connection, sql: str) -> None:
        """``BEGIN IMMEDIATE`` or ``COMMIT``, its failure a `StorageError`."""
        try:
            await conn.execute_fetchall(sql)
        except sqlite3.Error as exc:
            raise wrap_error(exc, self.url) from exc

    async def aclose(self) -> None:
        """Close the connections, once the worker has done what it was given.

        A connection still being opened is waited for and closed. Cancelled
        meanwhile, this still closes everything before raising the cancellation.
        """
        await _wait_out(asyncio.ensure_future(self._close()))

    async def _close(self) -> None:
        opening, self._opening = self._opening, None
        if opening is not None:
            await asyncio.wait({opening})
            if not opening.cancelled():
                opening.exception()  # retrieved: its callers had it raised
        checkpoint, self._checkpoint = self._checkpoint, None
        if checkpoint is not None:
            await asyncio.gather(checkpoint, return_exceptions=True)
        inline, self._inline = self._inline, None
        if inline is not None:
            inline.connection.close()
        conn, self._conn = self._conn, None
        if conn is not None:
            await conn.close()


def open_sync(parsed: StoreURL, settings: StoreSettings) -> SQLiteStore:
    """The sync store of a ``sqlite://`` URL (`quota._core.url.DIALECTS`)."""
    return SQLiteStore(
        parsed.target, parsed.url, busy_timeout=settings.timeout, db_clock=settings.db_clock,
        serialize=settings.serialize, pool_size=settings.pool_size,
        idle_timeout=settings.idle_timeout,
    )  # fmt: skip


def open_async(parsed: StoreURL, settings: StoreSettings) -> AsyncSQLiteStore:
    """The async store of a ``sqlite://`` URL."""
    return AsyncSQLiteStore(
        parsed.target, parsed.url, busy_timeout=settings.timeout, db_clock=settings.db_clock
    )
