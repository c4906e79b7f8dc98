"""Worker processes (``spawn``) hammering one key per algorithm, for test_algorithms_concurrency."""

from __future__ import annotations

from typing import Any

import quota
from tests._workers import BARRIER_TIMEOUT

ALGORITHMS = ("fixed_window", "sliding_window", "token_bucket", "gcra")


def algorithm_worker(
    barrier: Any, url: str, limit: int, window: int, hits: int, now: float
) -> dict[str, int]:
    """Hit key ``hammered-<algorithm>`` `hits` times per algorithm, interleaved, at the
    fixed instant `now`; return how many hits each algorithm allowed."""
    with quota.connect(url, clock=lambda: now) as limiter:
        for algorithm in ALGORITHMS:  # connect (and load scripts) before the start
            limiter.peek(f"hammered-{algorithm}", limit, window, algorithm=algorithm)
        barrier.wait(timeout=BARRIER_TIMEOUT)
        allowed = dict.fromkeys(ALGORITHMS, 0)
        for _ in range(hits):
            for algorithm in ALGORITHMS:
                decision = limiter.rate_limit(
                    f"hammered-{algorithm}", limit, window, algorithm=algorithm
                )
                allowed[algorithm] += decision.allowed
        return allowed
