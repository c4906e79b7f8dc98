"""Group commit: concurrent fixed-window hits gathered into one statement, counts kept exact.

On SQL the batch is one statement; on Redis it is one pipeline (see below).

A store wrapper with the store protocol (`quota._stores.base`), so it composes:
limiter → fallback → batcher → store. It intercepts the hot statement
`quota._sql.statements.HIT` (by name) and passes every other statement straight through.

How a hit travels:

* **Idle**: nothing is in flight, so the call goes out at once, alone, as the
  very statement the one-by-one path runs. Batching adds no latency when idle.
* **Busy**: a statement is in flight, so the call joins a queue. The queue
  goes out as soon as a slot is free (the store may have several statements
  in flight: `AsyncBatchingStore.slots`), as **one** statement per slot:
  hits on the same bucket key summed, keys sorted (two processes' batches
  lock rows in the same order, so they cannot deadlock), one
  ``INSERT … SELECT … ON CONFLICT DO UPDATE SET count = count + excluded.count
  RETURNING bucket_key, count``, at most `max_batch` hits each. With two
  slots free the queue is split evenly between them: one batch is written
  while the other is on the wire, and callers coming back from one batch
  gather for the next. A call never goes out alone while anything is in
  flight (that would spend a round trip on one hit).
* **Inline stores** (a `quota._stores.base.InlineStore`: the async SQLite store runs
  a statement on the event loop when the file is free): such a statement is
  never seen in flight, so a statement marks the rest of its loop turn busy
  instead; calls of other tasks in that turn queue and go out together when
  the turn ends. The caller that ran alone may go on alone for
  `LONE_RUNS_PER_TURN` calls.
* **Exact counts**: a key's hits of costs c1..cn (in arrival order) whose
  total came back as C hand caller i the count ``C - (c(i+1) + … + cn)``:
  the count it would have seen had the hits run one by one in that order.
  `quota._core.decision.decide` then allows exactly while that count is ≤ the limit.

Cancellation: a waiting caller cancelled before its batch is sent is dropped
from the queue and its hit is **not counted**; one cancelled after its batch
was sent **is counted** (the statement cannot be taken back), and the counts
handed to the others are the same either way. A database error fails every
caller of that batch with the exception the one-by-one path raises
(`StorageError`, `SchemaError`); the statement is atomic, so none of its hits
is counted. On the sync face an outage (a lost connection, a path that
stopped answering, a timeout) also fails the callers queued behind that
batch, unsent and uncounted, rather than sending their batch down the same
path: under a fallback each is decided from memory within its budget.

**Redis** (``redis://``; the stores declared ``pipelined``, `quota._core.url.DIALECTS`): a batch is
one pipeline (`BATCH_HIT_REDIS`) of the very ``EVALSHA`` each hit runs one by
one, in arrival order, sent in one round trip without ``MULTI``. Each script
answers its own hit's count, so no sum is split. Redis runs each script
atomically, but the pipeline as a whole is not: the scripts of other clients
may run between two of its scripts (counts stay exact: each script counts on
what is stored when it runs). A script that fails with a statement error (a
key of another type) fails its own caller only; the others get their counts.
A pipeline that fails otherwise fails every caller of the batch with
`StorageError`, yet the scripts Redis ran **are counted**: when the
connection is lost, those that reached Redis, though none is answered.
Nothing is sent twice (the store does not retry), so a hit is counted at
most once.

Only `HIT` (count_denied=True) is batched. `HIT_CAPPED` (count_denied=False)
is not: whether a capped hit counts depends on the count before it, which
the summed statement cannot hand back, so it goes one by one; so do the
other algorithms and the database clock (statements with ``:name`` parameters).
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any, TypeVar

from quota._core.errors import StorageError
from quota._core.url import DIALECTS
from quota._sql import statements as _sql
from quota._sql.statements import BATCH_HIT, BATCH_HIT_REDIS, Statement
from quota._sql.steps import Op, Rows, Step
from quota._stores.base import AsyncStore, InlineStore, SyncStore, call_deadline

T = TypeVar("T")

#: Default most hits in one batch statement.
DEFAULT_MAX_BATCH = 1000

#: Most hits in one SQLite batch: padded to at most 4,096 rows of six values,
#: within SQLite's 32,766 bound parameters a statement.
SQLITE_MAX_BATCH = 4096

#: With an inline store: statements one caller may send alone in one loop turn.
LONE_RUNS_PER_TURN = 32

_COLUMNS = (
    "INSERT INTO quota_counters"
    " (bucket_key, client_key, window_start, window_seconds, count, updated_at)"
)
_UPSERT = (
    " ON CONFLICT (bucket_key) DO UPDATE"
    " SET count = quota_counters.count + excluded.count, updated_at = excluded.updated_at"
    " RETURNING bucket_key, count"
)

#: The statement this module batches, by name.
_HIT = _sql.HIT.name

#: PostgreSQL's batch statement: two arrays (bucket keys, summed costs) and
#: the batch's time. The other columns are read back out of the bucket key,
#: ``window:start:client``, which costs the server less than the client
#: encoding four more arrays.
BATCH_HIT_POSTGRES = Statement(
    BATCH_HIT,
    _COLUMNS + " SELECT k,"
    " substr(k, length(split_part(k, ':', 1)) + length(split_part(k, ':', 2)) + 3),"
    " CAST(split_part(k, ':', 2) AS BIGINT), CAST(split_part(k, ':', 1) AS INTEGER), c,"
    " CAST(? AS DOUBLE PRECISION)"
    " FROM unnest(CAST(? AS TEXT[]), CAST(? AS BIGINT[])) AS t(k, c)" + _UPSERT,
)

Hit = Sequence[
    Any
]  # the params of `_sql.HIT`: bucket_key, client_key, window_start, window, cost, now


def _padded(rows: int) -> int:
    """`rows` rounded up to 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, …: few statement texts."""
    size = 1
    while size < rows:
        if size >= 2 and size * 3 // 2 >= rows:
            return size * 3 // 2
        size *= 2
    return size


@functools.cache
def sqlite_batch_sql(rows: int) -> Statement:
    """SQLite's batch statement for `rows` rows of six bound values.

    SQLite has no arrays; a VALUES list of bound parameters costs it about
    2.4 µs a row against 4 µs for rows read out of one JSON text. Batches
    are padded to a few sizes (`_padded`) with rows of NULLs that the
    ``WHERE`` drops, so the connection's statement cache holds every text
    (compiling a 64-row text costs more than running it). The ``WHERE`` also
    keeps the parser from reading ``ON CONFLICT`` as part of the ``SELECT``.
    """
    values = ", ".join(["(?, ?, ?, ?, ?, ?)"] * rows)
    return Statement(
        BATCH_HIT, f"{_COLUMNS} SELECT * FROM (VALUES {values}) WHERE column1 IS NOT NULL{_UPSERT}"
    )


def most_per_batch(dialect: str, max_batch: int) -> int:
    """`max_batch`, held within what one batch statement of `dialect` can carry."""
    return min(max_batch, SQLITE_MAX_BATCH) if dialect == "sqlite" else max_batch


def _batched(statement: Statement) -> bool:
    """Whether `statement` is the one this module batches (`quota._sql.statements.HIT`)."""
    try:
        return statement.name == _HIT
    except AttributeError:  # bare SQL text (`quota._sql.statements.as_statement`)
        return False


def is_batch_statement(statement: object) -> bool:
    """Whether `statement` is a batch statement of `batch_statement` (for tests and tools)."""
    return isinstance(statement, Statement) and statement.name == BATCH_HIT


def batch_statement(dialect: str, hits: Sequence[Hit]) -> Step:
    """The one statement and its parameters for `hits`: costs summed per bucket key, keys sorted.

    Every row's ``updated_at`` is the batch's latest hit time. On Redis, the hits as they
    are, in arrival order (`BATCH_HIT_REDIS`).
    """
    if DIALECTS[dialect].pipelined:
        return BATCH_HIT_REDIS, hits
    latest = 0.0
    if dialect == "postgresql":
        costs: dict[str, int] = {}
        for hit in hits:
            key, cost, now = hit[0], hit[4], hit[5]
            costs[key] = costs.get(key, 0) + cost
            if now > latest:
                latest = now
        keys = sorted(costs)
        return BATCH_HIT_POSTGRES, (latest, keys, [costs[key] for key in keys])
    rows: dict[str, list[Any]] = {}
    for bucket_key, client_key, start, window, cost, now in hits:
        row = rows.get(bucket_key)
        if row is None:
            rows[bucket_key] = [bucket_key, client_key, start, window, cost, now]
        else:
            row[4] += cost
        if now > latest:
            latest = now
    params: list[Any] = []
    for key in sorted(rows):
        row = rows[key]
        row[5] = latest
        params += row
    size = _padded(len(rows))
    params += [None] * (6 * (size - len(rows)))
    return sqlite_batch_sql(size), params


def split_counts(hits: Sequence[Hit], rows: Rows) -> list[int]:
    """Each hit's own count from the per-key totals `rows` (``bucket_key, count``).

    Walking the hits backwards, each one's count is its key's total less the
    costs of the later hits on that key. Raises `StorageError` if a key is
    missing from `rows` (the statement returns every key it wrote).
    """
    totals: dict[str, int] = {key: count for key, count in rows}
    counts = [0] * len(hits)
    i = len(hits)
    try:
        for hit in reversed(hits):
            i -= 1
            key = hit[0]
            counts[i] = total = totals[key]
            totals[key] = total - hit[4]
    except KeyError:
        raise StorageError(f"the batch statement returned no count for {key!r}") from None
    return counts


def batch_counts(dialect: str, hits: Sequence[Hit], rows: Rows) -> list[Any]:
    """Each hit's own count from the rows of its batch statement.

    SQL: per-key totals, split by `split_counts`. Redis: one row per hit, its own count
    or the `StorageError` of that hit alone (its script failed with a statement error: its
    caller gets it, the others their counts); `StorageError` if the number of rows is not
    the number of hits.
    """
    if not DIALECTS[dialect].pipelined:
        return split_counts(hits, rows)
    if len(rows) != len(hits):
        raise StorageError(f"the batch pipeline answered {len(rows)} counts for {len(hits)} hits")
    return [row[0] for row in rows]


class AsyncBatchingStore:
    """Group commit for an async store; see the module docstring. Safe to share between tasks.

    At most `slots` statements are in flight at once (2 on PostgreSQL, where
    a second batch can be on the wire while the first one is being
    written; 1 on SQLite, which has a single writer anyway).

    With 64 callers on 1,000 keys, sending the first caller back from each
    batch alone on the free slot (as an idle call) left most statements
    carrying one hit; queueing it and splitting the queue over the free
    slots took the batched rate from about 58,000 to about 90,000 decisions/s.
    """

    def __init__(
        self, store: AsyncStore, *, max_batch: int = DEFAULT_MAX_BATCH, slots: int | None = None
    ) -> None:
        self.store = store
        self.dialect = store.dialect
        self.max_batch = most_per_batch(store.dialect, max_batch)
        self.slots = slots or (1 if store.dialect == "sqlite" else 2)
        self._in_flight = 0
        self._queue: deque[tuple[Hit, asyncio.Future[Rows]]] = deque()
        self._flushes: set[asyncio.Task[None]] = set()
        # A store whose statements finish without yielding (the async SQLite
        # store runs them inline) is never seen "in flight" by the next
        # caller. For it, a statement marks the rest of this loop turn busy:
        # callers arriving in the same turn queue, and go out together.
        # A caller that goes on alone (nobody else has run meanwhile) may send
        # a few more statements of its own in the same turn: a lone sequential
        # caller pays no wait, and still yields to the others now and then.
        self._inline = store if isinstance(store, InlineStore) else None
        self._turn_busy = False
        self._turn_owner: asyncio.Task[Any] | None = None
        self._turn_runs = 0
        self._next_scheduled = False

    @property
    def up(self) -> bool:
        return self.store.up

    async def execute(self, statement: Statement, params: Sequence[Any]) -> Rows:
        if not _batched(statement):
            return await self.store.execute(statement, params)
        if self._in_flight == 0 and not self._queue and (not self._turn_busy or self._may_go_on()):
            inline = self._inline
            if inline is not None:  # done now, without yielding, if the file is free
                try:
                    rows = inline.try_inline(statement, params)
                except Exception:
                    self._mark_turn(True)
                    raise
                if rows is not None:
                    self._mark_turn(True)
                    return rows
            self._in_flight += 1
            try:
                return await self.store.execute(statement, params)
            finally:
                self._done(contended=False, lone=True)
        waiter: asyncio.Future[Rows] = asyncio.get_running_loop().create_future()
        self._queue.append((params, waiter))
        if self._in_flight < self.slots and not self._next_scheduled:
            # Busy only because of this turn: nothing in flight will send the queue.
            self._in_flight += 1
            self._schedule_next()
        return await waiter

    def _schedule_next(self) -> None:
        self._next_scheduled = True
        asyncio.get_running_loop().call_soon(self._next)

    def _may_go_on(self) -> bool:
        return self._turn_runs < LONE_RUNS_PER_TURN and self._turn_owner is asyncio.current_task()

    def _done(self, *, contended: bool, lone: bool) -> None:
        """A statement came back: its slot sends the queue, or goes free.

        `lone`: a caller's own statement (not a batch, even of one: a batch
        of one shows no company, so it does not make the turn busy).
        """
        if self._inline is not None and (lone or contended):
            self._mark_turn(lone)
        if contended or self._queue:
            # Let the callers just woken come back first, so they ride the
            # next batch instead of each starting a statement of their own.
            self._schedule_next()
        else:
            self._in_flight -= 1

    def _mark_turn(self, lone: bool) -> None:
        """An inline statement finished: callers of the rest of this turn queue (see above)."""
        task = asyncio.current_task() if lone else None
        if not self._turn_busy:
            self._turn_busy = True
            asyncio.get_running_loop().call_soon(self._end_turn)
            self._turn_owner, self._turn_runs = task, 1
        elif task is not None and self._turn_owner is task:
            self._turn_runs += 1
        else:
            self._turn_owner = None

    def _end_turn(self) -> None:
        self._turn_busy = False
        self._turn_owner = None

    def _next(self) -> None:
        """Send the queue on the slot just freed (and on any other free one), or free the slot."""
        self._next_scheduled = False
        batch = self._take()
        if not batch:
            self._in_flight -= 1
            return
        self._spawn(batch)
        self._fill()

    def _take(self) -> list[tuple[Hit, asyncio.Future[Rows]]]:
        """The next batch of a slot counted in `_in_flight`: its share of the queue."""
        queue = self._queue
        batch: list[tuple[Hit, asyncio.Future[Rows]]] = []
        # This slot and the ones still free share the queue evenly.
        free = self.slots - self._in_flight + 1
        size = min(self.max_batch, -(-len(queue) // free))
        while queue and len(batch) < size:
            entry = queue.popleft()
            if not entry[1].done():  # a caller cancelled while waiting: never sent
                batch.append(entry)
        return batch

    def _fill(self) -> None:
        """Send the rest of the queue on the slots still free, a batch each."""
        while self._queue and self._in_flight < self.slots:
            self._in_flight += 1
            batch = self._take()
            if not batch:
                self._in_flight -= 1
                return
            self._spawn(batch)

    def _spawn(self, batch: list[tuple[Hit, asyncio.Future[Rows]]]) -> None:
        task = asyncio.get_running_loop().create_task(self._flush(batch))
        self._flushes.add(task)
        task.add_done_callback(self._flushes.discard)

    async def _flush(self, batch: list[tuple[Hit, asyncio.Future[Rows]]]) -> None:
        """Send `batch`, then the next batches of its slot while the slot stays busy.

        Runs in a task of its own: a cancelled caller cannot cancel the
        statement that carries the others' hits. The task keeps its slot
        from one batch to the next (what `_done` and `_next` would do, without
        a task a batch).
        """
        while True:
            try:
                await self._send(batch)
            except BaseException:
                self._done(contended=len(batch) > 1, lone=False)
                raise
            contended = len(batch) > 1
            if not contended and not self._queue:
                self._in_flight -= 1  # the slot goes free
                return
            if self._inline is not None and contended:
                self._mark_turn(False)
            # Let the callers just woken come back first, so they ride the next
            # batch instead of each starting a statement of their own (meanwhile
            # no caller starts a free slot: this one shares the queue with it).
            self._next_scheduled = True
            try:
                await asyncio.sleep(0)
            except BaseException:
                self._schedule_next()  # the slot goes on without this task
                raise
            self._next_scheduled = False
            batch = self._take()
            if not batch:
                self._in_flight -= 1
                return
            self._fill()

    async def _send(self, batch: list[tuple[Hit, asyncio.Future[Rows]]]) -> None:
        """One statement for `batch`; each waiter gets its rows or the error (never raised here,
        but for a cancellation or another `BaseException`, after the waiters are told)."""
        try:
            if len(batch) == 1:
                hit, waiter = batch[0]
                rows = await self.store.execute(_sql.HIT, hit)
                if not waiter.done():
                    waiter.set_result(rows)
                return
            hits = [hit for hit, _ in batch]
            rows = await self.store.execute(*batch_statement(self.dialect, hits))
            counts = batch_counts(self.dialect, hits, rows)
        except BaseException as exc:
            for _, waiter in batch:
                if not waiter.done():
                    if isinstance(exc, asyncio.CancelledError):
                        waiter.cancel()
                    else:
                        waiter.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
        else:
            # One pass: each waiter still waiting gets its own count, as HIT returns it.
            for (_, waiter), count in zip(batch, counts, strict=True):
                if not waiter.done():
                    if isinstance(count, Exception):  # this hit's own error (`batch_counts`)
                        waiter.set_exception(count)
                    else:
                        waiter.set_result([(count,)])

    async def execute_strict(self, statement: Statement, params: Sequence[Any]) -> Rows:
        return await self.store.execute_strict(statement, params)

    async def run(self, op: Op[T], *, transaction: bool, maintenance: bool = False) -> T:
        return await self.store.run(op, transaction=transaction, maintenance=maintenance)

    async def aclose(self) -> None:
        """Wait for the batches in flight, then close the store."""
        while self._flushes:
            await asyncio.gather(*self._flushes, return_exceptions=True)
        await self.store.aclose()


class _Waiter:
    """A thread waiting for its hit's rows, or for its turn to send a batch."""

    __slots__ = ("batch", "deadline", "error", "gone", "hit", "result", "sent", "wake")

    def __init__(self, hit: Hit, deadline: float | None) -> None:
        self.hit = hit
        self.deadline = deadline  # its call's (`quota._stores.base.call_deadline`)
        self.result: Rows | None = None
        self.error: BaseException | None = None
        self.batch: list[_Waiter] | None = None  # set when this thread is to send a batch
        self.sent = False  # its hit is on the wire
        self.gone = False  # gave up before its batch was sent: not to be sent
        self.wake = threading.Lock()
        self.wake.acquire()


