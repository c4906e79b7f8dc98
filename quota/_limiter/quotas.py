"""Durable quotas: usage per period, an append-only ledger, and all-or-nothing checks.

Rate windows (`quota._core.decision`, ``quota_counters``) are cheap and ephemeral: a
crash may forget them and cleanup sweeps them. A quota is money (LLM calls,
paid API units), so it lives apart, in ordinary logged tables:

* ``quota_usage``: one row per (subject, quota name, period start) holding
  what was used and what was granted on top of the limit;
* ``quota_ledger``: one row per consume, denial, refund and grant (and, if
  asked for, per rate-window denial), appended in the same transaction as
  the usage change it records, so the two never disagree.

Every operation here is a generator of statements (see `quota._stores.base`)
written once for both faces and run in one transaction by `run` (sync,
`quota._limiter.drive_sync`, generated from the async `arun` in
`quota._limiter.drive_async`). An operation that must undo what it already wrote
raises `Abort` with its answer: the store rolls the transaction back, and the
driver returns the answer (or runs the follow-up operation it carries). The
types callers pass and get back are in `quota._limiter.quota_types`.

Semantics the issue left open, decided here:

* A denial is not bound to its idempotency key: a retry of a denied call
  decides again (it may pass after a reset, a grant or a refund).
* A key holds at most one charge that is not refunded. After a refund the
  key is free again, so the retry of work that failed and was refunded
  charges again, once. Retries while the charge stands return the original
  decision (``replayed=True``) whatever the new arguments are.
* A refund gives the charge back to the period it was taken from, even when
  that period has ended, so the ledger and the usage always agree.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from decimal import Decimal
from typing import Any

from quota._core import periods as _periods
from quota._core.decision import (
    Decision,
    check_int,
    check_now,
    decide,
    display_key,
    hit_params,
)
from quota._core.decision import retry_after as _retry_after
from quota._core.decision import stored_key as _stored_key
from quota._core.errors import ConfigurationError
from quota._limiter import thresholds as _thresholds
from quota._limiter.quota_types import (
    ALREADY_REFUNDED,
    CONSUME,
    DENY,
    GRANT,
    MAX_IDEMPOTENCY_KEY_BYTES,
    MAX_QUOTA_GRANTED,
    MAX_QUOTA_LIMIT,
    RATE_DENIED,
    REFUND,
    REFUNDED,
    UNKNOWN_KEY,
    Abort,
    CheckDecision,
    LedgerEntry,
    Limit,
    QuotaDecision,
    QuotaLimit,
    QuotaUsage,
    RateWindow,
    RefundResult,
    ThresholdEvent,
    check_key,
    check_text,
    check_thresholds,
)
from quota._sql import quotas as q
from quota._sql import statements as _sql
from quota._sql.ops import CleanupResult
from quota._sql.statements import Statement
from quota._sql.steps import Op

#: The operations (their types live in `quota._limiter.quota_types`).
__all__ = [
    "check",
    "cleanup_ledger",
    "consume",
    "grant",
    "ledger",
    "rate_denial",
    "record_rate_denial",
    "refund",
    "usage",
]

# -- placing a call in its period --------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Spot:
    """A quota placed in the period holding `now`."""

    subject: str
    name: str
    period: str
    tz: str | None
    start: int
    end: int

    @property
    def order(self) -> tuple[int, str, str, int]:
        return (1, self.subject, self.name, self.start)


def _spot(subject: object, name: object, period: object, tz: object, now: float) -> _Spot:
    check_now(now)
    subject = check_text("subject", subject)
    name = check_text("name", name)
    checked = _periods.check_period(period)
    zone, tz_name = _periods.load_zone(tz, checked)
    start, end = _periods.bounds(checked, now, zone)
    return _Spot(subject, name, str(checked), tz_name, start, end)


def _stored_period(text: str) -> str | int:
    return int(text) if text.isdigit() else text


def _decision(
    spot: _Spot, allowed: bool, limit: int, cost: int, used: int, granted: int, now: float,
    key: str | None,
) -> QuotaDecision:  # fmt: skip
    return QuotaDecision(
        allowed=allowed,
        used=used,
        remaining=max(0, limit + granted - used),
        limit=limit,
        period_start=spot.start,
        resets_at=spot.end,
        retry_after=0 if allowed else _retry_after(spot.end, now),
        subject=spot.subject,
        name=spot.name,
        cost=cost,
        granted=granted,
        idempotency_key=key,
    )


def _replayed(subject: str, name: str, key: str, held: Sequence[Any]) -> QuotaDecision:
    """The original decision of the charge `key` holds (a LEDGER_HELD row)."""
    cost, limit, used, remaining, start, end = (int(x) for x in held)
    return QuotaDecision(
        allowed=True,
        used=used,
        remaining=remaining,
        limit=limit,
        period_start=start,
        resets_at=end,
        retry_after=0,
        subject=subject,
        name=name,
        cost=cost,
        granted=remaining + used - limit,
        idempotency_key=key,
        replayed=True,
    )


def _entry(now: float, kind: str, d: QuotaDecision) -> tuple[Any, ...]:
    """LEDGER_APPEND / LEDGER_CHARGE params for decision `d`."""
    return (
        now, d.subject, d.name, kind, d.cost, d.idempotency_key, d.period_start, d.resets_at,
        d.limit, d.used, d.remaining,
    )  # fmt: skip


def _charge_params(spot: _Spot, limit: int, cost: int, now: float) -> tuple[Any, ...]:
    return (spot.subject, spot.name, spot.start, spot.end, spot.period, spot.tz, limit, cost, now)


def _fire_thresholds(
    spot: _Spot, limit: int, granted: int, used: int, thresholds: Sequence[Decimal], now: float
) -> Op[tuple[ThresholdEvent, ...]]:
    """The step every charge runs after it charged: fire the thresholds usage reached.

    In the charge's transaction, with its usage row locked; see `quota._limiter.thresholds`.
    """
    return (
        yield from _thresholds.fire(
            spot.subject, spot.name, spot.start, limit, granted, used, thresholds, now
        )
    )


# -- operations ----------------------------------------------------------------------------


def consume(
    subject: object, name: object, limit: object, period: object, cost: object,
    idempotency_key: object, tz: object, now: float, thresholds: object = (),
) -> Op[QuotaDecision]:  # fmt: skip
    """Charge `cost` units of `subject`'s quota `name` for the period holding `now`, or deny.

    A denial charges nothing. The ledger gets a ``consume`` or ``deny`` row
    in the same transaction, and a charge fires the `thresholds` it reaches
    (`_fire_thresholds`). See the module docstring for idempotency.
    """
    checked_limit = check_int("limit", limit, maximum=MAX_QUOTA_LIMIT)
    checked_cost = check_int("cost", cost, maximum=checked_limit)
    spot = _spot(subject, name, period, tz, now)
    key = check_key(idempotency_key)
    # No thresholds (the default) costs one comparison: no statement, no validation.
    checked = () if thresholds == () or thresholds is None else check_thresholds(thresholds)
    return _consume(spot, checked_limit, checked_cost, key, now, checked)


def _consume(
    spot: _Spot, limit: int, cost: int, key: str | None, now: float,
    thresholds: tuple[Decimal, ...] = (),
) -> Op[QuotaDecision]:  # fmt: skip
    rows = yield q.USAGE_CHARGE, _charge_params(spot, limit, cost, now)
    if rows:
        used, granted = int(rows[0][0]), int(rows[0][1])
        decision = _decision(spot, True, limit, cost, used, granted, now, key)
        claimed = yield q.LEDGER_CHARGE, _entry(now, CONSUME, decision)
        if not claimed:
            assert key is not None  # a NULL key never conflicts
            # The key already holds a charge: undo ours, answer the original.
            held = yield q.LEDGER_HELD, (spot.subject, spot.name, key)
            if held:
                raise Abort(_replayed(spot.subject, spot.name, key, held[0]))
            # Refunded between the two statements: decide again from scratch.
            raise Abort(None, then=_consume(spot, limit, cost, key, now, thresholds))
        if thresholds:
            fired = yield from _fire_thresholds(spot, limit, granted, used, thresholds, now)
            if fired:
                return _with(decision, fired=fired)
        return decision
    if key is not None:
        # A retry of a charge that went through, now that the period is full.
        held = yield q.LEDGER_HELD, (spot.subject, spot.name, key)
        if held:
            return _replayed(spot.subject, spot.name, key, held[0])
    rows = yield q.USAGE_GET, (spot.subject, spot.name, spot.start)
    decision = _decision(spot, False, limit, cost, int(rows[0][0]), int(rows[0][1]), now, key)
    yield q.LEDGER_APPEND, _entry(now, DENY, decision)
    return decision


def refund(
    subject: object, name: object, idempotency_key: object, now: float, *, rearm: bool = False
) -> Op[RefundResult]:
    """Give back the charge `idempotency_key` holds; a no-op that says so when there is none.

    With `rearm` (the outbox table is there), thresholds usage falls back below are
    re-armed in the same transaction.
    """
    check_now(now)
    return _refund(
        check_text("subject", subject),
        check_text("name", name),
        check_text("idempotency_key", idempotency_key, MAX_IDEMPOTENCY_KEY_BYTES),
        now,
        rearm,
    )


def _refund(subject: str, name: str, key: str, now: float, rearm: bool) -> Op[RefundResult]:
    # Row locks in the one order every operation takes them: the usage row, then the
    # ledger (a consume upserts usage, then claims its key in the ledger). The charge is
    # looked up without a lock first; marking it refunded first deadlocked against a
    # consume of the same key.
    held = yield q.LEDGER_HELD, (subject, name, key)
    if not held:
        seen = yield q.LEDGER_KEY_SEEN, (subject, name, key)
        status = ALREADY_REFUNDED if int(seen[0][0]) else UNKNOWN_KEY
        return RefundResult(False, status, subject, name, key, 0)
    cost, start, end = int(held[0][0]), int(held[0][4]), int(held[0][5])
    usage = yield q.USAGE_REFUND, (cost, now, subject, name, start)
    marked = yield q.LEDGER_MARK_REFUNDED, (now, subject, name, key)
    if not marked or (int(marked[0][0]), int(marked[0][1])) != (cost, start):
        # Refunded (and maybe charged again) between the look and the locks: undo, retry.
        raise Abort(None, then=_refund(subject, name, key, now, rearm))
    used = granted = limit = remaining = None
    if usage:
        used, granted = int(usage[0][0]), int(usage[0][1])
        limit = None if usage[0][2] is None else int(usage[0][2])
        remaining = None if limit is None else max(0, limit + granted - used)
        if rearm:
            yield from _thresholds.rearm(subject, name, start, used, limit, granted, now)
    yield (
        q.LEDGER_APPEND,
        (now, subject, name, REFUND, cost, key, start, end, limit, used, remaining),
    )
    return RefundResult(True, REFUNDED, subject, name, key, cost, used, start)


def grant(
    subject: object, name: object, amount: object, period: object, tz: object, now: float,
    *, rearm: bool = False,
) -> Op[QuotaUsage]:  # fmt: skip
    """Add `amount` units to `subject`'s quota `name` for the period holding `now`.

    Raises `ConfigurationError` naming ``amount`` when it is not an int in
    ``1..MAX_QUOTA_GRANTED``, or when it would take what the period has
    granted past `MAX_QUOTA_GRANTED` (then nothing is granted). With `rearm`, as
    for `refund`.
    """
    checked_amount = check_int("amount", amount, maximum=MAX_QUOTA_GRANTED)
    return _grant(_spot(subject, name, period, tz, now), checked_amount, now, rearm)


def _grant(spot: _Spot, amount: int, now: float, rearm: bool = False) -> Op[QuotaUsage]:
    rows = yield (
        q.USAGE_GRANT,
        (spot.subject, spot.name, spot.start, spot.end, spot.period, spot.tz, amount, now),
    )
    used, granted = int(rows[0][0]), int(rows[0][1])
    if granted > MAX_QUOTA_GRANTED:
        # Raised inside the transaction: the store rolls the grant back.
        raise ConfigurationError(
            f"amount {amount!r} would take what {spot.subject!r} {spot.name!r} has granted"
            f" this period to {granted}, over the most one period may be granted"
            f" ({MAX_QUOTA_GRANTED}); nothing was granted"
        )
    limit = None if rows[0][2] is None else int(rows[0][2])
    remaining = None if limit is None else max(0, limit + granted - used)
    if rearm:
        yield from _thresholds.rearm(spot.subject, spot.name, spot.start, used, limit, granted, now)
    yield (
        q.LEDGER_APPEND,
        (now, spot.subject, spot.name, GRANT, amount, None, spot.start, spot.end, limit, used,
         remaining),
    )  # fmt: skip
    return QuotaUsage(
        spot.subject, spot.name, _stored_period(spot.period), spot.tz, spot.start, spot.end,
        limit, used, granted, remaining,
    )  # fmt: skip


def usage(subject: object, now: float, *, include_ended: object) -> Op[list[QuotaUsage]]:
    """`subject`'s quotas in periods still running (every period with `include_ended`)."""
    check_now(now)
    if not isinstance(include_ended, bool):
        raise ConfigurationError(f"include_ended must be a bool, got {include_ended!r}")
    if include_ended:
        return _usage(q.USAGE_ALL, (check_text("subject", subject),))
    return _usage(q.USAGE_CURRENT, (check_text("subject", subject), math.floor(now)))


