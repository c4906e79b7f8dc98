"""`quota.Metrics`: in-process counters and histogram, and their Prometheus exposition."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import prometheus_client
import pytest
from prometheus_client import CollectorRegistry, generate_latest

import quota
from quota._wrappers.metrics import LATENCY_BUCKETS, OTHER


def test_decisions_are_counted_by_outcome_source_route_and_tier() -> None:
    metrics = quota.Metrics()
    for _ in range(3):
        metrics.record_decision(True, route="/api", tier="free")
    metrics.record_decision(False, route="/api", tier="free")
    metrics.record_decision(True, source="fallback")
    metrics.record_decision(True, source="fail_open", route="/login")
    metrics.record_decision(False, source="fallback")

    snap = metrics.snapshot()

    assert snap["decisions"] == [
        {"outcome": "denied", "source": "fallback", "route": "", "tier": "", "count": 1},
        {"outcome": "denied", "source": "store", "route": "/api", "tier": "free", "count": 1},
        {"outcome": "allowed", "source": "fail_open", "route": "/login", "tier": "", "count": 1},
        {"outcome": "allowed", "source": "fallback", "route": "", "tier": "", "count": 1},
        {"outcome": "allowed", "source": "store", "route": "/api", "tier": "free", "count": 3},
    ]
    assert snap["totals"] == {"allowed": 5, "denied": 2, "fallback": 2, "fail_open": 1}


def test_an_unknown_source_is_refused() -> None:
    with pytest.raises(quota.ConfigurationError, match="'db'"):
        quota.Metrics().record_decision(True, source="db")


def test_store_errors_sheds_and_abuse_alerts_are_counted() -> None:
    metrics = quota.Metrics()
    metrics.record_store_error("timeout")
    metrics.record_store_error("timeout")
    metrics.record_store_error("connection")
    metrics.record_shed()
    metrics.record_shed("/search")
    metrics.record_shed("/search")
    for i in range(12):
        metrics.record_abuse_alert(f"ip:{i}")

    snap = metrics.snapshot()

    assert snap["store_errors"] == {"timeout": 2, "connection": 1}
    assert snap["shed"] == {"": 1, "/search": 2}
    assert snap["abuse_alerts"] == 12
    # Only the last few keys are kept, oldest first.
    assert snap["abuse_recent_keys"] == [f"ip:{i}" for i in range(2, 12)]


def test_the_latency_histogram_uses_le_buckets_from_a_tenth_of_a_millisecond_to_a_second() -> None:
    assert LATENCY_BUCKETS[0] == 0.0001
    assert LATENCY_BUCKETS[-1] == 1.0
    assert list(LATENCY_BUCKETS) == sorted(LATENCY_BUCKETS)
    metrics = quota.Metrics()
    for seconds in (0.00005, 0.0001, 0.003, 0.003, 0.7, 2.0):
        metrics.observe_store_latency(seconds)

    latency = metrics.snapshot()["store_latency"]

    buckets = latency["buckets"]
    assert list(buckets) == [repr(b) for b in LATENCY_BUCKETS] + ["+Inf"]
    assert buckets["0.0001"] == 2  # le: a value on a bound falls in that bucket
    assert buckets["0.0025"] == 2
    assert buckets["0.005"] == 4
    assert buckets["0.5"] == 4
    assert buckets["1.0"] == 5
    assert buckets["+Inf"] == 6
    assert latency["count"] == 6
    assert latency["sum"] == pytest.approx(0.00005 + 0.0001 + 0.006 + 0.7 + 2.0)


def test_the_snapshot_is_plain_json() -> None:
    metrics = quota.Metrics()
    metrics.record_decision(True)
    metrics.observe_store_latency(0.001)
    snap = metrics.snapshot()
    assert json.loads(json.dumps(snap)) == snap


def test_label_sets_beyond_max_series_are_counted_under_other() -> None:
    metrics = quota.Metrics(max_series=3)
    for i in range(5):
        metrics.record_decision(True, route=f"/r{i}")
        metrics.record_shed(f"/r{i}")
    metrics.record_decision(True, route="/r0")  # an existing label set still counts as itself

    snap = metrics.snapshot()

    routes = {row["route"]: row["count"] for row in snap["decisions"]}
    assert routes == {"/r0": 2, "/r1": 1, "/r2": 1, OTHER: 2}
    assert snap["shed"] == {"/r0": 1, "/r1": 1, "/r2": 1, OTHER: 2}
    assert snap["totals"]["allowed"] == 6


def test_a_bad_max_series_names_the_field() -> None:
    with pytest.raises(quota.ConfigurationError, match="max_series"):
        quota.Metrics(max_series=0)


def test_concurrent_threads_lose_no_counts() -> None:
    metrics = quota.Metrics()
    threads_n, per_thread = 8, 5000
    start = threading.Barrier(threads_n)

    def work() -> None:
        start.wait()
        for _ in range(per_thread):
            metrics.record_decision(True)
            metrics.observe_store_latency(0.001)
            metrics.record_shed()

    threads = [threading.Thread(target=work) for _ in range(threads_n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    snap = metrics.snapshot()
    total = threads_n * per_thread
    assert snap["totals"]["allowed"] == total
    assert snap["store_latency"]["count"] == total
    assert snap["shed"] == {"": total}


# -- Prometheus --------------------------------------------------------------------------


def _exposition(metrics: quota.Metrics) -> list[str]:
    registry = CollectorRegistry()
    metrics.register(registry)
    return generate_latest(registry).decode().splitlines()


def test_the_prometheus_exposition_follows_the_naming_conventions() -> None:
    metrics = quota.Metrics()
    metrics.record_decision(True, route="/api", tier="pro")
    metrics.record_decision(True, route="/api", tier="pro")
    metrics.record_decision(False, source="fallback", route="/api", tier="pro")
    metrics.record_store_error("timeout")
    metrics.observe_store_latency(0.0002)
    metrics.observe_store_latency(0.03)
    metrics.record_shed("/search")
    metrics.record_abuse_alert("ip:1")

    lines = _exposition(metrics)

    assert "# TYPE quota_decisions_total counter" in lines
    assert (
        'quota_decisions_total{outcome="allowed",route="/api",source="store",tier="pro"} 2.0'
        in lines
    )
    assert (
        'quota_decisions_total{outcome="denied",route="/api",source="fallback",tier="pro"} 1.0'
        in lines
    )
    assert 'quota_store_errors_total{kind="timeout"} 1.0' in lines
    assert 'quota_shed_total{route="/search"} 1.0' in lines
    assert "quota_abuse_alerts_total 1.0" in lines
    assert "# TYPE quota_store_latency_seconds histogram" in lines
    assert 'quota_store_latency_seconds_bucket{le="0.0001"} 0.0' in lines
    assert 'quota_store_latency_seconds_bucket{le="0.00025"} 1.0' in lines
    assert 'quota_store_latency_seconds_bucket{le="0.025"} 1.0' in lines
    assert 'quota_store_latency_seconds_bucket{le="0.05"} 2.0' in lines
    assert 'quota_store_latency_seconds_bucket{le="+Inf"} 2.0' in lines
    assert "quota_store_latency_seconds_count 2.0" in lines
    (total,) = [
        line.split()[1] for line in lines if line.startswith("quota_store_latency_seconds_sum")
    ]
    assert float(total) == pytest.approx(0.0302)


def test_the_exposition_parses_and_reads_current_numbers_at_each_scrape() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    metrics = quota.Metrics()
    registry = CollectorRegistry()
    metrics.register(registry)
    metrics.record_shed()

    def shed_total() -> float:
        text = generate_latest(registry).decode()
        families = {f.name: f for f in text_string_to_metric_families(text)}
        assert {"quota_decisions", "quota_store_errors", "quota_shed", "quota_abuse_alerts"} <= set(
            families
        )
        assert families["quota_store_latency_seconds"].type == "histogram"
        return sum(s.value for s in families["quota_shed"].samples if s.name == "quota_shed_total")

    assert shed_total() == 1
    metrics.record_shed()
    metrics.record_shed()
    assert shed_total() == 3


def test_the_collector_can_be_registered_by_hand() -> None:
    metrics = quota.Metrics()
    metrics.record_abuse_alert("k")
    registry = CollectorRegistry()
    registry.register(metrics.prometheus_collector())
    assert b"quota_abuse_alerts_total 1.0" in generate_latest(registry)


def test_registering_twice_on_one_registry_is_refused() -> None:
    registry = CollectorRegistry()
    quota.Metrics().register(registry)
    with pytest.raises(ValueError, match="quota_"):
        quota.Metrics().register(registry)


def test_register_defaults_to_the_global_registry() -> None:
    metrics = quota.Metrics()
    collector = metrics.register()
    try:
        metrics.record_shed("/x")
        assert b'quota_shed_total{route="/x"} 1.0' in generate_latest(prometheus_client.REGISTRY)
    finally:
        prometheus_client.REGISTRY.unregister(collector)


def test_without_prometheus_client_the_error_names_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    metrics = quota.Metrics()
    with pytest.raises(quota.ConfigurationError, match=r"quota\[prometheus\]"):
        metrics.prometheus_collector()
    with pytest.raises(quota.ConfigurationError, match=r"quota\[prometheus\]"):
        metrics.register()


def test_import_quota_does_not_import_prometheus_client() -> None:
    code = (
        "import sys, quota\n"
        "quota.Metrics().record_decision(True)\n"
        "assert 'prometheus_client' not in sys.modules, 'imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
