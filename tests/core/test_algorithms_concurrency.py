"""Every algorithm stays exact with several OS processes racing on one key.

Four ``spawn``ed processes, each with its own connections, hit one key per
algorithm 50 times at one fixed instant (no refill, no window moving), so
exactly `LIMIT` hits may pass in all: one atomic statement (or Lua script)
per decision leaves no read-then-write gap for a race. The limit's emission
interval is a whole number of seconds, so GCRA's arithmetic is exact here.
"""

from __future__ import annotations

import multiprocessing

import pytest

import quota
from tests import _workers
from tests._algorithm_workers import ALGORITHMS, algorithm_worker
from tests.conftest import SQL_DIALECTS, backend_params, store_url

pytestmark = pytest.mark.slow

PROCESSES = 4
HITS_PER_PROCESS = 50
LIMIT, WINDOW = 40, 3600  # well under the 4 x 50 = 200 hits made on each key


@pytest.mark.parametrize("dialect", backend_params(*SQL_DIALECTS, "redis"))
def test_processes_on_one_key_allow_exactly_the_limit_under_every_algorithm(
    request: pytest.FixtureRequest, dialect: str
) -> None:
    url = store_url(request, dialect)
    now = _workers.FIXED_NOW
    results = _workers.run_processes(
        multiprocessing.get_context("spawn"),
        algorithm_worker,
        [(url, LIMIT, WINDOW, HITS_PER_PROCESS, now)] * PROCESSES,
    )

    for algorithm in ALGORITHMS:
        allowed = [result[algorithm] for result in results]
        assert sum(allowed) == LIMIT, f"{algorithm}: allowed per process {allowed}"
    with quota.connect(url, clock=lambda: now) as limiter:
        for algorithm in ALGORITHMS:
            after = limiter.peek(f"hammered-{algorithm}", LIMIT, WINDOW, algorithm=algorithm)
            assert (after.allowed, after.remaining) == (False, 0), algorithm
        assert (
            limiter.peek("hammered-fixed_window", LIMIT, WINDOW).count
            == PROCESSES * HITS_PER_PROCESS
        )
