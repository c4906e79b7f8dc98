"""A bounded connection pool for the sync stores: threads borrow a connection per call.

A thread-per-request server calls the store from ever new threads. Holding a
connection per thread would open one server session (or one SQLite file
descriptor) per thread that ever called; this pool holds at most `size`
connections, whatever the number of threads, and closes those left idle for
`idle_timeout` seconds.

Why not psycopg_pool: the store holds a connection for exactly one statement,
so borrowing must cost next to nothing beside it. Here the hot path is a
`deque.pop` and a `deque.append` (atomic in CPython, no lock); only a thread
that finds no idle connection takes the lock, to open one or to wait.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

from quota._core.errors import StorageError

C = TypeVar("C")

#: Default seconds an idle connection is kept before it is closed.
DEFAULT_IDLE_TIMEOUT = 300.0


class PoolTimeout(StorageError):
    """Every connection of the pool stayed busy for the whole wait."""


# What the sync pool and the async store's pool (`quota._stores.postgres`) share.
# The rest differs by face: threads borrow without a lock and wait on a lock of
# their own; the event loop needs no lock, waits on futures, and opens and
# settles connections in tasks.


def busy_message(size: int, wait_timeout: float) -> str:
    """The error text for a caller that waited `wait_timeout` seconds on a busy pool."""
    return (
        f"all {size} connections stayed busy for {wait_timeout:g}s"
        " (raise pool_size, or look for slow statements)"
    )


def reap_period(idle_timeout: float) -> float:
    """Seconds between two looks for connections idle for longer than `idle_timeout`."""
    return max(idle_timeout / 4, 0.01)


def stale_count(idle: Sequence[tuple[object, float]], cutoff: float) -> int:
    """How many of `idle` (connections with release times, oldest first) date from `cutoff` or before.

    The oldest are first: a busy pool lends the most recently released ones, so those
    it does not need age at the front.
    """
    count = 0
    while count < len(idle) and idle[count][1] <= cutoff:
        count += 1
    return count


class _Waiter(Generic[C]):
    """A thread waiting for a connection: handed one (`conn`), or a free slot (`slot`)."""

    __slots__ = ("conn", "ready", "slot")

    def __init__(self) -> None:
        self.conn: C | None = None
        self.slot = False
        self.ready = threading.Lock()
        self.ready.acquire()


class SyncPool(Generic[C]):
    """At most `size` connections; `acquire` borrows one, `release` gives it back.

    `open` makes a connection (its errors propagate), `close` closes one and
    must not raise. `wait_timeout` bounds the wait for a busy pool
    (`PoolTimeout`), `open_timeout` (None: no bound) the wait for a new connection. Connections idle for `idle_timeout` seconds are closed by
    a daemon thread that the first `release` starts and `close` ends. `alive`
    (None: not asked) tells an idle connection that may be lent from one that
    died while it sat in the pool, which is closed instead.
    """

    def __init__(
        self, open: Callable[[], C], close: Callable[[C], None], *, size: int,
        wait_timeout: float, idle_timeout: float = DEFAULT_IDLE_TIMEOUT,
        clock: Callable[[], float] = time.monotonic, open_timeout: float | None = None,
        alive: Callable[[C], bool] | None = None,
    ) -> None:  # fmt: skip
        self._open_conn = open
        self._close_conn = close
        self._alive = alive
        self.size = size
        self._wait_timeout = wait_timeout
        self._idle_timeout = idle_timeout
        self._open_timeout = open_timeout
        self._clock = clock
        #: Idle connections, most recently released on the right, with their release time.
        self._idle: deque[tuple[C, float]] = deque()
        self._lock = threading.Lock()
        self._waiters: deque[_Waiter[C]] = deque()
        #: ``len(_waiters)``, read without the lock on the hot path.
        self._waiting = 0
        #: Connections open now, idle or lent.
        self.opened = 0
        self._closed = False
        self._reaper: threading.Thread | None = None
        self._wake_reaper = threading.Event()

    def acquire(self) -> C:
        """A connection of this pool's own; give it back with `release` or `discard`."""
        try:
            conn = self._idle.pop()[0]
        except IndexError:
            return self._acquire_slow()
        if self._alive is None or self._alive(conn):
            return conn
        return self._replace(conn)

    def _replace(self, dead: C) -> C:
        """Close `dead`; the slow path lends another idle one it finds alive, or opens one."""
        self.discard(dead)
        return self._acquire_slow()

    def _acquire_slow(self) -> C:
        deadline = self._clock() + self._wait_timeout
        while True:
            idle: C | None = None
            with self._lock:
                if self._closed:
                    raise StorageError("the connection pool is closed")
                if self._idle:
                    idle = self._idle.pop()[0]
                elif self.opened < self.size:
                    self.opened += 1
                    break
                else:
                    waiter: _Waiter[C] = _Waiter()
                    self._waiters.append(waiter)
                    self._waiting = len(self._waiters)
            if idle is not None:
                if self._alive is None or self._alive(idle):
                    return idle
                self.discard(idle)  # died while idle: its slot reopens below
                continue
            # Released connections are handed to waiters in turn (no thread that
            # just gave one back takes it again ahead of them).
            waiter.ready.acquire(timeout=max(0.0, deadline - self._clock()))
            with self._lock:
                if waiter.conn is not None:
                    return waiter.conn
                if not waiter.slot:
                    self._waiters.remove(waiter)
                    self._waiting = len(self._waiters)
                    if self._clock() >= deadline:
                        raise PoolTimeout(busy_message(self.size, self._wait_timeout))
                    continue
            break  # a slot freed by a closed connection: open one
        if self._open_timeout is not None:
            return self._open_within(self._open_timeout)
        try:
            return self._open_conn()
        except BaseException:
            self._forget()
            raise

    def _open_within(self, seconds: float) -> C:
        """Open a connection on a thread of its own; wait for it at most `seconds`.

        A connection that takes longer (a server that accepts and never
        answers) is not waited for: the caller gets `PoolTimeout`, and the
        connection joins the pool if it opens after all.
        """
        opened: list[C] = []
        failed: list[BaseException] = []
        state = {"abandoned": False, "finished": False}
        done = threading.Event()

        def open_() -> None:
            try:
                opened.append(self._open_conn())
            except BaseException as exc:
                failed.append(exc)
            with self._lock:
                state["finished"] = True
                abandoned = state["abandoned"]
            done.set()
            if abandoned:
                if opened:
                    self.release(opened[0])
                else:
                    self._forget()

        threading.Thread(target=open_, name="quota-connect", daemon=True).start()
        done.wait(seconds)
        with self._lock:
            if not state["finished"]:
                state["abandoned"] = True
                raise PoolTimeout(f"a new connection took longer than {seconds:g}s to open")
        if failed:
            self._forget()
            raise failed[0]
        return opened[0]

    def release(self, conn: C) -> None:
        """Give back a connection that is idle and clean (no transaction open)."""
        if self._closed:
            self._close_conn(conn)
            self._forget()
            return
        self._idle.append((conn, self._clock()))
        if self._waiting:
            with self._lock:
                while self._waiters and self._idle:
                    waiter = self._waiters.popleft()
                    waiter.conn = self._idle.pop()[0]
                    waiter.ready.release()
                self._waiting = len(self._waiters)
        if self._reaper is None:
            self._start_reaper()

    def discard(self, conn: C) -> None:
        """Close a connection that must not be reused (broken, or left mid-transaction)."""
        self._close_conn(conn)
        self._forget()

    def _forget(self, closed: int = 1) -> None:
        """`closed` connections are gone: their slots go to waiters first."""
        with self._lock:
            self.opened -= closed
            for _ in range(closed):
                if not self._waiters:
                    break
                waiter = self._waiters.popleft()
                waiter.slot = True
                self.opened += 1
                waiter.ready.release()
            self._waiting = len(self._waiters)

    def _start_reaper(self) -> None:
        with self._lock:
            if self._reaper is not None or self._closed:
                return
            self._reaper = threading.Thread(target=self._reap_loop, name="quota-pool", daemon=True)
        self._reaper.start()

    def _reap_loop(self) -> None:
        period = reap_period(self._idle_timeout)
        while not self._closed:
            self._wake_reaper.wait(period)
            self.reap()

    def reap(self) -> int:
        """Close the connections idle for longer than `idle_timeout`; return how many."""
        cutoff = self._clock() - self._idle_timeout
        with self._lock:
            stale = [self._idle.popleft()[0] for _ in range(stale_count(self._idle, cutoff))]
        for conn in stale:
            self._close_conn(conn)
        if stale:
            self._forget(len(stale))
        return len(stale)

    def close(self) -> None:
        """Close the idle connections now, and each lent one as it comes back."""
        with self._lock:
            self._closed = True
            idle = [conn for conn, _ in self._idle]
            self._idle.clear()
            self.opened -= len(idle)
            for waiter in self._waiters:
                waiter.ready.release()  # it finds the pool closed
            self._waiters.clear()
            self._waiting = 0
        self._wake_reaper.set()
        for conn in idle:
            self._close_conn(conn)
