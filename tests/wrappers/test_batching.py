"""Group commit (``batching=True``): concurrent hits share statements, every count stays exact.

The batcher is first driven over a scripted store whose statements wait for
the test's go-ahead, so which hits share a statement, and what a
cancellation or an error does to them, is decided by the test, not by
timing. Then the real stores: concurrent tasks and threads on SQLite and
PostgreSQL, a database error in the middle of a batch, and several OS
processes on one key.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import sqlite3
import threading
import time
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from itertools import accumulate
from typing import Any

import pytest

import quota
from quota._core.decision import stored_key as quota_stored_key
from quota._sql import statements as _sql
from quota._sql.steps import Rows, Step
from quota._stores.base import call_deadline
from quota._wrappers.batching import (
    SQLITE_MAX_BATCH,
    AsyncBatchingStore,
    BatchingStore,
    _padded,
    batch_statement,
    is_batch_statement,
    split_counts,
)
from tests import _batch_workers, _workers
from tests._support import Backend, Clock
from tests.conftest import backend_params, dialect_of, store_url

KEY = "tenant:7"


def _hit(key: str, cost: int = 1, now: float = 100.0) -> tuple[Any, ...]:
    return (f"60:60:k:{key}", f"k:{key}", 60, 60, cost, now)


def _sqlite_rows(params: Sequence[Any]) -> list[list[Any]]:
    """The rows of a SQLite batch statement's parameters, padding left out."""
    rows = [list(params[i : i + 6]) for i in range(0, len(params), 6)]
    return [row for row in rows if row[0] is not None]


# -- the pure parts -----------------------------------------------------------------------


def test_batch_statement_sums_costs_per_key_and_sorts_the_keys() -> None:
    hits = [_hit("b", 2), _hit("a", 1, now=101.0), _hit("b", 3, now=99.0), _hit("c", 1)]

    sql, (latest, keys, costs) = batch_statement("postgresql", hits)

    assert is_batch_statement(sql)
    assert keys == ["60:60:k:a", "60:60:k:b", "60:60:k:c"]
    assert costs == [1, 5, 1]
    assert latest == 101.0  # the batch's latest hit time, every row's updated_at
    sql, params = batch_statement("sqlite", hits)
    assert is_batch_statement(sql)
    assert _sqlite_rows(params) == [
        ["60:60:k:a", "k:a", 60, 60, 1, 101.0],
        ["60:60:k:b", "k:b", 60, 60, 5, 101.0],
        ["60:60:k:c", "k:c", 60, 60, 1, 101.0],
    ]
    assert len(params) == 6 * 3


def test_sqlite_batches_are_padded_to_a_few_statement_texts() -> None:
    sizes = [_padded(n) for n in range(1, 1001)]
    assert all(size >= n for n, size in zip(range(1, 1001), sizes, strict=True))
    assert all(size < 1.5 * n + 1 for n, size in zip(range(1, 1001), sizes, strict=True))
    assert len(set(sizes)) <= 20  # the connection's statement cache holds them all
    sql, params = batch_statement("sqlite", [_hit(f"k{i}", 1) for i in range(5)])
    assert len(params) == 6 * 6 and params[30:] == [None] * 6  # one row of padding
    assert sql.count("(?, ?, ?, ?, ?, ?)") == 6


def test_sqlite_batch_statement_drops_the_padding_rows() -> None:
    conn = sqlite3.connect(":memory:")
    conn.execute(
        "CREATE TABLE quota_counters (bucket_key TEXT PRIMARY KEY, client_key TEXT,"
        " window_start INTEGER, window_seconds INTEGER, count INTEGER, updated_at REAL)"
    )
    hits = [_hit(k, c) for k, c in [("a", 1), ("b", 2), ("a", 3), ("c", 1), ("d", 1)]]
    for _ in range(2):
        rows = conn.execute(*batch_statement("sqlite", hits)).fetchall()
    assert sorted(rows) == [("60:60:k:a", 8), ("60:60:k:b", 4), ("60:60:k:c", 2), ("60:60:k:d", 2)]
    assert conn.execute("SELECT count(*) FROM quota_counters").fetchone() == (4,)
    # The largest batch a SQLite batcher sends fits SQLite's bound-parameter limit.
    for batcher in (AsyncBatchingStore, BatchingStore):
        assert batcher(ScriptedStore(), max_batch=100_000).max_batch == SQLITE_MAX_BATCH  # type: ignore[arg-type]
    most = [_hit(f"m{i}", 1) for i in range(SQLITE_MAX_BATCH)]
    assert len(conn.execute(*batch_statement("sqlite", most)).fetchall()) == SQLITE_MAX_BATCH


