"""The admission the job integrations share (quota.contrib._jobs), without a framework.

A run is admitted with a concurrency slot (when asked) and a hit under every rate, or
deferred with a delay that says when to come back: the rate's next slot plus a jitter,
a busy delay when every slot is held, a store delay when the store fails. A slot taken
for a run a rate then denies is given back.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

import quota
from quota.contrib import _jobs
from quota.contrib._jobs import BUSY_DELAY, STORE_DELAY, JobLimit, queue_key
from tests._support import Clock


def _limit(limiter: object, rates: str = "2/second", **options: object) -> JobLimit:
    settings: dict[str, object] = dict(
        key=None, limiter=limiter, concurrency=None, lease=30.0, name="tasks.export",
        face=quota.AsyncLimiter if isinstance(limiter, quota.AsyncLimiter) else quota.Limiter,
    )  # fmt: skip
    settings.update(options)
    return JobLimit(rates, **settings)  # type: ignore[arg-type]


@pytest.fixture
def clock() -> Clock:
    return Clock(1_800_000_000.25)  # a quarter into an aligned second


@pytest.fixture
def limiter(clock: Clock) -> Iterator[quota.Limiter]:
    with quota.connect("memory://", clock=clock) as limiter:
        yield limiter


def test_a_rate_admits_its_limit_then_defers_to_its_next_slot_plus_jitter(
    limiter: quota.Limiter,
) -> None:
    job = _limit(limiter)
    assert job.admit("k").admitted and job.admit("k").admitted
    denied = []
    for _ in range(50):
        limiter.reset(queue_key("k"))  # each the first in the queue
        denied.append(job.admit("k"))
    for admission in denied:
        assert admission.reason == "rate" and admission.decision is not None
        assert not admission.decision.allowed
        # The slot opens 0.75 s on; one slot's share of the window (0.5 s) of jitter at most.
        assert admission.delay is not None and 0.75 <= admission.delay <= 0.75 + 0.5
    assert len({a.delay for a in denied}) > 40  # spread, not one instant
    assert limiter.peek("k", 2, 1).count == 2  # deferrals charge nothing


def test_deferred_runs_queue_up_limit_per_window(limiter: quota.Limiter, clock: Clock) -> None:
    job = _limit(limiter, "5/second")
    assert all(job.admit("k").admitted for _ in range(5))
    delays = [job.admit("k").delay for _ in range(23)]
    # The k-th deferred run comes back in the k // 5-th window after the next one.
    for k, delay in enumerate(delays):
        assert delay is not None
        assert 0.75 + k // 5 <= delay <= 0.75 + k // 5 + 0.2, (k, delay)
    # The queue drains at the rate: 2 s on, 10 of its 23 are due, and a run deferred
    # now goes after the 13 left.
    clock.advance(2.0)
    assert all(job.admit("k").admitted for _ in range(5))
    late = job.admit("k").delay
    assert late is not None and 0.75 + 13 // 5 <= late <= 0.75 + 13 // 5 + 0.2


def test_a_queue_longer_than_max_delay_defers_by_max_delay(limiter: quota.Limiter) -> None:
    job = _limit(limiter, "1/minute")
    assert job.admit("k").admitted
    delays = [job.admit("k").delay for _ in range(8)]
    assert delays[0] is not None and 59.75 <= delays[0] <= 60.75  # the next minute
    for delay in delays[5:]:  # 5 minutes of tickets ahead of each
        assert delay is not None and _jobs.MAX_DELAY <= delay <= _jobs.MAX_DELAY + 1


def test_a_ticket_the_store_fails_leaves_the_plain_delay(
    limiter: quota.Limiter, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = _limit(limiter)
    assert job.admit("k").admitted and job.admit("k").admitted
    hit = limiter.hit

    def failing(key: str, *args: object, **kwargs: object) -> quota.Decision:
        if key == queue_key("k"):
            raise quota.StorageError("the tickets table is gone")
        return hit(key, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(limiter, "hit", failing)
    for _ in range(10):
        delay = job.admit("k").delay
        assert delay is not None and 0.75 <= delay <= 1.25


@pytest.mark.parametrize(
    ("rates", "jitter"), [("1000/second", 0.05), ("2/second", 0.5), ("10/minute", 1.0)]
)
def test_the_jitter_is_one_slots_share_between_50ms_and_1s(
    limiter: quota.Limiter, rates: str, jitter: float
) -> None:
    job = _limit(limiter, rates)
    delays = []
    while len(delays) < 200:
        limiter.reset(queue_key("k"))
        admission = job.admit("k")
        if not admission.admitted:
            assert admission.decision is not None and admission.delay is not None
            delays.append(admission.delay - admission.decision.retry_after_exact)
    assert 0 <= min(delays) < jitter * 0.2 and jitter * 0.8 < max(delays) <= jitter


def test_a_slot_further_off_than_max_delay_comes_back_at_max_delay(
    limiter: quota.Limiter,
) -> None:
    job = _limit(limiter, "1/day")
    assert job.admit("k").admitted
    denied = job.admit("k")
    assert denied.decision is not None and denied.decision.retry_after_exact > 50_000
    assert denied.delay is not None and _jobs.MAX_DELAY <= denied.delay <= _jobs.MAX_DELAY + 1


def test_several_rates_are_all_or_nothing(limiter: quota.Limiter, clock: Clock) -> None:
    job = _limit(limiter, "1/second;3/minute")
    assert job.admit("k").admitted
    assert job.admit("k").reason == "rate"
    clock.advance(1)
    assert job.admit("k").admitted
    clock.advance(1)
    assert job.admit("k").admitted
    clock.advance(1)
    denied = job.admit("k")  # the minute is full: its reset, not the second's
    assert denied.decision is not None and denied.decision.limit == 3
    assert limiter.peek("k", 1, 1).count == 0  # the second's hit was given back


def test_a_held_slot_defers_the_next_run_as_busy_and_frees_on_release(
    limiter: quota.Limiter,
) -> None:
    job = _limit(limiter, "100/second", concurrency=1, lease=5.0)
    running = job.admit("k")
    assert running.admitted and running.block is not None
    assert limiter.concurrency_usage("k").held == 1
    for _ in range(20):
        busy = job.admit("k")
        assert busy.reason == "busy" and busy.block is None
        assert busy.delay is not None and BUSY_DELAY <= busy.delay <= 2 * BUSY_DELAY
    running.release()
    assert limiter.concurrency_usage("k").held == 0
    again = job.admit("k")
    assert again.admitted
    again.release()


def test_a_slot_taken_for_a_run_a_rate_denies_is_given_back(limiter: quota.Limiter) -> None:
    job = _limit(limiter, "1/second", concurrency=3)
    first = job.admit("k")
    assert first.admitted
    assert job.admit("k").reason == "rate"
    assert limiter.concurrency_usage("k").held == 1  # only the running one
    first.release()


def test_a_failing_store_defers_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A database quota was never migrated into: every statement fails.
    with quota.connect(f"sqlite:///{tmp_path / 'empty.db'}") as limiter:
        job = _limit(limiter, concurrency=2)
        with caplog.at_level(logging.WARNING, logger="quota"):
            admission = job.admit("k")
    assert admission.reason == "store" and admission.block is None
    assert admission.delay is not None and STORE_DELAY <= admission.delay <= 2 * STORE_DELAY
    assert "tasks.export" in caplog.text and "'k'" in caplog.text and "deferred" in caplog.text


def test_the_async_face_admits_defers_and_frees_alike(clock: Clock) -> None:
    async def main() -> None:
        async with quota.connect_async("memory://", clock=clock) as limiter:
            job = _limit(limiter, "2/second", concurrency=1)
            running = await job.admit_async("k")
            assert running.admitted
            assert (await job.admit_async("k")).reason == "busy"
            await running.release_async()
            second = await job.admit_async("k")
            assert second.admitted
            await second.release_async()
            denied = await job.admit_async("k")
            assert denied.reason == "rate" and denied.delay is not None
            assert 0.75 <= denied.delay <= 1.25
            assert (await limiter.concurrency_usage("k")).held == 0

    asyncio.run(main())


def test_keys_come_from_the_name_a_string_or_the_tasks_arguments() -> None:
    assert _limit(None).key_of((1,), {}) == "tasks.export"
    assert _limit(None, key="exports").key_of((1,), {}) == "exports"
    by_tenant = _limit(None, key=lambda tenant, *a, **k: f"export:{tenant}:{k.get('fmt')}")
    assert by_tenant.key_of(("acme", 2), {"fmt": "csv"}) == "export:acme:csv"
    with pytest.raises(quota.ConfigurationError, match=r"key\(\.\.\.\) of task 'tasks.export'"):
        _limit(None, key=lambda *a: "").key_of((), {})


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"concurrency": 0}, "concurrency must be None or a whole number .* got 0"),
        ({"concurrency": True}, "concurrency .* got True"),
        ({"concurrency": 2.0}, "concurrency .* got 2.0"),
        ({"lease": 0}, "lease must be seconds between 0.1 and 86400, got 0"),
        ({"lease": "30"}, "lease .* got '30'"),
        ({"key": ""}, "key must be a non-empty str.* got ''"),
        ({"key": 5}, "key must be .* got 5"),
        ({"limiter": "memory://"}, "limiter must be a quota.Limiter or None, got 'memory://'"),
    ],
)
def test_bad_arguments_are_named(options: dict[str, object], message: str) -> None:
    with pytest.raises(quota.ConfigurationError, match=message):
        _limit(options.pop("limiter", None), **options)


def test_bad_rates_are_refused_when_the_task_is_decorated() -> None:
    with pytest.raises(quota.ConfigurationError, match="5/fortnight"):
        _limit(None, "5/fortnight")


def test_the_default_limiter_is_one_per_process_and_a_forked_child_opens_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("QUOTA_DATABASE_URL", "memory://")
    monkeypatch.setattr(_jobs, "_sync", None)
    parent = _jobs.default_limiter()
    assert _jobs.default_limiter() is parent
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: a new limiter, the parent's kept aside, not closed
        try:
            child = _jobs.default_limiter()
            ok = child is not parent and _jobs._inherited[-1] is parent
            ok = ok and _jobs.default_limiter() is child
            os.write(write, b"1" if ok else b"0")
        finally:
            os._exit(0)
    os.close(write)
    try:
        assert os.read(read, 1) == b"1"
    finally:
        os.close(read)
        os.waitpid(pid, 0)
    assert _jobs.default_limiter() is parent
    parent.close()
