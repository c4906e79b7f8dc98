"""The sliding window across real window boundaries, with processes whose clocks disagree.

Four ``spawn``ed processes on the real clock, each a few milliseconds off the
others (as app servers are) and each running concurrent tasks on an async
limiter, hammer one key (2 s window, limit 20, cost 2) across at least two
boundaries. Every admitted hit is booked in the window its own clock read;
no window may hold more than the limit (the guarantee of
``tests/core/test_sliding_skew.py``: a call that reaches a row rolled over by a
newer clock weighs the previous window in full).
"""

from __future__ import annotations

import asyncio
import contextvars
import multiprocessing
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

import quota
from tests import _workers
from tests._support import window_start
from tests.conftest import SQL_DIALECTS, backend_params, store_url

pytestmark = pytest.mark.slow

LIMIT, WINDOW, COST = 20, 2, 2
#: Each process's clock offset, in seconds.
OFFSETS = (-0.006, -0.002, 0.002, 0.006)
TASKS = 3
#: Seconds each process hammers: any stretch this long crosses two boundaries.
DURATION = 2 * WINDOW + 0.1
KEY = "sliding-across-boundaries"

#: The time the current task's last call read (each asyncio task has its own).
_READ: contextvars.ContextVar[float] = contextvars.ContextVar("read")


def _clock(offset: float) -> Callable[[], float]:
    def clock() -> float:
        now = time.time() + offset
        _READ.set(now)
        return now

    return clock


def sliding_worker(barrier: Any, url: str, offset: float) -> dict[int, int]:
    """Hammer `KEY` with `TASKS` tasks for `DURATION` s; return units admitted per window."""
    return asyncio.run(_hammer(barrier, url, offset))


async def _hammer(barrier: Any, url: str, offset: float) -> dict[int, int]:
    limiter = quota.connect_async(url, clock=_clock(offset), pool_size=TASKS)
    admitted: Counter[int] = Counter()

    async def task(end: float) -> None:
        while time.monotonic() < end:
            decision = await limiter.rate_limit(
                KEY, LIMIT, WINDOW, cost=COST, algorithm="sliding_window"
            )
            if decision.allowed:
                admitted[window_start(_READ.get(), WINDOW)] += COST

    try:
        await limiter.peek(KEY, LIMIT, WINDOW, algorithm="sliding_window")  # connect first
        barrier.wait(timeout=_workers.BARRIER_TIMEOUT)  # blocks the loop, on purpose
        end = time.monotonic() + DURATION
        await asyncio.gather(*(task(end) for _ in range(TASKS)))
    finally:
        await limiter.aclose()
    return dict(admitted)


@pytest.mark.parametrize("dialect", backend_params(*SQL_DIALECTS, "redis"))
def test_no_window_admits_over_the_limit_when_clocks_skew_by_milliseconds(
    request: pytest.FixtureRequest, dialect: str
) -> None:
    url = store_url(request, dialect)
    results = _workers.run_processes(
        multiprocessing.get_context("spawn"),
        sliding_worker,
        [(url, offset) for offset in OFFSETS],
    )

    per_window: Counter[int] = Counter()
    for result in results:
        per_window.update(result)
    over = {start: units for start, units in per_window.items() if units > LIMIT}
    assert not over, f"windows over the limit of {LIMIT}: {over} (all: {dict(per_window)})"
    # It did hammer across a boundary, admitting hits on both sides.
    assert len(per_window) >= 2, dict(per_window)
