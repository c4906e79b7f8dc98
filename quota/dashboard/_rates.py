"""The overview's decision and shedding rates: per-second figures from two `quota.Metrics` snapshots.

Pure arithmetic (`rates`) plus the little state one dashboard keeps between polls
(`RateTracker`): the previous snapshot's counts and the monotonic time it was taken.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import quota

#: Polls closer together than this (two tabs, a reload) reuse the last figures rather
#: than divide a handful of requests by a few milliseconds.
MIN_INTERVAL = 1.0

#: (route, tier) -> [decisions, denials], and route -> shed requests.
Decisions = dict[tuple[str, str], list[int]]
Shed = dict[str, int]


def counts(snapshot: dict[str, Any]) -> tuple[Decisions, Shed]:
    """The decisions and denials by (route, tier), every source summed, and the shed
    requests by route, out of a `quota.Metrics.snapshot`."""
    decisions: Decisions = {}
    for row in snapshot["decisions"]:
        pair = decisions.setdefault((row["route"], row["tier"]), [0, 0])
        pair[0] += row["count"]
        if row["outcome"] == "denied":
            pair[1] += row["count"]
    return decisions, dict(snapshot["shed"])


def _per_second(now: int, before: int | None, seconds: float | None) -> float | None:
    if seconds is None or before is None:
        return None
    # Counters only grow; a smaller number would be another Metrics: count from zero.
    delta = now - before if now >= before else now
    return delta / seconds


def rates(
    current: tuple[Decisions, Shed],
    previous: tuple[Decisions, Shed] | None,
    seconds: float | None,
) -> dict[str, Any]:
    """The ``rates`` of ``/api/overview``: counts since the Metrics began, and per-second
    figures over the `seconds` since `previous` (None on the first poll: no interval yet).

    A label set `previous` lacks was first counted since then, so it counts from zero.
    """
    decisions, shed = current
    before_decisions, before_shed = previous if previous is not None else ({}, {})
    interval = seconds if previous is not None else None
    rows = []
    for (route, tier), (total, denied) in sorted(decisions.items()):
        before = before_decisions.get((route, tier), [0, 0])
        rows.append(
            {
                "route": route,
                "tier": tier,
                "decisions": total,
                "denials": denied,
                "decisions_per_s": _per_second(total, before[0], interval),
                "denials_per_s": _per_second(denied, before[1], interval),
            }
        )
    shed_rows = [
        {
            "route": route,
            "shed": count,
            "shed_per_s": _per_second(count, before_shed.get(route, 0), interval),
        }
        for route, count in sorted(shed.items())
    ]
    return {"interval": interval, "decisions": rows, "shed": shed_rows}


@dataclass
class RateTracker:
    """One dashboard's view of a `quota.Metrics` between polls of ``/api/overview``."""

    metrics: quota.Metrics
    #: Monotonic seconds; tests swap it for a fake clock.
    clock: Callable[[], float] = time.monotonic
    _previous: tuple[Decisions, Shed] | None = field(default=None, init=False)
    _at: float = field(default=0.0, init=False)
    _last: dict[str, Any] | None = field(default=None, init=False)

    def poll(self) -> dict[str, Any]:
        """The rates since the previous poll (see `rates`); this poll becomes the previous one.

        A poll less than `MIN_INTERVAL` after the previous one returns that one's figures.
        """
        now = self.clock()
        if self._last is not None and now - self._at < MIN_INTERVAL:
            return self._last
        current = counts(self.metrics.snapshot())
        result = rates(current, self._previous, now - self._at)
        self._previous, self._at, self._last = current, now, result
        return result
