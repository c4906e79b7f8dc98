"""Signals the HTTP layer reports besides the counts: lane, per-key velocity, predicted pressure.

``X-RateLimit-Lane`` names the tier a request was decided in (`lane_header`).
`Velocity` keeps each key's request rate as a time-decayed moving average,
for observability only: it never changes a decision. `PredictivePressure`
is a pressure source (like `quota.http.SystemPressure`) that reports the
pressure expected a few seconds ahead, so adaptive capacity is lowered
before the system saturates and raised again as soon as the trend falls.
"""

from __future__ import annotations

import bisect
import heapq
import math
import re
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable

from quota._core.errors import ConfigurationError
from quota._wrappers.metrics import VELOCITY_BUCKETS
from quota.http._capacity import _system_sample

_LN2 = math.log(2)
_exp = math.exp

#: Header styles that carry ``X-RateLimit-Lane`` (it goes with the legacy headers).
LANE_STYLES = frozenset({"both", "legacy"})
#: An HTTP token (RFC 9110), at most 64 characters: a tier a header value can carry as is.
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]{1,64}")
_LANE_CACHE = 1024


def lane_header(
    tier: str, cache: dict[str, tuple[str, str] | tuple[()]]
) -> tuple[str, str] | tuple[()]:
    """``("X-RateLimit-Lane", tier)``, or ``()`` for a tier that is not an HTTP token.

    A tier an ``identify`` hook names may be any string; one with spaces,
    control or non-ASCII characters (or over 64 characters) gets no header
    rather than a malformed one. Empties `cache` (tier -> header) when full.
    """
    if len(cache) >= _LANE_CACHE:
        cache.clear()
    return ("X-RateLimit-Lane", tier) if _TOKEN.fullmatch(tier) else ()


_VELOCITY_LE = (*(repr(float(bound)) for bound in VELOCITY_BUCKETS), "+Inf")


def velocity_le(rate: float) -> str:
    """The ``le`` bound of the velocity bucket `rate` falls in (as Prometheus writes it)."""
    return _VELOCITY_LE[bisect.bisect_left(VELOCITY_BUCKETS, rate)]


def _positive(name: str, value: object, *, maximum: float) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not 0 < value <= maximum  # NaN fails this too
    ):
        raise ConfigurationError(
            f"{name} must be a number above 0 and at most {maximum:g}, got {value!r}"
        )
    return float(value)


def _count(name: str, value: object, *, minimum: int, maximum: int) -> int:
    if type(value) is not int or not minimum <= value <= maximum:
        raise ConfigurationError(
            f"{name} must be a whole number {minimum}..{maximum}, got {value!r}"
        )
    return value


class Velocity:
    """Each key's request rate (requests per second), an exponentially decayed average.

    Every `hit` adds one to the key's score after decaying it by the time
    since its last hit (halving every `half_life` seconds); the rate is the
    score divided by the mean lifetime ``half_life / ln 2``. A key hit
    steadily ``r`` times a second converges on ``r`` within a few half-lives,
    and a key that stops decays towards zero. O(1) per hit, thread-safe, and
    bounded: at most `max_keys` keys are kept, the one hit least recently
    dropped first. Pass hashed keys (the HTTP layer passes its counted keys,
    whose subjects are keyed hashes).
    """

    def __init__(
        self, *, half_life: float = 10.0, max_keys: int = 10_000,
        clock: Callable[[], float] = time.time,
    ) -> None:  # fmt: skip
        self.half_life = _positive("half_life", half_life, maximum=86400.0)
        self.max_keys = _count("max_keys", max_keys, minimum=1, maximum=10_000_000)
        if not callable(clock):
            raise ConfigurationError(f"clock must be a callable returning seconds, got {clock!r}")
        self.clock = clock
        self._decay = -_LN2 / self.half_life  # exponent per second
        self._per_score = _LN2 / self.half_life  # 1 / mean lifetime
        self._keys: OrderedDict[str, list[float]] = OrderedDict()  # key -> [score, at]
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """How many keys are tracked (at most `max_keys`)."""
        return len(self._keys)

    def hit(self, key: str, now: float | None = None) -> float:
        """Count one request of `key` at `now` (default: the clock); its rate after it."""
        if now is None:
            now = self.clock()
        keys = self._keys
        lock = self._lock
        lock.acquire()  # (cheaper than `with` on the per-request path)
        try:
            entry = keys.get(key)
            if entry is None:
                keys[key] = [1.0, now]
                if len(keys) > self.max_keys:
                    keys.popitem(last=False)
                return self._per_score
            keys.move_to_end(key)
            elapsed = now - entry[1]
            if elapsed > 0:  # a clock stepping back decays nothing
                score = entry[0] * _exp(self._decay * elapsed) + 1.0
                entry[1] = now
            else:
                score = entry[0] + 1.0
            entry[0] = score
        finally:
            lock.release()
        return score * self._per_score

    def rate(self, key: str, now: float | None = None) -> float:
        """`key`'s rate at `now` (default: the clock), decayed since its last hit; 0 if unknown."""
        if now is None:
            now = self.clock()
        with self._lock:
            entry = self._keys.get(key)
            if entry is None:
                return 0.0
            score, at = entry
        return self._at(score, at, now)

    def top(self, n: int = 10, now: float | None = None) -> list[tuple[str, float]]:
        """The `n` fastest keys as ``(key, requests per second)``, fastest first, as of `now`."""
        if now is None:
            now = self.clock()
        with self._lock:
            entries = [(key, entry[0], entry[1]) for key, entry in self._keys.items()]
        rates = ((key, self._at(score, at, now)) for key, score, at in entries)
        return heapq.nlargest(n, rates, key=lambda pair: pair[1])

    def clear(self) -> None:
        """Forget every key."""
        with self._lock:
            self._keys.clear()

    def _at(self, score: float, at: float, now: float) -> float:
        elapsed = now - at
        if elapsed > 0:
            score *= math.exp(self._decay * elapsed)
        return score * self._per_score


