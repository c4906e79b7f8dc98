"""The algorithms beyond the fixed window, as pure state transitions.

Each algorithm is one function from (stored state, now, parameters) to (new
state, allowed). The memory store runs these functions as they are; the SQL
statements in `quota._sql.statements` (`quota._sql.hits` picks one per algorithm) and the
Redis Lua scripts spell out the very same
arithmetic, operation for operation in IEEE doubles, so every store reaches
the same decision from the same trace (a property test holds them to it).
The functions that turn returned state into a `Decision` live here too, so
every store shares them.

State per key (the columns of ``quota_state``):

=================  ======================  ===============  ==================
algorithm          value                   prev_value       stamp
=================  ======================  ===============  ==================
sliding_window     hits in current window  hits in previous start of current
token_bucket       tokens left             (unused, 0)      time of last update
gcra               theoretical arrival     (unused, 0)      (unused, 0)
=================  ======================  ===============  ==================

None of them charges a denied hit: a token bucket's denial leaves the bucket
as the refill made it (no double penalty), a sliding window's leaves the
counts alone, and GCRA's leaves the arrival time alone.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from quota._core.decision import (
    MAX_LIMIT,
    MAX_WINDOW,
    Decision,
    _decision,
    check_int,
    check_seconds,
    decide,
)
from quota._core.errors import ConfigurationError

FIXED_WINDOW = "fixed_window"
SLIDING_WINDOW = "sliding_window"
TOKEN_BUCKET = "token_bucket"
GCRA = "gcra"
ALGORITHMS = (FIXED_WINDOW, SLIDING_WINDOW, TOKEN_BUCKET, GCRA)
"""Every algorithm name ``algorithm=`` takes, the default first."""

#: Short prefixes of the state rows' bucket keys, one per algorithm.
PREFIX = {SLIDING_WINDOW: "sw", TOKEN_BUCKET: "tb", GCRA: "gcra"}

# Floats that should be whole numbers (a remaining count computed through a
# division) are floored after adding this, so 8.999999999 counts as 9.
_EPS = 1e-9


def check_algorithm(algorithm: object) -> str:
    """Return `algorithm` if known; raise `ConfigurationError` listing the known ones."""
    if algorithm not in ALGORITHMS:
        raise ConfigurationError(
            f"algorithm must be one of {', '.join(ALGORITHMS)}; got {algorithm!r}"
        )
    return str(algorithm)


@dataclass(frozen=True, kw_only=True)
class Rate:
    """A limit a person can write down: `limit` hits per `window` seconds.

    `burst` is the capacity of a token bucket or the burst of GCRA (default:
    `limit`); it refills at `refill_per_second` (default ``limit / window``).
    Fixed and sliding windows ignore both. `quota.parse_rates` builds these
    from strings like ``"100/minute;1000/day"`` or ``"100/s burst 200"``.
    """

    limit: int
    """Hits allowed per window."""
    window: int
    """Window length in seconds (also taken as a duration like ``"30m"`` or a
    `datetime.timedelta`, kept as seconds)."""
    algorithm: str = FIXED_WINDOW
    """One of ``fixed_window``, ``sliding_window``, ``token_bucket``, ``gcra``."""
    burst: int | None = None
    """Token bucket capacity / GCRA burst; None means `limit`."""
    refill_per_second: float | None = None
    """Token bucket refill rate; None means ``limit / window``."""

    def __post_init__(self) -> None:
        check_int("limit", self.limit, maximum=MAX_LIMIT)
        if type(self.window) is not int:
            window = check_seconds("window", self.window, maximum=MAX_WINDOW)
            object.__setattr__(self, "window", window)
        check_int("window", self.window, maximum=MAX_WINDOW)
        check_algorithm(self.algorithm)
        if self.burst is not None:
            check_int("burst", self.burst, maximum=MAX_LIMIT)
        if self.refill_per_second is not None and (
            isinstance(self.refill_per_second, bool)
            or not isinstance(self.refill_per_second, (int, float))
            or not 0 < self.refill_per_second < math.inf
        ):
            raise ConfigurationError(
                f"refill_per_second must be a positive number, got {self.refill_per_second!r}"
            )

    # Derived values are cached on the (frozen) instance: a decision reads them
    # on every call, and `quota._limiter` keeps one `Rate` per distinct call.

    @functools.cached_property
    def capacity(self) -> int:
        """The most hits that can pass at once."""
        if self.algorithm in (TOKEN_BUCKET, GCRA) and self.burst is not None:
            return self.burst
        return self.limit

    @functools.cached_property
    def rate(self) -> float:
        """Tokens (hits) regained per second."""
        return float(self.refill_per_second or self.limit / self.window)

    @functools.cached_property
    def _state_prefix(self) -> str:
        """The start of this rate's state keys (see `state_key`)."""
        return state_key(self.algorithm, self.window, "") if self.algorithm in PREFIX else ""

    @functools.cached_property
    def _float_limit(self) -> float:
        return float(self.limit)

    @functools.cached_property
    def _gcra(self) -> tuple[float, float]:
        """GCRA's emission interval, and its tolerance (see `gcra_params`)."""
        interval = self.window / self.limit
        return interval, self.capacity * interval + (self.capacity + 1) * GCRA_SLACK

    def check_cost(self, cost: object) -> int:
        """`cost` if this rate can ever allow it; `ConfigurationError` otherwise."""
        if type(cost) is not int or cost < 1:
            raise ConfigurationError(f"cost must be a positive integer, got {cost!r}")
        if cost > self.capacity:
            raise ConfigurationError(
                f"cost {cost} can never pass: it exceeds the {self.algorithm} capacity"
                f" of {self.capacity}; raise the limit (or burst) or lower the cost"
            )
        return cost

    def __str__(self) -> str:
        text = f"{self.limit}/{self.window}s"
        if self.burst is not None:
            text += f" burst {self.burst}"
        return text if self.algorithm == FIXED_WINDOW else f"{text} ({self.algorithm})"


