"""The limiters: thin sync and async drivers around the decision core.

`Limiter` and `AsyncLimiter` hold no logic of their own: they read the clock,
ask `quota._core` to validate and place the call, hand the statement to their
store, and let the core decide from the rows that come back. Operations other
than the hot path are generators in `quota._ops`, driven by the store.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from quota import _algorithms, _ops, _quotas, _sql
from quota._abuse import AbuseDetector
from quota._algorithms import FIXED_WINDOW, Rate, closed_decision, open_decision
from quota._batch import DEFAULT_MAX_BATCH, AsyncBatchingStore, BatchingStore
from quota._core import (
    MAX_LIMIT,
    MAX_WINDOW,
    Decision,
    check_int,
    check_now,
    decide,
    decide_uncounted,
    hit_params,
    stored_key,
)
from quota._errors import ConfigurationError, QuotaError
from quota._metrics import AsyncMeteredStore, MeteredStore, Metrics
from quota._ops import CleanupResult, Usage
from quota._policy import as_rates, most_restrictive
from quota._pool import DEFAULT_IDLE_TIMEOUT
from quota._quotas import (
    CheckDecision,
    LedgerEntry,
    QuotaDecision,
    QuotaLimit,
    QuotaUsage,
    RateWindow,
    RefundResult,
)
from quota._resilience import (
    AsyncResilientStore,
    Fallback,
    ResilientStore,
    StoreDown,
    retry_after_down,
)
from quota._store import AsyncStore, SyncStore
from quota._url import StoreURL, check_schema, parse_url

Clock = Callable[[], float]
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
    """Group commit: concurrent fixed-window hits share one statement, each caller still
    getting its exact count (see `quota._batch`). No added latency when idle."""
    max_batch: int = DEFAULT_MAX_BATCH
    """Most hits one batch statement carries."""
    durability: str = "full"
    """``"full"``, or ``"relaxed"``: PostgreSQL commits the limiter's statements with
    ``synchronous_commit = off`` (durable quotas stay synchronous). See the README."""
    metrics: Metrics | None = None
    """Count decisions (by source), store errors and store latency into this `quota.Metrics`."""
    abuse: AbuseDetector | None = None
    """Tell this `quota.AbuseDetector` about every denial (alerts when one key is hammered)."""

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
        if self.abuse is not None and not isinstance(self.abuse, AbuseDetector):
            raise ConfigurationError(f"abuse must be a quota.AbuseDetector, got {self.abuse!r}")
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


def _observe(limiter: Limiter | AsyncLimiter, decision: Decision, source: str = "") -> None:
    """Tell the limiter's metrics and abuse detector about one decision (both faces)."""
    if limiter._metrics is not None:
        if not source:
            source = "store" if getattr(limiter.store, "up", True) else "fallback"
        limiter._metrics.record_decision(decision.allowed, source=source)
    if limiter._abuse is not None and not decision.allowed:
        limiter._abuse.record_denial(decision.key)


@functools.lru_cache(maxsize=1024, typed=True)  # typed: True must not pass as 1
def _rate(limit: int, window: int, algorithm: str, burst: int | None) -> Rate:
    """The validated `Rate` of a call's arguments, built once per distinct set."""
    return Rate(limit=limit, window=window, algorithm=algorithm, burst=burst)


def _fail_open(
    limiter: Limiter | AsyncLimiter, key: str, rate: Rate, cost: int, now: float
) -> Decision:
    """Allow, when neither the store nor the memory fallback could decide (both faces)."""
    log.exception("quota: neither the store nor the memory fallback decided; allowing")
    decision = open_decision(key, rate, cost, now)
    if limiter._observing:
        _observe(limiter, decision, "fail_open")
    return decision


def _check_cost(cost: object, limit: object) -> int:
    return check_int("cost", cost, maximum=limit if type(limit) is int and limit > 0 else MAX_LIMIT)


