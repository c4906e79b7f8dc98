"""`acquire`, `limit` and `limited`: waiting for a slot, on every store.

Where the arithmetic is checked the limiter runs on an injected clock and an injected
sleep that moves it, so nothing sleeps for real. The concurrency claims (many waiters in
several processes share the rate exactly; cancelled waiters are never charged; a waiter
holds no connection while it sleeps) run for real against the databases.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

import quota
from quota import Fallback, Rate
from quota._core import waiting
from tests._support import Backend, Clock, parent_death_signal
from tests.conftest import EVERY_FACE, backend_params, dialect_of, store_url

ROOT = Path(__file__).resolve().parents[2]
ALGORITHMS = ("token_bucket", "gcra", "sliding_window")


class Sleeps:
    """An injected sleep: records each pause and moves the clock by it."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.pauses: list[float] = []

    def __call__(self, seconds: float) -> None:
        self.pauses.append(seconds)
        self.clock.advance(seconds)


@pytest.fixture(params=backend_params(*EVERY_FACE))
def waiting_backend(
    request: pytest.FixtureRequest, clock: Clock
) -> Any:  # Iterator[tuple[Backend, Sleeps]]
    name: str = request.param
    sleeps = Sleeps(clock)
    backend = Backend(name, store_url(request, dialect_of(name)), clock, sleep=sleeps)
    try:
        yield backend, sleeps
    finally:
        backend.close()


# -- the pure arithmetic ----------------------------------------------------------------------


def test_pause_sleeps_the_exact_wait_plus_a_jitter_that_shrinks_with_each_attempt() -> None:
    assert waiting.pause(0.3, 5.0, attempt=1, spread=0.05, draw=0.0) == 0.3
    assert waiting.pause(0.3, 5.0, attempt=1, spread=0.05, draw=0.999) == pytest.approx(0.34995)
    assert waiting.pause(0.3, 5.0, attempt=5, spread=0.05, draw=0.999) == pytest.approx(0.30999)
    # Never past the deadline, never a spin.
    assert waiting.pause(0.3, 0.31, attempt=1, spread=0.05, draw=0.999) == 0.31
    assert waiting.pause(0.0, 5.0, attempt=1, spread=0.0, draw=0.0) == waiting.MIN_PAUSE


def test_pause_gives_up_when_the_slot_opens_after_the_deadline() -> None:
    assert waiting.pause(2.0, 1.999, attempt=1, spread=0.05, draw=0.5) is None
    assert waiting.pause(0.0, 0.0, attempt=3, spread=0.05, draw=0.5) is None


def test_jitter_is_a_quarter_of_a_slot_at_most_50_ms() -> None:
    assert waiting.jitter_spread(0.2) == 0.05
    assert waiting.jitter_spread(0.01) == pytest.approx(0.0025)
    assert waiting.jitter_spread(60.0) == waiting.MAX_JITTER


@pytest.mark.parametrize("bad", [-1, float("nan"), float("inf"), "5", None, True, 86_401])
def test_a_bad_timeout_is_named(bad: object) -> None:
    with pytest.raises(quota.ConfigurationError, match="timeout"):
        waiting.check_timeout(bad)
    with (
        quota.connect("memory://") as limiter,
        pytest.raises(quota.ConfigurationError, match="timeout"),
    ):
        limiter.acquire("k", "5/second", timeout=bad)  # type: ignore[arg-type]


# -- the exact wait each decision carries -------------------------------------------------------


@pytest.mark.parametrize("algorithm", ["fixed_window", *ALGORITHMS])
def test_a_denial_carries_the_exact_wait_its_retry_after_rounds(
    every_backend: Backend, algorithm: str
) -> None:
    rate = Rate(limit=4, window=2, algorithm=algorithm)
    for _ in range(4):
        assert every_backend.hit("k", rate).allowed
    every_backend.clock.advance(0.1)
    denied = every_backend.hit("k", rate)
    assert not denied.allowed
    assert 0 < denied.retry_after_exact <= denied.retry_after < denied.retry_after_exact + 1
    if algorithm == "fixed_window":
        assert denied.retry_after_exact == pytest.approx(denied.reset_at - every_backend.clock())
    if algorithm in ("token_bucket", "gcra"):
        # Four hits took the whole burst 0.1 s ago; one token is back 0.5 s after them.
        assert denied.retry_after_exact == pytest.approx(0.4, abs=1e-4)  # GCRA: its slack
    every_backend.clock.advance(denied.retry_after_exact + 1e-6)  # past the doubles' rounding
    assert every_backend.hit("k", rate).allowed


