"""The HTTP layer's signals: the lane header, per-key velocity, predicted pressure, abuse alerts.

Also the settings that change at run time: an abuse detector's threshold
and a guard's tier multipliers. The decision flow is driven by hand with
made-up decisions (no database) except where a test says it goes through
a real middleware; time comes from injected clocks, nothing sleeps.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import quota
from quota._core.decision import Decision
from quota.http import (
    EXPOSE_HEADERS,
    HttpConfig,
    Identity,
    PredictivePressure,
    RequestInfo,
    RoutePolicy,
    SystemPressure,
    Velocity,
    sign,
)
from quota.http._core import PASS, Guard, Verdict, drive_sync
from quota.http._planning import Hit
from quota.http._signals import MIN_TREND_SAMPLES, lane_header, velocity_le
from tests._http_support import HttpClient, make_client
from tests._support import Clock

SECRET = "signals-test-secret-0123456789"
HMAC_KEY = "signals-hmac-secret-0123456789"
NOW = 1_750_000_000.5
PEER = "198.51.100.7"


class Tick:
    """A clock the tests move by hand."""

    def __init__(self, now: float = NOW) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _config(**settings: Any) -> HttpConfig:
    base: dict[str, Any] = {
        "policies": [RoutePolicy(name="api", paths=["/api"], rates="10/minute")],
        "hash_secret": SECRET,
        "hmac_keys": {"k1": HMAC_KEY},
        "runtime_policies": False,
    }
    base.update(settings)
    return HttpConfig(**base)


def _guard(clock: Callable[[], float] | None = None, **settings: Any) -> Guard:
    hooks = {
        k: settings.pop(k)
        for k in ("identify", "observer", "on_abuse", "pressure")
        if k in settings
    }
    return Guard(_config(**settings), dialect="sqlite", clock=clock or Tick(), **hooks)


def _request(
    path: str = "/api", method: str = "GET", peer: str = PEER, **headers: str
) -> RequestInfo:
    return RequestInfo(
        method, path, path, {k.lower().replace("_", "-"): v for k, v in headers.items()}, peer
    )


def _decide(guard: Guard, request: RequestInfo, *, allowed: bool = True) -> Verdict:
    def hit(effect: Hit) -> Decision:
        limit = effect.rates[0].limit
        if allowed:
            return Decision(True, effect.key, limit, limit - 1, 1, 60, int(NOW) + 60, 0)
        return Decision(False, effect.key, limit, 0, limit, 60, int(NOW) + 60, 30)

    return drive_sync(guard.flow(request), hit, lambda: [])


def _headers(verdict: Verdict) -> list[tuple[str, str]]:
    if verdict.response is not None:
        return list(verdict.response.headers)
    return verdict.headers


def _lane(verdict: Verdict) -> str | None:
    return dict(_headers(verdict)).get("X-RateLimit-Lane")


# -- X-RateLimit-Lane ----------------------------------------------------------------------------


def test_the_lane_names_the_tier_each_request_was_decided_in() -> None:
    def identify(request: RequestInfo) -> Identity | None:
        role = request.headers.get("x-role")
        return Identity(role, "user:" + role) if role else None

    guard = _guard(identify=identify)

    assert _lane(_decide(guard, _request())) == "anon"
    assert _lane(_decide(guard, _request(authorization="Bearer t0k3n"))) == "auth"
    signed = {k.lower(): v for k, v in sign("k1", HMAC_KEY, "GET", "/api", NOW).items()}
    assert _lane(_decide(guard, _request(**signed))) == "trusted"
    assert _lane(_decide(guard, _request(x_role="staff"))) == "staff"
    assert _lane(_decide(guard, _request(x_role="admin"))) == "admin"


def test_the_lane_follows_the_legacy_headers_on_allowed_denied_and_shadow_answers() -> None:
    allowed = _decide(_guard(), _request())
    names = [name for name, _ in allowed.headers]
    assert names[:4] == [
        "X-RateLimit-Limit", "X-RateLimit-Remaining", "X-RateLimit-Reset", "X-RateLimit-Lane",
    ]  # fmt: skip

    denied = _decide(_guard(), _request(), allowed=False)
    assert denied.response is not None and denied.response.status == 429
    assert ("X-RateLimit-Lane", "anon") in denied.response.headers

    shadow = _decide(_guard(shadow=True), _request(), allowed=False)
    assert shadow.response is None and ("X-RateLimit-Lane", "anon") in shadow.headers


@pytest.mark.parametrize(
    ("style", "sent"), [("both", True), ("legacy", True), ("ietf", False), ("none", False)]
)
def test_the_lane_is_sent_with_the_legacy_styles_only(style: str, sent: bool) -> None:
    verdict = _decide(_guard(headers=style), _request(), allowed=False)
    assert (_lane(verdict) == "anon") is sent


def test_a_tier_no_header_can_carry_gets_no_lane_rather_than_a_broken_header() -> None:
    def identify(request: RequestInfo) -> Identity:
        return Identity(request.headers["x-tier"], "user:1")

    guard = _guard(identify=identify)
    for tier in ("gold tier", "bad\r\nX-Injected: 1", "ünïcode", "x" * 65):
        verdict = _decide(guard, _request(x_tier=tier))
        assert _lane(verdict) is None
        assert all("\r" not in v and "\n" not in v for _, v in verdict.headers)
    assert _lane(_decide(guard, _request(x_tier="gold"))) == "gold"


def test_the_lane_cache_stays_bounded() -> None:
    cache: dict[str, Any] = {}
    for i in range(3000):
        cache[f"t{i}"] = lane_header(f"t{i}", cache)
    assert len(cache) <= 1024


def test_the_lane_is_exposed_to_cross_origin_callers() -> None:
    assert "X-RateLimit-Lane" in EXPOSE_HEADERS
    origin = {"origin": "https://app.example"}
    allowed = _decide(_guard(), _request(**origin))
    assert allowed.expose
    denied = _decide(_guard(), _request(**origin), allowed=False)
    assert denied.response is not None
    exposed = dict(denied.response.headers)["Access-Control-Expose-Headers"]
    assert "X-RateLimit-Lane" in [name.strip() for name in exposed.split(",")]


# -- velocity ------------------------------------------------------------------------------------


def test_velocity_converges_on_a_steady_rate_and_halves_every_half_life() -> None:
    velocity = Velocity(half_life=10.0)
    now = NOW
    rate = 0.0
    for _ in range(5 * 60):  # 5 requests a second for a minute
        now += 0.2
        rate = velocity.hit("k", now)
    assert rate == pytest.approx(5.0, rel=0.05)
    assert velocity.rate("k", now + 10) == pytest.approx(rate / 2)
    assert velocity.rate("k", now + 20) == pytest.approx(rate / 4)
    assert velocity.rate("unknown", now) == 0.0
    # One request alone: one over the mean lifetime (half-life / ln 2).
    assert velocity.hit("new", now) == pytest.approx(math.log(2) / 10.0)


def test_velocity_keeps_the_most_recently_seen_keys_within_its_bound() -> None:
    velocity = Velocity(max_keys=3)
    for key in ("a", "b", "c"):
        velocity.hit(key, NOW)
    velocity.hit("a", NOW + 1)  # now the most recent
    velocity.hit("d", NOW + 2)  # evicts b, seen least recently
    assert len(velocity) == 3
    assert velocity.rate("b", NOW + 2) == 0.0
    assert velocity.rate("a", NOW + 2) > 0


def test_velocity_top_lists_the_fastest_keys_as_of_now() -> None:
    clock = Tick()
    velocity = Velocity(clock=clock)
    for i in range(20):
        velocity.hit("fast", NOW + i * 0.05)
    for i in range(5):
        velocity.hit("slow", NOW + i * 0.2)
    velocity.hit("once", NOW)
    clock.now = NOW + 1
    top = velocity.top(2)
    assert [key for key, _ in top] == ["fast", "slow"]
    assert top[0][1] == pytest.approx(velocity.rate("fast"))
    clock.now = NOW + 1000  # everything has decayed to almost nothing
    assert all(rate < 1e-9 for _, rate in velocity.top(3))


def test_velocity_loses_no_hit_under_threads() -> None:
    velocity = Velocity(half_life=10.0)
    start = threading.Barrier(8)

    def hammer() -> None:
        start.wait()
        for _ in range(2000):
            velocity.hit("shared", NOW)  # one instant: nothing decays, every hit adds one

    threads = [threading.Thread(target=hammer) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert velocity.rate("shared", NOW) == pytest.approx(16000 * math.log(2) / 10.0)


def test_a_clock_stepping_back_decays_nothing() -> None:
    velocity = Velocity()
    velocity.hit("k", NOW)
    assert velocity.hit("k", NOW - 5) == pytest.approx(2 * math.log(2) / 10.0)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"half_life": 0}, "half_life"),
        ({"half_life": math.nan}, "half_life"),
        ({"half_life": True}, "half_life"),
        ({"max_keys": 0}, "max_keys"),
        ({"max_keys": 1.5}, "max_keys"),
        ({"clock": 3}, "clock"),
    ],
)
def test_bad_velocity_settings_are_refused(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(quota.ConfigurationError, match=message):
        Velocity(**settings)


def test_the_guard_tracks_the_velocity_of_counted_keys_without_raw_ips() -> None:
    clock = Tick()
    guard = _guard(clock)
    assert guard.velocity is not None
    for i in range(10):
        clock.now = NOW + i * 0.1
        _decide(guard, _request())
        _decide(guard, _request(peer="203.0.113.50"), allowed=False)  # denials count too
    top = guard.velocity.top(5)
    assert len(top) == 2
    for key, rate in top:
        assert key.startswith("http:api:anon:ip:") and rate > 0
        assert PEER not in key and "203.0.113.50" not in key


def test_velocity_can_be_turned_off() -> None:
    guard = _guard(velocity=False)
    assert guard.velocity is None
    assert _lane(_decide(guard, _request())) == "anon"


def test_velocity_is_a_histogram_by_route_and_tier_never_by_key() -> None:
    metrics = quota.Metrics()
    guard = _guard(observer=metrics)
    for i in range(30):
        _decide(guard, _request(peer=f"198.51.100.{i % 3}"))
    rows = metrics.snapshot()["request_velocity"]
    assert [(row["route"], row["tier"], row["count"]) for row in rows] == [("api", "anon", 30)]
    assert rows[0]["buckets"]["+Inf"] == 30 and rows[0]["sum"] > 0

    pytest.importorskip("prometheus_client")
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry()
    metrics.register(registry)
    text = generate_latest(registry).decode()
    assert "# TYPE quota_request_velocity histogram" in text
    assert 'quota_request_velocity_count{route="api",tier="anon"} 30.0' in text
    samples = [line for line in text.splitlines() if line.startswith("quota_request_velocity")]
    assert samples and all("ip:" not in line and "key" not in line for line in samples)


def test_the_velocity_histogram_caps_its_label_sets() -> None:
    metrics = quota.Metrics(max_series=2)
    for route in ("a", "b", "c", "d"):
        metrics.observe_velocity(1.0, route=route, tier="anon")
    rows = metrics.snapshot()["request_velocity"]
    assert [(row["route"], row["count"]) for row in rows] == [("_other", 2), ("a", 1), ("b", 1)]


def test_a_callable_observer_sees_each_decisions_velocity_bucket() -> None:
    events: list[tuple[str, dict[str, str]]] = []
    guard = _guard(observer=lambda name, labels: events.append((name, dict(labels))))
    _decide(guard, _request())
    velocity = [labels for name, labels in events if name == "ratelimit.velocity"]
    assert velocity == [{"route": "api", "tier": "anon", "le": velocity_le(math.log(2) / 10.0)}]
    assert velocity[0]["le"] == "0.1"
    assert velocity_le(5000.0) == "+Inf"


# -- predictive pressure -------------------------------------------------------------------------


class Series:
    """A pressure reading that follows `shape(t)`, read at the clock's time."""

    def __init__(self, clock: Tick, shape: Callable[[float], float]) -> None:
        self.clock = clock
        self.shape = shape
        self.reads = 0

    def __call__(self) -> float:
        self.reads += 1
        return self.shape(self.clock.now - NOW)