def test_each_hit_gets_its_prefix_sum_of_the_keys_total() -> None:
    hits = [_hit("a", 2), _hit("b", 1), _hit("a", 3), _hit("a", 1), _hit("b", 4)]
    # Totals after the statement: a was at 10 before (+6), b at 0 (+5).
    counts = split_counts(hits, [("60:60:k:a", 16), ("60:60:k:b", 5)])

    assert counts == [12, 1, 15, 16, 5]


def test_a_key_missing_from_the_returned_rows_is_a_storage_error() -> None:
    with pytest.raises(quota.StorageError, match="no count"):
        split_counts([_hit("a")], [])


# -- the async batcher over a scripted store ------------------------------------------------


class ScriptedStore:
    """An async store on a dict whose statements each wait for `release` before running.

    It runs `_sql.HIT` and the SQLite batch statement, records every
    statement it is sent, and raises `fail` (when set) instead of running
    the next one.
    """

    dialect = "sqlite"

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.sent: list[tuple[str, Any]] = []
        self.fail: BaseException | None = None
        self._gates: asyncio.Queue[None] = asyncio.Queue()

    def release(self, statements: int = 1) -> None:
        for _ in range(statements):
            self._gates.put_nowait(None)

    async def execute(self, sql: Any, params: Any) -> Rows:
        self.sent.append((sql, params))
        await self._gates.get()
        if self.fail is not None:
            raise self.fail
        if sql is _sql.HIT:
            key, cost = params[0], params[4]
            self.counts[key] = self.counts.get(key, 0) + cost
            return [(self.counts[key],)]
        assert is_batch_statement(sql)
        rows = []
        for key, *_, cost, _now in _sqlite_rows(params):
            self.counts[key] = self.counts.get(key, 0) + cost
            rows.append((key, self.counts[key]))
        return rows

    async def run(self, op: Generator[Step, Rows, Any], *, transaction: bool) -> Any:
        raise NotImplementedError

    async def aclose(self) -> None:
        pass

    def batches(self) -> list[list[str]]:
        """The bucket keys of each statement sent, one list per statement."""
        return [
            [params[0]] if sql is _sql.HIT else [row[0] for row in _sqlite_rows(params)]
            for sql, params in self.sent
        ]


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def _scripted(test: Callable[[ScriptedStore, quota.AsyncLimiter], Any], *, slots: int = 1) -> None:
    async def main() -> None:
        store = ScriptedStore()
        batcher = AsyncBatchingStore(store, slots=slots)  # type: ignore[arg-type]
        limiter = quota.AsyncLimiter(batcher, quota.Options(clock=lambda: 100.0))
        await test(store, limiter)

    asyncio.run(main())


def test_a_lone_call_goes_out_at_once_as_the_one_by_one_statement() -> None:
    async def test(store: ScriptedStore, limiter: quota.AsyncLimiter) -> None:
        call = asyncio.ensure_future(limiter.rate_limit(KEY, 5, 60))
        await _settle()
        assert store.sent == [(_sql.HIT, _hit(KEY))]  # sent before anything was released
        store.release()
        assert (await call).count == 1

    _scripted(test)