def _usage(statement: Statement, params: tuple[Any, ...]) -> Op[list[QuotaUsage]]:
    rows = yield statement, params
    result = []
    for subject, name, period, tz, start, end, limit, used, granted in rows:
        lim = _opt_int(limit)
        remaining = None if lim is None else max(0, lim + int(granted) - int(used))
        result.append(
            QuotaUsage(
                subject=str(subject),
                name=str(name),
                period=_stored_period(str(period)),
                tz=tz,
                period_start=int(start),
                resets_at=int(end),
                limit=lim,
                used=int(used),
                granted=int(granted),
                remaining=remaining,
            )
        )
    return result


def _since(since: object) -> float | None:
    if since is None:
        return None
    if isinstance(since, dt.datetime):
        if since.tzinfo is None:
            raise ConfigurationError(
                f"since must be epoch seconds or a datetime with a time zone, got {since!r}"
            )
        return since.timestamp()
    if isinstance(since, bool) or not isinstance(since, (int, float)) or math.isnan(since):
        raise ConfigurationError(
            f"since must be epoch seconds or a datetime with a time zone, got {since!r}"
        )
    return float(since)


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)


def ledger(subject: object, since: object) -> Op[list[LedgerEntry]]:
    """`subject`'s ledger entries at or after `since` (epoch seconds or aware datetime), oldest first."""
    checked = check_text("subject", subject)
    start = _since(since)
    if start is None:
        return _ledger(q.LEDGER_LIST, (checked,))
    return _ledger(q.LEDGER_LIST_SINCE, (checked, start))


