"""What the two limiter faces share, written once.

`quota._limiter.async_face` holds `AsyncLimiter`, the source; `quota._limiter.sync_face`
(`Limiter`) is generated from it by unasyncd, so the faces differ only in
``await``. What never awaits lives here, and both faces call it: `Options` and
their validation (`options_from`, for `quota.connect`'s two ways of passing
them), the state the hot path reads (`LimiterBase`), what a decision tells
metrics and the abuse detector, failing open, and opening a URL's store
(`open_sync`, `open_async`) as its declaration in `quota._core.url.DIALECTS` says.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
import logging
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Generic, TypedDict, TypeVar

from quota._core.algorithms import FIXED_WINDOW, Rate, open_decision
from quota._core.decision import MAX_LIMIT, Decision, check_int, check_now
from quota._core.errors import ConfigurationError
from quota._core.url import StoreURL, check_schema
from quota._limiter.quota_types import ThresholdEvent
from quota._stores import base as _stores
from quota._stores.base import AsyncStore, StoreSettings, SyncStore
from quota._stores.pool import DEFAULT_IDLE_TIMEOUT
from quota._wrappers.abuse import AbuseDetector
from quota._wrappers.batching import DEFAULT_MAX_BATCH
from quota._wrappers.fallback import Fallback, retry_after_down
from quota._wrappers.metrics import Metrics
from quota._wrappers.telemetry import Recorder, Telemetry, _Traced

Clock = Callable[[], float]
Sleep = Callable[[float], object]
#: ``on_threshold=``: called with each `quota.ThresholdEvent` a call fired, after its commit.
OnThreshold = Callable[[ThresholdEvent], object]
log = logging.getLogger("quota")
#: ``clock="database"``: take the time from the database inside each statement.
DATABASE_CLOCK = "database"

#: Default grace before an ended window is swept, in seconds: covers app
#: servers whose clocks lag the others a little.
DEFAULT_GRACE = 60
DEFAULT_BATCH_SIZE = 10_000
#: ``durability=``: "relaxed" commits PostgreSQL hits without waiting for the WAL flush.
DURABILITY_MODES = ("full", "relaxed")


@dataclass(frozen=True, slots=True, kw_only=True)
class Options:
    """Settings shared by both faces; validated when built."""

    count_denied: bool = True
    """Count denied hits too, so a client that keeps hammering stays blocked."""
    clock: Clock | str = time.time
    """Returns the current time in epoch seconds (inject one in tests), or
    ``"database"``: every statement takes the database's time, so app servers
    whose clocks disagree still share one window."""
    pool_size: int = 10
    """Most connections the limiter's store opens (PostgreSQL and SQLite, both faces);
    a call borrows one and gives it back."""
    idle_timeout: float = DEFAULT_IDLE_TIMEOUT
    """Seconds a pooled connection may stay idle before it is closed."""
    schema: str | None = None
    """PostgreSQL: the schema holding quota's tables (``search_path`` of the limiter's
    connections). None takes the URL's ``?schema=`` (default: the server's search_path)."""
    prepared_statements: bool | None = None
    """PostgreSQL: False behind a transaction pooler (PgBouncer ``pool_mode = transaction``):
    no named prepared statements, no session settings. None takes the URL's
    ``?prepared_statements=`` (default true)."""
    timeout: float = 10.0
    """Seconds to wait for a connection (PostgreSQL) or a write lock (SQLite busy timeout)."""
    fallback: Fallback | None = None
    """Fail open to an in-memory store while the database is down; None raises instead."""
    record_rate_denials: bool = False
    """Append a ``rate_denied`` entry to the quota ledger whenever a rate limit denies
    (for abuse visibility); allowed hits never write it."""
    batching: bool = False
    """Group commit: concurrent fixed-window hits share one statement (on Redis, one
    pipeline of their scripts), each caller still getting its exact count (see
    `quota._wrappers.batching`). No added latency when idle. Not for ``memory://``."""
    max_batch: int = DEFAULT_MAX_BATCH
    """Most hits one batch statement (or Redis pipeline) carries."""
    durability: str = "full"
    """``"full"``, or ``"relaxed"``: PostgreSQL commits the limiter's statements with
    ``synchronous_commit = off`` (durable quotas stay synchronous). See the README."""
    metrics: Metrics | None = None
    """Count decisions (by source), store errors and store latency into this `quota.Metrics`."""
    abuse: AbuseDetector | None = None
    """Tell this `quota.AbuseDetector` about every denial (alerts when one key is hammered)."""
    telemetry: Telemetry | None = None
    """Report decisions, store call durations, the fallback's state and a span per store
    call to OpenTelemetry (a `quota.Telemetry`; the ``otel`` extra). Keys are never
    recorded. See `quota.Telemetry`."""
    sleep: Sleep | None = None
    """What `acquire` calls to wait that many seconds: a plain function, called (never
    awaited) by both faces. Inject one beside ``clock`` in tests (it should advance that
    clock). None: ``time.sleep`` on the sync face, ``asyncio.sleep`` on the async one."""
    on_threshold: OnThreshold | None = None
    """Called with each `quota.ThresholdEvent` a call fired, after the call's transaction
    committed (never for one rolled back), in the calling thread or task, before the
    call returns. On `quota.AsyncLimiter` it may be a plain function or a coroutine
    function (awaited); on `quota.Limiter` a plain function. Whatever it raises is
    logged (logger ``quota``) and never reaches the caller; the event stays in the
    outbox either way, for ``quota notify``."""

    def __post_init__(self) -> None:
        if not isinstance(self.count_denied, bool):
            raise ConfigurationError(f"count_denied must be a bool, got {self.count_denied!r}")
        if not callable(self.clock) and self.clock != DATABASE_CLOCK:
            raise ConfigurationError(
                f"clock must be a callable returning epoch seconds or 'database', got {self.clock!r}"
            )
        check_int("pool_size", self.pool_size, maximum=1000)
        if (
            isinstance(self.idle_timeout, bool)
            or not isinstance(self.idle_timeout, (int, float))
            or not (0 < self.idle_timeout <= 86_400)
        ):
            raise ConfigurationError(
                f"idle_timeout must be seconds in (0, 86400], got {self.idle_timeout!r}"
            )
        if self.schema is not None:
            check_schema(self.schema)
        if self.prepared_statements is not None and not isinstance(self.prepared_statements, bool):
            raise ConfigurationError(
                f"prepared_statements must be a bool, got {self.prepared_statements!r}"
            )
        if (
            isinstance(self.timeout, bool)
            or not isinstance(self.timeout, (int, float))
            or not (0 < self.timeout <= 3600)
        ):
            raise ConfigurationError(f"timeout must be seconds in (0, 3600], got {self.timeout!r}")
        if self.fallback is not None and not isinstance(self.fallback, Fallback):
            raise ConfigurationError(f"fallback must be a quota.Fallback, got {self.fallback!r}")
        if not isinstance(self.record_rate_denials, bool):
            raise ConfigurationError(
                f"record_rate_denials must be a bool, got {self.record_rate_denials!r}"
            )
        if not isinstance(self.batching, bool):
            raise ConfigurationError(f"batching must be a bool, got {self.batching!r}")
        check_int("max_batch", self.max_batch, maximum=100_000)
        if self.metrics is not None and not isinstance(self.metrics, Metrics):
            raise ConfigurationError(f"metrics must be a quota.Metrics, got {self.metrics!r}")
        if self.telemetry is not None and not isinstance(self.telemetry, Telemetry):
            raise ConfigurationError(
                f"telemetry must be a bool or a quota.Telemetry, got {self.telemetry!r}"
            )
        if self.abuse is not None and not isinstance(self.abuse, AbuseDetector):
            raise ConfigurationError(f"abuse must be a quota.AbuseDetector, got {self.abuse!r}")
        if self.sleep is not None and not callable(self.sleep):
            raise ConfigurationError(
                f"sleep must be a callable taking seconds, or None, got {self.sleep!r}"
            )
        if self.on_threshold is not None and not callable(self.on_threshold):
            raise ConfigurationError(
                f"on_threshold must be a callable taking a quota.ThresholdEvent, or None,"
                f" got {self.on_threshold!r}"
            )
        if self.durability not in DURABILITY_MODES:
            raise ConfigurationError(
                f"durability must be one of {', '.join(DURABILITY_MODES)}, got {self.durability!r}"
            )

    @property
    def database_clock(self) -> bool:
        return self.clock == DATABASE_CLOCK

    @property
    def app_clock(self) -> Clock:
        """The clock read in the app: time.time under the database clock (for peek and
        fallbacks). An injected clock is checked on every read: a value that is no usable
        time (NaN, infinite, not a number) is a `ConfigurationError` naming ``clock``."""
        clock = self.clock if callable(self.clock) else time.time
        if clock is time.time:
            return clock

        def checked() -> float:
            return check_now(clock())

        return checked