def test_hits_arriving_while_a_statement_is_in_flight_share_the_next_one() -> None:
    async def test(store: ScriptedStore, limiter: quota.AsyncLimiter) -> None:
        keys = ["a", "b", "a", "c", "a", "b"]
        costs = [1, 2, 3, 1, 2, 1]
        first = asyncio.ensure_future(limiter.rate_limit("a", 100, 60))
        await _settle()
        rest = [
            asyncio.ensure_future(limiter.rate_limit(k, 100, 60, cost=c))
            for k, c in zip(keys, costs, strict=True)
        ]
        await _settle()
        assert len(store.sent) == 1  # the others wait for the statement in flight
        store.release(2)
        decisions = await asyncio.gather(first, *rest)

        assert store.batches() == [
            ["60:60:k:a"],
            ["60:60:k:a", "60:60:k:b", "60:60:k:c"],  # summed per key, sorted
        ]
        assert decisions[0].count == 1
        for key in "abc":
            mine = [
                (c, d.count) for k, c, d in zip(keys, costs, decisions[1:], strict=True) if k == key
            ]
            before = 1 if key == "a" else 0
            assert [count for _, count in mine] == [
                before + total for total in accumulate(cost for cost, _ in mine)
            ], key

    _scripted(test)


def test_a_caller_cancelled_while_waiting_is_not_counted_and_moves_nobody() -> None:
    async def test(store: ScriptedStore, limiter: quota.AsyncLimiter) -> None:
        first = asyncio.ensure_future(limiter.rate_limit(KEY, 100, 60))
        await _settle()
        waiting = [asyncio.ensure_future(limiter.rate_limit(KEY, 100, 60)) for _ in range(3)]
        await _settle()
        waiting[1].cancel()
        store.release(2)
        assert (await first).count == 1
        assert (await waiting[0]).count == 2
        with pytest.raises(asyncio.CancelledError):
            await waiting[1]
        assert (await waiting[2]).count == 3
        assert store.counts == {f"60:60:k:{KEY}": 3}
        assert [len(batch) for batch in store.batches()] == [1, 1]  # summed: one key

        sent = _sqlite_rows(store.sent[1][1])
        assert sent[0][4] == 2  # the batch carried two hits, not three

    _scripted(test)


def test_a_caller_cancelled_after_its_batch_was_sent_is_counted_and_moves_nobody() -> None:
    async def test(store: ScriptedStore, limiter: quota.AsyncLimiter) -> None:
        first = asyncio.ensure_future(limiter.rate_limit(KEY, 100, 60))
        await _settle()
        batch = [asyncio.ensure_future(limiter.rate_limit(KEY, 100, 60)) for _ in range(3)]
        await _settle()
        store.release()
        await first
        await _settle()
        assert len(store.sent) == 2  # the batch is in flight
        batch[0].cancel()
        await _settle()
        store.release()
        with pytest.raises(asyncio.CancelledError):
            await batch[0]
        assert [(await call).count for call in batch[1:]] == [3, 4]
        assert store.counts == {f"60:60:k:{KEY}": 4}

    _scripted(test)


def test_a_cancelled_lone_call_leaves_the_queue_to_be_sent() -> None:
    async def test(store: ScriptedStore, limiter: quota.AsyncLimiter) -> None:
        first = asyncio.ensure_future(limiter.rate_limit(KEY, 100, 60))
        await _settle()
        waiting = [asyncio.ensure_future(limiter.rate_limit(KEY, 100, 60)) for _ in range(2)]
        await _settle()
        first.cancel()  # its own statement is abandoned, as one by one
        await _settle()
        store.release()
        assert sorted([(await call).count for call in waiting]) == [1, 2]

    _scripted(test)


def test_an_error_of_a_batch_reaches_every_caller_in_it() -> None:
    async def test(store: ScriptedStore, limiter: quota.AsyncLimiter) -> None:
        first = asyncio.ensure_future(limiter.rate_limit(KEY, 100, 60))
        await _settle()
        batch = [asyncio.ensure_future(limiter.rate_limit(f"k{i}", 100, 60)) for i in range(4)]
        await _settle()
        store.release()
        await first
        store.fail = quota.StorageError("SQLite error: disk I/O error")
        store.release()
        outcomes = await asyncio.gather(*batch, return_exceptions=True)
        assert all(outcome is store.fail for outcome in outcomes), outcomes
        assert len(store.batches()[1]) == 4  # they did share the failed statement
        # The batcher is idle again, and the next hit goes out on its own.
        store.fail = None
        again = asyncio.ensure_future(limiter.rate_limit(KEY, 100, 60))
        await _settle()
        store.release()
        assert (await again).count == 2

    _scripted(test)


