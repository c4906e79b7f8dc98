"""Reservation code that runs in worker processes (``spawn``), which the parent may SIGKILL.

Workers live at a fixed instant, so no hold expires and no period ends while they
run; the parent moves its own clock past the holds' ttl afterwards.
"""

from __future__ import annotations

import random
from typing import Any

import quota


def reserve_and_settle(
    url: str, subject: str, name: str, limit: int, ttl: int, seed: int, rounds: int,
    progress: Any, now: float,
) -> None:  # fmt: skip
    """`rounds` times: reserve a random 1..1000 units, then settle a random part of them.

    Sends one message on `progress` once connected, then one per round, so the
    parent can pick a moment inside the loop to kill the process.
    """
    rng = random.Random(seed)
    with quota.connect(url, clock=lambda: now, pool_size=1) as limiter:
        limiter.quota_usage(subject)
        progress.send(-1)
        for i in range(rounds):
            held = limiter.reserve_quota(subject, name, rng.randint(1, 1000), limit, "day", ttl=ttl)
            if held.allowed:
                assert held.id is not None
                limiter.settle_quota(held.id, rng.randint(0, held.decision.cost))
            progress.send(i)