# -- state transitions (the memory store runs these; SQL and Lua mirror them) --

SlidingState = tuple[
    float, float, float
]  # (value=current, prev_value=previous, stamp=window start)
BucketState = tuple[float, float]  # (tokens, stamp)


def window_start(now: float, window: int) -> float:
    second = int(now)
    return float(second - second % window)


def sliding_weight(now: float, ws: float, window: int) -> float:
    """How much of the previous window still counts: 1 at the window's start, 0 at its end."""
    return (window - (now - ws)) / window


def sliding_step(
    state: SlidingState | None, now: float, window: int, limit: int, cost: int
) -> tuple[SlidingState, bool]:
    """The sliding window's counts after a hit of `cost` at `now`, and whether it passed.

    A late call, one whose window is older than the row's (its clock lags the
    clock of a call that came first, or its statement waited behind one), is
    decided as of the start of the row's window: counted in that window, with
    the previous window weighing in full (weight 1, the most an on-time call
    ever gives it). So, for every window, the hits admitted whose clock reads
    a time in it never cost more than `limit`, in whatever order they arrive,
    as long as no call's clock lags the newest one the key has seen by more
    than one window (a call later still is taken as current all the same).
    """
    ws = window_start(now, window)
    if state is None:
        return (float(cost), 0.0, ws), True
    value, prev_value, stamp = state
    # A row of our window or a newer one is taken as current; one exactly a
    # window old becomes the previous one.
    current = value if stamp >= ws else 0.0
    previous = prev_value if stamp >= ws else (value if stamp == ws - window else 0.0)
    weight = 1.0 if stamp > ws else sliding_weight(now, ws, window)
    allowed = previous * weight + current + cost <= limit
    return (current + cost if allowed else current, previous, max(stamp, ws)), allowed


def bucket_step(
    state: BucketState | None, now: float, capacity: float, rate: float, cost: int
) -> tuple[BucketState, bool]:
    if state is None:
        return (capacity - cost, now), True
    tokens, stamp = state
    refill = min(capacity, tokens + max(0.0, now - stamp) * rate)
    allowed = refill >= cost
    return (refill - cost if allowed else refill, max(stamp, now)), allowed