class OptionsDict(TypedDict, total=False):
    """The keyword settings of `quota.connect` and `quota.connect_async`: `Options`' fields.

    Only for typing ``**settings``; `options_from` builds the `Options`, which
    validate. `fallback` also takes a bool (True: ``Fallback()``), and so does
    `telemetry` (True: ``Telemetry()``). A test keeps
    the names and types in step with `Options`.
    """

    count_denied: bool
    clock: Clock | str
    pool_size: int
    idle_timeout: float
    schema: str | None
    prepared_statements: bool | None
    timeout: float
    fallback: bool | Fallback | None
    record_rate_denials: bool
    batching: bool
    max_batch: int
    durability: str
    metrics: Metrics | None
    abuse: AbuseDetector | None
    telemetry: bool | Telemetry | None
    sleep: Sleep | None
    on_threshold: OnThreshold | None


def options_from(options: Options | None, settings: Mapping[str, object]) -> Options:
    """The `Options` of a connect call: `options`, or else built from keyword `settings`.

    Raises `ConfigurationError` when both are given (naming the keywords), for a
    setting `Options` has no field for, and for any bad value (see `Options`).
    """
    if options is not None:
        if not isinstance(options, Options):
            raise ConfigurationError(f"options must be a quota.Options, got {options!r}")
        if settings:
            raise ConfigurationError(
                "pass options=Options(...) or keyword settings, not both: got options= and "
                + ", ".join(f"{name}=" for name in settings)
            )
        return options
    known = [field.name for field in dataclasses.fields(Options)]
    unknown = [name for name in settings if name not in known]
    if unknown:
        raise ConfigurationError(
            f"unknown setting {', '.join(map(repr, unknown))}; the settings are {', '.join(known)}"
        )
    if "fallback" in settings:
        settings = {**settings, "fallback": _fallback(settings["fallback"])}
    if "telemetry" in settings:
        settings = {**settings, "telemetry": _telemetry(settings["telemetry"])}
    return Options(**settings)  # type: ignore[arg-type]


