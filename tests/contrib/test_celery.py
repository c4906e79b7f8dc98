"""quota.contrib.celery: task limits across real Celery workers, and the decorator in process.

The worker tests start solo worker processes (`tests.contrib._celery_workers`) on a private
redis-server (the broker; no result backend) running `tests.contrib._celery_app`, whose
tasks write a journal of their runs (`tests.contrib._jobs_support`). Celery's own
``rate_limit`` is per worker node; a quota limit holds across all of them, and a task
denied is deferred (sent again with a countdown), never slept on in the worker.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from celery.exceptions import Retry

import quota
from quota.contrib import _jobs
from quota.contrib.celery import rate_limited
from tests._redis_cluster import ClusterError, RedisServer, find_binaries, running_server
from tests.contrib._celery_workers import Workers
from tests.contrib._jobs_support import per_second, starts, wait_for

TASKS = 60
RATE = 5  # the tasks' "5/second"
NODES = 4

worker_test = pytest.mark.slow


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    if find_binaries() is None:
        pytest.skip("redis-server is not installed")
    try:
        with running_server() as server:
            yield server
    except ClusterError as exc:
        pytest.skip(f"no private redis-server: {exc}")


@pytest.fixture
def broker(redis_server: RedisServer) -> str:
    return f"redis://127.0.0.1:{redis_server.port}/0"


@pytest.fixture
def redis_store(redis_server: RedisServer) -> str:
    """quota's Redis store on the private server (its own db number), emptied."""
    with redis_server.client(db=1) as client:
        client.flushdb()
    return f"redis://127.0.0.1:{redis_server.port}/1"


def _runs(lines: list[dict[str, Any]], task: str) -> list[dict[str, Any]]:
    return [line for line in lines if line["event"] == "run" and line["task"] == task]


def _started(task: str, count: int) -> Callable[[list[dict[str, Any]]], bool]:
    return lambda lines: len(starts(lines, task=task)) >= count


# -- across worker processes ------------------------------------------------------------------


@worker_test
@pytest.mark.parametrize("store", [pytest.param("postgresql", marks=pytest.mark.postgres), "redis"])
def test_60_tasks_on_4_workers_start_at_most_5_in_any_second(
    request: pytest.FixtureRequest, store: str, broker: str, tmp_path: Path
) -> None:
    url = request.getfixturevalue("pg_store_url" if store == "postgresql" else "redis_store")
    with Workers(broker, tmp_path, count=NODES, store=url) as workers:
        ids = {workers.send("paced", index) for index in range(TASKS)}
        lines = wait_for(
            workers.journal, _started("paced", TASKS), timeout=TASKS / RATE + 30,
            alive=workers.alive,
        )  # fmt: skip

    begun = [line for line in lines if line["event"] == "start"]
    assert sorted(line["id"] for line in begun) == sorted(ids)  # each once
    times = starts(lines, task="paced")
    seconds = per_second(times)
    assert max(seconds.values()) <= RATE, sorted(seconds.items())
    assert times[-1] - times[0] <= TASKS / RATE + 15
    runs = _runs(lines, "paced")
    assert max(run["seconds"] for run in runs) <= 0.5  # deferred, never slept on
    deferred = [run for run in runs if run["outcome"] == "deferred"]
    assert len(deferred) >= TASKS - 2 * RATE  # most waited their turn
    assert {line["retries"] for line in begun} == {0}  # not one retry charged
    assert {workers.node_of(line["node"]) for line in begun} == set(workers.procs)
    print(
        f"\nquota on {store}: at most {max(seconds.values())} starts in one second,"
        f" {TASKS} in {times[-1] - times[0]:.1f}s, {len(deferred)} deferrals"
    )


@worker_test
def test_celerys_own_rate_limit_is_per_node(broker: str, tmp_path: Path) -> None:
    """Celery's ``rate_limit="5/s"`` on 4 nodes: measured and printed, not a promise."""
    with Workers(broker, tmp_path, count=NODES) as workers:
        for index in range(TASKS):
            workers.send("celery_paced", index)
        lines = wait_for(
            workers.journal, _started("celery_paced", TASKS), timeout=TASKS / RATE + 30,
            alive=workers.alive,
        )  # fmt: skip
    times = starts(lines, task="celery_paced")
    seconds = per_second(times)
    print(
        f"\nCelery's rate_limit='5/s' on {NODES} nodes: at most {max(seconds.values())} starts"
        f" in one second, {TASKS} in {times[-1] - times[0]:.1f}s"
    )


