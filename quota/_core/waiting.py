"""Waiting for a slot: the arithmetic of `Limiter.acquire`, pure and shared by whatever waits.

A waiter never polls. Each denial says exactly when the same hit could pass
(`Decision.retry_after_exact`: the window's reset, the bucket's refill); the
waiter sleeps until then plus a little jitter, and tries once more. So a wait
makes one store call per slot opening it competes for, and none while the
slot is surely closed.

The jitter keeps many waiters from waking at one instant. It shrinks with
each attempt a waiter has lost (``spread / attempt``), so a waiter that has
waited longest wakes closest to the slot's opening and tends to win it: a
newcomer cannot keep overtaking it (bounded unfairness, not FIFO).

`check_timeout` validates a caller's timeout; `Deadline` turns it into a
point on the limiter's clock; `pause` says how long to sleep before the next
attempt, or that the timeout cannot be met and the waiter should give up now.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from quota._core.errors import ConfigurationError

#: The most jitter a wait gets, in seconds.
MAX_JITTER = 0.05
#: The jitter is at most this share of the time between two slots of the rate.
JITTER_SHARE = 0.25
#: The shortest sleep between two attempts, in seconds: a denial whose slot is
#: due already (the store's clock runs ahead of ours) is not retried in a spin.
MIN_PAUSE = 0.001
#: The longest timeout accepted, in seconds (a day).
MAX_TIMEOUT = 86_400.0


def check_timeout(timeout: object, name: str = "timeout") -> float:
    """`timeout` as seconds if it is a finite number in ``0..MAX_TIMEOUT``.

    0 means one attempt and no wait. Raises `ConfigurationError` naming
    `name` and the value.
    """
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, (int, float))
        or not 0 <= timeout <= MAX_TIMEOUT
    ):
        raise ConfigurationError(
            f"{name} must be seconds between 0 and {MAX_TIMEOUT:g}, got {timeout!r}"
        )
    return float(timeout)


def jitter_spread(seconds_per_slot: float) -> float:
    """The jitter for a rate that frees a slot every `seconds_per_slot` seconds.

    A quarter of that time, at most `MAX_JITTER`: spread enough to keep
    waiters from waking together, short enough that a slot is not left idle.
    """
    if not seconds_per_slot > 0 or math.isinf(seconds_per_slot):
        return MAX_JITTER
    return min(MAX_JITTER, JITTER_SHARE * seconds_per_slot)


@dataclass(frozen=True, slots=True)
class Deadline:
    """The moment a wait ends, on the clock that drives the wait."""

    at: float
    """Clock time (epoch seconds) past which no attempt is made."""

    @classmethod
    def after(cls, now: float, timeout: float) -> Deadline:
        """The deadline `timeout` seconds after `now`."""
        return cls(now + timeout)

    def left(self, now: float) -> float:
        """Seconds left at `now`; never negative."""
        return max(0.0, self.at - now)


def pause(wait: float, left: float, *, attempt: int, spread: float, draw: float) -> float | None:
    """Seconds to sleep before the next attempt, or None to give up at once.

    `wait` is how long until the slot opens (`Decision.retry_after_exact`),
    `left` how much of the timeout is left, `attempt` how many attempts the
    waiter has made so far (1 after the first), `spread` the jitter of the
    rate (`jitter_spread`) and `draw` a number in ``[0, 1)`` (``random()``).

    None when the slot opens after the deadline (or no time is left):
    sleeping could only end in a timeout, so the waiter raises now. Otherwise the sleep is the wait
    (at least `MIN_PAUSE`) plus ``spread * draw / attempt`` of jitter, cut
    to what is left, so a waiter never sleeps past its deadline.
    """
    if wait > left or left <= 0:
        return None
    jitter = spread * draw / max(1, attempt)
    return min(max(wait, MIN_PAUSE) + jitter, left)