def test_a_batch_never_carries_more_than_max_batch_hits() -> None:
    async def test(store: ScriptedStore, limiter: quota.AsyncLimiter) -> None:
        batcher = limiter.store
        assert isinstance(batcher, AsyncBatchingStore)
        batcher.max_batch = 3
        calls = [asyncio.ensure_future(limiter.rate_limit(f"k{i}", 100, 60)) for i in range(8)]
        await _settle()
        store.release(4)
        await asyncio.gather(*calls)
        assert [len(batch) for batch in store.batches()] == [1, 3, 3, 1]

    _scripted(test)


def test_with_two_slots_only_an_idle_batcher_sends_a_call_alone() -> None:
    async def test(store: ScriptedStore, limiter: quota.AsyncLimiter) -> None:
        calls = [asyncio.ensure_future(limiter.rate_limit(f"k{i}", 100, 60)) for i in range(5)]
        await _settle()
        # The first went alone; the rest went together at once on the free slot
        # (a lone call on it would have cost a round trip for one hit).
        assert [len(batch) for batch in store.batches()] == [1, 4]
        store.release(2)
        await asyncio.gather(*calls)

    _scripted(test, slots=2)


def test_a_returning_batch_splits_the_queue_over_the_free_slots() -> None:
    async def twice(limiter: quota.AsyncLimiter, key: str) -> int:
        await limiter.rate_limit(key, 100, 60)
        return (await limiter.rate_limit(key, 100, 60)).count

    async def test(store: ScriptedStore, limiter: quota.AsyncLimiter) -> None:
        first = asyncio.ensure_future(limiter.rate_limit("a", 100, 60))
        await _settle()
        loops = [asyncio.ensure_future(twice(limiter, f"k{i}")) for i in range(8)]
        await _settle()
        store.release()  # the lone call returns: one slot free, the batch of 8 in flight
        await first
        store.release()  # the batch returns; its 8 callers come straight back
        await _settle()
        # Both slots free: half the queue on each, so one batch is on its way
        # while the other is being written.
        assert [len(batch) for batch in store.batches()] == [1, 8, 4, 4]
        store.release(2)
        assert await asyncio.gather(*loops) == [2] * 8

    _scripted(test, slots=2)


def test_a_batch_task_cancelled_between_batches_hands_its_slot_on() -> None:
    async def test(store: ScriptedStore, limiter: quota.AsyncLimiter) -> None:
        batcher = limiter.store
        assert isinstance(batcher, AsyncBatchingStore)
        first = asyncio.ensure_future(limiter.rate_limit("a", 100, 60))
        await _settle()
        pair = [asyncio.ensure_future(limiter.rate_limit(k, 100, 60)) for k in ("b", "c")]
        await _settle()
        store.release()  # the lone call returns; b and c go out together, in a task
        await first
        await _settle()
        assert [len(batch) for batch in store.batches()] == [1, 2]
        later = asyncio.ensure_future(limiter.rate_limit("d", 100, 60))
        await _settle()
        store.release()  # the batch returns: its task waits a turn before sending the queue
        for _ in range(20):
            await asyncio.sleep(0)
            if batcher._next_scheduled:
                break
        (task,) = batcher._flushes
        task.cancel()  # while it waits (the loop shutting down, say)
        assert [d.count for d in await asyncio.gather(*pair)] == [1, 1]
        await _settle()
        # The slot went on without the task: the queue was sent all the same.
        assert [len(batch) for batch in store.batches()] == [1, 2, 1]
        store.release()
        assert (await asyncio.wait_for(later, 5)).count == 1

    _scripted(test)


def test_only_the_counting_fixed_window_statement_is_batched() -> None:
    async def test(store: ScriptedStore, limiter: quota.AsyncLimiter) -> None:
        batcher = limiter.store
        assert isinstance(batcher, AsyncBatchingStore)
        other = asyncio.ensure_future(batcher.execute(_sql.PEEK, ("x",)))
        await _settle()
        assert store.sent == [(_sql.PEEK, ("x",))]
        other.cancel()

    _scripted(test)


