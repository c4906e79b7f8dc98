"""Usage-threshold code that runs in worker processes (``spawn``), through
`tests._workers.run_processes` (``target(barrier, *args)``). Workers live at a fixed
instant, so no period boundary is crossed; each keeps one connection (the shared
PostgreSQL server allows few)."""

from __future__ import annotations

from typing import Any

import quota
from tests._workers import BARRIER_TIMEOUT


def race_worker(
    barrier: Any, url: str, subject: str, name: str, limit: int, calls: int, now: float
) -> list[tuple[int, list[str]]]:
    """`calls` consumes of cost 1 with thresholds 0.8; (used, thresholds fired) per call."""
    with quota.connect(url, clock=lambda: now, pool_size=1) as limiter:
        limiter.quota_usage(subject)  # connect and check the schema before the start
        barrier.wait(timeout=BARRIER_TIMEOUT)
        out = []
        for _ in range(calls):
            d = limiter.consume_quota(subject, name, limit, "day", thresholds=(0.8,))
            out.append((d.used, [str(e.threshold) for e in d.fired]))
        return out
