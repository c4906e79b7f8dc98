"""`quota.AbuseDetector`: one alert per key per interval, bounded memory, callbacks never raise."""

from __future__ import annotations

import logging
import threading

import pytest

import quota
from tests._support import Clock

THRESHOLD = 5
WINDOW = 60
INTERVAL = 300


class Alerts:
    """A callback that records what it was called with."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def __call__(self, key: str, count: int) -> None:
        self.calls.append((key, count))


def _detector(clock: Clock, alerts: Alerts, **kwargs: object) -> quota.AbuseDetector:
    # The test clock starts mid-window: 1234.25 s past a whole hour, 34.25 s into its minute.
    return quota.AbuseDetector(
        THRESHOLD,
        WINDOW,
        INTERVAL,
        alerts,
        clock=clock,
        **kwargs,  # type: ignore[arg-type]
    )


def _alert_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if r.name == "quota" and r.levelno == logging.WARNING and "abuse alert" in r.getMessage()
    ]


def test_more_than_threshold_denials_in_a_window_raise_one_alert(
    clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    alerts = Alerts()
    detector = _detector(clock, alerts)
    with caplog.at_level(logging.WARNING, logger="quota"):
        for _ in range(THRESHOLD):
            detector.record_denial("ip:203.0.113.7")
            clock.advance(1)
        assert alerts.calls == []
        detector.record_denial("ip:203.0.113.7")

    assert alerts.calls == [("ip:203.0.113.7", THRESHOLD + 1)]
    (line,) = _alert_lines(caplog)
    assert line.levelno == logging.WARNING
    assert "'ip:203.0.113.7'" in line.getMessage()
    assert f"denied {THRESHOLD + 1} times within {WINDOW}s" in line.getMessage()


def test_a_flood_gives_one_alert_per_key_per_interval(
    clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    alerts = Alerts()
    detector = _detector(clock, alerts)
    with caplog.at_level(logging.WARNING, logger="quota"):
        for _ in range(5000):
            detector.record_denial("flood")
        clock.advance(INTERVAL - 1)
        for _ in range(5000):
            detector.record_denial("flood")
        assert len(alerts.calls) == 1
        clock.advance(1)  # the interval has passed; still flooding
        for _ in range(THRESHOLD + 1):
            detector.record_denial("flood")

    assert [key for key, _ in alerts.calls] == ["flood", "flood"]
    assert len(_alert_lines(caplog)) == 2


def test_each_key_is_debounced_on_its_own(clock: Clock) -> None:
    alerts = Alerts()
    detector = _detector(clock, alerts)
    for _ in range(100):
        for key in ("a", "b", "c"):
            detector.record_denial(key)
    assert sorted(key for key, _ in alerts.calls) == ["a", "b", "c"]


def test_denials_spread_wider_than_the_window_never_alert(clock: Clock) -> None:
    alerts = Alerts()
    detector = _detector(clock, alerts)
    for _ in range(10 * THRESHOLD):
        detector.record_denial("slow")
        clock.advance(WINDOW / 2)  # two denials per window: far under the threshold
    assert alerts.calls == []


def test_the_previous_window_counts_across_the_boundary(clock: Clock) -> None:
    alerts = Alerts()
    detector = _detector(clock, alerts)
    clock.now = 1_750_003_200 + WINDOW - 1  # one second before a window ends
    for _ in range(THRESHOLD):
        detector.record_denial("edge")
    clock.advance(2)  # one second into the next window: the last 60 s saw 5 + 1
    detector.record_denial("edge")
    assert alerts.calls == [("edge", THRESHOLD + 1)]


def test_memory_is_bounded_and_the_least_recently_denied_key_goes_first(clock: Clock) -> None:
    alerts = Alerts()
    detector = _detector(clock, alerts, max_keys=100)
    for _ in range(THRESHOLD - 1):
        detector.record_denial("kept")
    for _ in range(THRESHOLD):
        detector.record_denial("old")
    for i in range(98):
        detector.record_denial(f"other:{i}")
    assert detector.tracked_keys == 100
    detector.record_denial("kept")  # at the threshold now, and the most recently denied key

    detector.record_denial("one-more")  # pushes out "old", the least recently denied

    assert detector.tracked_keys == 100
    detector.record_denial("old")  # forgotten: counts from scratch, no alert
    assert alerts.calls == []
    detector.record_denial("kept")  # remembered: over the threshold
    assert alerts.calls == [("kept", THRESHOLD + 1)]
    for i in range(10_000):
        detector.record_denial(f"flood:{i}")
    assert detector.tracked_keys == 100


def test_callback_errors_are_logged_and_never_raised(
    clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    calls = []

    def callback(key: str, count: int) -> None:
        calls.append(key)
        raise RuntimeError("pager down")

    detector = quota.AbuseDetector(1, WINDOW, INTERVAL, callback, clock=clock)
    with caplog.at_level(logging.WARNING, logger="quota"):
        for _ in range(50):
            detector.record_denial("k")

    assert calls == ["k"]  # debounced like any alert, so a failing pager is not hammered
    failures = [r for r in caplog.records if "callback failed" in r.getMessage()]
    assert len(failures) == 1
    assert failures[0].levelno == logging.ERROR
    assert failures[0].exc_info is not None
    assert len(_alert_lines(caplog)) == 1


def test_alerts_are_counted_in_metrics(clock: Clock) -> None:
    metrics = quota.Metrics()
    detector = quota.AbuseDetector(2, WINDOW, INTERVAL, clock=clock, metrics=metrics)
    for _ in range(10):
        detector.record_denial("h:abc")
    snap = metrics.snapshot()
    assert (snap["abuse_alerts"], snap["abuse_recent_keys"]) == (1, ["h:abc"])


def test_a_failing_metrics_sink_does_not_stop_the_callback(clock: Clock) -> None:
    class BrokenMetrics(quota.Metrics):
        def record_abuse_alert(self, key: str) -> None:
            raise RuntimeError("metrics down")

    alerts = Alerts()
    detector = quota.AbuseDetector(
        1, WINDOW, INTERVAL, alerts, clock=clock, metrics=BrokenMetrics()
    )
    detector.record_denial("k")
    detector.record_denial("k")
    assert alerts.calls == [("k", 2)]


def test_observe_feeds_denied_decisions_only(clock: Clock, tmp_path: object) -> None:
    alerts = Alerts()
    detector = quota.AbuseDetector(1, WINDOW, INTERVAL, alerts, clock=clock)

    def decision(allowed: bool) -> quota.Decision:
        return quota.Decision(
            allowed=allowed, key="user:7", limit=1, remaining=0, count=2, window=60,
            reset_at=0, retry_after=0 if allowed else 1,
        )  # fmt: skip

    for _ in range(5):
        detector.observe(decision(True))
    assert alerts.calls == []
    detector.observe(decision(False))
    detector.observe(decision(False))
    assert alerts.calls == [("user:7", 2)]


def test_concurrent_denials_of_one_key_alert_once(clock: Clock) -> None:
    alerts = Alerts()
    detector = quota.AbuseDetector(10, WINDOW, INTERVAL, alerts, clock=clock)
    start = threading.Barrier(8)

    def flood() -> None:
        start.wait()
        for _ in range(2000):
            detector.record_denial("shared")

    threads = [threading.Thread(target=flood) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(alerts.calls) == 1


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("threshold", {"threshold": 0}),
        ("window", {"window": -1}),
        ("interval", {"interval": 1.5}),
        ("max_keys", {"max_keys": 0}),
        ("callback", {"callback": "not callable"}),
        ("clock", {"clock": 12}),
    ],
)
def test_bad_settings_name_the_field(field: str, kwargs: dict[str, object]) -> None:
    settings: dict[str, object] = {"threshold": 5, "window": 60, "interval": 300, **kwargs}
    with pytest.raises(quota.ConfigurationError, match=field):
        quota.AbuseDetector(**settings)  # type: ignore[arg-type]