def _ledger(statement: Statement, params: tuple[Any, ...]) -> Op[list[LedgerEntry]]:
    rows = yield statement, params
    return [
        LedgerEntry(
            id=int(id_),
            at=float(at),
            subject=str(subject),
            name=str(name),
            kind=str(kind),
            cost=int(cost),
            idempotency_key=key,
            period_start=_opt_int(start),
            resets_at=_opt_int(end),
            limit=_opt_int(limit),
            used=_opt_int(used),
            remaining=_opt_int(remaining),
            refunded_at=None if refunded_at is None else float(refunded_at),
        )
        for id_, at, subject, name, kind, cost, key, start, end, limit, used, remaining, refunded_at in rows
    ]


def cleanup_ledger(
    now: float, older_than: object, *, batch_size: object, dry_run: object
) -> Op[CleanupResult]:
    """Delete ledger entries older than `older_than` seconds, `batch_size` rows per statement.

    Run it without a transaction: each batch commits on its own. Usage rows
    are never deleted.
    """
    check_now(now)
    seconds = check_int("older_than", older_than, maximum=100 * 366 * 86400)
    size = check_int("batch_size", batch_size, maximum=1_000_000)
    if not isinstance(dry_run, bool):
        raise ConfigurationError(f"dry_run must be a bool, got {dry_run!r}")
    return _cleanup_ledger(now - seconds, size, dry_run)


