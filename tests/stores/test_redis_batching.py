"""Redis: group commit as pipelined scripts, and what the lean scripts keep of reset and top.

With ``batching=True`` concurrent fixed-window hits of one process go out as
one pipeline of per-hit scripts: every caller gets the count it would have
had one by one (threads, tasks, several OS processes), a pipeline that fails
fails every caller in it, and with a fallback nobody sees the error.

The scripts touch a caller's index only when a counter is created or a
state's expiry passes the horizon it was last kept for: hot calls leave it
alone, and still `reset` finds every row and `top` every live counter.
"""

from __future__ import annotations

import asyncio
import contextlib
import select
import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest

import quota
from quota._sql import statements as _sql
from quota._stores import redis as _redis
from quota._wrappers.batching import (
    AsyncBatchingStore,
    BatchingStore,
    batch_statement,
    is_batch_statement,
)
from tests._support import Clock
from tests.wrappers.test_batching import KEY, _check_positions, _Spy

pytestmark = pytest.mark.redis

ALGORITHMS = ("fixed_window", "sliding_window", "token_bucket", "gcra")
STATES = ("sliding_window", "token_bucket", "gcra")
#: Seconds a polled condition may take on a busy machine.
DEADLINE = 10.0


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[Any]:
    import redis

    with redis.Redis.from_url(_redis.split_url(redis_url)[0]) as client:
        yield client


def _prefix(url: str) -> str:
    return _redis.split_url(url)[1]


def _batcher(limiter: Any) -> Any:
    """The batcher inside a limiter's wrappers (fallback, metrics)."""
    store = limiter.store
    while not isinstance(store, (BatchingStore, AsyncBatchingStore)):
        store = getattr(store, "primary", None) or store.store
    return store


def _wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE
    while not condition():
        assert time.monotonic() < deadline, f"not within {DEADLINE}s: {what}"
        time.sleep(0.001)


async def _await_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE
    while not condition():
        assert time.monotonic() < deadline, f"not within {DEADLINE}s: {what}"
        await asyncio.sleep(0)


# -- the plan of a batch, without a server ---------------------------------------------------


def _hit(key: str, cost: int = 1, now: float = 100.5) -> tuple[Any, ...]:
    return (f"60:60:k:{key}", f"k:{key}", 60, 60, cost, now)


def _planner() -> _redis.RedisPlan:
    return _redis.RedisPlan(prefix="p:", db_clock=False, no_script=LookupError)


def test_a_redis_batch_is_one_pipeline_of_the_one_by_one_scripts_in_arrival_order() -> None:
    hits = [_hit("b", 2), _hit("a"), _hit("b", 3)]
    statement, params = batch_statement("redis", hits)
    assert is_batch_statement(statement)
    planner = _planner()

    plan = planner.plan(statement, params)
    name, commands = next(plan)

    assert name == "PIPELINE"
    alone = [next(planner.plan(_sql.HIT, hit)) for hit in hits]
    assert list(commands) == alone  # the very commands of the one-by-one path
    assert all(command[0] == "EVALSHA" for command in commands)
    with pytest.raises(StopIteration) as done:
        plan.send([2, 1, 5])
    assert list(done.value.value) == [(2,), (1,), (5,)]  # each hit's own count


def test_a_pipeline_reloads_a_lost_script_and_resends_only_the_scripts_that_did_not_run() -> None:
    hits = [_hit("a"), _hit("b"), _hit("c")]
    planner = _planner()
    plan = planner.plan(*batch_statement("redis", hits))
    _, commands = next(plan)

    # The server lost the script between two of the pipeline's commands.
    assert plan.send([1, LookupError("NOSCRIPT"), LookupError("NOSCRIPT")]) == (
        "SCRIPT",
        ("LOAD", _redis.SCRIPTS["fixed_window"]),
    )
    name, again = plan.send(_redis.SHAS["fixed_window"])
    assert (name, list(again)) == ("PIPELINE", list(commands[1:]))
    with pytest.raises(StopIteration) as done:
        plan.send([4, 7])
    assert list(done.value.value) == [(1,), (4,), (7,)]


def test_a_failed_script_in_a_pipeline_fails_the_batch() -> None:
    plan = _planner().plan(*batch_statement("redis", [_hit("a"), _hit("b")]))
    next(plan)
    error = ValueError("WRONGTYPE Operation against a key holding the wrong kind of value")
    with pytest.raises(ValueError, match="WRONGTYPE"):
        plan.send([1, error])


