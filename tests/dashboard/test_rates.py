"""The overview's decision and shedding rates, read from a `quota.Metrics`."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from typing import Any

import pytest
from starlette.testclient import TestClient

import quota
from quota.dashboard import create_app
from quota.dashboard._plots import rates_svg
from quota.dashboard._rates import RateTracker, counts, rates
from tests.dashboard.conftest import BROWSER, HTML_KEY, TOKEN, Seeded

BEARER = {"authorization": f"Bearer {TOKEN}"}
USERS, SEARCH, UPLOAD = "/users/{id}", "/search", "/upload"
ATTR = '"><img src=x onerror=alert(1)>'


class Clock:
    """A monotonic clock that moves only when told."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _app(target: Any, clock: Clock, **kwargs: Any) -> Any:
    app = create_app(target, token=TOKEN, **kwargs)
    if app.state.dashboard.rates is not None:
        app.state.dashboard.rates.clock = clock
    return app


def _by_label(body: dict[str, Any]) -> dict[Any, dict[str, Any]]:
    r = body["rates"]
    found: dict[Any, dict[str, Any]] = {(row["route"], row["tier"]): row for row in r["decisions"]}
    found.update({row["route"]: row for row in r["shed"]})
    return found


def test_two_polls_give_decisions_denials_and_shed_per_second(seeded: Seeded) -> None:
    metrics, clock = quota.Metrics(), Clock()
    for allowed in (True, True, True, False):
        metrics.record_decision(allowed, route=USERS, tier="anon")
    metrics.record_decision(True, source="fallback", route=USERS, tier="anon")
    metrics.record_shed(UPLOAD)
    app = _app(seeded.url, clock, metrics=metrics)
    try:
        with TestClient(app) as client:
            first = client.get("/api/overview", headers=BEARER).json()
            # The first poll has no interval: counts since the metrics began, no rate.
            assert first["rates"]["interval"] is None
            row = _by_label(first)[(USERS, "anon")]
            assert (row["decisions"], row["denials"]) == (5, 1)
            assert row["decisions_per_s"] is None and row["denials_per_s"] is None
            assert _by_label(first)[UPLOAD] == {"route": UPLOAD, "shed": 1, "shed_per_s": None}

            clock.now += 4.0
            for allowed in (True, True, False, False, False, True):
                metrics.record_decision(allowed, route=USERS, tier="anon")
            metrics.record_decision(False, source="fail_open", route=SEARCH, tier="pro")
            metrics.record_decision(True, route=SEARCH, tier="anon")
            for _ in range(10):
                metrics.record_shed(UPLOAD)
            second = client.get("/api/overview", headers=BEARER).json()
            assert second["rates"]["interval"] == 4.0
            found = _by_label(second)
            assert found[(USERS, "anon")] == {
                "route": USERS,
                "tier": "anon",
                "decisions": 11,
                "denials": 4,
                "decisions_per_s": 1.5,
                "denials_per_s": 0.75,
            }
            # A label set first counted since the last poll counts from zero.
            assert found[(SEARCH, "pro")]["decisions_per_s"] == 0.25
            assert found[(SEARCH, "pro")]["denials_per_s"] == 0.25
            assert found[(SEARCH, "anon")]["denials_per_s"] == 0.0
            assert found[UPLOAD]["shed_per_s"] == 2.5
            assert [r["route"] for r in second["rates"]["decisions"]] == [SEARCH, SEARCH, USERS]

            # A poll right after (another tab) shows the same figures, not a spike.
            clock.now += 0.2
            metrics.record_decision(True, route=USERS, tier="anon")
            assert client.get("/api/overview", headers=BEARER).json()["rates"] == second["rates"]

            clock.now += 1.8
            html = client.get("/", headers={**BEARER, **BROWSER}).text
            assert "the last 2.0 s" in html
            assert "<td>0.50</td>" in html  # the one decision on USERS over 2 s
            assert "0.00" in html and "No rates" not in html
    finally:
        app.state.dashboard.admin.close()


