"""OpenTelemetry (``telemetry=``): decisions counted, store calls timed and traced, the
fallback's state reported, through providers of the SDK read in memory."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import textwrap
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import quota
from quota import Fallback, Rate, RateWindow, Telemetry
from quota._limiter import base as _base
from tests._support import Backend
from tests.conftest import SQL_DIALECTS, backend_params, dialect_of, faces, store_url

KEY = "user:secret-42"


class Otel:
    """An SDK meter provider read in memory and a tracer provider exporting to memory."""

    def __init__(self) -> None:
        self.reader = InMemoryMetricReader()
        self.meters = MeterProvider(metric_readers=[self.reader])
        self.exporter = InMemorySpanExporter()
        self.tracers = TracerProvider()
        self.tracers.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.telemetry = Telemetry(meter_provider=self.meters, tracer_provider=self.tracers)

    def points(self, name: str) -> list[Any]:
        data = self.reader.get_metrics_data()
        found = []
        for resource in data.resource_metrics if data else ():
            for scope in resource.scope_metrics:
                assert scope.scope.name == "quota"
                assert scope.scope.version == quota.__version__
                for metric in scope.metrics:
                    if metric.name == name:
                        found.extend(metric.data.data_points)
        return found

    def decisions(self) -> Counter[tuple[str, str, str]]:
        counts: Counter[tuple[str, str, str]] = Counter()
        for point in self.points("quota.decisions"):
            attrs = point.attributes
            counts[(attrs["outcome"], attrs["algorithm"], attrs["store"])] += point.value
        return counts

    def spans(self) -> list[Any]:
        return list(self.exporter.get_finished_spans())

    def shutdown(self) -> None:
        self.meters.shutdown()
        self.tracers.shutdown()


@pytest.fixture
def otel() -> Iterator[Otel]:
    made = Otel()
    yield made
    made.shutdown()


@pytest.fixture(params=backend_params(*faces(*SQL_DIALECTS)))
def traced(request: pytest.FixtureRequest, otel: Otel, clock: Any) -> Iterator[Backend]:
    """Every SQL store and face, its limiter reporting to `otel` (a small pool: the
    PostgreSQL server is shared)."""
    backend = Backend(
        request.param,
        store_url(request, dialect_of(request.param)),
        clock,
        telemetry=otel.telemetry,
        pool_size=2,
    )
    try:
        yield backend
    finally:
        backend.close()


def _call(backend: Backend, value: Any) -> Any:
    return backend.run(value) if backend.is_async else value


def test_decisions_are_counted_per_call_by_outcome_algorithm_and_store(
    traced: Backend, otel: Otel
) -> None:
    for _ in range(5):
        traced.rate_limit(KEY, 3, 60)  # 3 allowed, 2 denied
    for _ in range(3):
        traced.hit(KEY, Rate(limit=2, window=60, algorithm="token_bucket"))  # 2, 1
    # One hit under two rates is two decisions.
    traced.hit("other", [Rate(limit=5, window=60), Rate(limit=9, window=3600)])
    traced.acquire("waited", Rate(limit=1, window=60), timeout=0)  # allowed
    with pytest.raises(quota.RateLimitTimeout):
        traced.acquire("waited", Rate(limit=1, window=60), timeout=0)  # one denial
    limiter = traced.limiter
    _call(traced, limiter.check(RateWindow(key="c", limit=1, window=60)))
    _call(traced, limiter.check(RateWindow(key="c", limit=1, window=60)))

    store = traced.dialect
    assert otel.decisions() == {
        ("allowed", "fixed_window", store): 3 + 2 + 1,
        ("denied", "fixed_window", store): 2 + 1,
        ("allowed", "token_bucket", store): 2,
        ("denied", "token_bucket", store): 1,
        ("allowed", "check", store): 1,
        ("denied", "check", store): 1,
    }


def test_each_store_call_is_a_span_named_for_its_operation_without_the_key(
    traced: Backend, otel: Otel
) -> None:
    traced.rate_limit(KEY, 1, 60)
    traced.rate_limit(KEY, 1, 60)
    traced.hit(KEY, Rate(limit=1, window=60, algorithm="sliding_window"))
    traced.peek(KEY, 1, 60)

    spans = otel.spans()
    names = [span.name for span in spans]
    assert names == ["quota.hit", "quota.hit", "quota.sliding_window", "quota.peek"]
    first, second, sliding, peek = (dict(span.attributes) for span in spans)
    assert first == {
        "quota.store": traced.dialect, "quota.operation": "hit",
        "quota.algorithm": "fixed_window", "quota.outcome": "allowed",
    }  # fmt: skip
    assert second["quota.outcome"] == "denied"
    assert sliding["quota.algorithm"] == "sliding_window"
    assert sliding["quota.outcome"] == "allowed"
    # A call that decides nothing has no outcome.
    assert peek == {"quota.store": traced.dialect, "quota.operation": "peek"}
    for span in spans:
        assert span.instrumentation_scope.name == "quota"
        assert span.end_time >= span.start_time
        assert not any(KEY in str(value) for value in span.attributes.values())
        assert not span.events


def test_store_call_durations_are_recorded_in_seconds(traced: Backend, otel: Otel) -> None:
    for _ in range(4):
        traced.rate_limit(KEY, 10, 60)
    traced.reset(KEY)

    points = {p.attributes["operation"]: p for p in otel.points("quota.store.duration")}
    assert set(points) == {"hit", "reset"}
    assert points["hit"].count == 4
    assert points["hit"].attributes == {"store": traced.dialect, "operation": "hit"}
    # Seconds, not milliseconds: four local statements take well under one.
    assert 0 < points["hit"].sum < 4
    assert points["reset"].count == 1


def test_durable_quota_decisions_are_counted(sqlite_url: str, otel: Otel) -> None:
    with quota.connect(sqlite_url, telemetry=otel.telemetry) as limiter:
        limiter.consume_quota("org", "tokens", 3, "day", cost=2)
        limiter.consume_quota("org", "tokens", 3, "day", cost=2)
        # A retry answered from the first charge (the store call rolls back to answer).
        limiter.consume_quota("org", "calls", 3, "day", idempotency_key="once")
        assert limiter.consume_quota("org", "calls", 3, "day", idempotency_key="once").replayed
    assert otel.decisions() == {("allowed", "quota", "sqlite"): 3, ("denied", "quota", "sqlite"): 1}
    spans = [s for s in otel.spans() if s.name == "quota.consume"]
    assert [s.attributes["quota.outcome"] for s in spans] == [
        "allowed", "denied", "allowed", "allowed",
    ]  # fmt: skip
    assert [s.status.status_code.name for s in otel.spans()] == ["UNSET"] * len(otel.spans())


@pytest.mark.parametrize("face", ["sync", "async"])
def test_the_fallback_state_is_reported_while_the_store_is_down(
    face: str, otel: Otel, sqlite_url: str
) -> None:
    url = "postgresql://root@127.0.0.1:1/x"  # refuses at once
    fallback = Fallback(timeout=0.1, probe_interval=60)
    # Another limiter on the same providers, its store up: reported beside it.
    healthy = quota.connect(sqlite_url, telemetry=otel.telemetry, fallback=fallback)

    def active() -> list[tuple[Any, float]]:
        points = otel.points("quota.fallback.active")
        return [(dict(p.attributes), p.value) for p in points if p.attributes["store"] != "sqlite"]

    if face == "sync":
        with quota.connect(url, telemetry=otel.telemetry, fallback=fallback) as limiter:
            assert active() == [({"store": "postgresql"}, 0)]
            for _ in range(3):
                limiter.rate_limit(KEY, 2, 60)
            down = active()
    else:

        async def main() -> list[tuple[Any, float]]:
            async with quota.connect_async(
                url, telemetry=otel.telemetry, fallback=fallback
            ) as limiter:
                assert active() == [({"store": "postgresql"}, 0)]
                for _ in range(3):
                    await limiter.rate_limit(KEY, 2, 60)
                return active()

        down = asyncio.run(main())
    assert down == [({"store": "postgresql"}, 1)]
    healthy.rate_limit(KEY, 2, 60)
    assert [
        p.value for p in otel.points("quota.fallback.active") if p.attributes["store"] == "sqlite"
    ] == [0]
    healthy.close()
    # The memory fallback decided: still counted, under the store configured.
    assert otel.decisions() == {
        ("allowed", "fixed_window", "postgresql"): 2,
        ("denied", "fixed_window", "postgresql"): 1,
        ("allowed", "fixed_window", "sqlite"): 1,
    }


def test_without_a_fallback_the_gauge_reads_zero(sqlite_url: str, otel: Otel) -> None:
    with quota.connect(sqlite_url, telemetry=otel.telemetry):
        assert [p.value for p in otel.points("quota.fallback.active")] == [0]


def test_a_failed_store_call_is_an_error_span_and_still_raises(otel: Otel) -> None:
    url = "postgresql://root@127.0.0.1:1/x"
    with (
        quota.connect(url, telemetry=otel.telemetry, timeout=1) as limiter,
        pytest.raises(quota.StorageError),
    ):
        limiter.rate_limit(KEY, 2, 60)
    (span,) = otel.spans()
    assert span.name == "quota.hit"
    assert span.status.status_code.name == "ERROR"
    assert "quota.outcome" not in span.attributes
    assert otel.decisions() == {}


def test_a_failing_sdk_never_reaches_the_caller(
    sqlite_url: str, otel: Otel, caplog: pytest.LogCaptureFixture
) -> None:
    class Broken:
        def start_span(self, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("exporter down")

    class BrokenProvider:
        def get_tracer(self, *args: Any, **kwargs: Any) -> Broken:
            return Broken()

    telemetry = Telemetry(meter_provider=otel.meters, tracer_provider=BrokenProvider())
    with (
        caplog.at_level(logging.WARNING, "quota"),
        quota.connect(sqlite_url, telemetry=telemetry) as limiter,
    ):
        decisions = [limiter.rate_limit(KEY, 1, 60).allowed for _ in range(3)]
    assert decisions == [True, False, False]
    # Counting went on; the failure was logged once.
    assert sum(otel.decisions().values()) == 3
    assert [r.getMessage() for r in caplog.records].count(
        "quota: telemetry failed (decision); carrying on without it"
    ) == 1


def test_telemetry_off_reports_nothing(sqlite_url: str, otel: Otel) -> None:
    with quota.connect(sqlite_url) as limiter:
        limiter.rate_limit(KEY, 1, 60)
    assert otel.decisions() == {}
    assert otel.spans() == []


def test_telemetry_true_uses_the_global_providers() -> None:
    # The global providers can be set once per process: in a process of its own.
    script = textwrap.dedent(
        """
        import quota
        from opentelemetry import metrics, trace
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import InMemoryMetricReader
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

        reader, exporter = InMemoryMetricReader(), InMemorySpanExporter()
        metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
        tracers = TracerProvider()
        tracers.add_span_processor(SimpleSpanProcessor(exporter))
        trace.set_tracer_provider(tracers)
        with quota.connect("memory://", telemetry=True) as limiter:
            limiter.rate_limit("k", 1, 60)
            limiter.rate_limit("k", 1, 60)
        points = [
            (dict(p.attributes), p.value)
            for r in reader.get_metrics_data().resource_metrics
            for s in r.scope_metrics for m in s.metrics if m.name == "quota.decisions"
            for p in m.data.data_points
        ]
        print(sorted(points, key=str))
        print([s.name for s in exporter.get_finished_spans()])
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60
    ).stdout.splitlines()
    assert out == [
        "[({'outcome': 'allowed', 'algorithm': 'fixed_window', 'store': 'memory'}, 1),"
        " ({'outcome': 'denied', 'algorithm': 'fixed_window', 'store': 'memory'}, 1)]",
        "['quota.hit', 'quota.hit']",
    ]