@worker_test
def test_each_tenant_has_its_own_5_a_second_and_both_progress_at_once(
    broker: str, redis_store: str, tmp_path: Path
) -> None:
    # `export` names no limiter: the default one, from $QUOTA_DATABASE_URL.
    with Workers(broker, tmp_path, count=NODES, default_store=redis_store) as workers:
        for index in range(20):
            for tenant in ("a", "b"):
                workers.send("export", tenant, index)
        lines = wait_for(
            workers.journal, _started("export", 40), timeout=20 / RATE + 30, alive=workers.alive
        )
    by_tenant = {tenant: starts(lines, task="export", tenant=tenant) for tenant in "ab"}
    for tenant, times in by_tenant.items():
        assert len(times) == 20
        seconds = per_second(times)
        assert max(seconds.values()) <= RATE, (tenant, sorted(seconds.items()))
        assert times[-1] - times[0] <= 20 / RATE + 10
    a, b = by_tenant["a"], by_tenant["b"]
    assert max(a[0], b[0]) < min(a[-1], b[-1])  # side by side, not one after the other
    both = per_second(a + b)
    assert max(both.values()) > RATE, sorted(both.items())  # two keys, not one


@worker_test
def test_a_killed_workers_slot_frees_itself_a_lease_later(
    broker: str, redis_store: str, tmp_path: Path
) -> None:
    lease = 2.0  # the `hold` task's
    limiter = quota.connect(redis_store, pool_size=1)
    try:
        with Workers(broker, tmp_path, count=2, store=redis_store) as workers:
            first = workers.send("hold", 120.0)
            lines = wait_for(workers.journal, _started("hold", 1), timeout=20, alive=workers.alive)
            (start,) = [line for line in lines if line["event"] == "start"]
            assert start["id"] == first
            usage = limiter.concurrency_usage("hold")
            assert usage.held == 1 and usage.free == 0, usage
            # A second run finds the slot taken: deferred (busy), not run.
            second = workers.send("hold", 0.0)
            wait_for(
                workers.journal,
                lambda ls: any(r["id"] == second for r in _runs(ls, "hold")),
                timeout=20, alive=workers.alive,
            )  # fmt: skip
            workers.kill(workers.node_of(start["node"]))
            killed_at = time.monotonic()
            while limiter.concurrency_usage("hold").held:
                assert time.monotonic() - killed_at <= lease + 1, limiter.concurrency_usage("hold")
                time.sleep(0.05)
            freed_after = time.monotonic() - killed_at
            # ...and the deferred run takes the freed slot on the surviving worker.
            lines = wait_for(workers.journal, _started("hold", 2), timeout=20, alive=workers.alive)
    finally:
        limiter.close()
    assert freed_after <= lease + 1
    later = [line for line in lines if line["event"] == "start" and line["id"] == second]
    assert len(later) == 1 and later[0]["deferrals"] >= 1
    print(f"\nthe killed worker's slot was free {freed_after:.2f}s after the kill (lease {lease}s)")


@worker_test
def test_deferrals_do_not_count_against_max_retries(
    broker: str, redis_store: str, tmp_path: Path
) -> None:
    limiter = quota.connect(redis_store, pool_size=1)
    try:
        with Workers(broker, tmp_path, count=2, store=redis_store) as workers:
            # This process holds `patient`'s only slot: the task (max_retries=1) is
            # deferred, busy, until it is given back.
            with limiter.concurrency("patient", 1, lease=5, timeout=5):
                task_id = workers.send("patient")
                wait_for(
                    workers.journal, lambda ls: len(_runs(ls, "patient")) >= 3, timeout=30,
                    alive=workers.alive,
                )  # fmt: skip
            lines = wait_for(
                workers.journal, _started("patient", 1), timeout=20, alive=workers.alive
            )
    finally:
        limiter.close()
    runs = _runs(lines, "patient")
    assert {run["id"] for run in runs} == {task_id}
    assert [run["outcome"] for run in runs][:3] == ["deferred"] * 3
    (start,) = [line for line in lines if line["event"] == "start"]
    assert start["retries"] == 0
    assert start["deferrals"] >= 3


# -- in process -------------------------------------------------------------------------------


class FakeTime:
    """A clock and a sleep that advances it (`quota.Options` ``clock`` / ``sleep``)."""

    def __init__(self) -> None:
        self.now = 1_800_000_000.25
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


@pytest.fixture
def fake_time() -> FakeTime:
    return FakeTime()


@pytest.fixture
def limiter(memory_url: str, fake_time: FakeTime) -> Iterator[quota.Limiter]:
    limiter = quota.connect(memory_url, clock=fake_time, sleep=fake_time.sleep)
    try:
        yield limiter
    finally:
        limiter.close()


@pytest.fixture
def app() -> Iterator[Celery]:
    app = Celery("quota_celery_inprocess", broker="memory://", set_as_current=False)
    app.conf.update(result_backend=None, task_ignore_result=True)
    try:
        yield app
    finally:
        app.close()