# -- acquire on the injected clock ---------------------------------------------------------------


def test_acquire_waits_for_the_next_window_and_charges_only_what_it_returns(
    waiting_backend: tuple[Backend, Sleeps],
) -> None:
    backend, sleeps = waiting_backend
    start = backend.clock()
    admitted = [backend.acquire("k", "5/second", timeout=3) for _ in range(12)]
    assert all(d.allowed for d in admitted)
    # Five in this window, five in the next, two in the one after: one sleep per window,
    # to the window's start plus a jitter of at most 50 ms.
    assert len(sleeps.pauses) == 2
    assert 0.75 <= sleeps.pauses[0] <= 0.75 + waiting.MAX_JITTER
    assert backend.clock() - start <= 1.75 + 2 * waiting.MAX_JITTER
    # The limiter counts denied hits (count_denied=True), yet the denied attempts of the
    # waits were not: each window holds exactly what was returned in it.
    assert [d.count for d in admitted] == [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2]
    assert backend.peek("k", 5, 1).count == 2
    backend.clock.now = start
    assert backend.peek("k", 5, 1).count == 5


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_each_wait_is_exact_so_every_wake_up_is_admitted(
    waiting_backend: tuple[Backend, Sleeps], algorithm: str
) -> None:
    backend, sleeps = waiting_backend
    rate = Rate(limit=2, window=1, algorithm=algorithm)
    start = backend.clock()
    for _ in range(8):
        assert backend.acquire("k", rate, timeout=5).allowed
    # Two pass at once; each of the six others sleeps once, and that one wake-up is
    # admitted: the wait was neither short (a second store call) nor a whole second.
    assert len(sleeps.pauses) == 6
    # A sliding window lets the previous window fade: its slots come later than a bucket's.
    per_slot = 1.0 if algorithm == "sliding_window" else 0.5
    assert backend.clock() - start <= 6 * (per_slot + waiting.MAX_JITTER)


def test_acquire_raises_at_once_when_the_slot_opens_after_the_timeout(
    waiting_backend: tuple[Backend, Sleeps],
) -> None:
    backend, sleeps = waiting_backend
    assert backend.acquire("k", "1/minute").allowed
    start = backend.clock()
    with pytest.raises(quota.RateLimitTimeout) as raised:
        backend.acquire("k", "1/minute", timeout=10)
    assert sleeps.pauses == [] and backend.clock() == start
    decision = raised.value.decision
    assert decision is not None and not decision.allowed
    assert decision.retry_after_exact > 10
    assert backend.peek("k", 1, 60).count == 1  # the denied attempt charged nothing


def test_acquire_times_out_after_waiting_when_others_take_the_slot(
    waiting_backend: tuple[Backend, Sleeps],
) -> None:
    backend, sleeps = waiting_backend
    with quota.connect(backend.url, clock=backend.clock) as rival:

        def take_it(seconds: float) -> None:
            sleeps(seconds)
            rival.hit("k", "2/second")  # another process wins every slot the waiter woke for
            rival.hit("k", "2/second")

        backend.limiter._sleep = take_it
        backend.hit("k", "2/second")
        backend.hit("k", "2/second")
        with pytest.raises(quota.RateLimitTimeout):
            backend.acquire("k", "2/second", timeout=2.5)
    assert 2 <= len(sleeps.pauses) <= 3
    assert sum(sleeps.pauses) <= 2.5 + 1e-9


def test_several_rates_wait_for_the_most_restrictive(
    waiting_backend: tuple[Backend, Sleeps],
) -> None:
    backend, sleeps = waiting_backend
    for _ in range(3):
        assert backend.acquire("k", "10/second;3/2 seconds", timeout=5).allowed
    decision = backend.acquire("k", "10/second;3/2 seconds", timeout=5)
    assert decision.allowed and len(sleeps.pauses) == 1
    assert backend.peek("k", 10, 1).count == 1  # a new second, and only the admitted hit


