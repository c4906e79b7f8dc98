"""quota.contrib.dramatiq: actors limited across dramatiq workers.

The fast tests run in this process: the decorator's checks, and deferrals through a
real dramatiq `Worker` on a `StubBroker` (the ``Retries`` middleware counting, or not,
a deferral against ``max_retries``). The worker-process tests start a private
redis-server as the broker and two ``dramatiq tests.contrib._dramatiq_app`` processes
(one worker process of one thread each) limited on PostgreSQL, and read what they did
off a journal (`tests.contrib._jobs_support`).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, suppress
from itertools import pairwise
from pathlib import Path
from typing import IO, Any

import dramatiq
import pytest
from dramatiq.brokers.redis import RedisBroker
from dramatiq.brokers.stub import StubBroker
from dramatiq.middleware import CurrentMessage

import quota
from quota._core.errors import ConfigurationError
from quota.contrib import _jobs
from quota.contrib._jobs import MAX_DELAY
from quota.contrib.dramatiq import Deferred, rate_limited
from tests._redis_cluster import running_server
from tests._support import Clock, parent_death_signal
from tests.contrib._jobs_support import per_second, read, starts, wait_for

ROOT = Path(__file__).resolve().parents[2]
T0 = 1_700_000_000.0


# -- in this process ---------------------------------------------------------------------------


@pytest.fixture
def memory() -> Iterator[tuple[quota.Limiter, Clock]]:
    clock = Clock(T0)
    limiter = quota.connect("memory://", clock=clock)
    try:
        yield limiter, clock
    finally:
        limiter.close()


@pytest.mark.parametrize(
    ("arguments", "named"),
    [
        ({"rates": "five a second"}, "five a second"),
        ({"key": ""}, "key"),
        ({"key": 3}, "key"),
        ({"limiter": "memory://"}, "limiter"),
        ({"limiter": object()}, "limiter"),
        ({"concurrency": 0}, "concurrency"),
        ({"concurrency": True}, "concurrency"),
        ({"lease": 0.0}, "lease"),
        ({"lease": "30"}, "lease"),
    ],
)
def test_a_bad_argument_is_refused_by_name(arguments: dict[str, Any], named: str) -> None:
    options: dict[str, Any] = {"rates": "5/second", **arguments}

    def task() -> None:
        pass

    with pytest.raises(ConfigurationError, match=re.escape(named)):
        rate_limited(options.pop("rates"), **options)(task)


def test_a_coroutine_function_and_an_actor_are_refused() -> None:
    async def coro() -> None:
        pass

    with pytest.raises(ConfigurationError, match="coroutine function"):
        rate_limited("5/second")(coro)

    broker = StubBroker()

    def plain() -> None:
        pass

    actor = dramatiq.actor(plain, broker=broker)
    with pytest.raises(ConfigurationError, match=re.escape("beneath @dramatiq.actor")):
        rate_limited("5/second")(actor)


def test_the_wrapper_keeps_the_name_so_the_actor_is_named_after_the_function(
    memory: tuple[quota.Limiter, Clock],
) -> None:
    limiter, _ = memory
    broker = StubBroker()

    def report(x: int) -> int:
        """Builds one."""
        return x * 2

    actor = dramatiq.actor(rate_limited("5/second", limiter=limiter)(report), broker=broker)
    assert actor.actor_name == "report"
    assert actor.fn.__doc__ == "Builds one." and actor.fn.__wrapped__ is report
    # Called outside a worker (no current message): the key is the function's name.
    assert actor(21) == 42
    assert limiter.peek("report", 5, 1).remaining == 4


def test_a_key_callable_gets_the_arguments_and_a_bad_key_is_refused(
    memory: tuple[quota.Limiter, Clock],
) -> None:
    limiter, _ = memory
    seen: list[tuple[Any, ...]] = []

    def key(tenant: str, month: str = "", **_: Any) -> Any:
        seen.append((tenant, month))
        return f"t:{tenant}" if tenant else None

    @rate_limited("1/second", key=key, limiter=limiter)
    def task(tenant: str, month: str = "") -> str:
        return tenant + month

    assert task("a", month="01") == "a01"
    assert task("b") == "b"
    assert seen == [("a", "01"), ("b", "")]
    assert limiter.peek("t:a", 1, 1).remaining == 0
    with pytest.raises(Deferred):
        task("a")  # "t:a" is used up; "t:b" is another key
    with pytest.raises(ConfigurationError, match="must return a non-empty str"):
        task("")


def test_in_a_worker_the_default_key_is_the_messages_actor_and_a_deferral_is_uncounted(
    memory: tuple[quota.Limiter, Clock],
) -> None:
    limiter, _ = memory

    @rate_limited("1/second", limiter=limiter)
    def inner() -> None:
        pass

    @rate_limited("1/second", limiter=limiter)
    def outer() -> None:
        inner()

    message = dramatiq.Message(
        queue_name="default", actor_name="named", args=(), kwargs={}, options={"retries": 2}
    )
    token = CurrentMessage._MESSAGE.set(message)
    try:
        outer()  # counts on "named"; the nested call on "inner"
        assert limiter.peek("named", 1, 1).remaining == 0
        assert limiter.peek("inner", 1, 1).remaining == 0
        assert limiter.peek("outer", 1, 1).remaining == 1
        with pytest.raises(Deferred):
            outer()
        assert message.options["retries"] == 1  # the Retries middleware adds one back
        limiter.reset("named")
        with pytest.raises(Deferred):
            outer()  # admitted, but its nested call is not: not the message's deferral
        assert message.options["retries"] == 1
    finally:
        CurrentMessage._MESSAGE.reset(token)


def test_a_denied_run_raises_retry_with_the_delay_of_the_rate(
    memory: tuple[quota.Limiter, Clock],
) -> None:
    limiter, clock = memory
    clock.now = T0 + 0.25  # 0.75 s before the next 1-second window
    runs: list[int] = []

    @rate_limited("2/second", key="k", limiter=limiter)
    def task(n: int) -> None:
        runs.append(n)

    task(1)
    task(2)
    with pytest.raises(dramatiq.Retry) as denied:
        task(3)
    assert runs == [1, 2]
    assert isinstance(denied.value, Deferred) and denied.value.reason == "rate"
    # The slot opens in 0.75 s; the jitter adds up to a slot's share (1/2 s).
    assert 750 <= denied.value.delay <= 750 + 500 + 1, denied.value.delay
    # Without a current message nothing is counted in advance.
    clock.advance(0.75)
    task(4)
    assert runs == [1, 2, 4]


def test_a_deferral_is_at_most_max_delay(
    memory: tuple[quota.Limiter, Clock],
) -> None:
    limiter, clock = memory
    clock.now = T0 - T0 % (30 * 86400)  # a window of 30 days begins

    @rate_limited("1/30days", key="m", limiter=limiter)
    def task() -> None:
        pass

    task()
    with pytest.raises(Deferred) as denied:
        task()
    assert MAX_DELAY * 1000 <= denied.value.delay <= (MAX_DELAY + 1) * 1000


def test_the_concurrency_slot_is_held_while_the_body_runs_and_freed_after(
    memory: tuple[quota.Limiter, Clock],
) -> None:
    limiter, _ = memory
    inside: list[int | None] = []

    @rate_limited("100/second", key="c", limiter=limiter, concurrency=1, lease=5)
    def task(fail: bool) -> None:
        inside.append(limiter.concurrency_usage("c").held)
        with pytest.raises(Deferred) as busy:
            task(False)  # a second run finds the only slot taken
        assert busy.value.reason == "busy" and 1000 <= busy.value.delay <= 2001
        if fail:
            raise RuntimeError("boom")

    task(False)
    with pytest.raises(RuntimeError):
        task(True)
    assert inside == [1, 1]
    assert limiter.concurrency_usage("c").held == 0


def test_the_default_limiter_is_the_processes_own(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("QUOTA_DATABASE_URL", "memory://")
    monkeypatch.setattr(_jobs, "_sync", None)

    @rate_limited("1/minute", key="default")
    def task() -> None:
        pass

    task()
    limiter = _jobs.default_limiter()
    try:
        assert limiter.peek("default", 1, 60).remaining == 0
    finally:
        limiter.close()
        monkeypatch.setattr(_jobs, "_sync", None)


@contextmanager
def _stub_worker(current_message: bool) -> Iterator[StubBroker]:
    broker = StubBroker()
    if current_message:
        broker.add_middleware(CurrentMessage())
    worker = dramatiq.Worker(broker, worker_threads=1, worker_timeout=50)
    worker.start()
    try:
        yield broker
    finally:
        worker.stop()
        broker.close()


def _deferral_run(
    broker: StubBroker, limiter: quota.Limiter, clock: Clock, *, fails: int = 0,
    **options: Any,
) -> list[tuple[str, Any]]:  # fmt: skip
    """An actor on an exhausted key (``max_retries=1`` unless `options` say otherwise),
    sent once: deferred three times, then the clock moves on and its body runs, raising
    `fails` times; the log of what happened once nothing is left to run. ``("run", n)``
    for each entry into the limited call (n the retry count of the message then, -9
    without a current message), ``("start", n)`` for each run of the body."""
    log: list[tuple[str, Any]] = []

    def limited(n: int) -> None:
        log.append(("start", n))
        if sum(1 for event, _ in log if event == "start") <= fails:
            raise RuntimeError("boom")

    inner = rate_limited("20/second", key="d", limiter=limiter)(limited)

    def entry(n: int) -> None:
        message = CurrentMessage.get_current_message()
        log.append(("run", -9 if message is None else message.options.get("retries", 0)))
        inner(n)

    entry.__name__ = "deferred_actor"
    options = {"max_retries": 1, "min_backoff": 10, "max_backoff": 10, **options}
    actor = dramatiq.actor(entry, broker=broker, **options)
    clock.now = T0 + 0.99  # 10 ms before the window ends: each deferral is short
    for _ in range(20):
        limiter.hit("d", "20/second")
    actor.send(1)
    deadline = time.monotonic() + 10
    while sum(1 for event, _ in log if event == "run") < 4 and not broker.dead_letters:
        assert time.monotonic() < deadline, log
        time.sleep(0.01)
    clock.advance(1.0)
    broker.join(actor.queue_name, fail_fast=False, timeout=10_000)
    return log


def test_deferrals_are_not_counted_against_max_retries_with_current_message(
    memory: tuple[quota.Limiter, Clock],
) -> None:
    limiter, clock = memory
    with _stub_worker(current_message=True) as broker:
        log = _deferral_run(broker, limiter, clock)
        assert not broker.dead_letters
    runs = [retries for event, retries in log if event == "run"]
    assert len(runs) >= 4 and log[-1] == ("start", 1), log
    # The count the Retries middleware keeps stays 0 however often it was deferred.
    assert set(runs) == {0}, log


def test_without_current_message_each_deferral_is_a_retry(
    memory: tuple[quota.Limiter, Clock],
) -> None:
    limiter, clock = memory
    with _stub_worker(current_message=False) as broker:
        log = _deferral_run(broker, limiter, clock)
        # max_retries=1: the second deferral fails the message; it never ran.
        assert len(broker.dead_letters) == 1
        failed = broker.dead_letters[0]
    assert log == [("run", -9), ("run", -9)], log
    assert failed.options["retries"] == 2


def test_after_deferrals_failures_are_retried_and_exhausted_as_without_them(
    memory: tuple[quota.Limiter, Clock],
) -> None:
    limiter, clock = memory
    exhausted: list[dict[str, Any]] = []
    with _stub_worker(current_message=True) as broker:

        def on_exhausted(message: dict[str, Any], info: dict[str, Any]) -> None:
            exhausted.append(info)

        dramatiq.actor(on_exhausted, broker=broker, actor_name="on_exhausted")
        log = _deferral_run(broker, limiter, clock, fails=2, on_retry_exhausted="on_exhausted")
        broker.join("default", fail_fast=False, timeout=10_000)
        assert len(broker.dead_letters) == 1
    # Deferred (retry count 0), then the body failed, was retried once (count 1) after
    # the actor's 10 ms backoff, failed again and was given up: max_retries=1 as ever.
    first = log.index(("start", 1))  # after the deferrals and the admitted entry
    assert first >= 4 and set(log[:first]) == {("run", 0)}, log
    assert log[first:] == [("start", 1), ("run", 1), ("start", 1)], log
    assert exhausted == [{"retries": 1, "max_retries": 1}]


def test_retry_when_is_asked_about_a_deferral_one_below_the_count(
    memory: tuple[quota.Limiter, Clock],
) -> None:
    limiter, clock = memory
    asked: list[tuple[int, str]] = []

    def retry_when(retries: int, exc: BaseException) -> bool:
        asked.append((retries, type(exc).__name__))
        return isinstance(exc, Deferred) or retries < 1

    with _stub_worker(current_message=True) as broker:
        log = _deferral_run(broker, limiter, clock, fails=5, retry_when=retry_when)
        assert len(broker.dead_letters) == 1
    deferrals = log.index(("start", 1)) - 1
    assert deferrals >= 3
    assert asked[:deferrals] == [(-1, "Deferred")] * deferrals, asked
    assert asked[deferrals:] == [(0, "RuntimeError"), (1, "RuntimeError")], asked


# -- worker processes --------------------------------------------------------------------------

WORKERS = 2
BOOT_TIMEOUT = 40.0
PACED = 60
RATE = 5


class Workers:
    """Two ``dramatiq`` processes (each its own session), their logs and journal."""

    def __init__(self, port: int, store: str, journal: Path, logs: list[IO[bytes]]) -> None:
        self.journal = journal
        self.logs = logs
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "QUOTA_TEST_DRAMATIQ_REDIS_PORT": str(port),
            "QUOTA_TEST_DRAMATIQ_STORE": store,
            "QUOTA_TEST_DRAMATIQ_JOURNAL": str(journal),
        }
        command = [sys.executable, "-m", "dramatiq", "tests.contrib._dramatiq_app",
                   "--processes", "1", "--threads", "1"]  # fmt: skip
        self.procs = [self._start(command, env, log) for log in logs]

    @staticmethod
    def _start(command: list[str], env: dict[str, str], log: IO[bytes]) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            command, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
            start_new_session=True, preexec_fn=parent_death_signal(),
        )  # fmt: skip

    def dead(self) -> str | None:
        for proc, log in zip(self.procs, self.logs, strict=True):
            if proc.poll() is not None:
                return f"dramatiq {proc.pid} exited {proc.returncode}:\n{_tail(log)}"
        return None

    def wait_booted(self) -> dict[int, int]:
        """The worker process of each ``dramatiq`` process: {group: pid}."""
        lines = wait_for(
            self.journal,
            lambda ls: len({x["pid"] for x in ls if x["event"] == "boot"}) >= WORKERS,
            timeout=BOOT_TIMEOUT, alive=self.dead,
        )  # fmt: skip
        return {os.getpgid(x["pid"]): x["pid"] for x in lines if x["event"] == "boot"}

    def kill_group(self, group: int) -> None:
        with suppress(ProcessLookupError):
            os.killpg(group, signal.SIGKILL)

    def stop(self) -> None:
        for proc in self.procs:
            self.kill_group(proc.pid)
        for proc in self.procs:
            proc.wait(timeout=10)

    def log_text(self) -> str:
        return "".join(_tail(log, 10**9) for log in self.logs)


def _tail(log: IO[bytes], size: int = 3000) -> str:
    log.flush()
    log.seek(0)
    return log.read().decode(errors="replace")[-size:]


@pytest.fixture
def workers(tmp_path: Path, pg_store_url: str) -> Iterator[tuple[Workers, RedisBroker]]:
    with ExitStack() as stack:
        server = stack.enter_context(running_server())
        logs = [stack.enter_context((tmp_path / f"w{i}.log").open("w+b")) for i in range(WORKERS)]
        group = Workers(server.port, pg_store_url, tmp_path / "journal.jsonl", logs)
        stack.callback(group.stop)
        broker = RedisBroker(host="127.0.0.1", port=server.port)
        stack.callback(broker.close)
        yield group, broker


def _send(broker: RedisBroker, actor_name: str, *args: Any) -> None:
    broker.enqueue(
        dramatiq.Message(
            queue_name="default", actor_name=actor_name, args=args, kwargs={}, options={}
        )
    )


def _ran_all(count: int) -> Callable[[list[dict[str, Any]]], bool]:
    return lambda lines: len({x["id"] for x in lines if x["event"] == "start"}) >= count


@pytest.mark.slow
@pytest.mark.postgres
def test_two_workers_run_60_messages_at_5_a_second_without_holding_a_thread(
    workers: tuple[Workers, RedisBroker],
) -> None:
    group, broker = workers
    booted = group.wait_booted()
    for ident in range(PACED):
        _send(broker, "paced", ident)
    lines = wait_for(group.journal, _ran_all(PACED), timeout=PACED / RATE + 30, alive=group.dead)
    time.sleep(0.5)  # a stray second start of one message would show now
    lines = read(group.journal)
    logs = group.log_text()

    begun = starts(lines)
    assert len(begun) == PACED
    assert sorted(x["id"] for x in lines if x["event"] == "start") == list(range(PACED))
    seconds = per_second(begun)
    print(f"starts per aligned second: {sorted(seconds.items())}")
    assert max(seconds.values()) <= RATE, seconds
    span = begun[-1] - begun[0]
    print(f"60 starts over {span:.2f}s")
    assert span <= PACED / RATE + 15, span
    runs = [x for x in lines if x["event"] == "run"]
    slowest = max(x["seconds"] for x in runs)
    print(f"{len(runs)} runs, the slowest call {slowest * 1000:.1f} ms")
    assert slowest <= 0.5, slowest
    assert {x["pid"] for x in lines if x["event"] == "start"} == set(booted.values())

    # Deferred messages wait in the broker, not in a worker thread: with one thread in
    # each of the two workers, half of the 60 or more were waiting while others started.
    waiting = max(
        len({x["id"] for x in runs if x["at"] < t} - {x["id"] for x in lines
             if x["event"] == "start" and x["at"] < t})
        for t in begun
    )  # fmt: skip
    print(f"most messages deferred and waiting at once: {waiting}")
    assert waiting >= PACED // 2, waiting

    # max_retries=0, yet most messages were deferred and none failed: uncounted.
    deferred = Counter(x["id"] for x in runs if x["outcome"] == "deferred")
    print(f"deferrals per message: most {max(deferred.values())}, in all {sum(deferred.values())}")
    assert len(deferred) >= PACED // 2, deferred
    assert {x["retries"] for x in runs} == {0}
    # dramatiq logs each deferral as one INFO line, never an error.
    assert logs.count("Retrying message") == sum(deferred.values()), logs[-3000:]
    assert "Retries exceeded" not in logs and " ERROR " not in logs, logs[-3000:]

    # How late a deferred message came back after its delay (the worker moves due
    # messages from its delay queue once per poll of it, up to a second apart).
    late = []
    by_id: dict[int, list[dict[str, Any]]] = {}
    for x in runs:
        by_id.setdefault(x["id"], []).append(x)
    for seq in by_id.values():
        seq.sort(key=lambda x: x["at"])
        late += [b["at"] - (a["at"] + a["delay"] / 1000) for a, b in pairwise(seq)]
    late.sort()
    print(
        f"back after the delay: median {late[len(late) // 2]:.3f}s,"
        f" 90% {late[int(len(late) * 0.9)]:.3f}s, most {late[-1]:.3f}s"
    )


@pytest.mark.slow
@pytest.mark.postgres
def test_a_killed_workers_slot_is_free_within_its_lease(
    workers: tuple[Workers, RedisBroker], pg_store_url: str
) -> None:
    group, broker = workers
    group.wait_booted()
    _send(broker, "held", 1)
    lines = wait_for(group.journal, _ran_all(1), timeout=20, alive=group.dead)
    holder = next(x["pid"] for x in lines if x["event"] == "start")
    limiter = quota.connect(pg_store_url, pool_size=1)
    try:
        usage = limiter.concurrency_usage("held")
        assert usage.held == 1 and usage.free == 0, usage
        assert f":{holder}:" in usage.holders[0], usage
        time.sleep(2.5)  # longer than the lease: renewed while the body runs
        assert limiter.concurrency_usage("held").held == 1
        group.kill_group(os.getpgid(holder))
        killed = time.monotonic()
        while limiter.concurrency_usage("held").held:
            assert time.monotonic() - killed < 2 + 1, limiter.concurrency_usage("held")
            time.sleep(0.05)
        freed = time.monotonic() - killed
    finally:
        limiter.close()
    print(f"the slot was free {freed:.2f}s after the kill")