def gcra_step(
    tat: float | None, now: float, increment: float, tolerance: float
) -> tuple[float, bool]:
    if tat is None:
        return now + increment, True
    arrival = max(tat, now) + increment
    # Not `arrival - now`: adding `now` and taking it away again rounds (its ulp is
    # ~2e-7 s), which denied a key idle since long when its cost equals its burst,
    # unlike no row at all. tat - now is exact (Sterbenz), and small sums stay so.
    allowed = max(tat - now, 0.0) + increment <= tolerance
    return (arrival if allowed else tat), allowed


#: Slack per hit of a burst, in seconds. GCRA keeps an absolute arrival time
#: in a double; each allowed hit adds the interval with a rounding of up to
#: half an ulp (about 1.2e-7 s at today's epoch), so a burst of n hits at one
#: instant can land n half-ulps past n intervals and lose its last hit. A
#: microsecond a hit absorbs that, and lets nothing measurable through early.
GCRA_SLACK = 1e-6


def gcra_params(rate: Rate, cost: int) -> tuple[float, float]:
    """GCRA's (increment, tolerance): cost * emission interval, and burst * interval (plus slack)."""
    interval, tolerance = rate._gcra
    return cost * interval, tolerance


# -- decisions from returned state --------------------------------------------------


def _retry(seconds: float) -> int:
    return max(1, math.ceil(seconds))


def sliding_decision(
    key: str, rate: Rate, cost: int, now: float, state: SlidingState, allowed: bool
) -> Decision:
    value, prev_value, stamp = state
    limit, window = rate.limit, rate.window
    # window_start and sliding_weight, inlined: this runs once per decision.
    second = int(now)
    start = second - second % window
    ws = float(start)
    weight = (window - (now - ws)) / window
    if stamp >= ws:
        current, previous = value, prev_value
        if stamp > ws:
            # A late call (see sliding_step): estimated at the start of the row's
            # window, the previous one in full; its wait is still from its own clock.
            weight, ws, start = 1.0, stamp, int(stamp)
    else:
        current, previous = 0.0, (value if stamp == ws - window else 0.0)
    estimate = previous * weight + current if previous else current
    remaining = math.floor(limit - estimate + _EPS)
    if remaining < 0:
        remaining = 0
    elif remaining > limit:
        remaining = limit
    if allowed:
        return _decision(
            True, key, limit, remaining, math.ceil(estimate - _EPS), window, start + window, 0
        )
    if current + cost <= limit and previous > 0:
        # Passes later in this window, once enough of the previous one fades.
        wait = ws + window * (1 - (limit - current - cost) / previous) - now
    else:
        # Only in the next window, once enough of this one fades.
        wait = ws + window + window * (1 - (limit - cost) / current) - now
    count = math.ceil(estimate - _EPS)
    return _decision(
        False, key, limit, remaining, count, window, start + window, _retry(wait), max(wait, 0.0)
    )


def bucket_decision(
    key: str, rate: Rate, cost: int, now: float, tokens: float, allowed: bool
) -> Decision:
    capacity, per_second = rate.capacity, rate.rate
    remaining = math.floor(tokens + _EPS)
    if remaining < 0:
        remaining = 0
    reset_at = math.ceil(now + (capacity - tokens) / per_second - _EPS)
    if allowed:
        return _decision(
            True, key, capacity, remaining, capacity - remaining, rate.window, reset_at, 0
        )
    wait = max((cost - tokens) / per_second, 0.0)
    return _decision(
        False, key, capacity, remaining, capacity - remaining, rate.window, reset_at,
        _retry(wait), wait,
    )  # fmt: skip