def _cleanup_ledger(cutoff: float, batch_size: int, dry_run: bool) -> Op[CleanupResult]:
    if dry_run:
        rows = yield q.LEDGER_COUNT_OLD, (cutoff,)
        return CleanupResult(deleted=0, expired=int(rows[0][0]), dry_run=True)
    deleted = 0
    while True:
        rows = yield q.LEDGER_DELETE_OLD, (cutoff, batch_size)
        deleted += len(rows)
        if len(rows) < batch_size:
            return CleanupResult(deleted=deleted, expired=deleted)


def record_rate_denial(decision: Decision, cost: int, now: float) -> Op[None]:
    """Append a ``rate_denied`` entry for a rate-window denial (`Options.record_rate_denials`)."""
    yield rate_denial(decision, cost, now)


def rate_denial(decision: Decision, cost: int, now: float) -> tuple[Statement, tuple[Any, ...]]:
    """The statement that records a rate-window denial in the ledger."""
    return q.LEDGER_APPEND, (
        now, display_key(_stored_key(decision.key)), f"rate:{decision.window}s", RATE_DENIED,
        cost, None, None, decision.reset_at, decision.limit, decision.count, decision.remaining,
    )  # fmt: skip


# -- check: several limits, all or nothing -----------------------------------------------


@dataclass(frozen=True, slots=True)
class _RateStep:
    index: int
    limit: RateWindow
    params: tuple[str, str, int, int, int, float]

    @property
    def order(self) -> tuple[int, str, str, int]:
        return (0, self.params[0], "", 0)


