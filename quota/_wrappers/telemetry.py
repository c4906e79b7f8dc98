"""OpenTelemetry metrics and traces for the limiter (``pip install 'quota[otel]'``).

``quota.connect(url, telemetry=True)`` reports through the global meter and
tracer providers (``opentelemetry.metrics`` / ``opentelemetry.trace``), under
the instrumentation scope ``quota`` and the package's version;
``telemetry=quota.Telemetry(meter_provider=..., tracer_provider=...)`` takes
providers of its own instead. The instruments:

========================  ===================  ==============================
name                      type                 attributes
========================  ===================  ==============================
quota.decisions           counter              outcome, algorithm, store
quota.store.duration      histogram (s)        store, operation
quota.fallback.active     observable gauge     store
========================  ===================  ==============================

``outcome`` is ``allowed`` or ``denied``; ``algorithm`` is the rate's
(``fixed_window``, ``sliding_window``, ``token_bucket``, ``gcra``), ``check``
for `Limiter.check` and ``quota`` for `Limiter.consume_quota`; ``store`` is
the kind of store (``sqlite``, ``postgresql``, ``redis``, ``memory``);
``operation`` is the store call (a statement's name, such as ``hit`` or
``sliding_window``, or an operation's, such as ``check``).
``quota.fallback.active`` is 1 while the memory fallback decides (the store
is down), else 0: one value per kind of store, 1 when any limiter of that kind
reporting to the meter provider is on its fallback.

Every store call is a span ``quota.<operation>`` with the attributes
``quota.store`` and ``quota.operation``; a call that decided also has
``quota.algorithm`` and ``quota.outcome``. Keys are never recorded, in spans
or metrics: they are unbounded and often personal.

Telemetry never raises into the caller: a failure of the SDK or an exporter
is logged (logger ``quota``, at warning, once per kind) and swallowed.
"""

from __future__ import annotations

import contextvars
import functools
import importlib.metadata
import logging
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from quota._core.errors import ConfigurationError
from quota._sql.statements import Statement
from quota._sql.steps import Op, Rows
from quota._stores.base import AsyncStore, SyncStore

T = TypeVar("T")
S = TypeVar("S", SyncStore, AsyncStore)
log = logging.getLogger("quota")

#: The instrumentation scope of quota's meter and tracer.
SCOPE = "quota"
#: Store calls that decide a rate limit, by the algorithm they decide for: their span
#: waits for the limiter to name the outcome.
DECIDING = {
    "hit": "fixed_window", "hit_capped": "fixed_window", "fixed_window": "fixed_window",
    "fixed_window_capped": "fixed_window", "sliding_window": "sliding_window",
    "token_bucket": "token_bucket", "gcra": "gcra", "check": "check", "consume": "quota",
}  # fmt: skip


def _version() -> str | None:
    try:
        return importlib.metadata.version("quota")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout, not installed
        return None


def _import_otel() -> tuple[Any, Any]:
    try:
        import opentelemetry.metrics as metrics
        import opentelemetry.trace as trace
    except ImportError as exc:
        raise ConfigurationError(
            "telemetry needs the OpenTelemetry API: pip install 'quota[otel]'"
        ) from exc
    return metrics, trace


@dataclass(frozen=True, slots=True, kw_only=True)
class Telemetry:
    """Where ``telemetry=`` reports: OpenTelemetry providers (the global ones by default).

    ``telemetry=True`` is ``Telemetry()``. Raises `ConfigurationError` when the
    OpenTelemetry API is not installed (``pip install 'quota[otel]'``).
    """

    meter_provider: Any = None
    """An ``opentelemetry.metrics.MeterProvider``; None: the global one, as set when
    the limiter is connected."""
    tracer_provider: Any = None
    """An ``opentelemetry.trace.TracerProvider``; None: the global one."""

    def __post_init__(self) -> None:
        _import_otel()
        if self.meter_provider is not None and not hasattr(self.meter_provider, "get_meter"):
            raise ConfigurationError(
                f"meter_provider must be an OpenTelemetry MeterProvider, got {self.meter_provider!r}"
            )
        if self.tracer_provider is not None and not hasattr(self.tracer_provider, "get_tracer"):
            raise ConfigurationError(
                "tracer_provider must be an OpenTelemetry TracerProvider,"
                f" got {self.tracer_provider!r}"
            )


class _Pending:
    """A deciding store call that has returned, waiting for the limiter's outcome."""

    __slots__ = ("end", "operation", "owner", "start")

    def __init__(self, owner: Recorder, operation: str, start: int, end: int) -> None:
        self.owner, self.operation, self.start, self.end = owner, operation, start, end