#: Samples the trend needs before it is trusted; fewer report the moving average alone.
MIN_TREND_SAMPLES = 5


class PredictivePressure:
    """System pressure (0..1) predicted `horizon` seconds ahead; a drop-in `pressure=` source.

    Every `interval` seconds it takes one reading (by default max(CPU load
    per core, memory in use), as `quota.http.SystemPressure` does), keeps
    the last `samples` of them, and reports:

        EWMA of the readings + least-squares slope of the last `samples` x horizon

    clamped to 0..1. On a flat series the slope is zero and this is the
    moving average `SystemPressure` reports; on a rising one it crosses the
    adaptive threshold before the load does, and on a falling one it drops
    below it early, giving capacity back as soon as the trend turns. With
    `horizon` 0, or until `MIN_TREND_SAMPLES` readings are in, it is the
    moving average alone. Between readings a call costs a clock read.

    Inject `sample` (a raw 0..1 reading) and `clock` (seconds) to drive it
    in tests. Thread-safe: one caller takes a due reading, the others get
    the last value meanwhile. Raises `ConfigurationError` for a bad setting.
    """

    def __init__(
        self, *, horizon: float = 10.0, interval: float = 1.0, samples: int = 30,
        alpha: float = 0.3, clock: Callable[[], float] = time.monotonic,
        sample: Callable[[], float] | None = None,
    ) -> None:  # fmt: skip
        if (
            isinstance(horizon, bool)
            or not isinstance(horizon, (int, float))
            or not 0 <= horizon <= 3600
        ):
            raise ConfigurationError(f"horizon must be 0..3600 seconds, got {horizon!r}")
        self.horizon = float(horizon)
        self.interval = _positive("interval", interval, maximum=3600.0)
        self.samples = _count("samples", samples, minimum=2, maximum=10_000)
        self.alpha = _positive("alpha", alpha, maximum=1.0)
        if not callable(clock):
            raise ConfigurationError(f"clock must be a callable returning seconds, got {clock!r}")
        if sample is not None and not callable(sample):
            raise ConfigurationError(f"sample must be a callable returning 0..1, got {sample!r}")
        self._clock = clock
        self._sample = sample or _system_sample
        self._points: deque[tuple[float, float]] = deque(maxlen=self.samples)
        self._ewma: float | None = None
        self._slope = 0.0
        self._value = 0.0
        self._at = -math.inf
        self._lock = threading.Lock()

    @property
    def ewma(self) -> float:
        """The moving average of the readings so far (what `SystemPressure` would report)."""
        return self._ewma or 0.0

    @property
    def slope(self) -> float:
        """The trend: pressure gained per second over the last `samples` readings."""
        return self._slope

    def __call__(self) -> float:
        now = self._clock()
        if now - self._at < self.interval or not self._lock.acquire(blocking=False):
            return self._value
        try:
            if now - self._at >= self.interval:
                self._at = now
                self._take(now, min(1.0, max(0.0, float(self._sample()))))
        finally:
            self._lock.release()
        return self._value

    def _take(self, now: float, reading: float) -> None:
        ewma = self._ewma
        ewma = reading if ewma is None else self.alpha * reading + (1 - self.alpha) * ewma
        self._ewma = ewma
        points = self._points
        points.append((now, reading))
        self._slope = _slope(points) if len(points) >= min(MIN_TREND_SAMPLES, self.samples) else 0.0
        self._value = min(1.0, max(0.0, ewma + self._slope * self.horizon))


def _slope(points: deque[tuple[float, float]]) -> float:
    """The least-squares slope of `points` (time, value); 0 when the times do not spread."""
    n = len(points)
    mean_t = sum(t for t, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    sxx = sum((t - mean_t) ** 2 for t, _ in points)
    if not sxx > 0:
        return 0.0
    return sum((t - mean_t) * (y - mean_y) for t, y in points) / sxx


__all__ = [
    "LANE_STYLES",
    "MIN_TREND_SAMPLES",
    "PredictivePressure",
    "Velocity",
    "lane_header",
    "velocity_le",
]
