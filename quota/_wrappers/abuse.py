"""Abuse alerts: a callback and one log line when a key keeps getting denied.

Feed `AbuseDetector.record_denial` (or `AbuseDetector.observe`) every denied
decision. When one key is denied more than `threshold` times within
`window` seconds, the detector logs one WARNING on the ``quota`` logger and
calls the callback once; further denials of that key raise nothing more
until `interval` seconds have passed, so a flood costs one alert per key per
interval, not thousands.

The count in a window is estimated the way the sliding-window algorithm
estimates it: exact while all denials fall in one window (aligned to the
epoch), weighted by overlap across the boundary. That keeps the state to a
few numbers per key whatever the threshold; at most `max_keys` keys are
tracked, and the one denied least recently is dropped first.

Keys appear in log lines and callbacks exactly as passed: pass a hashed key
when the raw one is personal data.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

from quota._core.decision import MAX_WINDOW, Decision, Duration, check_int, check_seconds
from quota._core.errors import ConfigurationError

if TYPE_CHECKING:
    from quota._wrappers.metrics import Metrics

log = logging.getLogger("quota")

Clock = Callable[[], float]
AlertCallback = Callable[[str, int], None]


class _KeyState:
    __slots__ = ("current", "last_alert", "previous", "start")

    def __init__(self, start: float) -> None:
        self.start = start
        self.current = 0
        self.previous = 0
        self.last_alert: float | None = None


class AbuseDetector:
    """Alert once per key per `interval` when the key is denied over `threshold` times in `window`.

    `callback(key, count)` gets the caller's key and the estimated denials
    in the window; its exceptions are logged, never raised. `clock` returns
    epoch seconds (inject one in tests). `metrics` counts each alert.
    `threshold` can be changed while in use (``detector.threshold = 50``).
    Thread-safe. Raises `ConfigurationError` naming the field for a bad value.
    """

    def __init__(
        self,
        threshold: int,
        window: Duration,
        interval: Duration,
        callback: AlertCallback | None = None,
        clock: Clock = time.time,
        metrics: Metrics | None = None,
        *,
        max_keys: int = 10_000,
    ) -> None:
        self._threshold = check_int("threshold", threshold, maximum=2**62)
        self.window = check_seconds("window", window, maximum=MAX_WINDOW)
        self.interval = check_seconds("interval", interval, maximum=MAX_WINDOW)
        self.max_keys = check_int("max_keys", max_keys, maximum=10_000_000)
        if callback is not None and not callable(callback):
            raise ConfigurationError(f"callback must be callable or None, got {callback!r}")
        if not callable(clock):
            raise ConfigurationError(
                f"clock must be a callable returning epoch seconds, got {clock!r}"
            )
        self.callback = callback
        self.clock = clock
        self.metrics = metrics
        self._lock = threading.Lock()
        self._keys: OrderedDict[str, _KeyState] = OrderedDict()

    @property
    def threshold(self) -> int:
        """Denials of one key within `window` above which it raises an alert.

        Settable while the detector is in use (from a settings table, say):
        the next denial of every key is judged against the new value; keys
        already alerted stay quiet until their `interval` ends. Raises
        `ConfigurationError` for anything but an integer in 1..2**62.
        """
        return self._threshold

    @threshold.setter
    def threshold(self, value: int) -> None:
        checked = check_int("threshold", value, maximum=2**62)
        with self._lock:
            self._threshold = checked

    @property
    def tracked_keys(self) -> int:
        """How many keys the detector holds state for (at most `max_keys`)."""
        return len(self._keys)

    def observe(self, decision: Decision) -> None:
        """`record_denial(decision.key)` when `decision` is a denial; nothing otherwise."""
        if not decision.allowed:
            self.record_denial(decision.key)

    def record_denial(self, key: str, now: float | None = None) -> None:
        """Note one denial of `key` at `now` (default: the clock's time); alert if it crossed the threshold and no alert is due yet."""
        if now is None:
            now = self.clock()
        window = self.window
        start = now - now % window
        with self._lock:
            state = self._keys.get(key)
            if state is None:
                state = self._keys[key] = _KeyState(start)
                if len(self._keys) > self.max_keys:
                    self._keys.popitem(last=False)
            else:
                self._keys.move_to_end(key)
                if start != state.start:
                    adjacent = start - state.start == window
                    state.previous = state.current if adjacent else 0
                    state.current = 0
                    state.start = start
            state.current += 1
            estimate = state.current + state.previous * (window - (now - start)) / window
            threshold = self._threshold
            if estimate <= threshold:
                return
            if state.last_alert is not None and now - state.last_alert < self.interval:
                return
            state.last_alert = now
        self._alert(key, math.ceil(estimate), threshold)

    def _alert(self, key: str, count: int, threshold: int) -> None:
        log.warning(
            "quota: abuse alert: key %r denied %d times within %ds (threshold %d);"
            " no further alert for this key for %ds",
            key,
            count,
            self.window,
            threshold,
            self.interval,
        )
        if self.metrics is not None:
            try:
                self.metrics.record_abuse_alert(key)
            except Exception:
                log.exception("quota: counting an abuse alert failed")
        if self.callback is not None:
            try:
                self.callback(key, count)
            except Exception:
                log.exception("quota: the abuse alert callback failed for key %r", key)