class Limiter:
    """Rate limits kept in a database, for synchronous code. Thread-safe.

    Get one from `quota.connect`. Use it as a context manager, or call
    `close` when done.
    """

    def __init__(self, store: SyncStore, options: Options) -> None:
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
        self._observing = options.metrics is not None or options.abuse is not None
        self._retry_down = retry_after_down(options.fallback) if options.fallback else 1
        self._record_denials = options.record_rate_denials
        # One test on the hot path for everything that happens after a decision.
        self._after = self._observing or self._record_denials

    def rate_limit(
        self, key: str, limit: int, window: int, *, cost: int = 1,
        algorithm: str = FIXED_WINDOW, burst: int | None = None, fail_closed: bool = False,
    ) -> Decision:  # fmt: skip
        """Count one hit on `key` and decide: at most `limit` hits per `window` seconds.

        `algorithm` is ``fixed_window`` (windows aligned to the epoch; the
        default), ``sliding_window``, ``token_bucket`` or ``gcra``; `burst` is
        the capacity of the last two (default `limit`). One atomic statement
        per call. Raises `ConfigurationError` for bad arguments (a `cost` the
        limit can never allow included), `StorageError` when the database
        fails, `SchemaError` when the tables are missing; with a `fallback`
        (see `quota.connect`) it never raises for the database: memory
        decides while it is down, and a `fail_closed` call is denied instead.
        """
        if algorithm != FIXED_WINDOW or not self._fast or fail_closed:
            return self._decide(key, _rate(limit, window, algorithm, burst), cost, fail_closed)
        now = self._clock()
        params = hit_params(
            key,
            limit,
            window,
            now,
            cost if cost.__class__ is int and cost == 1 else _check_cost(cost, limit),
        )
        try:
            if self._count_denied:
                rows = self.store.execute(_sql.HIT, params)
            else:
                rows = self.store.execute(_sql.HIT_CAPPED, (*params, limit))
        except Exception:
            if self._fallback is None:
                raise
            return _fail_open(self, key, Rate(limit=limit, window=window), cost, now)
        if rows:
            decision = decide(key, limit, window, params[2], now, rows[0][0])
        else:
            decision = self._uncounted(key, limit, window, params, now)
        if self._after and (self._observing or not decision.allowed):
            if self._record_denials and not decision.allowed:
                self._record_denial(decision, cost, now)
            if self._observing:
                _observe(self, decision)
        return decision

    def hit(
        self, key: str, rates: Rate | str | Iterable[Rate], *, cost: int = 1,
        fail_closed: bool = False,
    ) -> Decision:  # fmt: skip
        """Count one hit on `key` under each of `rates` and return the most restrictive decision.

        `rates` is a `Rate`, several, or a rate string (``"100/minute;1000/day"``).
        Each rate counts on its own; for all-or-nothing across several limits
        use `check`.
        """
        decisions = [self._decide(key, rate, cost, fail_closed) for rate in as_rates(rates)]
        return decisions[0] if len(decisions) == 1 else most_restrictive(decisions)

    def _decide(self, key: str, rate: Rate, cost: int, fail_closed: bool = False) -> Decision:
        if cost.__class__ is not int or cost != 1:  # a cost of 1 fits every rate
            rate.check_cost(cost)
        now = self._clock()
        sql, params = _algorithms.plan(
            key, rate, cost, now, count_denied=self._count_denied, database_clock=not self._fast
        )
        strict = fail_closed and self._fallback is not None
        try:
            rows = (self.store.execute_strict if strict else self.store.execute)(sql, params)  # type: ignore[attr-defined]
        except StoreDown:
            decision = closed_decision(key, rate, now, self._retry_down)
            if self._observing:
                _observe(self, decision, "fallback")
            return decision
        except Exception:
            if self._fallback is None:
                raise
            return _fail_open(self, key, rate, cost, now)
        if not rows and sql is _sql.HIT_CAPPED:
            decision = self._uncounted(key, rate.limit, rate.window, params, now)
        else:
            decision = _algorithms.decide_rows(key, rate, cost, now, rows)
        if self._after and (self._observing or not decision.allowed):
            if self._record_denials and not decision.allowed:
                self._record_denial(decision, cost, now)
            if self._observing:
                _observe(self, decision)
        return decision

    def _uncounted(
        self, key: str, limit: int, window: int, params: Sequence[Any], now: float
    ) -> Decision:
        """A capped window denied without counting: read what it holds, for honest numbers."""
        try:
            stored = self.store.execute(_sql.PEEK, (params[0],))
        except Exception:  # the denial stands; only the reported count is lost
            return decide(key, limit, window, params[2], now, None)
        return decide_uncounted(
            key, limit, window, params[2], now, int(stored[0][0]) if stored else 0
        )

    def peek(
        self, key: str, limit: int, window: int, *, algorithm: str = FIXED_WINDOW,
        burst: int | None = None,
    ) -> Decision:  # fmt: skip
        """`key`'s state under this limit, without counting a hit (the app clock decides).

        ``allowed`` says whether one more hit would pass right now.
        """
        rate = Rate(limit=limit, window=window, algorithm=algorithm, burst=burst)
        return self.store.run(_ops.peek(key, rate, self._clock()), transaction=False)

    def reset(self, key: str, window: int | None = None) -> int:
        """Forget `key`'s counts (only for windows of `window` seconds if given); return rows deleted."""
        if window is not None:
            check_int("window", window, maximum=MAX_WINDOW)
        return self.store.run(_ops.reset(stored_key(key), window), transaction=False)

    def top(self, n: int = 10) -> list[Usage]:
        """The `n` busiest keys in windows still running, busiest first."""
        return self.store.run(_ops.top(self._clock(), n), transaction=False)

    def cleanup(
        self,
        *,
        grace: int = DEFAULT_GRACE,
        batch_size: int = DEFAULT_BATCH_SIZE,
        dry_run: bool = False,
    ) -> CleanupResult:
        """Delete windows that ended more than `grace` seconds ago; see `quota._ops.cleanup`."""
        op = _ops.cleanup(
            self.store.dialect, self._clock(), grace=grace, batch_size=batch_size, dry_run=dry_run
        )
        return self.store.run(op, transaction=False)

    # -- durable quotas (quota._quotas): one transaction each ------------------------------

    def consume_quota(
        self, subject: str, name: str, limit: int, period: str | int, cost: int = 1,
        idempotency_key: str | None = None, tz: str | None = None,
    ) -> QuotaDecision:  # fmt: skip
        """Charge `cost` units of `subject`'s quota `name`, allowing at most `limit` per `period`.

        `period` is ``"day"``, ``"week"`` (ISO, from Monday) or ``"month"``,
        aligned to the calendar of time zone `tz` (an IANA name; UTC when
        None), or a whole number of seconds aligned to the epoch. A denial
        charges nothing. With `idempotency_key`, every retry (from any
        process, after any restart) gets the original decision back, marked
        ``replayed``, and the charge is made once. The usage and its ledger
        entry are written in one transaction.

        Raises `ConfigurationError` naming the bad argument (unknown period or
        zone, a limit or cost that is not a positive int, a cost above the
        limit), `StorageError` when the database fails (nothing is written).
        """
        now = self._clock()
        make = functools.partial(
            _quotas.consume, subject, name, limit, period, cost, idempotency_key, tz, now
        )
        return _quotas.run(self.store, make(), again=make)

    def refund_quota(self, subject: str, name: str, idempotency_key: str) -> RefundResult:
        """Give back the charge `idempotency_key` holds (its work failed, say).

        Refunding an unknown key, or a key already refunded, does nothing and
        says so in the result's ``status``. The key is free again afterwards.
        """
        make = functools.partial(_quotas.refund, subject, name, idempotency_key, self._clock())
        return _quotas.run(self.store, make(), again=make)

    def grant_quota(
        self, subject: str, name: str, amount: int, period: str | int, tz: str | None = None
    ) -> QuotaUsage:
        """Add `amount` units to `subject`'s quota `name` for the current `period` only."""
        make = functools.partial(_quotas.grant, subject, name, amount, period, tz, self._clock())
        return _quotas.run(self.store, make(), again=make)

    def quota_usage(self, subject: str, *, include_ended: bool = False) -> list[QuotaUsage]:
        """`subject`'s quotas in the periods running now (every period with `include_ended`)."""
        op = _quotas.usage(subject, self._clock(), include_ended=include_ended)
        return _quotas.run(self.store, op)

    def ledger(self, subject: str, since: float | None = None) -> list[LedgerEntry]:
        """`subject`'s ledger entries, oldest first; `since` (epoch seconds or an aware datetime) filters."""
        return _quotas.run(self.store, _quotas.ledger(subject, since))

    def cleanup_ledger(
        self, *, older_than: int, batch_size: int = DEFAULT_BATCH_SIZE, dry_run: bool = False
    ) -> CleanupResult:
        """Delete ledger entries older than `older_than` seconds (retention); usage stays.

        Idempotency keys whose charge is deleted are forgotten: keep the
        ledger longer than any client retries.
        """
        op = _quotas.cleanup_ledger(
            self._clock(), older_than, batch_size=batch_size, dry_run=dry_run
        )
        return self.store.run(op, transaction=False)

    def check(
        self, *limits: RateWindow | QuotaLimit, cost: int = 1, idempotency_key: str | None = None
    ) -> CheckDecision:
        """Charge `cost` to every limit, or to none: all or nothing, in one transaction.

        Each limit is a `quota.RateWindow` (the fixed window `rate_limit` counts
        in, here never charged past its limit) or a `quota.QuotaLimit`. If any
        would deny, nothing is charged anywhere and the decision names the
        first limit that denied and the longest ``retry_after``. Rows are
        touched in one fixed order, so concurrent checks never deadlock. An
        `idempotency_key` (which needs a `QuotaLimit`) makes retries return
        the original outcome without charging again.
        """
        make = functools.partial(
            _quotas.check, limits, cost, idempotency_key, self._clock(),
            record_rate_denials=self._record_denials,
        )  # fmt: skip
        return _quotas.run(self.store, make(), again=make)

    def _record_denial(self, decision: Decision, cost: int, now: float) -> None:
        try:
            self.store.run(_quotas.record_rate_denial(decision, cost, now), transaction=False)
        except QuotaError:
            # An audit entry must not turn a decision already made into an error.
            log.warning("quota: could not record a rate denial in the ledger", exc_info=True)

    def close(self) -> None:
        """Close the store's connections. The limiter reopens them if used again."""
        self.store.close()

    def __enter__(self) -> Limiter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class AsyncLimiter:
    """Rate limits kept in a database, for asyncio code. Safe to share between tasks.

    Get one from `quota.connect_async`. Use it as an async context manager,
    or await `aclose` when done. It belongs to the event loop that first uses it.
    """

    def __init__(self, store: AsyncStore, options: Options) -> None:
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
        self._observing = options.metrics is not None or options.abuse is not None
        self._retry_down = retry_after_down(options.fallback) if options.fallback else 1
        self._record_denials = options.record_rate_denials
        # One test on the hot path for everything that happens after a decision.
        self._after = self._observing or self._record_denials

    async def rate_limit(
        self, key: str, limit: int, window: int, *, cost: int = 1,
        algorithm: str = FIXED_WINDOW, burst: int | None = None, fail_closed: bool = False,
    ) -> Decision:  # fmt: skip
        """Count one hit on `key` and decide; see `Limiter.rate_limit`."""
        if algorithm != FIXED_WINDOW or not self._fast or fail_closed:
            return await self._decide(
                key, _rate(limit, window, algorithm, burst), cost, fail_closed
            )
        now = self._clock()
        params = hit_params(
            key,
            limit,
            window,
            now,
            cost if cost.__class__ is int and cost == 1 else _check_cost(cost, limit),
        )
        try:
            if self._count_denied:
                rows = await self.store.execute(_sql.HIT, params)
            else:
                rows = await self.store.execute(_sql.HIT_CAPPED, (*params, limit))
        except Exception:
            if self._fallback is None:
                raise
            return _fail_open(self, key, Rate(limit=limit, window=window), cost, now)
        if rows:
            decision = decide(key, limit, window, params[2], now, rows[0][0])
        else:
            decision = await self._uncounted(key, limit, window, params, now)
        if self._after and (self._observing or not decision.allowed):
            if self._record_denials and not decision.allowed:
                await self._record_denial(decision, cost, now)
            if self._observing:
                _observe(self, decision)
        return decision

    async def hit(
        self, key: str, rates: Rate | str | Iterable[Rate], *, cost: int = 1,
        fail_closed: bool = False,
    ) -> Decision:  # fmt: skip
        """See `Limiter.hit`."""
        decisions = [await self._decide(key, rate, cost, fail_closed) for rate in as_rates(rates)]
        return decisions[0] if len(decisions) == 1 else most_restrictive(decisions)

    async def _decide(self, key: str, rate: Rate, cost: int, fail_closed: bool = False) -> Decision:
        if cost.__class__ is not int or cost != 1:  # a cost of 1 fits every rate
            rate.check_cost(cost)
        now = self._clock()
        sql, params = _algorithms.plan(
            key, rate, cost, now, count_denied=self._count_denied, database_clock=not self._fast
        )
        strict = fail_closed and self._fallback is not None
        try:
            rows = await (self.store.execute_strict if strict else self.store.execute)(sql, params)  # type: ignore[attr-defined]
        except StoreDown:
            decision = closed_decision(key, rate, now, self._retry_down)
            if self._observing:
                _observe(self, decision, "fallback")
            return decision
        except Exception:
            if self._fallback is None:
                raise
            return _fail_open(self, key, rate, cost, now)
        if not rows and sql is _sql.HIT_CAPPED:
            decision = await self._uncounted(key, rate.limit, rate.window, params, now)
        else:
            decision = _algorithms.decide_rows(key, rate, cost, now, rows)
        if self._after and (self._observing or not decision.allowed):
            if self._record_denials and not decision.allowed:
                await self._record_denial(decision, cost, now)
            if self._observing:
                _observe(self, decision)
        return decision

    async def _uncounted(
        self, key: str, limit: int, window: int, params: Sequence[Any], now: float
    ) -> Decision:
        """A capped window denied without counting: read what it holds, for honest numbers."""
        try:
            stored = await self.store.execute(_sql.PEEK, (params[0],))
        except Exception:  # the denial stands; only the reported count is lost
            return decide(key, limit, window, params[2], now, None)
        return decide_uncounted(
            key, limit, window, params[2], now, int(stored[0][0]) if stored else 0
        )

    async def peek(
        self, key: str, limit: int, window: int, *, algorithm: str = FIXED_WINDOW,
        burst: int | None = None,
    ) -> Decision:  # fmt: skip
        """See `Limiter.peek`."""
        rate = Rate(limit=limit, window=window, algorithm=algorithm, burst=burst)
        return await self.store.run(_ops.peek(key, rate, self._clock()), transaction=False)

    async def reset(self, key: str, window: int | None = None) -> int:
        """See `Limiter.reset`."""
        if window is not None:
            check_int("window", window, maximum=MAX_WINDOW)
        return await self.store.run(_ops.reset(stored_key(key), window), transaction=False)

    async def top(self, n: int = 10) -> list[Usage]:
        """See `Limiter.top`."""
        return await self.store.run(_ops.top(self._clock(), n), transaction=False)

    async def cleanup(
        self,
        *,
        grace: int = DEFAULT_GRACE,
        batch_size: int = DEFAULT_BATCH_SIZE,
        dry_run: bool = False,
    ) -> CleanupResult:
        """See `Limiter.cleanup`."""
        op = _ops.cleanup(
            self.store.dialect, self._clock(), grace=grace, batch_size=batch_size, dry_run=dry_run
        )
        return await self.store.run(op, transaction=False)

    # -- durable quotas: see the `Limiter` methods of the same names ------------------------

    async def consume_quota(
        self, subject: str, name: str, limit: int, period: str | int, cost: int = 1,
        idempotency_key: str | None = None, tz: str | None = None,
    ) -> QuotaDecision:  # fmt: skip
        """See `Limiter.consume_quota`."""
        now = self._clock()
        make = functools.partial(
            _quotas.consume, subject, name, limit, period, cost, idempotency_key, tz, now
        )
        return await _quotas.arun(self.store, make(), again=make)

    async def refund_quota(self, subject: str, name: str, idempotency_key: str) -> RefundResult:
        """See `Limiter.refund_quota`."""
        make = functools.partial(_quotas.refund, subject, name, idempotency_key, self._clock())
        return await _quotas.arun(self.store, make(), again=make)

    async def grant_quota(
        self, subject: str, name: str, amount: int, period: str | int, tz: str | None = None
    ) -> QuotaUsage:
        """See `Limiter.grant_quota`."""
        make = functools.partial(_quotas.grant, subject, name, amount, period, tz, self._clock())
        return await _quotas.arun(self.store, make(), again=make)

    async def quota_usage(self, subject: str, *, include_ended: bool = False) -> list[QuotaUsage]:
        """See `Limiter.quota_usage`."""
        op = _quotas.usage(subject, self._clock(), include_ended=include_ended)
        return await _quotas.arun(self.store, op)

    async def ledger(self, subject: str, since: float | None = None) -> list[LedgerEntry]:
        """See `Limiter.ledger`."""
        return await _quotas.arun(self.store, _quotas.ledger(subject, since))

    async def cleanup_ledger(
        self, *, older_than: int, batch_size: int = DEFAULT_BATCH_SIZE, dry_run: bool = False
    ) -> CleanupResult:
        """See `Limiter.cleanup_ledger`."""
        op = _quotas.cleanup_ledger(
            self._clock(), older_than, batch_size=batch_size, dry_run=dry_run
        )
        return await self.store.run(op, transaction=False)

    async def check(
        self, *limits: RateWindow | QuotaLimit, cost: int = 1, idempotency_key: str | None = None
    ) -> CheckDecision:
        """See `Limiter.check`."""
        make = functools.partial(
            _quotas.check, limits, cost, idempotency_key, self._clock(),
            record_rate_denials=self._record_denials,
        )  # fmt: skip
        return await _quotas.arun(self.store, make(), again=make)

    async def _record_denial(self, decision: Decision, cost: int, now: float) -> None:
        try:
            op = _quotas.record_rate_denial(decision, cost, now)
            await self.store.run(op, transaction=False)
        except QuotaError:
            # An audit entry must not turn a decision already made into an error.
            log.warning("quota: could not record a rate denial in the ledger", exc_info=True)

    async def aclose(self) -> None:
        """Close the store's connections."""
        await self.store.aclose()

    async def __aenter__(self) -> AsyncLimiter:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()