def _first_time(
    shape: Callable[[float], float], test: Callable[[float], bool], *, horizon: float
) -> tuple[float | None, float | None]:
    """When the predictive source, then the EWMA one, first satisfy `test`, sampling once a second."""
    clock = Tick()
    predictive = PredictivePressure(horizon=horizon, clock=clock, sample=Series(clock, shape))
    ewma = SystemPressure(clock=clock, sample=Series(clock, shape))
    first: list[float | None] = [None, None]
    sources: tuple[Callable[[], float], ...] = (predictive, ewma)
    for step in range(200):
        clock.now = NOW + step
        for i, source in enumerate(sources):
            if first[i] is None and test(source()):
                first[i] = float(step)
    return first[0], first[1]


def test_a_rising_load_crosses_the_threshold_before_the_moving_average_does() -> None:
    def rising(t: float) -> float:
        return min(1.0, 0.2 + 0.01 * t)  # +1% a second: reaches 0.75 at t=55

    predicted, averaged = _first_time(rising, lambda p: p >= 0.75, horizon=10)
    assert predicted is not None and averaged is not None
    assert predicted < 55 <= averaged, "ahead of the load itself; the moving average lags it"
    assert predicted + 8 <= averaged


def test_a_falling_load_releases_before_the_moving_average_does() -> None:
    def falling(t: float) -> float:
        return 0.95 if t < 40 else max(0.0, 0.95 - 0.01 * (t - 40))  # under 0.75 from t=60

    predicted, averaged = _first_time(falling, lambda p: p < 0.75, horizon=10)
    assert predicted is not None and averaged is not None
    assert predicted < 60 <= averaged, "ahead of the load itself; the moving average lags it"
    assert predicted + 5 <= averaged