def test_a_limiter_given_lends_its_metrics(seeded: Seeded) -> None:
    metrics, clock = quota.Metrics(), Clock()
    limiter = quota.connect(seeded.url, pool_size=2, metrics=metrics)
    try:
        with TestClient(_app(limiter, clock)) as client:
            client.get("/api/overview", headers=BEARER)
            limiter.hit("user:1", "1/hour")
            limiter.hit("user:1", "1/hour")
            clock.now += 2.0
            row = _by_label(client.get("/api/overview", headers=BEARER).json())[("", "")]
            assert (row["decisions_per_s"], row["denials_per_s"]) == (1.0, 0.5)
        # An explicit metrics= wins over the limiter's.
        other = quota.Metrics()
        other.record_decision(True, route=USERS, tier="anon")
        with TestClient(_app(limiter, clock, metrics=other)) as client:
            found = _by_label(client.get("/api/overview", headers=BEARER).json())
            assert list(found) == [(USERS, "anon")]
    finally:
        limiter.close()


def test_route_and_tier_labels_render_escaped(seeded: Seeded) -> None:
    metrics = quota.Metrics()
    metrics.record_decision(False, route=HTML_KEY, tier=ATTR)
    metrics.record_shed(ATTR)
    app = _app(seeded.url, Clock(), metrics=metrics)
    try:
        with TestClient(app) as client:
            html = client.get("/", headers={**BEARER, **BROWSER}).text
            assert "<script>window" not in html and "<img" not in html
            assert "&lt;script&gt;window.pwned=1;alert(1)&lt;/script&gt;" in html
            assert "&#34;&gt;&lt;img src=x onerror=alert(1)&gt;" in html
            assert _by_label(client.get("/api/overview", headers=BEARER).json())[ATTR]
    finally:
        app.state.dashboard.admin.close()


def test_without_metrics_the_page_says_how_to_get_them(seeded: Seeded) -> None:
    for target in (seeded.url, seeded.limiter):
        app = create_app(target, token=TOKEN)
        try:
            with TestClient(app) as client:
                assert client.get("/api/overview", headers=BEARER).json()["rates"] is None
                html = client.get("/", headers={**BEARER, **BROWSER}).text
                assert 'id="rates-hint"' in html and 'id="rates-decisions"' not in html
                assert "metrics=metrics" in html and "metrics=quota.Metrics()" in html
                assert "quota dashboard" in html
        finally:
            app.state.dashboard.admin.close()
    with pytest.raises(quota.ConfigurationError, match="metrics must be a"):
        create_app(seeded.url, token=TOKEN, metrics={})  # type: ignore[arg-type]


def test_rates_count_from_zero_after_a_counter_went_back() -> None:
    metrics = quota.Metrics()
    for _ in range(3):
        metrics.record_decision(True, route="a", tier="t")
    before = counts(metrics.snapshot())
    fresh = quota.Metrics()
    fresh.record_decision(False, route="a", tier="t")
    fresh.record_shed("a")
    out = rates(counts(fresh.snapshot()), before, 2.0)
    assert out["decisions"][0]["decisions_per_s"] == 0.5
    assert out["decisions"][0]["denials_per_s"] == 0.5
    assert out["shed"] == [{"route": "a", "shed": 1, "shed_per_s": 0.5}]


SVG = "{http://www.w3.org/2000/svg}"


def _points(svg: str, name: str) -> list[tuple[float, float]]:
    found = re.search(rf'<polyline class="{name}" points="([^"]*)"', svg)
    assert found, svg
    return [(float(x), float(y)) for x, y in (p.split(",") for p in found.group(1).split())]


def test_the_history_grows_with_polls_and_is_bounded_in_time_and_length() -> None:
    metrics, clock = quota.Metrics(), Clock()
    tracker = RateTracker(metrics, clock=clock)
    assert tracker.poll()["history"] == []  # the first poll has no interval: no sample
    for n in range(1, 4):
        clock.now += 5.0
        for route, allowed in (("a", True), ("b", False)):
            for _ in range(5 * n):
                metrics.record_decision(allowed, route=route, tier="t")
        history = tracker.poll()["history"]
        assert len(history) == n
    # Summed over routes and tiers; t is seconds before the last poll, oldest first.
    assert history == [
        {"t": 10.0, "decisions_per_s": 2.0, "denials_per_s": 1.0},
        {"t": 5.0, "decisions_per_s": 4.0, "denials_per_s": 2.0},
        {"t": 0.0, "decisions_per_s": 6.0, "denials_per_s": 3.0},
    ]
    # A poll within MIN_INTERVAL adds no sample.
    clock.now += 0.5
    assert len(tracker.poll()["history"]) == 3

    # Bounded in time: samples older than history_seconds go.
    clock.now += tracker.history_seconds - 5.0
    assert [h["t"] for h in tracker.poll()["history"]] == [595.5, 0.0]
    clock.now += 1.0
    assert [h["t"] for h in tracker.poll()["history"]] == [596.5, 1.0, 0.0]
    clock.now += 601.0
    assert [h["t"] for h in tracker.poll()["history"]] == [0.0]

    # Bounded in length: the newest history_samples stay.
    tracker.history_samples = 4
    for _ in range(10):
        clock.now += 1.0
        history = tracker.poll()["history"]
    assert [h["t"] for h in history] == [3.0, 2.0, 1.0, 0.0]