class GatedStore:
    """`ScriptedStore` for threads: each statement waits for `release` before running."""

    dialect = "sqlite"

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.sent: list[tuple[Any, Any]] = []
        self._gates = threading.Semaphore(0)

    def release(self) -> None:
        self._gates.release()

    def execute(self, sql: Any, params: Any) -> Rows:
        self.sent.append((sql, params))
        assert self._gates.acquire(timeout=10)
        if sql is _sql.HIT:
            key, cost = params[0], params[4]
            self.counts[key] = self.counts.get(key, 0) + cost
            return [(self.counts[key],)]
        rows = []
        for key, *_, cost, _now in _sqlite_rows(params):
            self.counts[key] = self.counts.get(key, 0) + cost
            rows.append((key, self.counts[key]))
        return rows


def _call(batcher: BatchingStore, deadline: float | None, out: list[Any]) -> threading.Thread:
    """A thread calling `batcher` with its call's deadline `deadline` seconds from now."""

    def call() -> None:
        if deadline is not None:
            call_deadline.set(time.monotonic() + deadline)
        try:
            out.append(batcher.execute(_sql.HIT, _hit(KEY)))
        except quota.StorageError as exc:
            out.append(exc)

    thread = threading.Thread(target=call)
    thread.start()
    return thread


def _queued(batcher: BatchingStore, waiters: int) -> None:
    for _ in range(1000):
        if len(batcher._queue) == waiters:
            return
        time.sleep(0.001)
    raise AssertionError(f"{waiters} waiter(s) never queued")


def test_a_thread_whose_deadline_passes_while_queued_leaves_uncounted() -> None:
    store = GatedStore()
    batcher = BatchingStore(store)  # type: ignore[arg-type]
    first: list[Any] = []
    late: list[Any] = []
    patient: list[Any] = []
    threads = [_call(batcher, None, first)]
    _queued(batcher, 0)
    threads.append(_call(batcher, 0.1, late))
    _queued(batcher, 1)
    threads.append(_call(batcher, None, patient))
    _queued(batcher, 2)
    threads[1].join(5)  # gives up at its deadline, the statement in flight still waiting
    assert len(late) == 1 and isinstance(late[0], quota.StorageError), late
    assert late[0].outage and "not sent" in str(late[0])
    store.release()
    store.release()
    for thread in threads:
        thread.join(5)
    assert first == [[(1,)]] and patient == [[(2,)]]
    assert store.counts == {f"60:60:k:{KEY}": 2}  # the one that gave up is not counted
    assert [params for _, params in store.sent] == [_hit(KEY), _hit(KEY)]


def test_a_thread_whose_batch_was_sent_leaves_at_its_deadline_and_is_counted() -> None:
    store = GatedStore()
    batcher = BatchingStore(store)  # type: ignore[arg-type]
    first: list[Any] = []
    sender: list[Any] = []
    late: list[Any] = []
    threads = [_call(batcher, None, first)]
    _queued(batcher, 0)
    threads.append(_call(batcher, None, sender))
    _queued(batcher, 1)
    threads.append(_call(batcher, 0.3, late))
    _queued(batcher, 2)
    store.release()  # the first answers; `sender` sends the batch of both
    threads[2].join(5)
    assert len(late) == 1 and isinstance(late[0], quota.StorageError), late
    assert late[0].outage and "not sent" not in str(late[0])
    store.release()
    for thread in threads:
        thread.join(5)
    assert first == [[(1,)]] and sender == [[(2,)]]
    assert store.counts == {f"60:60:k:{KEY}": 3}  # sent, so counted: its answer was lost


# -- real stores -------------------------------------------------------------------------------