def _fallback(fallback: object) -> Fallback | None:
    if fallback is True:
        return Fallback()
    if fallback is False or fallback is None:
        return None
    if isinstance(fallback, Fallback):
        return fallback
    raise ConfigurationError(f"fallback must be a bool or a quota.Fallback, got {fallback!r}")


def _telemetry(telemetry: object) -> Telemetry | None:
    if telemetry is True:
        return Telemetry()
    if telemetry is False or telemetry is None:
        return None
    if isinstance(telemetry, Telemetry):
        return telemetry
    raise ConfigurationError(f"telemetry must be a bool or a quota.Telemetry, got {telemetry!r}")


StoreT = TypeVar("StoreT", SyncStore, AsyncStore)


class LimiterBase(Generic[StoreT]):
    """The state of either face, read from its `Options` once: the hot path tests plain attributes."""

    store: StoreT

    def __init__(self, store: StoreT, options: Options) -> None:
        self.store = store
        self.options = options
        self._clock = options.app_clock
        self._count_denied = options.count_denied
        # The positional fixed-window statement is the hot path; everything
        # else (other algorithms, the database clock) goes through _decide.
        self._fast = not options.database_clock
        self._fallback = options.fallback
        self._metrics = options.metrics
        self._abuse = options.abuse
        # The telemetry wrapper is outermost (see open_sync_store): the limiter tells its
        # recorder each decision.
        self._telemetry: Recorder | None = store.recorder if isinstance(store, _Traced) else None
        self._observing = (
            options.metrics is not None or options.abuse is not None or self._telemetry is not None
        )
        self._retry_down = retry_after_down(options.fallback) if options.fallback else 1
        self._record_denials = options.record_rate_denials
        # One test on the hot path for everything that happens after a decision.
        self._after = self._observing or self._record_denials
        self._sleep = options.sleep
        self._draw = random.random
        self._on_threshold = options.on_threshold
        # Whether the outbox table (revision 0008_thresholds) is known to be there.
        self._events = False

    def _observe(self, decision: Decision, source: str = "", algorithm: str = FIXED_WINDOW) -> None:
        """Tell the metrics, the telemetry and the abuse detector (those configured) about
        one decision made under `algorithm`."""
        if self._telemetry is not None:
            self._telemetry.decided(decision.allowed, algorithm)
        if self._metrics is not None:
            if not source:
                source = "store" if self.store.up else "fallback"
            self._metrics.record_decision(decision.allowed, source=source)
        if self._abuse is not None and not decision.allowed:
            self._abuse.record_denial(decision.key)

    def _fail_open(self, key: str, rate: Rate, cost: int, now: float) -> Decision:
        """Allow, when neither the store nor the memory fallback could decide."""
        log.exception("quota: neither the store nor the memory fallback decided; allowing")
        decision = open_decision(key, rate, cost, now)
        if self._observing:
            self._observe(decision, "fail_open", rate.algorithm)
        return decision


