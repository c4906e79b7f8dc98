"""The overview's decision and shedding rates: per-second figures from two `quota.Metrics` snapshots.

Pure arithmetic (`rates`, `totals`) plus the little state one dashboard keeps between
polls (`RateTracker`): the previous snapshot's counts, the monotonic time it was taken,
and a bounded history of the totals per poll for the overview's plot.
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

#: The history the overview plots: samples older than this many seconds are dropped...
HISTORY_SECONDS = 600.0
#: ...and never more than this many are kept (polls are at least `MIN_INTERVAL` apart,
#: but a tab polls every 5 s: 10 minutes of one tab is 120).
HISTORY_SAMPLES = 300

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


def totals(result: dict[str, Any]) -> tuple[float, float] | None:
    """Decisions and denials per second summed over every route and tier of a `rates`
    result (None when it has no interval yet)."""
    if result["interval"] is None:
        return None
    rows = result["decisions"]
    return (
        sum(row["decisions_per_s"] for row in rows),
        sum(row["denials_per_s"] for row in rows),
    )


@dataclass
class RateTracker:
    """One dashboard's view of a `quota.Metrics` between polls of ``/api/overview``."""

    metrics: quota.Metrics
    #: Monotonic seconds; tests swap it for a fake clock.
    clock: Callable[[], float] = time.monotonic
    #: The history's bounds: its age in seconds and its length (see `HISTORY_SECONDS`).
    history_seconds: float = HISTORY_SECONDS
    history_samples: int = HISTORY_SAMPLES
    #: (monotonic time, decisions/s, denials/s) per poll with an interval, oldest first.
    _samples: list[tuple[float, float, float]] = field(default_factory=list, init=False)
    _previous: tuple[Decisions, Shed] | None = field(default=None, init=False)
    _at: float = field(default=0.0, init=False)
    _last: dict[str, Any] | None = field(default=None, init=False)

    def poll(self) -> dict[str, Any]:
        """The rates since the previous poll (see `rates`) and their ``history``; this poll
        becomes the previous one.

        A poll less than `MIN_INTERVAL` after the previous one returns that one's figures.
        """
        now = self.clock()
        if self._last is not None and now - self._at < MIN_INTERVAL:
            return self._last
        current = counts(self.metrics.snapshot())
        result = rates(current, self._previous, now - self._at)
        summed = totals(result)
        if summed is not None:
            self._samples.append((now, *summed))
        # Drop by age, then by count: a dashboard nobody looked at for an hour starts afresh.
        kept = [s for s in self._samples if now - s[0] <= self.history_seconds]
        self._samples = kept[-self.history_samples :] if self.history_samples > 0 else []
        result["history"] = self.history(now)
        self._previous, self._at, self._last = current, now, result
        return result

    def history(self, now: float | None = None) -> list[dict[str, float]]:
        """The totals per poll, oldest first: ``t`` is the seconds before `now` (default:
        the last poll, whose sample has ``t`` 0) that the sample was taken."""
        at = self._at if now is None else now
        return [
            {"t": at - when, "decisions_per_s": decided, "denials_per_s": denied}
            for when, decided, denied in self._samples
        ]