@pytest.mark.parametrize("algorithm", ["fixed_window", *ALGORITHMS])
def test_an_attempt_a_later_rate_denies_leaves_no_charge_on_the_earlier_ones(
    waiting_backend: tuple[Backend, Sleeps], algorithm: str
) -> None:
    backend, sleeps = waiting_backend
    short = [
        Rate(limit=5, window=1, algorithm=algorithm),
        Rate(limit=7, window=10, algorithm=algorithm),
    ]
    rates = [*short, Rate(limit=2, window=60)]
    for _ in range(2):
        assert backend.acquire("k", rates, timeout=5).allowed
    # The minute's next slot opens after the timeout: each call makes one attempt, which
    # both short rates allow and the minute denies.
    for _ in range(3):
        with pytest.raises(quota.RateLimitTimeout):
            backend.acquire("k", rates, timeout=5)
    assert sleeps.pauses == []
    # Each short rate holds the two hits admitted and nothing of the three denied attempts.
    assert sum(backend.hit("k", short[0]).allowed for _ in range(6)) == 3
    assert sum(backend.hit("k", short[1]).allowed for _ in range(6)) == 5


def test_a_hit_given_back_during_an_outage_is_not_written_back_later() -> None:
    # Nothing listens on port 1: the store is down from the start, memory decides, and the
    # fixed-window hits it counts are owed to the database for when it is back.
    url = "postgresql://root@127.0.0.1:1/x"
    with quota.connect(url, fallback=Fallback(timeout=0.1, probe_interval=60)) as limiter:
        assert limiter.acquire("k", "5/hour;1/day", timeout=0).allowed
        for _ in range(3):
            with pytest.raises(quota.RateLimitTimeout):
                limiter.acquire("k", "5/hour;1/day", timeout=0)
        owed = limiter.store.health.take_owed(time.time(), 100)  # type: ignore[attr-defined]
    assert sorted(hit[3] for hit in owed) == [3600, 86400]
    assert [hit[4] for hit in owed] == [1, 1]  # the hit returned, on each rate


def test_limit_and_limited_wrap_plain_functions(waiting_backend: tuple[Backend, Sleeps]) -> None:
    backend, sleeps = waiting_backend
    limiter = backend.limiter
    if backend.is_async:

        @limiter.limit("2/second", key=lambda user: f"user:{user}")
        async def fetch(user: str) -> str:
            return user.upper()

        async def use() -> list[str]:
            out = [await fetch("ann") for _ in range(3)]
            async with limiter.limited("block", "1/second") as decision:
                assert decision.allowed
            return out

        assert backend.run(use()) == ["ANN"] * 3
    else:

        @limiter.limit("2/second", key=lambda user: f"user:{user}")
        def fetch_sync(user: str) -> str:
            return user.upper()

        assert [fetch_sync("ann") for _ in range(3)] == ["ANN"] * 3
        with limiter.limited("block", "1/second") as decision:
            assert decision.allowed
    assert len(sleeps.pauses) == 1
    assert backend.peek("user:ann", 2, 1).count == 1


def test_limit_without_wait_raises_at_once() -> None:
    clock = Clock()
    with quota.connect("memory://", clock=clock, sleep=Sleeps(clock)) as limiter:

        @limiter.limit("1/hour", wait=False)
        def once() -> int:
            return 1

        assert once() == 1
        with pytest.raises(quota.RateLimitTimeout) as raised:
            once()
        decision = raised.value.decision
        assert decision is not None and decision.retry_after_exact > 1000


def test_limit_checks_its_arguments_when_decorating() -> None:
    with quota.connect("memory://") as limiter:
        with pytest.raises(quota.ConfigurationError, match="rate"):
            limiter.limit("5 a second")
        with pytest.raises(quota.ConfigurationError, match="wait"):
            limiter.limit("5/second", wait="yes")  # type: ignore[arg-type]
        with pytest.raises(quota.ConfigurationError, match="key"):
            limiter.limit("5/second", key=5)(lambda: None)  # type: ignore[arg-type]
        with pytest.raises(quota.ConfigurationError, match="async functions"):

            @limiter.limit("5/second")
            async def not_for_the_sync_face() -> None: ...

    async def main() -> None:
        async with quota.connect_async("memory://") as limiter:
            with pytest.raises(quota.ConfigurationError, match="plain functions"):
                limiter.limit("5/second")(lambda: None)

    asyncio.run(main())