def test_a_flat_load_predicts_the_moving_average() -> None:
    clock = Tick()
    noise = [0.0, 0.02, -0.015, 0.01, -0.02, 0.015, -0.01, 0.005]
    sample = Series(clock, lambda t: 0.5 + noise[int(t) % len(noise)])
    source = PredictivePressure(horizon=10, clock=clock, sample=sample)
    for step in range(120):
        clock.now = NOW + step
        value = source()
        if step >= 30:
            assert value == pytest.approx(source.ewma, abs=0.03)
            assert abs(source.slope) < 0.003


def test_with_no_horizon_it_is_the_moving_average_exactly() -> None:
    clock = Tick()
    shape = [0.1, 0.9, 0.4, 0.8, 0.3, 0.95, 0.2]
    predictive = PredictivePressure(
        horizon=0, clock=clock, sample=Series(clock, lambda t: shape[int(t) % 7])
    )
    ewma = SystemPressure(clock=clock, sample=Series(clock, lambda t: shape[int(t) % 7]))
    for step in range(40):
        clock.now = NOW + step
        assert predictive() == pytest.approx(ewma())


def test_the_prediction_waits_for_a_trend_samples_once_per_interval_and_stays_in_0_1() -> None:
    clock = Tick()
    sample = Series(clock, lambda t: min(1.0, 0.5 + 0.05 * t))
    source = PredictivePressure(horizon=60, interval=1.0, clock=clock, sample=sample)
    for step in range(MIN_TREND_SAMPLES - 1):
        clock.now = NOW + step
        assert source() == pytest.approx(source.ewma), "no trend from so few readings"
    for step in range(MIN_TREND_SAMPLES - 1, 20):
        clock.now = NOW + step
        assert 0.0 <= source() <= 1.0
    assert source() == 1.0
    reads = sample.reads
    clock.now += 0.5
    source()
    source()
    assert sample.reads == reads, "a reading at most once per interval"

    falling = Series(clock, lambda t: max(0.0, 1.0 - 0.1 * t))
    down = PredictivePressure(horizon=60, clock=clock, sample=falling)
    for step in range(10):
        clock.now = NOW + step
        assert 0.0 <= down() <= 1.0
    assert down() == 0.0


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"horizon": -1}, "horizon"),
        ({"horizon": math.inf}, "horizon"),
        ({"interval": 0}, "interval"),
        ({"samples": 1}, "samples"),
        ({"alpha": 0}, "alpha"),
        ({"alpha": 1.5}, "alpha"),
        ({"sample": 0.5}, "sample"),
    ],
)
def test_bad_predictive_settings_are_refused(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(quota.ConfigurationError, match=message):
        PredictivePressure(**settings)


def test_adaptive_uses_the_predictive_source_when_a_horizon_is_set() -> None:
    assert isinstance(_guard(adaptive=True)._pressure, SystemPressure)
    predictive = _guard(adaptive=True, pressure_horizon=15)._pressure
    assert isinstance(predictive, PredictivePressure) and predictive.horizon == 15
    assert _guard(pressure_horizon=15)._pressure is None, "only with adaptive=True"


def test_a_predictive_source_lowers_capacity_before_the_load_crosses_the_threshold() -> None:
    clock = Tick()
    load = Series(clock, lambda t: min(1.0, 0.2 + 0.01 * t))
    source = PredictivePressure(horizon=10, clock=clock, sample=load)
    guard = _guard(clock, adaptive=True, pressure=source)
    limits = {}
    for step in range(0, 60):
        clock.now = NOW + step
        flow = guard.flow(_request())
        hit = flow.send(None)
        assert isinstance(hit, Hit)
        limits[step] = hit.rates[0].limit
    assert limits[0] == 10
    assert limits[50] == 5, "anon keeps 0.55 of 10 while the load itself is still 0.7"


# -- abuse alerts --------------------------------------------------------------------------------


def test_the_threshold_of_a_detector_can_be_changed_while_in_use() -> None:
    alerts: list[tuple[str, int]] = []
    clock = Tick()
    detector = quota.AbuseDetector(5, 60, 300, lambda k, n: alerts.append((k, n)), clock=clock)
    for _ in range(3):
        detector.record_denial("k")
    assert alerts == []
    detector.threshold = 2
    assert detector.threshold == 2
    detector.record_denial("k")
    assert alerts == [("k", 4)]
    for bad in (0, -1, True, 1.5, "3", 2**63):
        with pytest.raises(quota.ConfigurationError, match="threshold"):
            detector.threshold = bad  # type: ignore[assignment]
    assert detector.threshold == 2


def test_the_threshold_setter_is_safe_across_threads() -> None:
    detector = quota.AbuseDetector(1000, 60, 300, clock=Tick())

    def churn(offset: int) -> None:
        for i in range(500):
            detector.threshold = 1 + (i + offset) % 50
            detector.record_denial(f"k{offset}")

    threads = [threading.Thread(target=churn, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert 1 <= detector.threshold <= 50 and detector.tracked_keys == 4


def test_a_flood_of_429s_raises_one_alert_per_key_per_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    alerts: list[tuple[str, int]] = []
    clock = Tick()
    guard = _guard(clock, abuse_threshold=3, abuse_window=60, abuse_interval=300,
                   on_abuse=lambda key, count: alerts.append((key, count)))  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="quota"):
        for _ in range(50):
            verdict = _decide(guard, _request(), allowed=False)
            assert verdict.response is not None and verdict.response.status == 429
    assert len(alerts) == 1
    key, count = alerts[0]
    assert count == 4
    assert key.startswith("http:api:anon:ip:") and PEER not in key, "the hashed counted key"
    assert sum("abuse alert" in r.getMessage() for r in caplog.records) == 1
    assert PEER not in caplog.text
    assert guard.metrics.get("abuse_alerts") == 1

    clock.now += 300  # the interval has passed: the next flood alerts again
    for _ in range(5):
        _decide(guard, _request(), allowed=False)
    assert len(alerts) == 2


def test_abuse_alerts_reach_prometheus_metrics() -> None:
    metrics = quota.Metrics()
    guard = _guard(observer=metrics, abuse_threshold=2)
    for _ in range(5):
        _decide(guard, _request(), allowed=False)
    snap = metrics.snapshot()
    assert snap["abuse_alerts"] == 1
    assert snap["abuse_recent_keys"][0].startswith("http:api:anon:ip:")


def test_shadow_denials_allowed_requests_and_fail_open_passes_are_not_abuse() -> None:
    shadow = _guard(shadow=True, abuse_threshold=1)
    for _ in range(10):
        _decide(shadow, _request(), allowed=False)
    assert shadow.abuse is not None and shadow.abuse.tracked_keys == 0

    guard = _guard(abuse_threshold=1)
    for _ in range(10):
        _decide(guard, _request())

    def down(_effect: Hit) -> Decision:
        raise quota.StorageError("down")

    for _ in range(10):
        assert drive_sync(guard.flow(_request()), down, lambda: []) is PASS
    assert guard.abuse is not None and guard.abuse.tracked_keys == 0
    assert guard.metrics.get("abuse_alerts") == 0


def test_alerts_are_on_by_default_and_off_with_a_zero_threshold() -> None:
    guard = _guard()
    assert guard.abuse is not None
    assert (guard.abuse.threshold, guard.abuse.window, guard.abuse.interval) == (100, 60, 900)
    assert _guard(abuse_threshold=0).abuse is None
    with pytest.raises(quota.ConfigurationError, match="on_abuse needs abuse_threshold"):
        _guard(abuse_threshold=0, on_abuse=lambda key, count: None)
    with pytest.raises(quota.ConfigurationError, match="on_abuse must be callable"):
        _guard(on_abuse="page me")


def test_a_failing_on_abuse_callback_never_reaches_the_request(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def broken(key: str, count: int) -> None:
        raise RuntimeError("pager down")

    guard = _guard(abuse_threshold=1, on_abuse=broken)
    with caplog.at_level(logging.ERROR, logger="quota.http"):
        for _ in range(3):
            verdict = _decide(guard, _request(), allowed=False)
            assert verdict.response is not None and verdict.response.status == 429
    assert guard.metrics.get("hook_failed", hook="on_abuse") == 1
    assert guard.metrics.get("abuse_alerts") == 1
    assert "on_abuse callback failed" in caplog.text


def test_the_guards_abuse_threshold_changes_at_run_time() -> None:
    alerts: list[str] = []
    guard = _guard(abuse_threshold=50, on_abuse=lambda key, count: alerts.append(key))
    for _ in range(5):
        _decide(guard, _request(), allowed=False)
    assert alerts == []
    assert guard.abuse is not None
    guard.abuse.threshold = 5
    _decide(guard, _request(), allowed=False)
    assert len(alerts) == 1


@pytest.fixture
def clients() -> Iterator[list[HttpClient]]:
    made: list[HttpClient] = []
    yield made
    for client in made:
        client.close()


def test_the_middlewares_pass_on_abuse_through_and_send_the_lane(
    framework: str, sqlite_url: str, clients: list[HttpClient]
) -> None:
    clock = Clock(NOW)
    alerts: list[tuple[str, int]] = []
    config = _config(policies=[RoutePolicy(name="api", paths=["/api"], rates="2/minute")],
                     abuse_threshold=3)  # fmt: skip
    client = make_client(framework, sqlite_url, clock, config,
                         on_abuse=lambda key, count: alerts.append((key, count)))  # fmt: skip
    clients.append(client)
    replies = [client.get("/api/items", origin="https://app.example") for _ in range(12)]
    assert [r.status for r in replies] == [200, 200] + [429] * 10
    assert {r.header("X-RateLimit-Lane") for r in replies} == {"anon"}
    exposed = (replies[-1].header("Access-Control-Expose-Headers") or "").lower()
    assert "x-ratelimit-lane" in exposed
    assert len(alerts) == 1 and alerts[0][1] == 4
    assert "203.0.113.9" not in alerts[0][0]
    assert client.metrics.get("abuse_alerts") == 1


def test_the_fastapi_dependency_passes_on_abuse_through(sqlite_url: str) -> None:
    pytest.importorskip("fastapi")
    from quota.http.fastapi import RateLimit

    def page(key: str, count: int) -> None: ...

    dependency = RateLimit("2/minute", name="search", url=sqlite_url, on_abuse=page,
                           config=_config(abuse_threshold=7))  # fmt: skip
    assert dependency.guard.abuse is not None and dependency.guard.abuse.threshold == 7
    assert dependency.guard._on_abuse is page


# -- tier multipliers at run time ----------------------------------------------------------------


def _auth_limit(guard: Guard) -> int:
    flow = guard.flow(_request(authorization="Bearer t0k3n"))
    hit = flow.send(None)
    assert isinstance(hit, Hit)
    return hit.rates[0].limit


def test_a_tier_multiplier_set_at_run_time_applies_from_the_next_request() -> None:
    config = _config(tier_multipliers={"anon": 1, "auth": 5})
    guard = Guard(config, dialect="sqlite", clock=Tick())
    assert _auth_limit(guard) == 50
    scaled = guard.planner.scaled

    guard.set_tier_multiplier("auth", 2)

    assert _auth_limit(guard) == 20
    assert guard.planner.scaled is not scaled, "the scaled-rates cache starts afresh"
    assert guard.config.tier_multipliers["auth"] == 2.0
    assert config.tier_multipliers["auth"] == 5.0, "the config given (maybe shared) is untouched"
    guard.set_tier_multiplier("gold", 3.5)
    assert guard.config.tier_multipliers == {"anon": 1.0, "auth": 2.0, "gold": 3.5}


@pytest.mark.parametrize("value", [0, 0.0005, 1001, math.nan, math.inf, True, "2", None])
def test_a_bad_tier_multiplier_is_refused_and_changes_nothing(value: Any) -> None:
    guard = _guard(tier_multipliers={"anon": 1, "auth": 5})
    with pytest.raises(quota.ConfigurationError, match="tier_multipliers"):
        guard.set_tier_multiplier("auth", value)
    assert guard.config.tier_multipliers["auth"] == 5.0
    with pytest.raises(quota.ConfigurationError, match="tier"):
        guard.set_tier_multiplier("", 2)


def test_tier_multipliers_set_from_several_threads_are_all_kept() -> None:
    guard = _guard()
    threads = [
        threading.Thread(target=guard.set_tier_multiplier, args=(f"tier{i}", 1 + i))
        for i in range(16)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(guard.config.tier_multipliers[f"tier{i}"] == 1 + i for i in range(16))


# -- configuration -------------------------------------------------------------------------------


def test_the_new_settings_have_their_defaults_and_read_the_environment() -> None:
    config = HttpConfig()
    assert (config.pressure_horizon, config.velocity, config.velocity_half_life,
            config.velocity_max_keys) == (0.0, True, 10.0, 10_000)  # fmt: skip
    assert (config.abuse_threshold, config.abuse_window, config.abuse_interval) == (100, 60, 900)
    env = {
        "QUOTA_PRESSURE_HORIZON": "12.5",
        "QUOTA_VELOCITY": "false",
        "QUOTA_VELOCITY_HALF_LIFE": "30",
        "QUOTA_VELOCITY_MAX_KEYS": "500",
        "QUOTA_ABUSE_THRESHOLD": "0",
        "QUOTA_ABUSE_WINDOW": "120",
        "QUOTA_ABUSE_INTERVAL": "3600",
    }
    config = HttpConfig.from_env(env)
    assert (config.pressure_horizon, config.velocity, config.velocity_half_life,
            config.velocity_max_keys) == (12.5, False, 30.0, 500)  # fmt: skip
    assert (config.abuse_threshold, config.abuse_window, config.abuse_interval) == (0, 120, 3600)
    for name in env:
        assert name in quota.http.ENV_VARS


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"QUOTA_PRESSURE_HORIZON": "-1"}, r"\$QUOTA_PRESSURE_HORIZON"),
        ({"QUOTA_PRESSURE_HORIZON": "soon"}, r"\$QUOTA_PRESSURE_HORIZON"),
        ({"QUOTA_VELOCITY": "maybe"}, r"\$QUOTA_VELOCITY"),
        ({"QUOTA_VELOCITY_HALF_LIFE": "0"}, r"\$QUOTA_VELOCITY_HALF_LIFE"),
        ({"QUOTA_VELOCITY_MAX_KEYS": "0"}, r"\$QUOTA_VELOCITY_MAX_KEYS"),
        ({"QUOTA_ABUSE_THRESHOLD": "-5"}, r"\$QUOTA_ABUSE_THRESHOLD"),
        ({"QUOTA_ABUSE_WINDOW": "0"}, r"\$QUOTA_ABUSE_WINDOW"),
        ({"QUOTA_ABUSE_INTERVAL": "1.5"}, r"\$QUOTA_ABUSE_INTERVAL"),
    ],
)
def test_a_malformed_variable_is_named(env: dict[str, str], message: str) -> None:
    with pytest.raises(quota.ConfigurationError, match=message):
        HttpConfig.from_env(env)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"pressure_horizon": -1}, "pressure_horizon"),
        ({"pressure_horizon": True}, "pressure_horizon"),
        ({"velocity": 1}, "velocity"),
        ({"velocity_half_life": 0}, "velocity_half_life"),
        ({"velocity_max_keys": 0}, "velocity_max_keys"),
        ({"abuse_threshold": -1}, "abuse_threshold"),
        ({"abuse_threshold": 2.0}, "abuse_threshold"),
        ({"abuse_window": 0}, "abuse_window"),
        ({"abuse_interval": None}, "abuse_interval"),
    ],
)
def test_bad_settings_are_refused(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(quota.ConfigurationError, match=message):
        HttpConfig(**settings)