def _options(**kwargs: object) -> Options:
    try:
        return Options(**kwargs)  # type: ignore[arg-type]
    except TypeError as exc:
        raise ConfigurationError(str(exc)) from exc


def _fallback(fallback: object) -> Fallback | None:
    if fallback is True:
        return Fallback()
    if fallback is False or fallback is None:
        return None
    if isinstance(fallback, Fallback):
        return fallback
    raise ConfigurationError(f"fallback must be a bool or a quota.Fallback, got {fallback!r}")


def _schemaless_options(parsed: StoreURL, options: Options) -> None:
    if options.batching:
        raise ConfigurationError(
            f"batching=True groups SQL statements into one; a {parsed.dialect}:// store"
            " decides each call in one step already: leave batching off"
        )


def _postgres_settings(parsed: StoreURL, options: Options) -> dict[str, Any]:
    """The keywords of either PostgreSQL store: the URL's own parameters, then `options`."""
    prepared = options.prepared_statements
    return {
        "dsn": parsed.target, "url": parsed.url, "pool_size": options.pool_size,
        "connect_timeout": options.timeout, "db_clock": options.database_clock,
        "statement_timeout": options.fallback.timeout if options.fallback else None,
        "relaxed": options.durability == "relaxed", "idle_timeout": options.idle_timeout,
        "prepared_statements": parsed.prepared_statements if prepared is None else prepared,
        "schema": options.schema or parsed.schema,
    }  # fmt: skip