def test_telemetry_without_the_extra_is_a_configuration_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "opentelemetry", None)
    with pytest.raises(quota.ConfigurationError, match=r"telemetry.*quota\[otel\]"):
        quota.connect("memory://", telemetry=True)


def test_bad_telemetry_values_are_refused() -> None:
    with pytest.raises(quota.ConfigurationError, match="telemetry must be"):
        quota.connect("memory://", telemetry="yes")  # type: ignore[typeddict-item]
    with pytest.raises(quota.ConfigurationError, match="meter_provider"):
        Telemetry(meter_provider=object())
    assert _base.options_from(None, {"telemetry": False}).telemetry is None


def test_concurrent_tasks_each_name_the_outcome_of_their_own_call(
    sqlite_url: str, otel: Otel
) -> None:
    other = Otel()

    async def main() -> list[bool]:
        async with (
            quota.connect_async(sqlite_url, telemetry=otel.telemetry) as limiter,
            quota.connect_async(sqlite_url, telemetry=other.telemetry) as second,
        ):
            calls = [limiter.rate_limit(KEY, 5, 60) for _ in range(10)]
            calls += [second.rate_limit("b", 1, 60) for _ in range(3)]
            return [d.allowed for d in await asyncio.gather(*calls)]

    try:
        allowed = asyncio.run(main())
        assert allowed.count(True) == 5 + 1
        outcomes = Counter(s.attributes["quota.outcome"] for s in otel.spans())
        assert outcomes == {"allowed": 5, "denied": 5}
        assert Counter(s.attributes["quota.outcome"] for s in other.spans()) == {
            "allowed": 1, "denied": 2,
        }  # fmt: skip
    finally:
        other.shutdown()