# -- threads, tasks and processes on a real server ----------------------------------------------


def test_concurrent_tasks_on_one_key_get_every_count_once(redis_url: str) -> None:
    limit, calls = 40, 300

    async def main() -> tuple[list[quota.Decision], _Spy, int]:
        async with quota.connect_async(redis_url, clock=Clock(), batching=True) as limiter:
            spy = _Spy(_batcher(limiter).store)
            decisions = await asyncio.gather(
                *(limiter.rate_limit(KEY, limit, 60) for _ in range(calls))
            )
            return decisions, spy, (await limiter.peek(KEY, limit, 60)).count

    decisions, spy, stored = asyncio.run(main())

    _check_positions([d.count for d in decisions], limit, sum(d.allowed for d in decisions))
    assert spy.batch_statements >= 1
    assert spy.hit_statements + spy.batch_statements < calls / 4
    assert stored == calls


def test_mixed_keys_and_costs_in_concurrent_tasks(redis_url: str) -> None:
    keys = [f"key-{i % 7}" for i in range(140)]
    costs = [1 + i % 3 for i in range(140)]

    async def main() -> tuple[list[quota.Decision], _Spy, dict[str, int]]:
        async with quota.connect_async(redis_url, clock=Clock(), batching=True) as limiter:
            spy = _Spy(_batcher(limiter).store)
            decisions = await asyncio.gather(
                *(limiter.rate_limit(k, 1000, 60, cost=c) for k, c in zip(keys, costs, strict=True))
            )
            stored = {key: (await limiter.peek(key, 1000, 60)).count for key in set(keys)}
            return decisions, spy, stored

    decisions, spy, stored = asyncio.run(main())

    assert spy.batch_statements >= 1
    for key in set(keys):
        mine = sorted(
            (d.count, c) for k, c, d in zip(keys, costs, decisions, strict=True) if k == key
        )
        # Positions are exact prefix sums of the costs, in some order of the hits.
        assert [count for count, _ in mine] == [
            sum(cost for _, cost in mine[: i + 1]) for i in range(len(mine))
        ]
        assert stored[key] == mine[-1][0]


def _hold_the_first_hit(
    store: Any, batcher: Any, waiting: int
) -> tuple[threading.Event, threading.Event]:
    """Hold the first one-by-one hit in flight until `waiting` threads queue behind it;
    the events tell when it arrived, and when it went on."""
    entered, released = threading.Event(), threading.Event()
    execute = store.execute

    def held(statement: Any, params: Any) -> Any:
        if statement is _sql.HIT and not entered.is_set():
            entered.set()
            _wait_for(lambda: len(batcher._queue) >= waiting, f"{waiting} threads queued")
            released.set()
        return execute(statement, params)

    store.execute = held
    return entered, released