@dataclass(frozen=True, slots=True)
class _QuotaStep:
    index: int
    limit: QuotaLimit
    spot: _Spot

    @property
    def order(self) -> tuple[int, str, str, int]:
        return self.spot.order


def _steps(
    limits: Sequence[object], cost: object, now: float
) -> tuple[list[_RateStep | _QuotaStep], int]:
    check_now(now)
    if not limits:
        raise ConfigurationError("limits must name at least one RateWindow or QuotaLimit, got ()")
    for limit in limits:
        if not isinstance(limit, (RateWindow, QuotaLimit)):
            raise ConfigurationError(
                f"limits must be quota.RateWindow or quota.QuotaLimit objects, got {limit!r}"
            )
    checked: Sequence[Limit] = limits  # type: ignore[assignment]
    checked_cost = check_int("cost", cost, maximum=min(limit.limit for limit in checked))
    steps: list[_RateStep | _QuotaStep] = []
    seen: set[tuple[str, ...]] = set()
    for index, limit in enumerate(checked):
        step: _RateStep | _QuotaStep
        identity: tuple[str, ...]
        if isinstance(limit, RateWindow):
            params = hit_params(limit.key, limit.limit, limit.window, now, checked_cost)
            step, identity = _RateStep(index, limit, params), ("rate", params[0])
        else:
            # Checked when the QuotaLimit was built: only place it in its period.
            zone, tz_name = _periods.load_zone(limit.tz, limit.period)
            start, end = _periods.bounds(limit.period, now, zone)
            spot = _Spot(limit.subject, limit.name, str(limit.period), tz_name, start, end)
            step, identity = _QuotaStep(index, limit, spot), ("quota", spot.subject, spot.name)
        if identity in seen:
            raise ConfigurationError(
                f"limits must be distinct: {limit!r} repeats a counter or quota given before"
            )
        seen.add(identity)
        steps.append(step)
    # One fixed order for everyone: two checks never wait for each other's rows in a cycle.
    steps.sort(key=lambda s: s.order)
    return steps, checked_cost


def check(
    limits: Sequence[object], cost: object, idempotency_key: object, now: float,
    *, record_rate_denials: bool = False,
) -> Op[CheckDecision]:  # fmt: skip
    """Charge every limit in `limits` or none of them; see `Limiter.check`."""
    steps, checked_cost = _steps(limits, cost, now)
    key = check_key(idempotency_key)
    if key is not None and not any(isinstance(s, _QuotaStep) for s in steps):
        raise ConfigurationError(
            f"idempotency_key={key!r} needs at least one QuotaLimit among the limits:"
            " rate windows keep no memory of keys"
        )
    return _check(steps, len(limits), checked_cost, key, now, record_rate_denials)