def _schema_only_on_postgres(parsed: StoreURL, options: Options) -> None:
    if options.schema is not None and parsed.dialect != "postgresql":
        raise ConfigurationError(
            f"schema={options.schema!r} is for PostgreSQL; a {parsed.dialect} store has no schemas"
        )


def open_sync_store(parsed: StoreURL, options: Options) -> SyncStore:
    """The sync store for `parsed`, wrapped in the memory fallback when one is configured."""
    parsed.driver_for(asynchronous=False)
    _schema_only_on_postgres(parsed, options)
    fallback = options.fallback
    # Under a fallback a slow database must not make a slow request: the
    # store's own waits shrink to the fallback's time budget.
    timeout = fallback.timeout if fallback else options.timeout
    store: SyncStore
    if parsed.dialect == "sqlite":
        from quota._sqlite import SQLiteStore

        store = SQLiteStore(
            parsed.target, parsed.url, busy_timeout=timeout, db_clock=options.database_clock,
            serialize=fallback is not None, pool_size=options.pool_size,
            idle_timeout=options.idle_timeout,
        )  # fmt: skip
    elif parsed.dialect == "memory":
        _schemaless_options(parsed, options)
        from quota._memory import MemoryStore, parse_target

        name, max_keys = parse_target(parsed.target)
        store = MemoryStore(max_keys=max_keys, name=name, db_clock=options.database_clock)
    elif parsed.dialect == "redis":
        _schemaless_options(parsed, options)
        from quota._redis import RedisStore

        store = RedisStore(parsed.url, timeout=timeout, db_clock=options.database_clock)
    else:
        from quota._postgres import PostgresStore

        store = PostgresStore(**_postgres_settings(parsed, options))
    if options.batching:
        store = BatchingStore(store, max_batch=options.max_batch)
    if options.metrics is not None:
        store = MeteredStore(store, options.metrics)
    if fallback is None:
        return store
    from quota._memory import MemoryStore

    return ResilientStore(store, MemoryStore(max_keys=fallback.max_keys), fallback, parsed.url)