def test_the_rates_plot_has_one_point_per_sample_to_scale() -> None:
    history = [
        {"t": 600.0, "decisions_per_s": 0.0, "denials_per_s": 0.0},
        {"t": 300.0, "decisions_per_s": 10.0, "denials_per_s": 2.5},
        {"t": 0.0, "decisions_per_s": 5.0, "denials_per_s": 5.0},
    ]
    svg = rates_svg(history, span=600.0, width=640, height=180)
    root = ET.fromstring(svg)  # well-formed
    assert root.get("role") == "img" and root.get("aria-labelledby")
    assert "last 10 minutes" in (root.findtext(f"{SVG}title") or "")
    desc = root.findtext(f"{SVG}desc") or ""
    assert "latest: 5.00 decisions/s, 5.00 denials/s" in desc and "largest 10.00" in desc
    assert "latest: 5.00 decisions/s" in "".join(root.itertext())
    assert "style=" not in svg and "<script" not in svg
    # Plot area: x from 56 to 628 (600 s ago to now), y from 156 (0) up to 24 (the peak).
    assert _points(svg, "decisions") == [(56.0, 156.0), (342.0, 24.0), (628.0, 90.0)]
    assert _points(svg, "denials") == [(56.0, 156.0), (342.0, 123.0), (628.0, 90.0)]
    assert ">10.00/s<" in svg
    area = re.search(r'<polygon class="area" points="([^"]*)"', svg)
    assert (
        area and area.group(1).split()[0] == "56.0,156" and area.group(1).split()[-1] == "628.0,156"
    )

    empty = rates_svg([], span=600.0)
    ET.fromstring(empty)
    assert "<polyline" not in empty and "no sample yet" in empty


def test_the_overview_carries_and_plots_the_history(seeded: Seeded) -> None:
    metrics, clock = quota.Metrics(), Clock()
    app = _app(seeded.url, clock, metrics=metrics)
    try:
        with TestClient(app) as client:
            assert client.get("/api/overview", headers=BEARER).json()["rates"]["history"] == []
            svg = client.get("/api/overview/rates.svg", headers=BEARER)
            assert svg.headers["content-type"].startswith("image/svg+xml")
            assert "no sample yet" in svg.text
            for n in (4, 8):
                clock.now += 2.0
                for _ in range(n):
                    metrics.record_decision(False, route=USERS, tier=ATTR)
                body = client.get("/api/overview", headers=BEARER).json()
            assert body["rates"]["history"] == [
                {"t": 2.0, "decisions_per_s": 2.0, "denials_per_s": 2.0},
                {"t": 0.0, "decisions_per_s": 4.0, "denials_per_s": 4.0},
            ]
            # The plot endpoint shows the last poll's figures and does not poll itself.
            clock.now += 3.0
            svg = client.get("/api/overview/rates.svg", headers=BEARER).text
            assert len(_points(svg, "decisions")) == 2 and "latest: 4.00 decisions/s" in svg
            assert client.get("/api/overview/rates.svg").status_code == 401

            html = client.get("/", headers={**BEARER, **BROWSER}).text
            plot = re.search(r'<div id="rates-plot">(.*?)</div>', html, re.S)
            assert plot, html
            assert len(_points(plot.group(1), "decisions")) == 3
            ET.fromstring(plot.group(1))
            assert "<img" not in html
    finally:
        app.state.dashboard.admin.close()
    bare = create_app(seeded.url, token=TOKEN)
    try:
        with TestClient(bare) as client:
            assert client.get("/api/overview/rates.svg", headers=BEARER).status_code == 404
            assert 'id="rates-plot"' not in client.get("/", headers={**BEARER, **BROWSER}).text
    finally:
        bare.state.dashboard.admin.close()