# -- waiting (acquire): what differs between the faces, as twins unasyncd swaps ------------

T = TypeVar("T")
Attempt = tuple[Decision, int]


async def async_sleep(seconds: float) -> None:
    """The async face's real sleep."""
    await asyncio.sleep(seconds)


def sync_sleep(seconds: float) -> None:
    """The sync face's real sleep."""
    time.sleep(seconds)


async def async_threshold(callback: OnThreshold, event: ThresholdEvent) -> None:
    """Call the async face's ``on_threshold``: a coroutine function's result is awaited."""
    result = callback(event)
    if inspect.isawaitable(result):
        await result


def sync_threshold(callback: OnThreshold, event: ThresholdEvent) -> None:
    """Call the sync face's ``on_threshold``."""
    result = callback(event)
    if inspect.isawaitable(result):
        # A coroutine nobody awaits would warn later, far from its cause: say it now.
        close = getattr(result, "close", None)
        if close is not None:
            close()
        raise ConfigurationError(
            "on_threshold returned an awaitable: Limiter calls a plain function;"
            " give a coroutine function to AsyncLimiter (connect_async)"
        )


async def async_settle(attempt: Awaitable[T], kept: Callable[[T], bool]) -> T:
    """Await one attempt of a wait to its end, even if the task is cancelled meanwhile.

    Cancelling a statement in flight could leave a hit counted (a slot taken)
    that no caller got. So the attempt always finishes; if a cancellation came
    meanwhile, an attempt whose result is not `kept` (a denial: nothing was
    charged) raises `asyncio.CancelledError`, and one that is kept is returned,
    the cancellation being requested again so that it reaches the caller at its
    next ``await``.
    """
    task = asyncio.ensure_future(attempt)
    cancelled = False
    while True:
        try:
            result = await asyncio.shield(task)
            break
        except asyncio.CancelledError:
            if task.cancelled():
                raise
            cancelled = True
            if task.done():
                result = task.result()
                break
    if cancelled:
        if not kept(result):
            raise asyncio.CancelledError
        current = asyncio.current_task()
        if current is not None:
            current.cancel()
    return result


def sync_settle(attempt: T, kept: Callable[[T], bool]) -> T:
    """The sync face's attempt has ended by the time it is returned."""
    return attempt


def allowed(attempt: Attempt) -> bool:
    """Whether an attempt of `acquire` took its slot (`async_settle` keeps it)."""
    return attempt[0].allowed


def check_async_target(func: object) -> None:
    """`AsyncLimiter.limit` decorates coroutine functions; anything else is a `ConfigurationError`."""
    if not inspect.iscoroutinefunction(func):
        raise ConfigurationError(
            f"AsyncLimiter.limit decorates async functions (async def), got {func!r};"
            " use Limiter.limit for plain functions"
        )