def open_async_store(parsed: StoreURL, options: Options) -> AsyncStore:
    """The async store for `parsed`, wrapped in the memory fallback when one is configured."""
    parsed.driver_for(asynchronous=True)
    _schema_only_on_postgres(parsed, options)
    fallback = options.fallback
    store: AsyncStore
    if parsed.dialect == "sqlite":
        from quota._sqlite import AsyncSQLiteStore

        store = AsyncSQLiteStore(
            parsed.target, parsed.url, busy_timeout=fallback.timeout if fallback else options.timeout,
            db_clock=options.database_clock,
        )  # fmt: skip
    elif parsed.dialect == "memory":
        _schemaless_options(parsed, options)
        from quota._memory import AsyncMemoryStore, parse_target

        name, max_keys = parse_target(parsed.target)
        store = AsyncMemoryStore(max_keys=max_keys, name=name, db_clock=options.database_clock)
    elif parsed.dialect == "redis":
        _schemaless_options(parsed, options)
        from quota._redis import AsyncRedisStore

        store = AsyncRedisStore(
            parsed.url, timeout=fallback.timeout if fallback else options.timeout,
            db_clock=options.database_clock,
        )  # fmt: skip
    else:
        from quota._postgres import AsyncPostgresStore

        store = AsyncPostgresStore(**_postgres_settings(parsed, options))
    if options.batching:
        store = AsyncBatchingStore(store, max_batch=options.max_batch)
    if options.metrics is not None:
        store = AsyncMeteredStore(store, options.metrics)
    if fallback is None:
        return store
    from quota._memory import AsyncMemoryStore

    return AsyncResilientStore(
        store, AsyncMemoryStore(max_keys=fallback.max_keys), fallback, parsed.url
    )