class _Spy:
    """Counts the statements a store is sent."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.hit_statements = 0
        self.batch_statements = 0
        self._execute = store.execute
        store.execute = self.execute
        # The async SQLite store also runs statements at once, on the loop.
        self._try_inline = getattr(store, "try_inline", None)
        if self._try_inline is not None:
            store.try_inline = self.try_inline

    def _count(self, sql: Any) -> None:
        if sql is _sql.HIT:
            self.hit_statements += 1
        elif is_batch_statement(sql):
            self.batch_statements += 1

    def execute(self, sql: Any, params: Sequence[Any] | Mapping[str, Any]) -> Any:
        self._count(sql)
        return self._execute(sql, params)

    def try_inline(self, sql: Any, params: Sequence[Any]) -> Any:
        rows = self._try_inline(sql, params)  # type: ignore[misc]
        if rows is not None:
            self._count(sql)
        return rows


def _make_backend(request: pytest.FixtureRequest, clock: Clock) -> Iterator[Backend]:
    name: str = request.param
    backend = Backend(name, store_url(request, dialect_of(name)), clock)
    try:
        yield backend
    finally:
        backend.close()


@pytest.fixture(params=backend_params("sqlite-async", "postgresql-async"))
def async_backend(request: pytest.FixtureRequest, clock: Clock) -> Iterator[Backend]:
    """The async faces (concurrent tasks)."""
    yield from _make_backend(request, clock)


@pytest.fixture(params=backend_params("sqlite-sync", "postgresql-sync"))
def sync_backend(request: pytest.FixtureRequest, clock: Clock) -> Iterator[Backend]:
    """The sync faces (concurrent threads)."""
    yield from _make_backend(request, clock)


def _batched(backend: Backend, **options: Any) -> tuple[Any, _Spy]:
    face = backend.connect(batching=True, **options)
    inner = face.limiter.store.store
    return face.limiter, _Spy(inner)


def _check_positions(counts: list[int], limit: int, allowed: int) -> None:
    assert sorted(counts) == list(range(1, len(counts) + 1))
    assert allowed == limit


def test_concurrent_tasks_on_one_key_get_every_count_once(async_backend: Backend) -> None:
    backend = async_backend
    limiter, spy = _batched(backend, pool_size=4)
    limit, calls = 40, 300

    async def main() -> list[quota.Decision]:
        return await asyncio.gather(*(limiter.rate_limit(KEY, limit, 60) for _ in range(calls)))

    decisions = backend.run(main())

    _check_positions([d.count for d in decisions], limit, sum(d.allowed for d in decisions))
    assert spy.batch_statements >= 1
    assert spy.hit_statements + spy.batch_statements < calls / 4
    assert backend.peek(KEY, limit, 60).count == calls


def test_mixed_keys_and_costs_in_concurrent_tasks(async_backend: Backend) -> None:
    backend = async_backend
    limiter, spy = _batched(backend)
    keys = [f"key-{i % 7}" for i in range(140)]
    costs = [1 + i % 3 for i in range(140)]

    async def main() -> list[quota.Decision]:
        return await asyncio.gather(
            *(limiter.rate_limit(k, 1000, 60, cost=c) for k, c in zip(keys, costs, strict=True))
        )

    decisions = backend.run(main())

    assert spy.batch_statements >= 1
    for key in set(keys):
        mine = sorted(
            (d.count, c) for k, c, d in zip(keys, costs, decisions, strict=True) if k == key
        )
        # Positions are exact prefix sums of the costs, in some order of the hits.
        assert [count for count, _ in mine] == list(accumulate(cost for _, cost in mine))
        assert backend.peek(key, 1000, 60).count == mine[-1][0]


def test_concurrent_threads_on_one_key_get_every_count_once(sync_backend: Backend) -> None:
    backend = sync_backend
    limiter, spy = _batched(backend)
    limit, threads, hits = 25, 8, 30
    counts: list[int] = []
    allowed = [0]
    lock = threading.Lock()
    start = threading.Barrier(threads)

    def caller() -> None:
        start.wait()
        mine = [limiter.rate_limit(KEY, limit, 60) for _ in range(hits)]
        with lock:
            counts.extend(d.count for d in mine)
            allowed[0] += sum(d.allowed for d in mine)

    workers = [threading.Thread(target=caller) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()

    _check_positions(counts, limit, allowed[0])
    assert spy.hit_statements + spy.batch_statements <= threads * hits
    assert backend.peek(KEY, limit, 60).count == threads * hits


def test_count_denied_false_goes_one_by_one_and_stays_capped(async_backend: Backend) -> None:
    backend = async_backend
    limiter, spy = _batched(backend, count_denied=False)

    async def main() -> list[quota.Decision]:
        return await asyncio.gather(*(limiter.rate_limit(KEY, 10, 60) for _ in range(30)))

    decisions = backend.run(main())

    assert sum(d.allowed for d in decisions) == 10
    assert spy.batch_statements == 0
    assert backend.peek(KEY, 10, 60).count == 10


def test_a_batch_writes_the_same_rows_as_one_by_one_hits(async_backend: Backend) -> None:
    """Client key, window start and length are what the one-by-one statement writes,
    read back out of the bucket key even when the key itself holds colons."""
    limiter, spy = _batched(async_backend)
    keys = ["a:b:c", "plain", "::", "x" * 300]  # the last is stored hashed

    async def main() -> None:
        await asyncio.gather(
            *(limiter.rate_limit(key, 100, window) for key in keys for window in (60, 3600)
              for _ in range(3))
        )  # fmt: skip

    async_backend.run(main())

    assert spy.batch_statements >= 1
    rows = _select(
        async_backend.url,
        "SELECT bucket_key, client_key, window_start, window_seconds, count FROM quota_counters",
    )
    assert len(rows) == 8
    for bucket_key, client_key, start, window, count in rows:
        assert bucket_key == f"{window}:{start}:{client_key}"
        assert start % window == 0 and count == 3
    assert {client for _, client, *_ in rows} == {quota_stored_key(key) for key in keys}


def _select(url: str, sql: str) -> list[tuple[Any, ...]]:
    if url.startswith("sqlite"):
        with sqlite3.connect(url.removeprefix("sqlite:///")) as conn:
            return list(conn.execute(sql))
    import psycopg

    with psycopg.connect(url) as conn:
        return list(conn.execute(sql))


def _drop_counters(url: str) -> None:
    if url.startswith("sqlite"):
        with sqlite3.connect(url.removeprefix("sqlite:///")) as conn:
            conn.execute("DROP TABLE quota_counters")
        return
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("DROP TABLE quota_counters")


def test_a_database_error_in_a_batch_reaches_every_caller_as_one_by_one(
    sql_own_url: str,  # a database of its own: its counters table is about to be dropped
) -> None:
    async def main() -> tuple[BaseException, list[Any], _Spy]:
        one_by_one = quota.connect_async(sql_own_url)
        batched = quota.connect_async(sql_own_url, batching=True)
        spy = _Spy(batched.store.store)  # type: ignore[attr-defined]
        try:
            # Both connected (schema checked) while the table is there.
            await one_by_one.rate_limit("warm", 10, 60)
            await batched.rate_limit("warm", 10, 60)
            _drop_counters(sql_own_url)
            try:
                await one_by_one.rate_limit(KEY, 10, 60)
            except quota.QuotaError as exc:
                alone: BaseException = exc
            else:  # pragma: no cover - the assertion below reports it
                raise AssertionError("a hit on a dropped table did not fail")
            outcomes = await asyncio.gather(
                *(batched.rate_limit(f"k{i}", 10, 60) for i in range(20)),
                return_exceptions=True,
            )
            return alone, outcomes, spy
        finally:
            await one_by_one.aclose()
            await batched.aclose()

    alone, outcomes, spy = asyncio.run(main())

    assert isinstance(alone, quota.SchemaError)
    assert spy.batch_statements >= 1
    assert [type(outcome) for outcome in outcomes] == [type(alone)] * 20
    assert all("schema drift" in str(outcome) for outcome in outcomes)  # at head: doctor says what


# -- several OS processes -----------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("dialect", backend_params("sqlite", "postgresql", "redis"))
def test_processes_batching_on_one_key_allow_exactly_the_limit(
    request: pytest.FixtureRequest, dialect: str
) -> None:
    """Group commit in four OS processes (SQL: one statement a batch; Redis: one pipeline)."""
    url = store_url(request, dialect)
    limit, callers, hits = 37, 6, 15
    faces = ["async", "sync", "async", "sync"]
    results = _workers.run_processes(
        multiprocessing.get_context("spawn"),
        _batch_workers.batched_hit_worker,
        [(url, face, KEY, limit, callers, hits) for face in faces],
    )
    counts = [count for result in results for count in result]
    assert sorted(counts) == list(range(1, len(faces) * callers * hits + 1))
    assert sum(count <= limit for count in counts) == limit
    with quota.connect(url, clock=lambda: _workers.FIXED_NOW) as limiter:
        assert limiter.peek(KEY, limit, 3600).count == len(counts)