@pytest.mark.parametrize(
    ("arguments", "named"),
    [
        ({"rates": "5 per fortnight"}, "rate"),
        ({"rates": "5/second", "key": ""}, "key"),
        ({"rates": "5/second", "key": 3}, "key"),
        ({"rates": "5/second", "limiter": "redis://"}, "limiter"),
        ({"rates": "5/second", "concurrency": 0}, "concurrency"),
        ({"rates": "5/second", "concurrency": True}, "concurrency"),
        ({"rates": "5/second", "concurrency": 1, "lease": 0}, "lease"),
    ],
)
def test_bad_arguments_are_refused_when_decorating(arguments: dict[str, Any], named: str) -> None:
    with pytest.raises(quota.ConfigurationError, match=named):
        rate_limited(**arguments)


def test_a_coroutine_function_is_refused() -> None:
    async def body() -> None: ...

    with pytest.raises(quota.ConfigurationError, match="coroutine function"):
        rate_limited("5/second")(body)


def test_the_wrapper_keeps_the_functions_name_and_signature(limiter: quota.Limiter) -> None:
    import inspect

    def body(self: Any, tenant: str, day: int = 1) -> str:
        """Exports."""
        return tenant

    wrapped = rate_limited("5/second", limiter=limiter)(body)
    assert wrapped.__name__ == "body" and wrapped.__doc__ == "Exports."
    assert list(inspect.signature(wrapped).parameters) == ["self", "tenant", "day"]


def test_a_direct_call_waits_in_the_caller_for_its_turn(
    app: Celery, limiter: quota.Limiter, fake_time: FakeTime
) -> None:
    seen: list[tuple[Any, ...]] = []

    def key(*args: Any, **kwargs: Any) -> str:
        seen.append((args, kwargs))
        return f"export:{args[0]}"

    @app.task(bind=True, name="export_bound")
    @rate_limited("2/second", key=key, limiter=limiter)
    def export_bound(self: Any, tenant: str, day: int = 0) -> str:
        assert self.name == "export_bound"
        return f"{tenant}-{day}"

    assert [export_bound("a", day=i) for i in range(5)] == [f"a-{i}" for i in range(5)]
    # The key saw the task's own arguments, without `self`.
    assert seen == [(("a",), {"day": i}) for i in range(5)]
    # 2 a second: the third and fifth calls waited (in the caller) for the next second.
    assert len(fake_time.slept) == 2 and 1.0 <= fake_time.now - 1_800_000_000.25 <= 2.2
    assert limiter.peek("export:a", 2, 1).remaining == 1


def test_an_eager_run_waits_in_the_caller_and_a_plain_task_gets_its_arguments(
    app: Celery, limiter: quota.Limiter, fake_time: FakeTime
) -> None:
    app.conf.task_always_eager = True
    seen: list[tuple[Any, ...]] = []

    @app.task(name="plain")
    @rate_limited("1/second", key=lambda *a, **k: seen.append(a) or "plain", limiter=limiter)
    def plain(x: int) -> int:
        return x * 2

    assert [plain.delay(i).get() for i in range(3)] == [0, 2, 4]
    assert seen == [(0,), (1,), (2,)]
    assert len(fake_time.slept) == 2  # no worker to defer to: the caller waited twice


def test_the_default_key_is_the_tasks_name(app: Celery, limiter: quota.Limiter) -> None:
    @app.task(name="reports.daily")
    @rate_limited("5/minute", limiter=limiter)
    def daily() -> None: ...

    daily()
    assert limiter.peek("reports.daily", 5, 60).remaining == 4