def connect(
    url: str,
    *,
    count_denied: bool = True,
    clock: Clock | str = time.time,
    pool_size: int = 10,
    idle_timeout: float = DEFAULT_IDLE_TIMEOUT,
    prepared_statements: bool | None = None,
    schema: str | None = None,
    timeout: float = 10.0,
    fallback: bool | Fallback = False,
    record_rate_denials: bool = False,
    batching: bool = False,
    max_batch: int = DEFAULT_MAX_BATCH,
    durability: str = "full",
    metrics: Metrics | None = None,
    abuse: AbuseDetector | None = None,
) -> Limiter:
    """A synchronous `Limiter` for the database at `url`.

    ``sqlite:///path.db`` (sqlite3) or ``postgresql://…`` (psycopg 3, from the
    ``postgres`` extra); ``memory://`` (in this process) or ``redis://…`` (the
    ``redis`` extra) for every algorithm but no durable quotas. Connections open
    on first use. Raises
    `ConfigurationError` for an unknown scheme (listing the known ones) or an
    async driver (``+aiosqlite``, ``+asyncpg``: use `connect_async`).

    With ``fallback=True`` (or a `quota.Fallback`) the limiter never raises
    for the database: an in-memory store decides while it errors, times out
    or is unreachable, a background probe switches back when it answers, and
    the fixed-window hits of the outage are written back. Use it in request
    paths; `fail_closed=True` on a call denies instead while the store is down.

    With ``record_rate_denials=True`` every rate-limit denial also appends a
    ``rate_denied`` entry to the quota ledger (allowed hits never do).

    With ``batching=True`` concurrent fixed-window hits from threads share one
    statement (group commit, at most `max_batch` hits, and never more than
    4,096 on SQLite), each still getting its exact count; a lone call goes
    out at once. ``durability="relaxed"`` lets
    PostgreSQL commit the limiter's statements without waiting for the WAL
    flush; durable quotas stay synchronous. See the README for both.

    `metrics` (a `quota.Metrics`) counts decisions by source (store,
    fallback, fail_open), store errors and store latency; `abuse` (a
    `quota.AbuseDetector`) hears of every denial.
    """
    options = _options(
        count_denied=count_denied, clock=clock, pool_size=pool_size, timeout=timeout,
        idle_timeout=idle_timeout, prepared_statements=prepared_statements, schema=schema,
        fallback=_fallback(fallback), record_rate_denials=record_rate_denials,
        batching=batching, max_batch=max_batch, durability=durability, metrics=metrics,
        abuse=abuse,
    )  # fmt: skip
    return Limiter(open_sync_store(parse_url(url), options), options)


