"""Counters and histograms for the limiter, shed requests, abuse alerts and request velocity.

`Metrics` keeps plain numbers in process: a few dict increments under one
lock per event, cheap enough for every decision. `Metrics.snapshot` returns
them as plain data (the shape is documented there); with the optional
``prometheus`` extra (``pip install 'quota[prometheus]'``),
`Metrics.prometheus_collector` or `Metrics.register` expose the same numbers
as Prometheus metrics:

==============================  =========  ==================================
name                            type       labels
==============================  =========  ==================================
quota_decisions_total           counter    outcome, source, route, tier
quota_store_errors_total        counter    kind
quota_store_latency_seconds     histogram  (none)
quota_shed_total                counter    route
quota_abuse_alerts_total        counter    (none)
quota_request_velocity          histogram  route, tier
quota_fallback_debt_dropped     counter    (none)
==============================  =========  ==================================

``outcome`` is ``allowed`` or ``denied``; ``source`` says who decided:
``store`` (the database), ``fallback`` (the in-memory store while the
database is down) or ``fail_open`` (nothing could decide, so the request was
allowed). ``quota_request_velocity`` is the request rate (requests per
second) of each decision's key, as the HTTP layer tracks it, by route and
tier: how fast the callers behind the requests were going, never which ones.
Label values come from the caller: pass route templates (``/users/{id}``)
and tier names, never raw paths or keys. A family that reaches `max_series`
label sets counts further new ones under the value ``_other``, so a mistake
there costs a wrong label, not unbounded memory.
``quota_fallback_debt_dropped_total`` counts the outage hits of windows a
fallback dropped instead of writing them back to the database: it owes at
most ``Fallback.max_keys`` windows, and the window owed least recently goes
first (see ``docs/resilience.md``).

`quota` never imports ``prometheus_client`` unless one of those two methods
is called.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from quota._core.decision import check_int
from quota._core.errors import ConfigurationError, QuotaError, SchemaError
from quota._sql.statements import Statement
from quota._sql.steps import Op, Rows
from quota._stores.base import AsyncStore, SyncStore

T = TypeVar("T")
S = TypeVar("S", SyncStore, AsyncStore)

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric
    from prometheus_client.registry import CollectorRegistry

#: Upper bounds (``le``) of the store latency buckets, in seconds: 0.1 ms … 1 s.
LATENCY_BUCKETS: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005,
    0.001, 0.0025, 0.005,
    0.01, 0.025, 0.05,
    0.1, 0.25, 0.5,
    1.0,
)  # fmt: skip
#: Upper bounds (``le``) of the request velocity buckets, in requests per second per key.
VELOCITY_BUCKETS: tuple[float, ...] = (
    0.1, 0.25, 0.5,
    1.0, 2.5, 5.0,
    10.0, 25.0, 50.0,
    100.0, 250.0, 1000.0,
)  # fmt: skip
#: The decision sources `Metrics.record_decision` accepts.
SOURCES = ("store", "fallback", "fail_open")
#: The label value a family's label sets beyond `max_series` are counted under.
OTHER = "_other"
_SOURCE_SET = frozenset(SOURCES)
_RECENT_ALERTS = 10


def _le(bound: float) -> str:
    """A bucket bound as Prometheus writes it in the ``le`` label."""
    return repr(float(bound))


def _histogram(bounds: tuple[float, ...], counts: list[float]) -> dict[str, Any]:
    """Per-bucket `counts` (then +Inf, then the sum) as cumulative buckets, count and sum."""
    buckets: dict[str, int] = {}
    running = 0
    for bound, count in zip((*map(_le, bounds), "+Inf"), counts, strict=False):
        running += int(count)
        buckets[bound] = running
    return {"buckets": buckets, "count": running, "sum": counts[-1]}


class Metrics:
    """Thread-safe in-process counters; see the module docstring for names and labels.

    One instance per process (or per limiter) is the usual setup; pass it to
    the limiter, `quota.http.shedding.ConcurrencyGuard` and `quota.AbuseDetector`.
    """

    def __init__(self, *, max_series: int = 1000) -> None:
        """`max_series` caps the label sets kept per family (see the module docstring).

        Raises `ConfigurationError` when it is not a positive integer.
        """
        self.max_series = check_int("max_series", max_series, maximum=1_000_000)
        self._lock = threading.Lock()
        # (allowed, source, route, tier) -> count
        self._decisions: dict[tuple[bool, str, str, str], int] = {}
        self._store_errors: dict[str, int] = {}
        self._shed: dict[str, int] = {}
        # Per bucket, not cumulative; the last slot is +Inf.
        self._latency_counts = [0] * (len(LATENCY_BUCKETS) + 1)
        self._latency_sum = 0.0
        self._abuse_alerts = 0
        self._abuse_recent: deque[str] = deque(maxlen=_RECENT_ALERTS)
        # (route, tier) -> per-bucket counts (the last is +Inf), then the sum of the rates.
        self._velocity: dict[tuple[str, str], list[float]] = {}
        self._debt_dropped = 0

    # -- recording (the hot path) ------------------------------------------------

    def record_decision(
        self, allowed: bool, *, source: str = "store", route: str = "", tier: str = ""
    ) -> None:
        """Count one decision. `source` is ``store``, ``fallback`` or ``fail_open``.

        Raises `ConfigurationError` for any other `source` (a bug in the caller).
        """
        key = (allowed, source, route, tier)
        with self._lock:
            count = self._decisions.get(key)
            if count is not None:
                self._decisions[key] = count + 1
                return
            # A label set seen for the first time: check it, and cap their number.
            if source not in _SOURCE_SET:
                raise ConfigurationError(
                    f"source must be one of {', '.join(SOURCES)}, got {source!r}"
                )
            if len(self._decisions) >= self.max_series:
                key = (allowed, source, OTHER, OTHER)
            self._decisions[key] = self._decisions.get(key, 0) + 1

    def record_store_error(self, kind: str) -> None:
        """Count one failed store call; `kind` is a short word such as ``timeout``."""
        with self._lock:
            self._bump(self._store_errors, kind)

    def observe_store_latency(self, seconds: float) -> None:
        """Add one store round trip of `seconds` to the latency histogram."""
        index = bisect.bisect_left(LATENCY_BUCKETS, seconds)
        with self._lock:
            self._latency_counts[index] += 1
            self._latency_sum += seconds

    def record_shed(self, route: str = "") -> None:
        """Count one request shed by a concurrency guard."""
        with self._lock:
            self._bump(self._shed, route)

    def record_abuse_alert(self, key: str) -> None:
        """Count one abuse alert; the last few keys show in `snapshot`, never as a label."""
        with self._lock:
            self._abuse_alerts += 1
            self._abuse_recent.append(key)

    def observe_velocity(self, rate: float, *, route: str = "", tier: str = "") -> None:
        """Add one decision's per-key request rate (requests per second) to the velocity histogram."""
        index = bisect.bisect_left(VELOCITY_BUCKETS, rate)
        key = (route, tier)
        with self._lock:
            counts = self._velocity.get(key)
            if counts is None:
                if len(self._velocity) >= self.max_series:
                    key = (OTHER, OTHER)
                    counts = self._velocity.get(key)
                if counts is None:
                    counts = self._velocity[key] = [0.0] * (len(VELOCITY_BUCKETS) + 2)
            counts[index] += 1
            counts[-1] += rate

    def record_debt_dropped(self, windows: int) -> None:
        """Count `windows` windows of outage hits a fallback dropped instead of writing back."""
        with self._lock:
            self._debt_dropped += windows

    def _bump(self, family: dict[str, int], label: str) -> None:
        count = family.get(label)
        if count is None and len(family) >= self.max_series:
            label = OTHER
            count = family.get(label)
        family[label] = (count or 0) + 1

    # -- reading -----------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """Every number, copied under the lock, as plain data (JSON-serialisable).

        The shape:

            {
              "decisions": [          # one row per label set, sorted
                {"outcome": "allowed", "source": "store", "route": "", "tier": "",
                 "count": 12}, ...
              ],
              "totals": {"allowed": 12, "denied": 3,      # every source
                         "fallback": 0, "fail_open": 0},  # decisions by those sources
              "store_errors": {"timeout": 1},
              "store_latency": {
                "buckets": {"0.0001": 4, ..., "1.0": 15, "+Inf": 15},  # cumulative
                "count": 15, "sum": 0.0123,                            # seconds
              },
              "shed": {"": 2},                   # by route
              "abuse_alerts": 1,
              "abuse_recent_keys": ["ip:…"],     # the last 10 alerted keys, oldest first
              "request_velocity": [   # one row per route and tier, sorted
                {"route": "api", "tier": "anon",
                 "buckets": {"0.1": 3, ..., "1000.0": 9, "+Inf": 9},  # cumulative
                 "count": 9, "sum": 4.2},                            # requests/s
              ],
              "fallback_debt_dropped": 0,  # windows of outage hits never written back
            }
        """
        with self._lock:
            decisions = dict(self._decisions)
            store_errors = dict(self._store_errors)
            shed = dict(self._shed)
            latency = list(self._latency_counts)
            latency_sum = self._latency_sum
            abuse_alerts = self._abuse_alerts
            abuse_recent = list(self._abuse_recent)
            velocity = {key: list(counts) for key, counts in self._velocity.items()}
            debt_dropped = self._debt_dropped
        totals = {"allowed": 0, "denied": 0, "fallback": 0, "fail_open": 0}
        rows = []
        for (allowed, source, route, tier), count in sorted(decisions.items()):
            outcome = "allowed" if allowed else "denied"
            totals[outcome] += count
            if source != "store":
                totals[source] += count
            rows.append(
                {"outcome": outcome, "source": source, "route": route, "tier": tier, "count": count}
            )
        buckets: dict[str, int] = {}
        running = 0
        for bound, count in zip((*map(_le, LATENCY_BUCKETS), "+Inf"), latency, strict=True):
            running += count
            buckets[bound] = running
        return {
            "decisions": rows,
            "totals": totals,
            "store_errors": store_errors,
            "store_latency": {"buckets": buckets, "count": running, "sum": latency_sum},
            "shed": shed,
            "abuse_alerts": abuse_alerts,
            "abuse_recent_keys": abuse_recent,
            "request_velocity": [
                {"route": route, "tier": tier, **_histogram(VELOCITY_BUCKETS, counts)}
                for (route, tier), counts in sorted(velocity.items())
            ],
            "fallback_debt_dropped": debt_dropped,
        }

    # -- Prometheus --------------------------------------------------------------

    def prometheus_collector(self) -> _PrometheusCollector:
        """A ``prometheus_client`` collector reading these metrics at each scrape.

        Register it yourself (``registry.register(...)``) or use `register`.
        Raises `ConfigurationError` when ``prometheus_client`` is not installed.
        """
        _import_prometheus()
        return _PrometheusCollector(self)

    def register(self, registry: CollectorRegistry | None = None) -> _PrometheusCollector:
        """Register these metrics on `registry` (default: ``prometheus_client.REGISTRY``).

        Returns the collector, for ``registry.unregister``. Raises
        `ConfigurationError` when ``prometheus_client`` is not installed.
        """
        prometheus_client = _import_prometheus()
        collector = _PrometheusCollector(self)
        (registry if registry is not None else prometheus_client.REGISTRY).register(collector)
        return collector


def _import_prometheus() -> Any:
    try:
        import prometheus_client
    except ImportError as exc:
        raise ConfigurationError(
            "Prometheus metrics need prometheus_client: pip install 'quota[prometheus]'"
        ) from exc
    return prometheus_client


class _PrometheusCollector:
    """Turns a `Metrics` snapshot into Prometheus metric families at each scrape."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def describe(self) -> Iterator[Metric]:
        # Names only, so registering checks for clashes without taking a snapshot.
        return self._families(None)

    def collect(self) -> Iterator[Metric]:
        return self._families(self.metrics.snapshot())

    def _families(self, snap: dict[str, Any] | None) -> Iterator[Metric]:
        from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

        decisions = CounterMetricFamily(
            "quota_decisions",
            "Rate-limit decisions, by outcome and by who decided (store, fallback, fail_open).",
            labels=["outcome", "source", "route", "tier"],
        )
        errors = CounterMetricFamily(
            "quota_store_errors", "Store calls that failed, by kind.", labels=["kind"]
        )
        shed = CounterMetricFamily(
            "quota_shed", "Requests shed by a concurrency guard.", labels=["route"]
        )
        alerts = CounterMetricFamily(
            "quota_abuse_alerts", "Abuse alerts raised (one per key per interval)."
        )
        velocity = HistogramMetricFamily(
            "quota_request_velocity",
            "Per-key request rate (requests per second) observed at each decision.",
            labels=["route", "tier"],
        )
        debt = CounterMetricFamily(
            "quota_fallback_debt_dropped",
            "Windows of outage hits a fallback dropped instead of writing them back"
            " (it owes at most Fallback.max_keys).",
        )
        if snap is None:
            yield from (decisions, errors, shed, alerts)
            yield HistogramMetricFamily(
                "quota_store_latency_seconds", "Store round-trip time in seconds."
            )
            yield from (velocity, debt)
            return
        for row in snap["decisions"]:
            decisions.add_metric(
                [row["outcome"], row["source"], row["route"], row["tier"]], row["count"]
            )
        for kind, count in sorted(snap["store_errors"].items()):
            errors.add_metric([kind], count)
        for route, count in sorted(snap["shed"].items()):
            shed.add_metric([route], count)
        alerts.add_metric([], snap["abuse_alerts"])
        latency = snap["store_latency"]
        yield from (decisions, errors, shed, alerts)
        yield HistogramMetricFamily(
            "quota_store_latency_seconds",
            "Store round-trip time in seconds.",
            buckets=list(latency["buckets"].items()),
            sum_value=latency["sum"],
        )
        for row in snap["request_velocity"]:
            velocity.add_metric(
                [row["route"], row["tier"]], list(row["buckets"].items()), sum_value=row["sum"]
            )
        debt.add_metric([], snap["fallback_debt_dropped"])
        yield from (velocity, debt)


