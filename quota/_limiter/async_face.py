# quota/_limiter/sync_face.py is generated from quota/_limiter/async_face.py by unasyncd
# ([tool.unasyncd] in pyproject.toml): edit the async file, then run `unasyncd`.
"""`AsyncLimiter`: rate limits for asyncio code, a thin driver around the decision core.

It holds no logic of its own: it reads the clock, asks `quota._core.decision` to
validate and place the call, hands the statement to its store, and lets the
core decide from the rows that come back. Operations other than the hot path
are generators in `quota._sql.ops` and `quota._limiter.quotas`, driven by the store. What
never awaits (options, metrics, failing open, the table of stores) is in
`quota._limiter.base`, shared by both faces.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from decimal import Decimal
from typing import Any, ParamSpec, TypeVar

from quota._core import algorithms as _algorithms
from quota._core import leases as _leases
from quota._core.algorithms import FIXED_WINDOW, Rate, closed_decision
from quota._core.decision import (
    MAX_WINDOW,
    Decision,
    Duration,
    check_int,
    check_seconds,
    decide,
    decide_uncounted,
    hit_params,
    stored_key,
)
from quota._core.errors import ConfigurationError, QuotaError, RateLimitTimeout, SchemaError
from quota._core.leases import MAX_SLOTS, ConcurrencyUsage
from quota._core.rates import as_rates, most_restrictive
from quota._core.url import StoreURL
from quota._core.waiting import MAX_TIMEOUT, Deadline, check_timeout, jitter_spread, pause
from quota._limiter import base as _base
from quota._limiter import export as _export_ops
from quota._limiter import quota_types as _types
from quota._limiter import quotas as _quotas
from quota._limiter import thresholds as _thresholds
from quota._limiter.base import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_GRACE,
    Attempt,
    LimiterBase,
    Options,
    allowed,
    async_memory_fallback,
    async_settle,
    async_sleep,
    async_threshold,
    check_async_target,
    check_cost,
    check_wait,
    key_of,
    log,
    rate_of,
)
from quota._limiter.drive_async import arun
from quota._limiter.leases import AsyncConcurrency
from quota._sql import hits as _hits
from quota._sql import ops as _ops
from quota._sql import statements as _sql
from quota._sql.ops import CleanupResult, Usage
from quota._sql.steps import Op, adrive
from quota._stores.base import AsyncStore
from quota._wrappers.batching import AsyncBatchingStore
from quota._wrappers.fallback import AsyncResilientStore, StoreDown
from quota._wrappers.metrics import AsyncMeteredStore
from quota._wrappers.telemetry import AsyncTracedStore, Recorder

T = TypeVar("T")
P = ParamSpec("P")


class AsyncLimiter(LimiterBase[AsyncStore]):
    """Rate limits kept in a database, for asyncio code. Safe to share between tasks.

    Get one from `quota.connect_async`. Use it as an async context manager, or call
    `aclose` when done. It belongs to the event loop that first uses it.
    """

    async def rate_limit(
        self, key: str, limit: int, window: Duration, *, cost: int = 1,
        algorithm: str = FIXED_WINDOW, burst: int | None = None, fail_closed: bool = False,
    ) -> Decision:  # fmt: skip
        """Count one hit on `key` and decide: at most `limit` hits per `window` seconds.

        `window` is seconds, or a duration as the command line takes it (``"30m"``,
        ``"12h"``) or a `datetime.timedelta`.

        `algorithm` is ``fixed_window`` (windows aligned to the epoch; the
        default), ``sliding_window``, ``token_bucket`` or ``gcra``; `burst` is
        the capacity of the last two (default `limit`). One atomic statement
        per call. Raises `ConfigurationError` for bad arguments (a `cost` the
        limit can never allow included), `StorageError` when the database
        fails, `SchemaError` when the tables are missing (with a `fallback` too);
        with a `fallback` (see `quota.connect_async`) it never raises for an
        outage: memory decides while the database is down, and a
        `fail_closed` call is denied instead.
        """
        if window.__class__ is not int:
            window = check_seconds("window", window, maximum=MAX_WINDOW)
        if algorithm != FIXED_WINDOW or not self._fast or fail_closed:
            return await self._decide(
                key, rate_of(limit, window, algorithm, burst), cost, fail_closed
            )
        now = self._clock()
        params = hit_params(
            key,
            limit,
            window,
            now,
            cost if cost.__class__ is int and cost == 1 else check_cost(cost, limit),
        )
        try:
            if self._count_denied:
                rows = await self.store.execute(_sql.HIT, params)
            else:
                rows = await self.store.execute(_sql.HIT_CAPPED, (*params, limit))
        except SchemaError:
            raise  # never migrated: a deployment error, never decided from memory
        except Exception:
            if self._fallback is None:
                raise
            return self._fail_open(key, Rate(limit=limit, window=window), cost, now)
        if rows:
            decision = decide(key, limit, window, params[2], now, rows[0][0])
        else:
            decision = await self._uncounted(key, limit, window, params, now)
        if self._after and (self._observing or not decision.allowed):
            if self._record_denials and not decision.allowed:
                await self._record_denial(decision, cost, now)
            self._observe(decision)
        return decision

    async def hit(
        self, key: str, rates: Rate | str | Iterable[Rate], *, cost: int = 1,
        fail_closed: bool = False,
    ) -> Decision:  # fmt: skip
        """Count one hit on `key` under each of `rates` and return the most restrictive decision.

        `rates` is a `Rate`, several, or a rate string (``"100/minute;1000/day"``).
        Each rate counts on its own; for all-or-nothing across several limits
        use `check`.
        """
        decisions = [await self._decide(key, rate, cost, fail_closed) for rate in as_rates(rates)]
        return decisions[0] if len(decisions) == 1 else most_restrictive(decisions)

    async def _decide(
        self, key: str, rate: Rate, cost: int, fail_closed: bool = False, waiting: bool = False
    ) -> Decision:
        """One hit under `rate`. `waiting` (an attempt of `acquire`): a denial is never
        counted, whatever ``count_denied`` says, and is not reported as one (the wait is)."""
        if cost.__class__ is not int or cost != 1:  # a cost of 1 fits every rate
            rate.check_cost(cost)
        now = self._clock()
        sql, params = _hits.plan(
            key, rate, cost, now, count_denied=self._count_denied and not waiting,
            database_clock=not self._fast,
        )  # fmt: skip
        strict = fail_closed and self._fallback is not None
        try:
            execute = self.store.execute_strict if strict else self.store.execute
            rows = await execute(sql, params)
        except StoreDown:
            decision = closed_decision(key, rate, now, self._retry_down)
            if self._observing:
                self._observe(decision, "fallback", rate.algorithm)
            return decision
        except SchemaError:
            raise
        except Exception:
            if self._fallback is None:
                raise
            return self._fail_open(key, rate, cost, now)
        if not rows and sql is _sql.HIT_CAPPED and not waiting:
            decision = await self._uncounted(key, rate.limit, rate.window, params, now)
        else:
            decision = _algorithms.decide_rows(key, rate, cost, now, rows)
        if self._after and (self._observing or not decision.allowed):
            if waiting and not decision.allowed:
                if self._telemetry is not None:  # an attempt, not a decision: its span only
                    self._telemetry.decided(False, rate.algorithm, count=False)
                return decision
            if self._record_denials and not decision.allowed:
                await self._record_denial(decision, cost, now)
            self._observe(decision, algorithm=rate.algorithm)
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

    async def acquire(
        self, key: str, rates: Rate | str | Iterable[Rate], *, cost: int = 1,
        timeout: float = 30.0, fail_closed: bool = False,
    ) -> Decision:  # fmt: skip
        """Wait until a hit of `cost` on `key` is allowed under every one of `rates`; return it.

        `rates` as for `hit`. Each denial says when the hit could pass (the
        window's reset, the bucket's refill: `Decision.retry_after_exact`); the
        call sleeps until then, plus up to 50 ms of jitter, and tries again, so
        it makes one store call per rate for each slot it competes for and
        holds no connection while it sleeps. A denied attempt charges nothing
        (whatever ``count_denied`` says); only the hit returned is charged. A
        task cancelled while it waits is never charged: each attempt after a
        sleep runs to its end, and one that was allowed is returned (the
        cancellation then reaches the caller at its next ``await``); the first
        attempt is cancelled as a `hit` would be.
        With several rates, the rate that denied last is tried first, and an
        attempt is all or nothing: when a rate denies, each rate that allowed
        before it in the same attempt is given its charge back (one more store
        call each), so a denied attempt or a timeout leaves every rate's stored
        count as it was. Until the give-back lands, a concurrent caller may be
        denied by that charge; a give-back the store fails leaves it charged
        (logged); a token bucket gets its tokens back up to its capacity.

        Raises `quota.RateLimitTimeout` (``decision`` the last denial) when
        `timeout` seconds pass first, and at once when the slot opens only
        after the timeout; `timeout=0` tries once and never waits. With a
        fallback, the store being down is handled as `hit` handles it
        (`fail_closed` waits out the outage, retrying every ``retry_after``).
        Raises `ConfigurationError` for bad arguments, `StorageError` without
        a fallback when the database fails.
        """
        if timeout.__class__ is not float or not 0.0 <= timeout <= MAX_TIMEOUT:
            timeout = check_timeout(timeout)
        # Our own list: the wait reorders it.
        limits = [rates] if rates.__class__ is Rate else list(as_rates(rates))
        if cost.__class__ is not int or cost != 1:  # a cost of 1 fits every rate
            for rate in limits:
                rate.check_cost(cost)
        started = self._clock()
        # The first attempt runs as a hit does: a task of its own (see `async_settle`) would
        # cost a turn of the event loop, more than the hit itself when the slot is free.
        if len(limits) == 1:
            decision = await self._decide(key, limits[0], cost, fail_closed, waiting=True)
            if decision.allowed:
                return decision
            denied_by = 0
        else:
            decision, denied_by = await self._attempt(key, limits, cost, fail_closed)
            if decision.allowed:
                return decision
        deadline = Deadline.after(started, timeout)
        attempt = 1
        while True:
            if denied_by:  # the rate that denied goes first next time
                limits.insert(0, limits.pop(denied_by))
            rate = limits[0]
            sleep = pause(
                decision.retry_after_exact, deadline.left(self._clock()), attempt=attempt,
                spread=jitter_spread(cost / rate.rate), draw=self._draw(),
            )  # fmt: skip
            if sleep is None:
                if self._after:
                    self._observe(decision, algorithm=rate.algorithm)
                raise RateLimitTimeout(
                    f"no slot for {key!r} under {rate} within {timeout:g}s"
                    f" (the next opens in {decision.retry_after_exact:.3f}s)",
                    decision=decision,
                )
            if self._sleep is None:
                await async_sleep(sleep)
            else:
                self._sleep(sleep)
            attempt += 1
            # A waiter's attempts run to their end even if it is cancelled meanwhile.
            decision, denied_by = await async_settle(
                self._attempt(key, limits, cost, fail_closed), allowed
            )
            if decision.allowed:
                return decision

    async def _attempt(
        self, key: str, limits: Sequence[Rate], cost: int, fail_closed: bool
    ) -> Attempt:
        """One try of `acquire`: the decision, and the index of the rate that denied (0 if none)."""
        if len(limits) == 1:
            return await self._decide(key, limits[0], cost, fail_closed, waiting=True), 0
        decisions: list[Decision] = []
        for index, rate in enumerate(limits):
            decision = await self._decide(key, rate, cost, fail_closed, waiting=True)
            if not decision.allowed:
                for taken, allowed_by in zip(decisions, limits, strict=False):
                    await self._give_back(key, allowed_by, cost, taken)
                return decision, index
            decisions.append(decision)
        return most_restrictive(decisions), 0

    async def _give_back(self, key: str, rate: Rate, cost: int, decision: Decision) -> None:
        """Take back the hit `decision` allowed under `rate`: a later rate denied the attempt.

        A store that fails here leaves the hit charged: the denial stands, and the
        caller's wait goes on (its next attempt meets the failure, if it lasts).
        """
        try:
            await self.store.execute(*_hits.give_back(key, rate, cost, decision))
        except Exception:
            log.warning(
                "quota: could not give back a denied attempt's hit on %r", key, exc_info=True
            )

    def limit(
        self, rates: Rate | str | Iterable[Rate], *, key: str | Callable[..., str] | None = None,
        cost: int = 1, wait: bool = True, timeout: float = 30.0,
    ) -> Callable[[Callable[P, Awaitable[T]]], Callable[P, Awaitable[T]]]:  # fmt: skip
        """Decorate a function so that each call first takes a slot under `rates`.

        `key` is a string, a callable taking the call's arguments and returning
        the key, or None (the function's module and qualified name). With
        `wait` each call waits as `acquire` does, up to `timeout` seconds;
        without, a call that is denied raises `quota.RateLimitTimeout` at once
        (its ``decision`` says when to retry). Arguments are checked when
        decorating (`ConfigurationError`).
        """
        limits = as_rates(rates)
        for rate in limits:
            rate.check_cost(cost)
        budget = check_timeout(timeout) if check_wait(wait) else 0.0

        def decorate(func: Callable[P, Awaitable[T]]) -> Callable[P, Awaitable[T]]:
            check_async_target(func)
            key_for = key_of(key, func)

            @functools.wraps(func)
            async def limited(*args: P.args, **kwargs: P.kwargs) -> T:
                await self.acquire(key_for(*args, **kwargs), limits, cost=cost, timeout=budget)
                return await func(*args, **kwargs)

            return limited

        return decorate

    @contextlib.asynccontextmanager
    async def limited(
        self, key: str, rates: Rate | str | Iterable[Rate], *, cost: int = 1,
        timeout: float = 30.0,
    ) -> AsyncIterator[Decision]:  # fmt: skip
        """``async with limiter.limited(key, rates):`` waits for a slot as `acquire` does
        and runs the block with its `Decision`; `quota.RateLimitTimeout` at the timeout."""
        yield await self.acquire(key, rates, cost=cost, timeout=timeout)

    async def peek(
        self, key: str, limit: int, window: Duration, *, algorithm: str = FIXED_WINDOW,
        burst: int | None = None,
    ) -> Decision:  # fmt: skip
        """`key`'s state under this limit, without counting a hit (the app clock decides).

        ``allowed`` says whether one more hit would pass right now.
        """
        rate = Rate(limit=limit, window=window, algorithm=algorithm, burst=burst)  # type: ignore[arg-type]
        return await self.store.run(_ops.peek(key, rate, self._clock()), transaction=False)

    async def reset(self, key: str, window: Duration | None = None) -> int:
        """Forget `key`'s counts (only for windows of `window` seconds if given); return rows deleted."""
        if window is not None:
            window = check_seconds("window", window, maximum=MAX_WINDOW)
        return await self.store.run(_ops.reset(stored_key(key), window), transaction=False)

    async def pause(self, key: str, seconds: float) -> float:
        """Hold `key` back for `seconds` from now, for every process using this store.

        `paused` tells anyone when a key is held back; the outbound transports of
        ``quota.contrib`` (httpx, requests, aiohttp) wait out their key's pause
        before sending, so one provider's ``Retry-After`` stops every process.
        A pause only grows: while a longer one runs, a shorter one changes
        nothing. Returns the seconds the key now stays paused. The pause is
        rate state: ``reset(key)`` lifts it, cleanup sweeps it once it has
        ended; with a fallback, while the store is down, it is kept in this
        process's memory. `seconds` is a number in ``0..86400``
        (`ConfigurationError` naming it otherwise).
        """
        seconds = check_timeout(seconds, "seconds")
        now = self._clock()
        skey = stored_key(key)
        row = (
            await self.store.execute(
                _sql.PAUSE_SET, (_algorithms.pause_key(skey), skey, now, seconds, now + seconds)
            )
        )[0]
        return max(0.0, float(row[0]) - (float(row[1]) if len(row) > 1 else now))

    async def paused(self, key: str) -> float:
        """Seconds `key` stays paused (see `pause`), 0.0 when it is not: one read of the store."""
        skey = stored_key(key)
        rows = await self.store.execute(
            _sql.PAUSE_LEFT, (_algorithms.pause_key(skey), self._clock())
        )
        return float(rows[0][0]) if rows else 0.0

    async def top(self, n: int = 10) -> list[Usage]:
        """The `n` busiest keys in windows still running, busiest first."""
        return await self.store.run(_ops.top(self._clock(), n), transaction=False)

    async def cleanup(
        self,
        *,
        grace: int = DEFAULT_GRACE,
        batch_size: int = DEFAULT_BATCH_SIZE,
        dry_run: bool = False,
        progress: Callable[[int], None] | None = None,
    ) -> CleanupResult:
        """Delete windows that ended more than `grace` seconds ago; see `quota._sql.ops.cleanup`.

        Then release the durable quotas' reservations whose time is up (no grace),
        one transaction per `batch_size` usage rows: ``released`` counts them (on a
        dry run, the ones that would be). `progress`, when given, is called with the rows deleted so far after each
        batch that deleted some (committed by then); whatever it raises stops the
        sweep there. With a fallback, it runs on the database without the
        fallback's time budget (the store's own timeouts), and raises `StorageError`
        when the database fails.
        """
        now = self._clock()
        op = _ops.cleanup(
            self.store.dialect, now, grace=grace, batch_size=batch_size,
            dry_run=dry_run, progress=progress,
        )  # fmt: skip
        result = await self.store.run(op, transaction=False, maintenance=True)
        if result.skipped or self.store.dialect not in _types.QUOTA_DIALECTS:
            return result
        try:
            if dry_run:
                released = await self.store.run(_quotas.count_expired(now), transaction=False)
                return dataclasses.replace(result, released=released)
            released = 0
            while True:
                count, rows = await arun(self.store, _quotas.release_expired(now, batch_size))
                released += count
                if rows < batch_size:
                    return dataclasses.replace(result, released=released)
        except SchemaError as exc:
            if exc.outage:
                raise
            return result  # before revision 0007_reservations: no reservations to release

    # -- concurrency leases (quota._limiter.leases) --------------------------------------------

    def concurrency(
        self, key: str, limit: int, *, lease: float = 30.0, timeout: float = 30.0
    ) -> AsyncConcurrency:
        """A block that holds one of `limit` slots of `key`: ``async with limiter.concurrency(…):``.

        At most `limit` blocks of `key` run at once across every process and host
        using this store. Entering takes a slot (one statement), waiting up to
        `timeout` seconds for one to come free (0: one try); leaving frees it (one
        statement). While inside, the block renews its lease every ``lease / 3``
        seconds, so work of any length keeps its slot; a holder that dies (killed,
        its host lost) stops renewing, and its slot frees itself `lease` seconds
        after the last renewal. Blocks are not re-entrant: a block nested in another
        of the same key takes a second slot.

        Raises `ConfigurationError` for a bad argument (naming it), `RateLimitTimeout`
        when no slot came free in time, `StorageError` when the store fails
        (`quota.StoreDown` under a fallback while the store is down: slots are never
        handed out from this process's memory), `SchemaError` before ``quota migrate``
        made the leases table.
        """
        return AsyncConcurrency(
            self.store, self._clock, _leases.lease_request(key, limit, lease, timeout)
        )

    async def concurrency_usage(self, key: str, limit: int | None = None) -> ConcurrencyUsage:
        """Who holds `key`'s concurrency slots now, and how many are free under `limit`
        (default: the limit the holders took their slots under)."""
        lease_key = stored_key(key)
        if limit is not None:
            check_int("limit", limit, maximum=MAX_SLOTS)
        rows = await self.store.execute_strict(_sql.LEASE_HOLDERS, (lease_key, self._clock()))
        return _leases.usage_from_rows(key, rows, limit)

    async def concurrency_top(self, n: int = 10) -> list[ConcurrencyUsage]:
        """The `n` concurrency keys with the most live leases, busiest first."""
        check_int("n", n, maximum=100_000)
        rows = await self.store.execute_strict(_sql.LEASE_TOP, (self._clock(), n))
        return _leases.top_from_rows(rows)

    # -- durable quotas (quota._limiter.quotas): one transaction each ------------------------------

    async def consume_quota(
        self, subject: str, name: str, limit: int, period: Duration, cost: int = 1,
        idempotency_key: str | None = None, tz: str | None = None,
        thresholds: Sequence[float | int | Decimal] = (),
    ) -> _types.QuotaDecision:  # fmt: skip
        """Charge `cost` units of `subject`'s quota `name`, allowing at most `limit` per `period`.

        `period` is ``"day"``, ``"week"`` (ISO, from Monday) or ``"month"``,
        aligned to the calendar of time zone `tz` (an IANA name; UTC when
        None), or whole seconds aligned to the epoch (an int, a duration like
        ``"30d"`` or a `datetime.timedelta`). A denial
        charges nothing. With `idempotency_key`, every retry (from any
        process, after any restart) gets the original decision back, marked
        ``replayed``, and the charge is made once. The usage and its ledger
        entry are written in one transaction.

        `thresholds` are fractions of the limit with grants (numbers in (0, 1],
        ``(0.8, 0.9, 1.0)``): a charge that takes usage to ``threshold * (limit +
        granted)`` or past it fires the threshold, once per period, writing a
        `quota.ThresholdEvent` to the outbox in the same transaction; the
        decision's ``fired`` lists the events this call fired, and the
        ``on_threshold`` callback (see `quota.connect`) gets each after the
        commit. A refund or grant that takes usage back below a threshold
        re-arms it.

        Raises `ConfigurationError` naming the bad argument (unknown period or
        zone, a limit or cost that is not a positive int, a cost above the
        limit, bad thresholds), `StorageError` when the database fails (nothing
        is written), `SchemaError` with thresholds on a database not migrated
        to the outbox yet (run ``quota migrate``).
        """
        now = self._clock()
        make = functools.partial(
            _quotas.consume, subject, name, limit, period, cost, idempotency_key, tz, now,
            thresholds,
        )  # fmt: skip
        decision = await arun(self.store, make(), again=make)
        if self._telemetry is not None:
            self._telemetry.decided(decision.allowed, "quota")
        if decision.fired:
            await self._tell_fired(decision.fired)
        return decision

    async def _tell_fired(self, events: Sequence[_types.ThresholdEvent]) -> None:
        """After a commit that fired `events`: the outbox is known to be there, and
        ``on_threshold`` (if any) gets each event; whatever it raises is logged, never
        raised into the caller (the outbox keeps the event anyway)."""
        self._events = True
        if self._on_threshold is None:
            return
        for event in events:
            try:
                await async_threshold(self._on_threshold, event)
            except Exception:
                log.exception(
                    "quota: on_threshold raised for the %s threshold of %r %r (event %d)",
                    event.threshold, event.subject, event.quota, event.id,
                )  # fmt: skip

    async def _events_ready(self) -> bool:
        """Whether the outbox table is there (refunds and grants then re-arm thresholds).

        Known once true; until then asked each time (one small statement, only on a
        database not yet migrated to it), so a migration made while running is seen.
        """
        if self._events:
            return True
        try:
            await self.store.run(_thresholds.probe(), transaction=False)
        except (SchemaError, ConfigurationError):
            return False  # not migrated yet, or a store without durable quotas
        self._events = True
        return True

    async def refund_quota(
        self, subject: str, name: str, idempotency_key: str
    ) -> _types.RefundResult:
        """Give back the charge `idempotency_key` holds (its work failed, say).

        Refunding an unknown key, or a key already refunded, does nothing and
        says so in the result's ``status``. The key is free again afterwards.
        """
        rearm = await self._events_ready()
        make = functools.partial(
            _quotas.refund, subject, name, idempotency_key, self._clock(), rearm=rearm
        )
        return await arun(self.store, make(), again=make)

    async def grant_quota(
        self, subject: str, name: str, amount: int, period: Duration, tz: str | None = None
    ) -> _types.QuotaUsage:
        """Add `amount` units to `subject`'s quota `name` for the current `period` only.

        Thresholds usage is now below (the limit with grants grew) are re-armed.
        """
        rearm = await self._events_ready()
        make = functools.partial(
            _quotas.grant, subject, name, amount, period, tz, self._clock(), rearm=rearm
        )
        return await arun(self.store, make(), again=make)

    async def reserve_quota(
        self, subject: str, name: str, amount: int, limit: int, period: Duration, *,
        ttl: Duration = 300, idempotency_key: str | None = None, tz: str | None = None,
        thresholds: Sequence[float | int | Decimal] = (),
    ) -> _types.Reservation:  # fmt: skip
        """Hold `amount` units of `subject`'s quota `name` until the real cost is known.

        All or nothing: the hold fits when ``used + reserved + amount <= limit +
        granted``, every other live reservation counted. Denied, nothing is held
        (``allowed`` False, ``id`` None, a ``deny`` ledger entry). `period` and `tz`
        are as for `consume_quota`. End the hold with `settle_quota` (or
        `release_quota`) within `ttl` (whole seconds from 1 to 7 days, or a duration
        like ``"10m"``); after that it releases itself on the next consume, reserve,
        check or usage read of the quota, or in ``quota cleanup``. With
        `idempotency_key`, a retry (from any process) returns the same reservation,
        ``decision.replayed`` True, and holds nothing more.

        `thresholds` are as for `consume_quota`, kept with the hold: the hold itself
        fires none (it may be released); its settle fires those its charge reaches.

        Raises `ConfigurationError` naming the bad argument, `StorageError` when the
        database fails (nothing is held), `SchemaError` before ``quota migrate``
        brought the schema to revision 0007_reservations (0008_thresholds with
        `thresholds`).
        """
        make = functools.partial(
            _quotas.reserve, subject, name, amount, limit, period, ttl, idempotency_key, tz,
            self._clock(), thresholds,
        )  # fmt: skip
        op = make()  # arguments checked before any statement
        if thresholds and not self._events:
            # Its settle would fail on a schema without the outbox: say so now.
            await self.store.run(_thresholds.probe(), transaction=False)
            self._events = True
        return await arun(self.store, op, again=make)

    async def settle_quota(self, reservation_id: str, actual: int) -> _types.QuotaDecision:
        """End a reservation, charging the `actual` units used, in one transaction.

        The charge goes to the period the reservation was made in. Up to the amount
        reserved it is always charged; above it, the excess is charged as far as the
        limit allows (other live reservations counted) and the rest is reported as
        ``overage``, not charged; ``allowed`` stays True. A second settle of the same
        reservation, whatever its `actual`, charges nothing and returns the first
        one's decision, ``replayed`` True. After the reservation expired, `actual`
        is charged like a new `consume_quota`, all or nothing, in the period running
        now (``expired`` True); when it does not fit nothing is charged, ``allowed``
        is False and ``overage`` is `actual`.

        Raises `quota.ReservationNotFound` for an unknown id, `ConfigurationError`
        for an `actual` that is not an int from 0, `StorageError` when the database
        fails (nothing is charged).

        A reservation made with ``thresholds`` fires those its charge reaches, as
        `consume_quota` does (``fired``, ``on_threshold``, the outbox); a replay
        fires none.
        """
        make = functools.partial(_quotas.settle, reservation_id, actual, self._clock())
        decision = await arun(self.store, make(), again=make)
        if decision.fired:
            await self._tell_fired(decision.fired)
        return decision

    async def release_quota(self, reservation_id: str) -> _types.QuotaDecision:
        """End a reservation without charging anything: `settle_quota` of 0."""
        return await self.settle_quota(reservation_id, 0)

    async def quota_usage(
        self, subject: str, *, include_ended: bool = False
    ) -> list[_types.QuotaUsage]:
        """`subject`'s quotas in the periods running now (every period with `include_ended`).

        ``reserved`` is read with ``used`` in one snapshot, after the reservations
        whose time is up were released.
        """
        op = _quotas.usage(subject, self._clock(), include_ended=include_ended)
        return await arun(self.store, op)

    async def ledger(self, subject: str, since: float | None = None) -> list[_types.LedgerEntry]:
        """`subject`'s ledger entries, oldest first; `since` (epoch seconds or an aware datetime) filters."""
        return await arun(self.store, _quotas.ledger(subject, since))

    def export(
        self, since: _export_ops.Moment, until: _export_ops.Moment, *, subject: str | None = None,
        ledger: bool = False, batch_size: int = _export_ops.DEFAULT_BATCH_SIZE,
    ) -> AsyncIterator[_export_ops.ExportRecord]:  # fmt: skip
        """Every durable quota's usage in a time range, and its ledger with `ledger`: for billing.

        Yields a `quota.UsageRecord` (``type`` ``"usage"``) for each subject,
        quota and period whose period starts in ``[since, until)``, by subject,
        quota name and period start; then, with `ledger`, a `quota.LedgerRecord`
        (``type`` ``"ledger"``) for each ledger entry whose time ``at`` is in
        ``[since, until)``, by id. `subject` keeps one subject's. A ledger
        entry's ``id`` is stable: use it as a billing meter event's idempotency
        identifier, so that an upload retried is counted once.

        `since` and `until` are datetimes with a time zone, dates (midnight UTC)
        or epoch seconds. The rows are read `batch_size` at a time, each batch
        one short statement picking up after the last row of the one before: no
        transaction or connection is held between batches, and memory holds one
        batch whatever the size of the export. So the export is no snapshot: a
        row written meanwhile may or may not be in it, and a period still running
        is exported as it stands when read. Export ranges that have ended, once
        the clocks of all your servers are past their end.

        Raises `ConfigurationError` naming the bad argument when called (a naive
        datetime, an `until` not after `since`). While iterating, raises
        `ConfigurationError` on a store without durable quotas (``memory://``,
        ``redis://``) and `StorageError` when the database fails.
        """
        plan = _export_ops.plan(since, until, subject=subject, ledger=ledger, batch_size=batch_size)
        return self._export_batches(plan)

    async def _export_batches(
        self, plan: _export_ops.ExportPlan
    ) -> AsyncIterator[_export_ops.ExportRecord]:
        after = None
        while True:
            usage = await self.store.run(_export_ops.usage_batch(plan, after), transaction=False)
            for record in usage:  # noqa: RUF100, UP028 (UP028: the generated sync face)
                yield record
            if len(usage) < plan.batch_size:
                break
            after = usage[-1]
        if not plan.ledger:
            return
        bounds = await self.store.run(_export_ops.ledger_bounds(plan), transaction=False)
        if bounds is None:
            return
        after_id, last_id = bounds[0] - 1, bounds[1]
        while after_id < last_id:
            entries = await self.store.run(
                _export_ops.ledger_batch(plan, after_id, last_id), transaction=False
            )
            for entry in entries:  # noqa: RUF100, UP028
                yield entry
            if len(entries) < plan.batch_size:
                break
            after_id = entries[-1].id

    async def cleanup_ledger(
        self, *, older_than: int, batch_size: int = DEFAULT_BATCH_SIZE, dry_run: bool = False
    ) -> CleanupResult:
        """Delete ledger entries older than `older_than` seconds (retention); usage stays.

        Idempotency keys whose charge is deleted are forgotten: keep the
        ledger longer than any client retries. Like `cleanup`, it runs without a
        fallback's time budget.
        """
        op = _quotas.cleanup_ledger(
            self._clock(), older_than, batch_size=batch_size, dry_run=dry_run
        )
        return await self.store.run(op, transaction=False, maintenance=True)

    async def cleanup_events(
        self,
        *,
        older_than: int = _thresholds.DEFAULT_EVENT_RETENTION,
        batch_size: int = DEFAULT_BATCH_SIZE,
        dry_run: bool = False,
    ) -> CleanupResult:
        """Delete threshold events delivered more than `older_than` seconds ago (default
        30 days); an event not delivered yet is never deleted. Like `cleanup`, it runs
        without a fallback's time budget. Raises `SchemaError` before ``quota migrate``
        made the outbox.
        """
        op = _thresholds.cleanup_events(
            self._clock(), older_than, batch_size=batch_size, dry_run=dry_run
        )
        return await self.store.run(op, transaction=False, maintenance=True)

    async def check(
        self,
        *limits: _types.RateWindow | _types.QuotaLimit,
        cost: int = 1,
        idempotency_key: str | None = None,
    ) -> _types.CheckDecision:
        """Charge `cost` to every limit, or to none: all or nothing, in one transaction.

        Each limit is a `quota.RateWindow` (the fixed window `rate_limit` counts
        in, here never charged past its limit) or a `quota.QuotaLimit`. If any
        would deny, nothing is charged anywhere and the decision names the
        first limit that denied and the longest ``retry_after``. Rows are
        touched in one fixed order, so concurrent checks never deadlock. An
        `idempotency_key` (which needs a `QuotaLimit`) makes retries return
        the original outcome without charging again. A `QuotaLimit` with
        ``thresholds`` fires them as `consume_quota` does (its decision's
        ``fired``).
        """
        make = functools.partial(
            _quotas.check, limits, cost, idempotency_key, self._clock(),
            record_rate_denials=self._record_denials,
        )  # fmt: skip
        result = await arun(self.store, make(), again=make)
        if self._telemetry is not None:
            self._telemetry.decided(result.allowed, "check")
        fired = [
            event
            for decision in result.decisions
            if isinstance(decision, _types.QuotaDecision)
            for event in decision.fired
        ]
        if fired:
            await self._tell_fired(fired)
        return result

    async def run(self, op: Op[T], *, transaction: bool = False, strict: bool = False) -> T:
        """Run `op`, an operation of `quota._sql.statements` statements (see `quota._stores.base`), on the store.

        On one connection, in one transaction if `transaction`. With `strict`
        and a fallback, never from memory: `quota.StoreDown` while the store is
        down, each statement held to the fallback's budget (then each commits on
        its own, so `transaction` must be False). Raises `StorageError` when the
        database fails, `ConfigurationError` for `strict` with `transaction`.
        """
        if strict and self._fallback is not None:
            if transaction:
                raise ConfigurationError("run(strict=True) cannot hold a transaction")
            return await adrive(op, self.store.execute_strict)
        return await self.store.run(op, transaction=transaction)

    async def _record_denial(self, decision: Decision, cost: int, now: float) -> None:
        try:
            await self.store.run(_quotas.record_rate_denial(decision, cost, now), transaction=False)
        except QuotaError:
            # An audit entry must not turn a decision already made into an error.
            log.warning("quota: could not record a rate denial in the ledger", exc_info=True)

    async def aclose(self) -> None:
        """Close the store's connections. The limiter reopens them if used again."""
        await self.store.aclose()

    async def __aenter__(self) -> AsyncLimiter:
        return self

    async def __aexit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        await self.aclose()


def open_async_store(parsed: StoreURL, options: Options) -> AsyncStore:
    """The store for `parsed` (see `quota._limiter.base.open_async`), wrapped as `options` say:
    in group commit (`batching`), then in `metrics`, then in the memory `fallback`, then in
    `telemetry` (outermost: it sees the calls as the limiter makes them, fallback included)."""
    store = _base.open_async(parsed, options)
    if options.batching:
        store = AsyncBatchingStore(store, max_batch=options.max_batch)
    if options.metrics is not None:
        store = AsyncMeteredStore(store, options.metrics)
    if options.fallback is not None:
        memory = async_memory_fallback(options.fallback)
        store = AsyncResilientStore(store, memory, options.fallback, parsed.url, options.metrics)
    if options.telemetry is None:
        return store
    recorder = Recorder(options.telemetry, parsed.dialect, answers=(_types.Abort,))
    if options.fallback is not None:
        recorder.watch_fallback(store)
    return AsyncTracedStore(store, recorder)