def connect_async(
    url: str,
    *,
    count_denied: bool = True,
    clock: Clock | str = time.time,
    pool_size: int = 10,
    idle_timeout: float = DEFAULT_IDLE_TIMEOUT,
    prepared_statements: bool | None = None,
    schema: str | None = None,
    timeout: float = 10.0,
    fallback: bool | Fallback = False,
    record_rate_denials: bool = False,
    batching: bool = False,
    max_batch: int = DEFAULT_MAX_BATCH,
    durability: str = "full",
    metrics: Metrics | None = None,
    abuse: AbuseDetector | None = None,
) -> AsyncLimiter:
    """An `AsyncLimiter` for the database at `url`.

    ``sqlite:///path.db`` or ``sqlite+aiosqlite:///…`` (aiosqlite),
    ``postgresql://…`` or ``postgresql+asyncpg://…`` (asyncpg pool of at most
    `pool_size` connections); ``memory://`` or ``redis://…`` (redis.asyncio).
    Connections open on first use. `batching`,
    `max_batch` and `durability` as for `connect`; batching gathers the hits of
    concurrent tasks.
    """
    options = _options(
        count_denied=count_denied, clock=clock, pool_size=pool_size, timeout=timeout,
        idle_timeout=idle_timeout, prepared_statements=prepared_statements, schema=schema,
        fallback=_fallback(fallback), record_rate_denials=record_rate_denials,
        batching=batching, max_batch=max_batch, durability=durability, metrics=metrics,
        abuse=abuse,
    )  # fmt: skip
    return AsyncLimiter(open_async_store(parse_url(url), options), options)