def gcra_decision(
    key: str, rate: Rate, cost: int, now: float, tat: float, allowed: bool
) -> Decision:
    increment, tolerance = gcra_params(rate, cost)
    interval = increment / cost
    capacity = rate.capacity
    remaining = math.floor((tolerance - (tat - now)) / interval + _EPS)
    if remaining < 0:
        remaining = 0
    elif remaining > capacity:
        remaining = capacity
    later = tat if tat > now else now
    reset_at = math.ceil(later - _EPS)
    if allowed:
        return _decision(
            True, key, capacity, remaining, capacity - remaining, rate.window, reset_at, 0
        )
    wait = max(later + increment - tolerance - now, 0.0)
    return _decision(
        False, key, capacity, remaining, capacity - remaining, rate.window, reset_at,
        _retry(wait), wait,
    )  # fmt: skip


# -- one call, end to end: the decision from the rows of its statement (`quota._sql.hits`) --


def state_key(algorithm: str, window: int, stored_key: str) -> str:
    """Primary key of a ``quota_state`` row.

    Capacity and refill are not part of it, so a bucket keeps its state when
    its capacity changes (adaptive capacity, a policy edit).
    """
    return f"{PREFIX[algorithm]}:{window}:{stored_key}"


def pause_key(stored_key: str) -> str:
    """Primary key of a key's pause in ``quota_state`` (`quota._sql.statements.PAUSE_SET`)."""
    return f"pause:0:{stored_key}"


#: State rows expire on the hour (see `expiry`).
EXPIRY_GRANULARITY = 3600


def expiry(now: float, horizon: float) -> float:
    """When a state row touched at `now` is surely the same as no row: rounded up to the hour.

    `horizon` bounds how long any algorithm's state matters after a hit: two
    windows for the sliding window, a full refill for the token bucket, the
    tolerance for GCRA. Rounding up keeps the stored value (and its index
    entry) unchanged for an hour of updates.
    """
    end = int(now + horizon)
    return float((end // EXPIRY_GRANULARITY + 1) * EXPIRY_GRANULARITY)


def open_decision(key: str, rate: Rate, cost: int, now: float) -> Decision:
    """Fail open: allow, when neither the store nor the memory fallback could decide."""
    start = int(window_start(now, rate.window))
    remaining = max(0, rate.capacity - cost)
    return _decision(True, key, rate.capacity, remaining, cost, rate.window, start + rate.window, 0)


def closed_decision(key: str, rate: Rate, now: float, retry_after: int) -> Decision:
    """Fail closed: deny while the store is down (a login limit must not open up in an outage)."""
    start = int(window_start(now, rate.window))
    reset_at = start + rate.window
    return _decision(
        False, key, rate.capacity, 0, rate.capacity, rate.window, reset_at, retry_after,
        float(retry_after),
    )  # fmt: skip


def decide_rows(
    key: str, rate: Rate, cost: int, now: float, rows: Sequence[Sequence[Any]]
) -> Decision:
    """The decision from the rows `quota._sql.hits.statement` returned.

    The time the statement used comes back with its rows when the caller
    cannot know it (the database's, with ``clock="database"``; memory and
    Redis always send it); otherwise, and for a capped fixed window that
    denied and so returned no row, `now`, the app's time, is used.
    """
    algorithm = rate.algorithm
    row: Sequence[Any] = rows[0] if rows else ()
    # SQL stores on the app clock leave the time out of the row (`_sql.RETURN_NOW`).
    if algorithm == SLIDING_WINDOW:
        # Every store returns these columns as floats (and `allowed` as 0/1) already.
        when = row[4] if len(row) > 4 else now
        return sliding_decision(key, rate, cost, when, (row[0], row[1], row[2]), row[3])
    if algorithm == TOKEN_BUCKET:
        when = row[2] if len(row) > 2 else now
        return bucket_decision(key, rate, cost, when, float(row[0]), bool(row[1]))
    if algorithm == GCRA:
        when = row[2] if len(row) > 2 else now
        return gcra_decision(key, rate, cost, when, float(row[0]), bool(row[1]))
    if len(row) <= 1:  # the positional statement, or a capped denial (no row)
        start = int(window_start(now, rate.window))
        return decide(key, rate.limit, rate.window, start, now, row[0] if row else None)
    count, start, now = row
    return decide(key, rate.limit, rate.window, int(start), float(now), int(count))