def check_sync_target(func: object) -> None:
    """`Limiter.limit` decorates plain functions; anything else is a `ConfigurationError`."""
    if not callable(func) or inspect.iscoroutinefunction(func):
        raise ConfigurationError(
            f"Limiter.limit decorates plain functions, got {func!r};"
            " use AsyncLimiter.limit for async functions"
        )


def key_of(key: object, func: Callable[..., object]) -> Callable[..., str]:
    """The key function of a `limit` decorator: `key` a string, a callable of the call's
    arguments returning one, or None for the function's module and qualified name."""
    if key is None:
        name = f"{func.__module__}.{func.__qualname__}"
        return lambda *args, **kwargs: name
    if isinstance(key, str):
        if not key:
            raise ConfigurationError("key must be a non-empty string or a callable, got ''")
        fixed = key
        return lambda *args, **kwargs: fixed
    if callable(key):
        return key
    raise ConfigurationError(
        f"key must be a string or a callable of the call's arguments, got {key!r}"
    )


def check_wait(wait: object) -> bool:
    if not isinstance(wait, bool):
        raise ConfigurationError(f"wait must be a bool, got {wait!r}")
    return wait


@functools.lru_cache(maxsize=1024, typed=True)  # typed: True must not pass as 1
def rate_of(limit: int, window: int, algorithm: str, burst: int | None) -> Rate:
    """The validated `Rate` of a call's arguments, built once per distinct set."""
    return Rate(limit=limit, window=window, algorithm=algorithm, burst=burst)


def check_cost(cost: object, limit: object) -> int:
    """`cost` if it is a positive int the limit can allow; `ConfigurationError` naming it if not."""
    return check_int("cost", cost, maximum=limit if type(limit) is int and limit > 0 else MAX_LIMIT)


# -- the stores: opened where their declaration (`quota._core.url.DIALECTS`) says -----------


def _timeout(options: Options) -> float:
    # Under a fallback a slow database must not make a slow request: the
    # store's own waits shrink to the fallback's time budget.
    return options.fallback.timeout if options.fallback else options.timeout


def store_settings(options: Options) -> StoreSettings:
    """What the store is opened with, read from `options`."""
    return StoreSettings(
        timeout=_timeout(options), connect_timeout=options.timeout,
        statement_timeout=options.fallback.timeout if options.fallback else None,
        db_clock=options.database_clock, serialize=options.fallback is not None,
        pool_size=options.pool_size, idle_timeout=options.idle_timeout,
        relaxed=options.durability == "relaxed",
        prepared_statements=options.prepared_statements, schema=options.schema,
    )  # fmt: skip


def memory_fallback(fallback: Fallback) -> SyncStore:
    """The in-memory store that decides while the database is down."""
    from quota._stores.memory import MemoryStore

    return MemoryStore(max_keys=fallback.max_keys)


def async_memory_fallback(fallback: Fallback) -> AsyncStore:
    """The in-memory store that decides while the database is down."""
    from quota._stores.memory import AsyncMemoryStore

    return AsyncMemoryStore(max_keys=fallback.max_keys)


def open_sync(parsed: StoreURL, options: Options) -> SyncStore:
    """The sync store of `parsed` (its declaration, `quota._core.url.DIALECTS`, says where
    it opens); `ConfigurationError` if the URL names an async driver or `options` one the
    store has no use for."""
    parsed.driver_for(asynchronous=False)
    _check_for_dialect(parsed, options)
    return _stores.open_sync(parsed, store_settings(options))


def open_async(parsed: StoreURL, options: Options) -> AsyncStore:
    """The async store of `parsed`; see `open_sync`."""
    parsed.driver_for(asynchronous=True)
    _check_for_dialect(parsed, options)
    return _stores.open_async(parsed, store_settings(options))


def _check_for_dialect(parsed: StoreURL, options: Options) -> None:
    """Refuse options the dialect has no use for, naming them."""
    if options.schema is not None and not parsed.kind.schemas:
        raise ConfigurationError(
            f"schema={options.schema!r} is for PostgreSQL; a {parsed.dialect} store has no schemas"
        )
    if options.batching and not parsed.kind.batching:
        raise ConfigurationError(
            "batching=True groups SQL statements (Redis scripts) into one round trip;"
            f" a {parsed.dialect}:// store decides each call in memory: leave batching off"
        )