def test_a_bad_sleep_is_named() -> None:
    with pytest.raises(quota.ConfigurationError, match="sleep"):
        quota.connect("memory://", sleep=5)


# -- the fallback ---------------------------------------------------------------------------------


def test_with_the_store_down_acquire_waits_on_memory_or_fails_closed() -> None:
    url = "postgresql://root@127.0.0.1:1/x"  # nothing listens on port 1
    clock = Clock()
    sleeps = Sleeps(clock)
    with quota.connect(
        url, clock=clock, sleep=sleeps, fallback=Fallback(timeout=0.1, probe_interval=5)
    ) as limiter:
        # Fail open: memory decides, and acquire waits on its windows as on the store's.
        assert [limiter.acquire("k", "2/second").allowed for _ in range(3)] == [True] * 3
        assert len(sleeps.pauses) == 1
        # Fail closed: denied while down, the next try when the store may be back (the probe
        # interval): at once a timeout when that is too far, else a wait that retries.
        t0 = time.perf_counter()
        with pytest.raises(quota.RateLimitTimeout) as raised:
            limiter.acquire("login", "5/second", timeout=3.5, fail_closed=True)
        decision = raised.value.decision
        assert decision is not None and not decision.allowed
        assert decision.retry_after_exact == decision.retry_after == 5
        assert len(sleeps.pauses) == 1
        with pytest.raises(quota.RateLimitTimeout):
            limiter.acquire("login", "5/second", timeout=12, fail_closed=True)
        assert len(sleeps.pauses) == 3
        assert time.perf_counter() - t0 < 2.0  # no real sleep, no store timeouts piling up


# -- for real: connections, processes, cancellation --------------------------------------------