def _kind(exc: BaseException) -> str:
    """A short word for a store failure, for the ``kind`` label."""
    text = f"{type(exc).__name__} {exc}".lower()
    if "timeout" in text or "timed out" in text or "canceling statement" in text:
        return "timeout"
    if isinstance(exc, SchemaError):
        return "schema"
    if "connect" in text or "refused" in text or "closed" in text:
        return "connection"
    return "error"


class _Timed:
    """Times one store call into `Metrics`: its latency when it returns, the kind of
    failure when it raises a `QuotaError` (both faces: ``with _Timed(metrics): …``)."""

    __slots__ = ("_metrics", "_started")

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def __enter__(self) -> None:
        self._started = time.perf_counter()

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        if exc is None:
            self._metrics.observe_store_latency(time.perf_counter() - self._started)
        elif isinstance(exc, QuotaError):
            self._metrics.record_store_error(_kind(exc))


class _Metered(Generic[S]):
    """What both faces' wrappers share: the wrapped store, the metrics, the dialect; each
    face times its own calls with `_Timed`."""

    def __init__(self, store: S, metrics: Metrics) -> None:
        self.store: S = store
        self.metrics = metrics
        self.dialect: str = store.dialect

    @property
    def up(self) -> bool:
        return self.store.up


class MeteredStore(_Metered[SyncStore]):
    """A sync store wrapper timing every statement and counting failures into `Metrics`."""

    def execute(self, statement: Statement, params: Sequence[Any]) -> Rows:
        with _Timed(self.metrics):
            return self.store.execute(statement, params)

    def execute_strict(self, statement: Statement, params: Sequence[Any]) -> Rows:
        with _Timed(self.metrics):
            return self.store.execute_strict(statement, params)

    def run(self, op: Op[T], *, transaction: bool, maintenance: bool = False) -> T:
        return self.store.run(op, transaction=transaction, maintenance=maintenance)

    def close(self) -> None:
        self.store.close()


class AsyncMeteredStore(_Metered[AsyncStore]):
    """`MeteredStore` for an async store."""

    async def execute(self, statement: Statement, params: Sequence[Any]) -> Rows:
        with _Timed(self.metrics):
            return await self.store.execute(statement, params)

    async def execute_strict(self, statement: Statement, params: Sequence[Any]) -> Rows:
        with _Timed(self.metrics):
            return await self.store.execute_strict(statement, params)

    async def run(self, op: Op[T], *, transaction: bool, maintenance: bool = False) -> T:
        return await self.store.run(op, transaction=transaction, maintenance=maintenance)

    async def aclose(self) -> None:
        await self.store.aclose()