def _unsent() -> StorageError:
    return StorageError("no answer in time for the batch in flight; this hit was not sent")


class BatchingStore:
    """Group commit for a sync store, between threads: a leader/follower scheme.

    The thread that finds the store idle sends its own hit at once. Threads
    that arrive while a statement is in flight queue up; when it returns, the
    oldest of them is woken to send the queue as one batch (on its own
    connection), hands every other waiter its rows, and passes the turn on.
    Thread-safe; a thread never sends more than the one batch it is in.

    A call with a deadline (`quota._stores.base.call_deadline`, set by the
    fallback) waits no longer than it, then fails with an outage
    `StorageError`: a call whose hit was not sent yet leaves the queue (or its
    batch), uncounted; one whose batch was sent leaves without its answer (the
    batch may count its hit); the thread sending a batch is held to its own
    deadline by the store (the PostgreSQL store cuts the connection).
    """

    def __init__(self, store: SyncStore, *, max_batch: int = DEFAULT_MAX_BATCH) -> None:
        self.store = store
        self.dialect = store.dialect
        self.max_batch = most_per_batch(store.dialect, max_batch)
        self._lock = threading.Lock()
        self._busy = False
        self._queue: deque[_Waiter] = deque()

    @property
    def up(self) -> bool:
        return self.store.up

    def execute(self, statement: Statement, params: Sequence[Any]) -> Rows:
        if not _batched(statement):
            return self.store.execute(statement, params)
        me: _Waiter | None = None
        with self._lock:
            if self._busy:
                me = _Waiter(params, call_deadline.get())
                self._queue.append(me)
            else:
                self._busy = True
        if me is None:
            try:
                rows = self.store.execute(statement, params)
            except BaseException as exc:
                self._hand_on(exc)
                raise
            self._hand_on()
            return rows
        if me.deadline is None:
            me.wake.acquire()
        elif not me.wake.acquire(timeout=max(0.0, me.deadline - time.monotonic())):
            self._give_up(me)
        if me.batch is not None:
            self._send(me.batch)
        if me.error is not None:
            raise me.error
        assert me.result is not None
        return me.result

    def _give_up(self, me: _Waiter) -> None:
        """`me`'s deadline passed while it waited: raise an outage `StorageError`, unless
        it is to send a batch or has its answer (then it goes on as if woken)."""
        with self._lock:
            if me in self._queue:
                self._queue.remove(me)
                raise _unsent()
            if me.batch is None and me.result is None and me.error is None:
                if not me.sent:
                    me.gone = True
                    raise _unsent()
                raise StorageError("no answer in time for the batch carrying this hit")
        me.wake.acquire()  # released by now, or about to be

    def _send(self, batch: list[_Waiter]) -> None:
        failed: BaseException | None = None
        with self._lock:
            batch[1:] = [waiter for waiter in batch[1:] if not waiter.gone]
            for waiter in batch:
                waiter.sent = True
        try:
            hits = [waiter.hit for waiter in batch]
            if len(hits) == 1:
                batch[0].result = self.store.execute(_sql.HIT, hits[0])
            else:
                rows = self.store.execute(*batch_statement(self.dialect, hits))
                for waiter, count in zip(
                    batch, batch_counts(self.dialect, hits, rows), strict=True
                ):
                    if isinstance(count, Exception):  # this hit's own error (`batch_counts`)
                        waiter.error = count
                    else:
                        waiter.result = [(count,)]
        except BaseException as exc:
            failed = exc
            for waiter in batch:
                waiter.error = exc
        finally:
            for waiter in batch[1:]:  # batch[0] is this thread
                waiter.wake.release()
            self._hand_on(failed)

    def _hand_on(self, failed: BaseException | None = None) -> None:
        """The statement in flight returned: wake the oldest waiter to send the queue, or go idle.

        One that `failed` with an outage (a lost connection, a path that stopped
        answering, a timeout) fails the queue with the same error, unsent (so
        uncounted): the queue's batch would go down the same path, making its
        callers wait a second time (a fallback decides them from memory). So
        are waiters whose deadline has passed: none sends a batch it has no time for.
        """
        stranded: list[_Waiter] = []
        batch: list[_Waiter] = []
        with self._lock:
            queue = self._queue
            if isinstance(failed, StorageError) and failed.outage:
                stranded = list(queue)
                queue.clear()
                for waiter in stranded:
                    waiter.error = failed
            else:
                now = time.monotonic()
                while queue and len(batch) < self.max_batch:
                    waiter = queue.popleft()
                    if waiter.deadline is not None and waiter.deadline <= now:
                        waiter.error = _unsent()
                        stranded.append(waiter)
                    else:
                        batch.append(waiter)
            if batch:
                batch[0].batch = batch
            else:
                self._busy = False
        for waiter in stranded:
            waiter.wake.release()
        if batch:
            batch[0].wake.release()

    def execute_strict(self, statement: Statement, params: Sequence[Any]) -> Rows:
        return self.store.execute_strict(statement, params)

    def run(self, op: Op[T], *, transaction: bool, maintenance: bool = False) -> T:
        return self.store.run(op, transaction=transaction, maintenance=maintenance)

    def close(self) -> None:
        self.store.close()