def test_concurrent_threads_on_one_key_get_every_count_once(redis_url: str) -> None:
    limit, threads, hits = 25, 8, 30
    counts: list[int] = []
    allowed = [0]
    lock = threading.Lock()
    with quota.connect(redis_url, clock=Clock(), batching=True) as limiter:
        batcher = _batcher(limiter)
        spy = _Spy(batcher.store)
        _hold_the_first_hit(batcher.store, batcher, threads - 1)

        def caller() -> None:
            mine = [limiter.rate_limit(KEY, limit, 60) for _ in range(hits)]
            with lock:
                counts.extend(d.count for d in mine)
                allowed[0] += sum(d.allowed for d in mine)

        workers = [threading.Thread(target=caller) for _ in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        stored = limiter.peek(KEY, limit, 60).count

    _check_positions(counts, limit, allowed[0])
    assert spy.batch_statements >= 1  # the queued threads went out together
    assert spy.hit_statements + spy.batch_statements < threads * hits
    assert stored == threads * hits


# -- a pipeline that fails ----------------------------------------------------------------------


class CuttingProxy:
    """Forwards 127.0.0.1:port to Redis until `cut`: then every connection is closed and new
    ones are refused. With `cut_on_reply`, the first reply Redis sends after it is set is
    dropped and the path cut (the commands ran; their replies never arrive). While `frozen`,
    it forwards nothing (the data waits in the kernel) and goes on when it is cleared."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.cut_on_reply = threading.Event()
        self.frozen = threading.Event()
        self._cut = threading.Event()
        self._stop = threading.Event()
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._server.getsockname()[1])
        self._sockets: list[socket.socket] = []
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        selector = selectors.DefaultSelector()
        self._server.setblocking(False)
        selector.register(self._server, selectors.EVENT_READ)
        peers: dict[socket.socket, socket.socket] = {}
        upstreams: set[socket.socket] = set()
        while not self._stop.is_set() and not self._cut.is_set():
            for key, _ in selector.select(0.02):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                if sock is self._server:
                    client, _ = self._server.accept()
                    upstream = socket.create_connection(self.target)
                    self._sockets += [client, upstream]
                    upstreams.add(upstream)
                    peers[client], peers[upstream] = upstream, client
                    for end in (client, upstream):
                        end.setblocking(False)
                        selector.register(end, selectors.EVENT_READ)
                    continue
                if self.frozen.is_set():
                    time.sleep(0.005)  # level-triggered: don't spin on unread data
                    continue
                with contextlib.suppress(OSError):
                    data = sock.recv(65536)
                    if data and sock in upstreams and self.cut_on_reply.is_set():
                        self._cut.set()
                        break
                    if data:
                        peers[sock].sendall(data)
                    else:
                        selector.unregister(sock)
        selector.close()
        self._close()

    def _close(self) -> None:
        for sock in self._sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        self._server.close()

    def cut(self) -> None:
        self._cut.set()
        self._thread.join(5)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


@contextlib.contextmanager
def proxied(redis_url: str) -> Iterator[tuple[CuttingProxy, str]]:
    parts = urlsplit(redis_url)
    proxy = CuttingProxy((parts.hostname or "127.0.0.1", parts.port or 6379))
    try:
        yield proxy, parts._replace(netloc=f"127.0.0.1:{proxy.port}").geturl()
    finally:
        proxy.close()


@pytest.mark.parametrize("fallback", [False, True], ids=["no-fallback", "fallback"])
def test_threads_of_a_pipeline_whose_replies_are_lost_all_fail_and_nothing_counts_twice(
    redis_url: str, fallback: bool
) -> None:
    threads = 6
    outcomes: list[Any] = []
    lock = threading.Lock()
    with (
        proxied(redis_url) as (proxy, url),
        quota.connect(url, clock=Clock(), batching=True, fallback=fallback) as limiter,
    ):
        limiter.rate_limit("warm", 10, 60)  # connected through the proxy
        batcher = _batcher(limiter)
        spy = _Spy(batcher.store)
        entered, released = _hold_the_first_hit(batcher.store, batcher, threads - 1)
        execute = batcher.store.execute

        def cut_after_sending(statement: Any, params: Any) -> Any:
            if is_batch_statement(statement):
                proxy.cut_on_reply.set()
            return execute(statement, params)

        batcher.store.execute = cut_after_sending

        def caller(i: int) -> None:
            try:
                outcome: Any = limiter.rate_limit(f"k{i}", 10, 60)
            except Exception as exc:
                outcome = exc
            with lock:
                outcomes.append((i, outcome))

        workers = [threading.Thread(target=caller, args=(i,)) for i in range(threads)]
        workers[0].start()
        _wait_for(entered.is_set, "the first hit in flight")
        for worker in workers[1:]:
            worker.start()
        for worker in workers:
            worker.join()
        assert released.is_set()
    assert spy.batch_statements == 1
    batch = sorted(i for i, _ in outcomes if i != 0)
    assert batch == list(range(1, threads))
    if fallback:
        assert all(isinstance(outcome, quota.Decision) for _, outcome in outcomes)
        return
    failed = [outcome for i, outcome in outcomes if i != 0]
    assert all(isinstance(outcome, quota.StorageError) for outcome in failed), failed
    # The scripts ran, their replies were lost: each hit counted once, never retried.
    with quota.connect(redis_url, clock=Clock()) as direct:
        assert all(direct.peek(f"k{i}", 10, 60).count <= 1 for i in range(1, threads))


@pytest.mark.parametrize("fallback", [False, True], ids=["no-fallback", "fallback"])
def test_tasks_of_a_pipeline_to_an_unreachable_redis_all_fail(
    redis_url: str, fallback: bool
) -> None:
    calls = 12

    async def main(proxy: CuttingProxy, url: str) -> tuple[list[Any], _Spy]:
        async with quota.connect_async(
            url, clock=Clock(), batching=True, fallback=fallback
        ) as limiter:
            await limiter.rate_limit("warm", 10, 60)
            batcher = _batcher(limiter)
            spy = _Spy(batcher.store)
            execute = batcher.store.execute

            async def held(statement: Any, params: Any) -> Any:
                if statement is _sql.HIT:  # the lone call: in flight while the rest queue
                    await _await_for(lambda: len(batcher._queue) == calls - 1, "tasks queued")
                    proxy.cut()
                return await execute(statement, params)

            batcher.store.execute = held
            outcomes = await asyncio.gather(
                *(limiter.rate_limit(f"k{i}", 10, 60) for i in range(calls)),
                return_exceptions=True,
            )
            return outcomes, spy

    with proxied(redis_url) as (proxy, url):
        outcomes, spy = asyncio.run(main(proxy, url))

    assert spy.batch_statements >= 1
    if fallback:
        assert all(isinstance(outcome, quota.Decision) for outcome in outcomes), outcomes
    else:
        assert all(isinstance(outcome, quota.StorageError) for outcome in outcomes), outcomes


def test_a_reply_that_comes_too_late_never_reaches_the_next_call(redis_url: str) -> None:
    clock = Clock()
    with (
        proxied(redis_url) as (proxy, url),
        quota.connect(url, clock=clock, timeout=0.3) as limiter,
    ):
        for _ in range(5):
            limiter.rate_limit("a", 100, 60)
        proxy.frozen.set()
        with pytest.raises(quota.StorageError, match="Timeout"):
            limiter.rate_limit("a", 100, 60)  # sent; its reply (6) comes after the timeout
        proxy.frozen.clear()
        assert limiter.rate_limit("b", 100, 60).count == 1  # not the late 6
        assert limiter.peek("a", 100, 60).count == 6  # it ran, once
        assert limiter.rate_limit("a", 100, 60).count == 7


def test_an_error_reply_leaves_the_connection_to_the_next_call(
    redis_url: str, redis_client: Any
) -> None:
    clock = Clock()
    start = int(clock.now) - int(clock.now) % 60
    redis_client.hset(f"{_prefix(redis_url)}{{k:bad}}:fw:60:{start}", "x", "1")
    with quota.connect(redis_url, clock=clock) as limiter:
        for _ in range(3):
            with pytest.raises(quota.StorageError, match="WRONGTYPE"):
                limiter.rate_limit("bad", 100, 60)
            assert limiter.rate_limit("good", 100, 60).allowed
        assert limiter.peek("good", 100, 60).count == 3
        assert len(limiter.store._idle) == 1  # type: ignore[attr-defined]  # one, reused


def test_an_idle_connection_the_server_closed_is_replaced_before_the_next_call(
    redis_url: str, redis_client: Any
) -> None:
    """A Redis restart, a failover or a server ``timeout`` closes idle connections:
    the next call finds its connection closed and opens another, without an error."""
    clock = Clock()
    with quota.connect(redis_url, clock=clock) as limiter:
        for _ in range(3):
            assert limiter.rate_limit("idle", 100, 60).allowed
        idle = list(limiter.store._idle)  # type: ignore[attr-defined]
        assert len(idle) == 1
        sock = idle[0]._sock
        host, port = sock.getsockname()[:2]
        assert redis_client.client_kill_filter(_type=None, addr=f"{host}:{port}") == 1
        # Readable without a reply pending: the server's end of the stream has arrived.
        _wait_for(lambda: bool(select.select([sock], [], [], 0)[0]), "the server to close it")
        for expected in (4, 5):
            assert limiter.rate_limit("idle", 100, 60).count == expected
        assert limiter.peek("idle", 100, 60).count == 5


def test_a_script_that_fails_in_a_pipeline_fails_only_its_own_caller(
    redis_url: str, redis_client: Any
) -> None:
    clock = Clock()
    start = int(clock.now) - int(clock.now) % 60
    # A counter that is not a counter: its INCRBY fails (WRONGTYPE) inside the pipeline.
    redis_client.hset(f"{_prefix(redis_url)}{{k:k3}}:fw:60:{start}", "x", "1")
    calls = 6

    async def main() -> tuple[list[Any], _Spy, list[int]]:
        async with quota.connect_async(redis_url, clock=clock, batching=True) as limiter:
            await limiter.rate_limit("warm", 10, 60)
            batcher = _batcher(limiter)
            spy = _Spy(batcher.store)
            execute = batcher.store.execute

            async def held(statement: Any, params: Any) -> Any:
                if statement is _sql.HIT:
                    await _await_for(lambda: len(batcher._queue) == calls - 1, "tasks queued")
                return await execute(statement, params)

            batcher.store.execute = held
            outcomes = await asyncio.gather(
                *(limiter.rate_limit(f"k{i}", 10, 60) for i in range(calls)),
                return_exceptions=True,
            )
            counts = [(await limiter.peek(f"k{i}", 10, 60)).count for i in (1, 2, 4, 5)]
            return outcomes, spy, counts

    outcomes, spy, counts = asyncio.run(main())

    assert spy.batch_statements == 1
    assert isinstance(outcomes[0], quota.Decision)  # the lone call, before the batch
    # A statement error of one script is its caller's alone: the other scripts of the
    # batch ran, each on its own, and their callers get their decisions.
    assert isinstance(outcomes[3], quota.StorageError), outcomes
    assert "WRONGTYPE" in str(outcomes[3]) and outcomes[3].outage is False
    others = [outcomes[i] for i in (1, 2, 4, 5)]
    assert all(isinstance(o, quota.Decision) and o.count == 1 for o in others), outcomes
    assert counts == [1, 1, 1, 1]


# -- reset, top and peek over the lean scripts -------------------------------------------------


@pytest.mark.parametrize("algorithm", STATES)
def test_a_state_hit_within_its_horizon_leaves_the_index_alone(
    redis_url: str, redis_client: Any, algorithm: str
) -> None:
    clock = Clock()
    index = f"{_prefix(redis_url)}{{k:a}}:idx"
    with quota.connect(redis_url, clock=clock) as limiter:
        limiter.rate_limit("a", 100, 60, algorithm=algorithm)
        assert redis_client.exists(index)
        redis_client.delete(index)
        for _ in range(5):
            clock.advance(0.25)
            limiter.rate_limit("a", 100, 60, algorithm=algorithm)
    assert not redis_client.exists(index)


def test_a_counter_hit_after_its_first_leaves_the_index_alone(
    redis_url: str, redis_client: Any
) -> None:
    index = f"{_prefix(redis_url)}{{k:a}}:idx"
    with quota.connect(redis_url, clock=Clock()) as limiter:
        limiter.rate_limit("a", 100, 60)
        redis_client.delete(index)
        for _ in range(3):
            limiter.rate_limit("a", 100, 60)
        limiter.rate_limit("a", 100, 60, cost=2)
        assert limiter.peek("a", 100, 60).count == 6
    assert not redis_client.exists(index)


def _rows(client: Any, url: str, key: str, now: float | None = None) -> dict[str, int]:
    """Every row of `key` but its index, with its TTL (ms); with `now`, only the counters
    of windows that ended less than `GRACE` seconds before `now` (an injected clock jumps
    ahead of Redis's, whose TTLs keep older windows' counters a while longer)."""
    base = f"{_prefix(url)}{{k:{key}}}:"
    rows = {
        raw.decode()[len(base) :]: client.pttl(raw)
        for raw in client.scan_iter(match=base.replace("{", "\\{").replace("}", "\\}") + "*")
        if not raw.decode().endswith(":idx")
    }
    if now is None:
        return rows
    return {name: ttl for name, ttl in rows.items() if _live(name, now)}


def _live(name: str, now: float) -> bool:
    kind, *rest = name.split(":")
    return kind != "fw" or int(rest[0]) + int(rest[1]) + _redis.GRACE > now


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_the_index_lists_every_live_row_and_outlives_it(
    redis_url: str, redis_client: Any, algorithm: str
) -> None:
    clock = Clock()
    index = f"{_prefix(redis_url)}{{k:a}}:idx"
    steps = [0.5, 0.5, 7.0, 0.1, 31.0, 0.2, 59.5, 0.3, 200.0, 1.0] * 4
    with quota.connect(redis_url, clock=clock) as limiter:
        for step in steps:
            clock.advance(step)
            for window in (10, 60):
                limiter.rate_limit("a", 3, window, algorithm=algorithm)
            ttl = redis_client.pttl(index)  # read first: the rows' TTLs only shrink meanwhile
            listed = {member.decode() for member in redis_client.zrange(index, 0, -1)}
            rows = _rows(redis_client, redis_url, "a", clock.now)
            assert set(rows) <= listed, (step, rows, listed)
            assert all(0 < row_ttl <= ttl for row_ttl in rows.values()), (ttl, rows)
        assert len(rows) >= 2
        assert limiter.reset("a") >= len(rows)
    assert _rows(redis_client, redis_url, "a", clock.now) == {}


def test_reset_deletes_every_row_of_a_key_after_many_hot_hits(
    redis_url: str, redis_client: Any
) -> None:
    clock = Clock()
    with quota.connect(redis_url, clock=clock) as limiter:
        for _ in range(30):
            clock.advance(0.7)
            for algorithm in ALGORITHMS:
                for window in (60, 3600):
                    limiter.rate_limit("a", 1000, window, algorithm=algorithm)
        start = int(clock.now) - int(clock.now) % 3600
        assert len(_rows(redis_client, redis_url, "a")) == 8
        assert limiter.reset("a", 60) == 4
        assert set(_rows(redis_client, redis_url, "a")) == {
            "sw:3600", "tb:3600", "gcra:3600", f"fw:3600:{start}"
        }  # fmt: skip
        assert limiter.reset("a") == 4
        assert limiter.peek("a", 1000, 60, algorithm="token_bucket").remaining == 1000
    assert _rows(redis_client, redis_url, "a") == {}


def test_top_finds_live_counters_whose_index_entry_is_gone(
    redis_url: str, redis_client: Any
) -> None:
    clock = Clock()
    with quota.connect(redis_url, clock=clock) as limiter:
        for key, hits in (("a", 3), ("b", 5), ("c", 1)):
            for _ in range(hits):
                limiter.rate_limit(key, 100, 60)
        for key in "abc":
            redis_client.delete(f"{_prefix(redis_url)}{{k:{key}}}:idx")
        top = limiter.top(2)
        reset_at = limiter.peek("a", 100, 60).reset_at
    assert top == [quota.Usage("b", 60, 5, reset_at), quota.Usage("a", 60, 3, reset_at)]


@pytest.mark.parametrize("face", ["sync", "async"])
def test_peek_and_capped_hits_read_what_the_lean_script_wrote(redis_url: str, face: str) -> None:
    clock = Clock()
    if face == "sync":
        with quota.connect(redis_url, clock=clock, count_denied=False) as limiter:
            decisions = [limiter.rate_limit("a", 3, 60) for _ in range(5)]
            peeked = limiter.peek("a", 3, 60)
    else:

        async def main() -> tuple[list[quota.Decision], quota.Decision]:
            async with quota.connect_async(redis_url, clock=clock, count_denied=False) as limiter:
                made = [await limiter.rate_limit("a", 3, 60) for _ in range(5)]
                return made, await limiter.peek("a", 3, 60)

        decisions, peeked = asyncio.run(main())
    assert [d.allowed for d in decisions] == [True, True, True, False, False]
    assert [d.count for d in decisions] == [1, 2, 3, 3, 3]
    assert (peeked.count, peeked.remaining, peeked.allowed) == (3, 0, False)


@pytest.mark.parametrize("batching", [False, True], ids=["one-by-one", "batching"])
def test_a_lost_fixed_window_script_is_loaded_again_on_both_faces(
    redis_url: str, monkeypatch: pytest.MonkeyPatch, batching: bool
) -> None:
    # A restarted Redis forgets its scripts: EVALSHA answers NOSCRIPT, the store loads it.
    monkeypatch.setitem(_redis.SHAS, "fixed_window", "0" * 40)
    with quota.connect(redis_url, clock=Clock(), batching=batching) as limiter:
        assert [limiter.rate_limit("k", 2, 60).allowed for _ in range(3)] == [True, True, False]

    async def main() -> list[int]:
        async with quota.connect_async(redis_url, clock=Clock(), batching=batching) as limiter:
            decisions = await asyncio.gather(*(limiter.rate_limit("k", 2, 60) for _ in range(5)))
            return sorted(d.count for d in decisions)

    assert asyncio.run(main()) == [4, 5, 6, 7, 8]