# Set by the wrapper (the outermost one, awaited in the caller's own context) and
# taken by the limiter once it has decided: concurrent tasks and threads each see their own.
_pending: contextvars.ContextVar[_Pending | None] = contextvars.ContextVar(
    "quota_telemetry_pending", default=None
)


# Meter provider -> the recorders reporting to it (held weakly: a limiter that is gone
# stops being reported).
_gauges: weakref.WeakKeyDictionary[Any, weakref.WeakSet[Recorder]] = weakref.WeakKeyDictionary()
_gauges_lock = threading.Lock()


def _observe_fallbacks(recorders: weakref.WeakSet[Recorder], metrics: Any, options: object) -> Any:
    """``quota.fallback.active`` by kind of store: 1 when any limiter's fallback decides."""
    try:
        with _gauges_lock:
            live = list(recorders)
        active: dict[str, int] = {}
        for recorder in live:
            kind = recorder.store_kind
            active[kind] = max(active.get(kind, 0), int(recorder.fallback_active()))
        return [metrics.Observation(value, {"store": kind}) for kind, value in active.items()]
    except Exception:
        log.warning("quota: telemetry failed (fallback gauge)", exc_info=True)
        return []


class Recorder:
    """The instruments of one limiter; every method swallows (and logs) its own failures."""

    def __init__(
        self, config: Telemetry, store_kind: str, answers: tuple[type[BaseException], ...] = ()
    ) -> None:
        """`answers`: exceptions a store call raises to answer, not to fail (the durable
        quotas' rollback with a result); their calls are no error spans."""
        metrics, trace = _import_otel()
        self.store_kind = store_kind
        self._answers = answers
        meters = config.meter_provider or metrics.get_meter_provider()
        tracers = config.tracer_provider or trace.get_tracer_provider()
        meter = meters.get_meter(SCOPE, _version())
        self._tracer = tracers.get_tracer(SCOPE, _version())
        self._error = trace.StatusCode.ERROR
        self._decisions = meter.create_counter(
            "quota.decisions", unit="{decision}", description="Rate-limit and quota decisions."
        )
        self._duration = meter.create_histogram(
            "quota.store.duration", unit="s", description="Duration of store calls."
        )
        self._fallback_of: Any = None
        # One gauge per meter provider (a second one of the same name would be ignored),
        # reading every limiter that reports to it.
        with _gauges_lock:
            recorders = _gauges.get(meters)
            if recorders is None:
                recorders = _gauges[meters] = weakref.WeakSet()
                meter.create_observable_gauge(
                    "quota.fallback.active",
                    callbacks=[functools.partial(_observe_fallbacks, recorders, metrics)],
                    unit="1",
                    description="1 while the memory fallback decides (the store is down), else 0.",
                )
            recorders.add(self)
        # Attribute sets, built once each: the hot path only looks them up.
        self._decision_attrs: dict[tuple[bool, str], dict[str, str]] = {}
        self._call_attrs: dict[str, dict[str, str]] = {}
        self._warned: set[str] = set()

    def watch_fallback(self, store: object) -> None:
        """Report `store`'s ``up`` (a fallback wrapper) as ``quota.fallback.active``; held weakly."""
        self._fallback_of = weakref.ref(store)

    def fallback_active(self) -> bool:
        """Whether this limiter's memory fallback decides now (its store is down)."""
        store = self._fallback_of() if self._fallback_of is not None else None
        return store is not None and not store.up

    def _failed(self, what: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning("quota: telemetry failed (%s); carrying on without it", what, exc_info=True)

    # -- the limiter reports decisions ---------------------------------------------------

    def decided(self, allowed: bool, algorithm: str, *, count: bool = True) -> None:
        """One decision: count it (unless not `count`: an attempt of a wait), and end the
        span of the store call that made it, if one waits."""
        try:
            attrs = self._decision_attrs.get((allowed, algorithm))
            if attrs is None:
                attrs = self._decision_attrs[(allowed, algorithm)] = {
                    "outcome": "allowed" if allowed else "denied",
                    "algorithm": algorithm,
                    "store": self.store_kind,
                }
            if count:
                self._decisions.add(1, attrs)
            pending = _pending.get()
            if pending is not None and pending.owner is self:  # not another limiter's
                _pending.set(None)
                self._span(
                    pending.operation, pending.start, pending.end, algorithm, attrs["outcome"]
                )
        except Exception:
            self._failed("decision")

    # -- the store wrapper reports calls ---------------------------------------------------

    def called(self, operation: str, start: int, started: float, exc: BaseException | None) -> None:
        """A store call that began at `start` (epoch ns; `started` perf_counter) has ended."""
        try:
            end = time.time_ns()
            attrs = self._call_attrs.get(operation)
            if attrs is None:
                attrs = self._call_attrs[operation] = {
                    "store": self.store_kind,
                    "operation": operation,
                }
            self._duration.record(time.perf_counter() - started, attrs)
            if exc is not None and isinstance(exc, self._answers):
                exc = None  # a durable quota's answer given by rolling back: no failure
            if operation in DECIDING:
                left = _pending.get()
                if left is not None:  # a deciding call nobody named the outcome of
                    _pending.set(None)
                    left.owner._span(left.operation, left.start, left.end, None, None)
                if exc is None:
                    _pending.set(_Pending(self, operation, start, end))
                    return
            self._span(operation, start, end, None, None, exc)
        except Exception:
            self._failed("store call")

    def _span(
        self, operation: str, start: int, end: int, algorithm: str | None, outcome: str | None,
        exc: BaseException | None = None,
    ) -> None:  # fmt: skip
        attributes = {"quota.store": self.store_kind, "quota.operation": operation}
        if algorithm is not None and outcome is not None:
            attributes["quota.algorithm"] = algorithm
            attributes["quota.outcome"] = outcome
        span = self._tracer.start_span(
            "quota." + operation, start_time=start, attributes=attributes
        )
        if exc is not None:
            span.record_exception(exc)
            span.set_status(self._error, type(exc).__name__)
        span.end(end_time=end)


def _op_name(op: object) -> str:
    return str(getattr(op, "__name__", "run")).lstrip("_") or "run"


class _Traced(Generic[S]):
    """What both faces' wrappers share: the wrapped store, the recorder, the dialect."""

    def __init__(self, store: S, recorder: Recorder) -> None:
        self.store: S = store
        self.recorder = recorder
        self.dialect: str = store.dialect

    @property
    def up(self) -> bool:
        return self.store.up


class TracedStore(_Traced[SyncStore]):
    """A sync store wrapper: a span and a duration for every store call."""

    def execute(self, statement: Statement, params: Sequence[Any]) -> Rows:
        start, started = time.time_ns(), time.perf_counter()
        try:
            rows = self.store.execute(statement, params)
        except BaseException as exc:
            self.recorder.called(statement.name, start, started, exc)
            raise
        self.recorder.called(statement.name, start, started, None)
        return rows

    def execute_strict(self, statement: Statement, params: Sequence[Any]) -> Rows:
        start, started = time.time_ns(), time.perf_counter()
        try:
            rows = self.store.execute_strict(statement, params)
        except BaseException as exc:
            self.recorder.called(statement.name, start, started, exc)
            raise
        self.recorder.called(statement.name, start, started, None)
        return rows

    def run(self, op: Op[T], *, transaction: bool, maintenance: bool = False) -> T:
        name, start, started = _op_name(op), time.time_ns(), time.perf_counter()
        try:
            result = self.store.run(op, transaction=transaction, maintenance=maintenance)
        except BaseException as exc:
            self.recorder.called(name, start, started, exc)
            raise
        self.recorder.called(name, start, started, None)
        return result

    def close(self) -> None:
        self.store.close()


class AsyncTracedStore(_Traced[AsyncStore]):
    """`TracedStore` for an async store."""

    async def execute(self, statement: Statement, params: Sequence[Any]) -> Rows:
        start, started = time.time_ns(), time.perf_counter()
        try:
            rows = await self.store.execute(statement, params)
        except BaseException as exc:
            self.recorder.called(statement.name, start, started, exc)
            raise
        self.recorder.called(statement.name, start, started, None)
        return rows

    async def execute_strict(self, statement: Statement, params: Sequence[Any]) -> Rows:
        start, started = time.time_ns(), time.perf_counter()
        try:
            rows = await self.store.execute_strict(statement, params)
        except BaseException as exc:
            self.recorder.called(statement.name, start, started, exc)
            raise
        self.recorder.called(statement.name, start, started, None)
        return rows

    async def run(self, op: Op[T], *, transaction: bool, maintenance: bool = False) -> T:
        name, start, started = _op_name(op), time.time_ns(), time.perf_counter()
        try:
            result = await self.store.run(op, transaction=transaction, maintenance=maintenance)
        except BaseException as exc:
            self.recorder.called(name, start, started, exc)
            raise
        self.recorder.called(name, start, started, None)
        return result

    async def aclose(self) -> None:
        await self.store.aclose()