def test_a_direct_call_times_out_without_a_concurrency_slot(
    app: Celery, limiter: quota.Limiter, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("quota.contrib.celery.WAIT_TIMEOUT", 0.2)  # the slot's wait is real time

    @app.task(name="single")
    @rate_limited("100/second", limiter=limiter, concurrency=1, lease=5)
    def single() -> str:
        return "ran"

    with (
        limiter.concurrency("single", 1, lease=5, timeout=0),
        pytest.raises(quota.RateLimitTimeout),
    ):
        single()


def _in_worker(task: Any, *args: Any, retries: int = 0, **headers: Any) -> Any:
    """Runs `task` as a worker would: its request pushed, not called directly."""
    from celery._state import _task_stack

    task = task.app.tasks[task.name]  # the task itself, not a proxy of it
    task.push_request(
        id="t-1", args=args, kwargs={}, retries=retries, called_directly=False, is_eager=False,
        delivery_info={"exchange": "", "routing_key": "celery"}, hostname="w@h", **headers,
    )  # fmt: skip
    _task_stack.push(task)
    try:
        return task.run(*args)
    finally:
        _task_stack.pop()
        task.pop_request()


def test_a_denied_run_is_sent_again_with_its_retries_unchanged(
    app: Celery, limiter: quota.Limiter, monkeypatch: pytest.MonkeyPatch
) -> None:
    ran: list[int] = []

    @app.task(bind=True, name="once", max_retries=0)
    @rate_limited("1/second", limiter=limiter)
    def once(self: Any, x: int) -> None:
        ran.append(x)

    sent: list[Any] = []
    monkeypatch.setattr("celery.canvas.Signature.apply_async", lambda sig: sent.append(sig))
    _in_worker(once, 1)
    with pytest.raises(Retry) as caught:
        _in_worker(once, 2, retries=3, quota_deferrals=4)
    assert ran == [1]
    (signature,) = sent
    assert signature.args == (2,) and signature.options["task_id"] == "t-1"
    assert signature.options["retries"] == 3  # not one more
    assert 0.75 <= signature.options["countdown"] <= 1.75  # the next second, plus jitter
    assert signature.options["headers"]["quota_deferrals"] == 5
    assert caught.value.sig is signature and caught.value.when == signature.options["countdown"]


def test_a_run_that_cannot_be_sent_again_waits_in_the_worker(
    app: Celery, limiter: quota.Limiter, fake_time: FakeTime, monkeypatch: pytest.MonkeyPatch
) -> None:
    ran: list[int] = []

    @app.task(bind=True, name="stubborn")
    @rate_limited("1/second", limiter=limiter)
    def stubborn(self: Any, x: int) -> None:
        ran.append(x)

    def broker_down(sig: Any) -> None:
        raise ConnectionError("broker down")

    monkeypatch.setattr("celery.canvas.Signature.apply_async", broker_down)
    _in_worker(stubborn, 1)
    _in_worker(stubborn, 2)  # not dropped: waited for its turn, in the worker
    assert ran == [1, 2]
    assert len(fake_time.slept) == 1 and fake_time.slept[0] >= 0.75


def test_the_slot_of_a_run_is_given_back_when_its_body_fails(
    app: Celery, limiter: quota.Limiter
) -> None:
    @app.task(bind=True, name="failing")
    @rate_limited("100/second", limiter=limiter, concurrency=1, lease=5)
    def failing(self: Any) -> None:
        assert limiter.concurrency_usage("failing").held == 1
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        _in_worker(failing)
    assert limiter.concurrency_usage("failing").held == 0


def test_the_default_limiter_is_the_processes(
    monkeypatch: pytest.MonkeyPatch, app: Celery, memory_url: str
) -> None:
    monkeypatch.setenv("QUOTA_DATABASE_URL", memory_url)
    monkeypatch.setattr(_jobs, "_sync", None)

    @app.task(name="defaulted")
    @rate_limited("3/minute")
    def defaulted() -> None: ...

    defaulted()
    default = _jobs.default_limiter()
    try:
        assert default.peek("defaulted", 3, 60).remaining == 2
    finally:
        default.close()


def test_a_bound_tasks_run_called_in_another_tasks_body_waits_there(
    app: Celery, limiter: quota.Limiter, fake_time: FakeTime, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[tuple[Any, ...]] = []

    @app.task(bind=True, name="inner")
    @rate_limited("1/second", key=lambda *a, **k: seen.append(a) or "inner", limiter=limiter)
    def inner(self: Any, x: int) -> int:
        return x

    @app.task(bind=True, name="outer")
    def outer(self: Any) -> list[int]:
        real = app.tasks["inner"]
        return [real.run(1), real.run(2)]

    def no_sending(sig: Any) -> None:
        raise AssertionError(f"sent {sig!r}")

    monkeypatch.setattr("celery.canvas.Signature.apply_async", no_sending)
    assert _in_worker(outer) == [1, 2]  # the outer task is not deferred: the inner call waited
    assert seen == [(1,), (2,)]
    assert len(fake_time.slept) == 1


def test_a_deferral_passes_through_autoretry_for(
    app: Celery, limiter: quota.Limiter, monkeypatch: pytest.MonkeyPatch
) -> None:
    @app.task(bind=True, name="auto", autoretry_for=(Exception,), max_retries=0)
    @rate_limited("1/second", limiter=limiter)
    def auto(self: Any) -> None: ...

    sent: list[Any] = []
    monkeypatch.setattr("celery.canvas.Signature.apply_async", lambda sig: sent.append(sig))
    _in_worker(auto)
    with pytest.raises(Retry):
        _in_worker(auto)
    (signature,) = sent
    assert signature.options["retries"] == 0