def _check(
    steps: list[_RateStep | _QuotaStep], n: int, cost: int, key: str | None, now: float,
    record_rate_denials: bool,
) -> Op[CheckDecision]:  # fmt: skip
    decisions: list[Decision | QuotaDecision | None] = [None] * n
    charged: list[bool] = [False] * n
    for step in steps:
        if isinstance(step, _RateStep):
            limit, params = step.limit, step.params
            rows = yield _sql.HIT_CAPPED, (*params, limit.limit)
            if rows:
                decisions[step.index] = decide(
                    limit.key, limit.limit, limit.window, params[2], now, int(rows[0][0])
                )
                charged[step.index] = True
            else:
                rows = yield _sql.PEEK, (params[0],)
                count = int(rows[0][0]) if rows else 0
                reset_at = params[2] + limit.window
                decisions[step.index] = Decision(
                    allowed=False, key=limit.key, limit=limit.limit,
                    remaining=max(0, limit.limit - count), count=count, window=limit.window,
                    reset_at=reset_at, retry_after=_retry_after(reset_at, now),
                    retry_after_exact=max(reset_at - now, 0.0),
                )  # fmt: skip
        else:
            spot, quota_limit = step.spot, step.limit.limit
            rows = yield q.USAGE_CHARGE, _charge_params(spot, quota_limit, cost, now)
            if rows:
                used, granted, allowed = int(rows[0][0]), int(rows[0][1]), True
                charged[step.index] = True
            else:
                rows = yield q.USAGE_GET, (spot.subject, spot.name, spot.start)
                used, granted, allowed = int(rows[0][0]), int(rows[0][1]), False
            decisions[step.index] = _decision(
                spot, allowed, quota_limit, cost, used, granted, now, key
            )
    final = [d for d in decisions if d is not None]
    denied = [i for i, d in enumerate(final) if not d.allowed]
    if not denied:
        for step in steps:
            if isinstance(step, _QuotaStep):
                decision = final[step.index]
                assert isinstance(decision, QuotaDecision)
                claimed = yield q.LEDGER_CHARGE, _entry(now, CONSUME, decision)
                if not claimed:
                    raise Abort(None, then=_replay_check(steps, n, cost, key, now))
                if step.limit.thresholds:
                    fired = yield from _fire_thresholds(
                        step.spot, decision.limit, decision.granted, decision.used,
                        step.limit.thresholds, now,
                    )  # fmt: skip
                    if fired:
                        final[step.index] = _with(decision, fired=fired)
        return CheckDecision(True, None, 0, tuple(final))
    if key is not None:
        for step in steps:
            if isinstance(step, _QuotaStep):
                held = yield q.LEDGER_HELD, (step.spot.subject, step.spot.name, key)
                if held:
                    raise Abort(None, then=_replay_check(steps, n, cost, key, now))
    # Everything this transaction charged is rolled back: report the counts without it.
    uncharged = tuple(_uncharged(d, cost) if charged[i] else d for i, d in enumerate(final))
    result = CheckDecision(
        False,
        _limit_of(steps, denied[0]),
        max(final[i].retry_after for i in denied),
        uncharged,
    )
    entries: list[tuple[Any, ...]] = []
    for step in sorted(steps, key=lambda s: s.index):
        decision = final[step.index]
        if decision.allowed:
            continue
        if isinstance(decision, QuotaDecision):
            entries.append(_entry(now, DENY, decision))
        elif record_rate_denials:
            entries.append(rate_denial(decision, cost, now)[1])
    raise Abort(result, then=_append_entries(entries, result))


def _limit_of(steps: list[_RateStep | _QuotaStep], index: int) -> RateWindow | QuotaLimit:
    return next(s.limit for s in steps if s.index == index)


def _uncharged(decision: Decision | QuotaDecision, cost: int) -> Decision | QuotaDecision:
    """`decision` as it would read had its (rolled back) charge never been made."""
    if isinstance(decision, QuotaDecision):
        return _with(decision, used=decision.used - cost, remaining=decision.remaining + cost)
    count = decision.count - cost
    return replace(decision, allowed=True, remaining=max(0, decision.limit - count), count=count)


def _with(decision: QuotaDecision, **changes: Any) -> QuotaDecision:
    return replace(decision, **changes)


def _append_entries(entries: list[tuple[Any, ...]], result: CheckDecision) -> Op[CheckDecision]:
    for params in entries:
        yield q.LEDGER_APPEND, params
    return result


def _replay_check(
    steps: list[_RateStep | _QuotaStep], n: int, cost: int, key: str | None, now: float
) -> Op[CheckDecision]:
    """The answer to a check whose key already holds a charge: charge nothing, report the state.

    Quotas the key holds a charge on report that charge's original decision;
    the other limits report their counts as they stand.
    """
    assert key is not None
    decisions: list[Decision | QuotaDecision | None] = [None] * n
    for step in steps:
        if isinstance(step, _RateStep):
            limit, params = step.limit, step.params
            rows = yield _sql.PEEK, (params[0],)
            count = int(rows[0][0]) if rows else 0
            decisions[step.index] = Decision(
                allowed=count + cost <= limit.limit, key=limit.key, limit=limit.limit,
                remaining=max(0, limit.limit - count), count=count, window=limit.window,
                reset_at=params[2] + limit.window, retry_after=0,
            )  # fmt: skip
            continue
        spot = step.spot
        held = yield q.LEDGER_HELD, (spot.subject, spot.name, key)
        if held:
            decisions[step.index] = _replayed(spot.subject, spot.name, key, held[0])
            continue
        rows = yield q.USAGE_GET, (spot.subject, spot.name, spot.start)
        used, granted = (int(rows[0][0]), int(rows[0][1])) if rows else (0, 0)
        view = _decision(spot, True, step.limit.limit, cost, used, granted, now, key)
        decisions[step.index] = _with(view, allowed=used + cost <= step.limit.limit + granted)
    final = tuple(d for d in decisions if d is not None)
    return CheckDecision(True, None, 0, final, replayed=True)