@pytest.mark.parametrize("dialect", backend_params("sqlite", "postgresql"))
def test_waiters_hold_no_connection_while_they_sleep(
    request: pytest.FixtureRequest, dialect: str
) -> None:
    """25 threads wait on a pool of 2: nobody runs out of connections."""
    url = store_url(request, dialect)
    results: list[quota.Decision | BaseException] = []
    with quota.connect(url, pool_size=2, timeout=1.0) as limiter:
        barrier = threading.Barrier(25)

        def waiter() -> None:
            barrier.wait()
            try:
                results.append(limiter.acquire("pool", "10/second", timeout=10))
            except BaseException as exc:
                results.append(exc)

        threads = [threading.Thread(target=waiter) for _ in range(25)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(15)
    assert len(results) == 25
    assert all(isinstance(r, quota.Decision) and r.allowed for r in results), results


RATE, SECONDS, PROCESSES, TASKS = "5/second", 6.0, 4, 25


def _window_aligned_start() -> float:
    """A start 0.3 s into a second, at least 0.5 s from now: the boundaries of the fixed
    windows then fall inside the run, which admits rate x time + the first window's."""
    return float(int(time.time() + 0.5) + 1) + 0.3


def _check_shared_rate(results: list[dict[str, float]]) -> None:
    print("acquire shared rate:", json.dumps(results))  # the figures docs/waiting.md quotes
    admitted = sum(r["admitted"] for r in results)
    ideal = 5 * SECONDS + 5  # rate x time + the first window's burst
    assert 0.9 * ideal <= admitted <= ideal, results
    assert max(r["overrun"] for r in results) < 0.5, results  # every call within its timeout


@pytest.mark.parametrize("dialect", backend_params("sqlite", "postgresql", "redis"))
def test_waiters_in_four_processes_share_the_rate_exactly(
    request: pytest.FixtureRequest, dialect: str
) -> None:
    url = store_url(request, dialect)
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests._acquire_worker", url, RATE, str(TASKS)],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            preexec_fn=parent_death_signal(),
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        for _ in range(PROCESSES)
    ]
    try:
        for proc in procs:  # each is connected: starting them is no part of the run
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        start = _window_aligned_start()
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write(f"{start} {start + SECONDS}\n")
            proc.stdin.flush()
        outs = [proc.communicate(timeout=60)[0] for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    assert all(proc.returncode == 0 for proc in procs), outs
    _check_shared_rate([json.loads(out) for out in outs])


@pytest.mark.parametrize("dialect", backend_params("sqlite", "postgresql", "redis"))
def test_waiters_in_four_processes_leave_no_charge_of_their_denied_attempts(
    request: pytest.FixtureRequest, dialect: str
) -> None:
    """40 tasks in 4 processes race for the 30 slots of a week; the day's rate lets them all
    through, so every attempt the week denies has first charged the day, and given it back.
    Each task stops at its first timeout (the week's next slot opens after it)."""
    url = store_url(request, dialect)
    rates, tasks = "1000/day;30/7 days", 10
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests._acquire_worker", url, rates, str(tasks)],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            preexec_fn=parent_death_signal(),
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        for _ in range(PROCESSES)
    ]
    try:
        for proc in procs:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        start = time.time() + 0.5
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write(f"{start} {start + 5.0}\n")
            proc.stdin.flush()
        outs = [proc.communicate(timeout=60)[0] for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    assert all(proc.returncode == 0 for proc in procs), outs
    results = [json.loads(out) for out in outs]
    assert sum(r["admitted"] for r in results) == 30, results
    assert sum(r["timeouts"] for r in results) == PROCESSES * tasks, results
    with quota.connect(url) as limiter:
        assert limiter.peek("shared", 30, 7 * 86_400).count == 30
        assert limiter.peek("shared", 1000, 86_400).count == 30  # the admitted hits, no more


def test_waiters_share_the_rate_exactly_in_memory() -> None:
    from tests._acquire_worker import run

    async def when() -> tuple[float, float]:
        start = _window_aligned_start()
        return start, start + SECONDS

    url = f"memory://{uuid.uuid4().hex}"
    _check_shared_rate([asyncio.run(run(url, RATE, PROCESSES * TASKS, when))])


@pytest.mark.parametrize("name", backend_params("sqlite-async", "postgresql-async",
                                                "memory-async", "redis-async"))  # fmt: skip
def test_cancelled_waiters_are_never_charged(request: pytest.FixtureRequest, name: str) -> None:
    url = store_url(request, dialect_of(name))
    rng = random.Random(7)

    async def main() -> list[quota.Decision]:
        admitted: list[quota.Decision] = []
        async with quota.connect_async(url, pool_size=4) as limiter:
            await limiter.peek("warm-up", 1, 1)
            # The first attempt, made at once, is cancelled as a hit would be (see
            # docs/waiting.md): the cancellations start once every waiter has made it.
            decide, attempts, all_waiting = limiter._decide, [0], asyncio.Event()

            async def counted(*args: Any, **kwargs: Any) -> quota.Decision:
                try:
                    return await decide(*args, **kwargs)
                finally:
                    attempts[0] += 1
                    if attempts[0] >= 50:
                        all_waiting.set()

            limiter._decide = counted  # type: ignore[method-assign]

            async def waiter() -> None:
                admitted.append(await limiter.acquire("c", "10/second", timeout=10))

            tasks = [asyncio.create_task(waiter()) for _ in range(50)]
            await asyncio.wait_for(all_waiting.wait(), 30)
            loop, now = asyncio.get_running_loop(), time.time()
            for i, task in enumerate(tasks):
                # Half at any time (most are asleep then), half just after a window opens,
                # while the woken waiters' statements are in flight.
                at = rng.uniform(0, 2.5)
                if i % 2:
                    at = math.ceil(now + at) - now + rng.uniform(0.0, 0.03)
                loop.call_later(at, task.cancel)
            await asyncio.gather(*tasks, return_exceptions=True)
        return admitted

    admitted = asyncio.run(main())
    assert 10 <= len(admitted) < 50
    # Count each window's admissions, and read what the store holds for it.
    per_window: dict[int, int] = {}
    for decision in admitted:
        per_window[decision.reset_at] = per_window.get(decision.reset_at, 0) + 1
    clock = Clock()
    with quota.connect(url, clock=clock) as reader:
        for reset_at, count in per_window.items():
            clock.now = reset_at - 0.5
            assert reader.peek("c", 10, 1).count == count, (reset_at, per_window)
