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

Reservations (`reserve`, `settle`; the table ``quota_reservations``):

* A hold counts against the quota like a charge (``used + reserved + cost <=
  limit + granted``) but is kept apart in ``reserved``; ``remaining`` stays
  ``limit + granted - used``.
* An idempotency key holds at most one reservation per subject and quota, for as
  long as ledger retention keeps it: a retry returns that reservation (its id and
  expiry, and the quota as it stands, ``replayed``), even once it has ended.
* A hold whose time is up is released (``release`` in the ledger) by the first
  operation that touches its usage row and sees ``next_expiry <= now``: the
  charge statements answer "no" while one is due, so a charge stays one
  statement while none is.
* Rows are locked in one order: the usage row, then its reservations, then the
  ledger. A settle locks the usage row of its reservation's period first.
* A settle after the expiry that does not fit is denied (``allowed`` False,
  nothing charged, ``overage`` the whole amount); one of 0 is allowed and
  charges nothing. Its outcome is replayed like any other settle.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import math
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace
from decimal import Decimal
from typing import Any

from quota._core import periods as _periods
from quota._core.decision import (
    Decision,
    check_int,
    check_now,
    check_seconds,
    decide,
    display_key,
    hit_params,
)
from quota._core.decision import retry_after as _retry_after
from quota._core.decision import stored_key as _stored_key
from quota._core.errors import ConfigurationError, ReservationNotFound, SchemaError
from quota._limiter import thresholds as _thresholds
from quota._limiter.quota_types import (
    ALREADY_REFUNDED,
    CONSUME,
    DENY,
    GRANT,
    MAX_IDEMPOTENCY_KEY_BYTES,
    MAX_QUOTA_GRANTED,
    MAX_QUOTA_LIMIT,
    MAX_RESERVATION_TTL,
    RATE_DENIED,
    REFUND,
    REFUNDED,
    RELEASE,
    RESERVE,
    SETTLE,
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
    Reservation,
    ThresholdEvent,
    check_key,
    check_text,
    check_thresholds,
    threshold_text,
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
    "release_expired",
    "reserve",
    "settle",
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
    key: str | None, reserved: int = 0,
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
        reserved=reserved,
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
    return (
        spot.subject, spot.name, spot.start, spot.end, spot.period, spot.tz, limit, cost, now,
        now,
    )  # fmt: skip


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
    allowed, used, granted, reserved = yield from _charge(spot, limit, cost, now)
    if allowed:
        decision = _decision(spot, True, limit, cost, used, granted, now, key, reserved)
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
    decision = _decision(spot, False, limit, cost, used, granted, now, key, reserved)
    yield q.LEDGER_APPEND, _entry(now, DENY, decision)
    return decision


def _charge(spot: _Spot, limit: int, cost: int, now: float) -> Op[tuple[bool, int, int, int]]:
    """Charge `cost` to `spot`'s usage row: (allowed, used, granted, reserved) after it.

    One statement when it fits and no reservation of the period is due; when the
    statement says no, the holds whose time is up are released and it runs again.
    Denied, the row is left locked, as it stands.
    """
    rows = yield q.USAGE_CHARGE, _charge_params(spot, limit, cost, now)
    if rows:
        return True, int(rows[0][0]), int(rows[0][1]), int(rows[0][2])
    rows = yield q.USAGE_GET, (spot.subject, spot.name, spot.start)
    if _due(rows, now):
        yield from _release_due(spot.subject, spot.name, spot.start, now)
        rows = yield q.USAGE_CHARGE, _charge_params(spot, limit, cost, now)
        if rows:
            return True, int(rows[0][0]), int(rows[0][1]), int(rows[0][2])
        rows = yield q.USAGE_GET, (spot.subject, spot.name, spot.start)
    return False, int(rows[0][0]), int(rows[0][1]), int(rows[0][2])


def _due(rows: Sequence[Sequence[Any]], now: float) -> bool:
    """Whether a USAGE_GET row says a reservation of its period is due to be released."""
    return bool(rows) and rows[0][3] is not None and float(rows[0][3]) <= now


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
    """`subject`'s quotas in periods still running (every period with `include_ended`).

    Reservations whose time is up are released first (in the same transaction).
    """
    check_now(now)
    if not isinstance(include_ended, bool):
        raise ConfigurationError(f"include_ended must be a bool, got {include_ended!r}")
    if include_ended:
        return _usage(q.USAGE_ALL, (check_text("subject", subject),), now)
    return _usage(q.USAGE_CURRENT, (check_text("subject", subject), math.floor(now)), now)


def _usage(statement: Statement, params: tuple[Any, ...], now: float) -> Op[list[QuotaUsage]]:
    rows = yield statement, params
    result = []
    for subject, name, period, tz, start, end, limit, used, granted, reserved, due in rows:
        if due is not None and float(due) <= now:
            _, used, granted, reserved = yield from _release_due(subject, name, int(start), now)
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
                reserved=int(reserved),
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
            reservation_id=reservation_id,
            reserved=_opt_int(reserved),
        )
        for (
            id_, at, subject, name, kind, cost, key, start, end, limit, used, remaining,
            refunded_at, reservation_id, reserved,
        ) in rows
    ]  # fmt: skip


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
        expired = int(rows[0][0])
        try:
            rows = yield q.RESERVATION_COUNT_OLD, (cutoff,)
            expired += int(rows[0][0])
        except SchemaError as exc:
            if not _before_reservations(exc):
                raise
        return CleanupResult(deleted=0, expired=expired, dry_run=True)
    deleted = 0
    for statement in (q.LEDGER_DELETE_OLD, q.RESERVATION_DELETE_OLD):
        while True:
            try:
                rows = yield statement, (cutoff, batch_size)
            except SchemaError as exc:
                if statement is q.RESERVATION_DELETE_OLD and _before_reservations(exc):
                    break
                raise
            deleted += len(rows)
            if len(rows) < batch_size:
                break
    return CleanupResult(deleted=deleted, expired=deleted)


def _before_reservations(exc: SchemaError) -> bool:
    """Whether `exc` says the reservations table is not made yet (a database before
    revision 0007_reservations has no reservations to sweep)."""
    return q.RESERVATIONS in str(exc) and not exc.outage


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
            allowed, used, granted, reserved = yield from _charge(spot, quota_limit, cost, now)
            charged[step.index] = allowed
            decisions[step.index] = _decision(
                spot, allowed, quota_limit, cost, used, granted, now, key, reserved
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
        used, granted, reserved = (
            (int(rows[0][0]), int(rows[0][1]), int(rows[0][2])) if rows else (0, 0, 0)
        )
        view = _decision(spot, True, step.limit.limit, cost, used, granted, now, key, reserved)
        decisions[step.index] = _with(
            view, allowed=used + reserved + cost <= step.limit.limit + granted
        )
    final = tuple(d for d in decisions if d is not None)
    return CheckDecision(True, None, 0, final, replayed=True)


# -- reservations: reserve, then settle ----------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Held:
    """A row of ``quota_reservations`` (`q.RESERVATION_GET`)."""

    id: str
    subject: str
    name: str
    start: int
    end: int
    period: str
    tz: str | None
    limit: int
    amount: int
    key: str | None
    expires_at: float
    state: str
    outcome: str | None
    thresholds: tuple[Decimal, ...] = ()

    @classmethod
    def of(cls, row: Sequence[Any]) -> _Held:
        id_, subject, name, start, end, period, tz, limit, amount, key, _, expires, state = row[:13]
        out, stored = row[13], row[14]
        return cls(
            str(id_), str(subject), str(name), int(start), int(end), str(period), tz, int(limit),
            int(amount), key, float(expires), str(state), out,
            tuple(Decimal(t) for t in str(stored).split(",")) if stored else (),
        )  # fmt: skip

    @property
    def spot(self) -> _Spot:
        return _Spot(self.subject, self.name, self.period, self.tz, self.start, self.end)


def reserve(
    subject: object, name: object, amount: object, limit: object, period: object, ttl: object,
    idempotency_key: object, tz: object, now: float, thresholds: object = (),
) -> Op[Reservation]:  # fmt: skip
    """Hold `amount` units of `subject`'s quota `name` for the period holding `now`, or deny.

    All or nothing: it fits when ``used + reserved + amount <= limit + granted``.
    A denial holds nothing and appends a ``deny`` entry; a hold appends ``reserve``.
    The hold fires no threshold; its settle fires the `thresholds` its charge reaches.
    Raises `ConfigurationError` naming a bad argument (`ttl`: whole seconds in
    ``1..MAX_RESERVATION_TTL`` or a duration like ``"10m"``).
    """
    checked_limit = check_int("limit", limit, maximum=MAX_QUOTA_LIMIT)
    checked_amount = check_int("amount", amount, maximum=checked_limit)
    seconds = check_seconds("ttl", ttl, maximum=MAX_RESERVATION_TTL)
    spot = _spot(subject, name, period, tz, now)
    key = check_key(idempotency_key)
    checked = () if thresholds == () or thresholds is None else check_thresholds(thresholds)
    return _reserve(spot, checked_limit, checked_amount, now + seconds, key, now, checked)


def _reserve(
    spot: _Spot, limit: int, amount: int, expires: float, key: str | None, now: float,
    thresholds: tuple[Decimal, ...] = (),
) -> Op[Reservation]:  # fmt: skip
    if key is not None:
        rows = yield q.RESERVATION_BY_KEY, (spot.subject, spot.name, key)
        if rows:
            return (yield from _reservation_again(_Held.of(rows[0]), now))
    params = (
        spot.subject, spot.name, spot.start, spot.end, spot.period, spot.tz, limit, now, amount,
        expires, now,
    )  # fmt: skip
    rows = yield q.USAGE_RESERVE, params
    if not rows:
        rows = yield q.USAGE_GET, (spot.subject, spot.name, spot.start)
        if _due(rows, now):
            yield from _release_due(spot.subject, spot.name, spot.start, now)
            rows = yield q.USAGE_RESERVE, params
            if not rows:
                rows = yield q.USAGE_GET, (spot.subject, spot.name, spot.start)
                return (yield from _denied_reservation(spot, limit, amount, key, now, rows[0]))
        else:
            return (yield from _denied_reservation(spot, limit, amount, key, now, rows[0]))
    used, granted, reserved = int(rows[0][0]), int(rows[0][1]), int(rows[0][2])
    reservation_id = uuid.uuid4().hex
    inserted = yield (
        q.RESERVATION_INSERT,
        (reservation_id, spot.subject, spot.name, spot.start, spot.end, spot.period, spot.tz,
         limit, amount, key, now, expires,
         ",".join(threshold_text(t) for t in thresholds) if thresholds else None),
    )  # fmt: skip
    if not inserted:
        # The key got a reservation meanwhile (another process's): undo ours, answer that one.
        raise Abort(None, then=_reserve(spot, limit, amount, expires, key, now, thresholds))
    decision = _decision(spot, True, limit, amount, used, granted, now, key, reserved)
    yield q.LEDGER_APPEND_RESERVATION, (*_entry(now, RESERVE, decision), reservation_id, amount)
    return Reservation(True, reservation_id, expires, decision)


def _denied_reservation(
    spot: _Spot, limit: int, amount: int, key: str | None, now: float, row: Sequence[Any]
) -> Op[Reservation]:
    used, granted, reserved = int(row[0]), int(row[1]), int(row[2])
    decision = _decision(spot, False, limit, amount, used, granted, now, key, reserved)
    yield q.LEDGER_APPEND, _entry(now, DENY, decision)
    return Reservation(False, None, None, decision)


def _reservation_again(held: _Held, now: float) -> Op[Reservation]:
    """The reservation an idempotency key already holds, with its quota as it stands."""
    rows = yield q.USAGE_GET, (held.subject, held.name, held.start)
    used, granted, reserved = (
        (int(rows[0][0]), int(rows[0][1]), int(rows[0][2])) if rows else (0, 0, 0)
    )
    decision = _decision(held.spot, True, held.limit, held.amount, used, granted, now, held.key)
    decision = _with(decision, reserved=reserved, replayed=True)
    return Reservation(True, held.id, held.expires_at, decision)


def settle(reservation_id: object, actual: object, now: float) -> Op[QuotaDecision]:
    """End reservation `reservation_id`, charging `actual` units; see `Limiter.settle_quota`.

    Raises `ConfigurationError` naming a bad argument (`actual`: an int in
    ``0..MAX_QUOTA_LIMIT``) and `ReservationNotFound` for an unknown id.
    """
    check_now(now)
    checked_id = check_text("reservation_id", reservation_id)
    if type(actual) is not int or not 0 <= actual <= MAX_QUOTA_LIMIT:
        raise ConfigurationError(
            f"actual must be an int between 0 and {MAX_QUOTA_LIMIT}, got {actual!r}"
        )
    return _settle(checked_id, actual, now)


def _settle(reservation_id: str, actual: int, now: float) -> Op[QuotaDecision]:
    rows = yield q.RESERVATION_GET, (reservation_id,)
    if not rows:
        raise ReservationNotFound(reservation_id)
    held = _Held.of(rows[0])
    if held.state == "settled":
        return _settled_before(held)
    # The usage row first (the order every operation locks in), then the reservation again.
    usage = yield q.USAGE_LOCK, (held.subject, held.name, held.start)
    if usage and usage[0][3] is not None and float(usage[0][3]) <= now:
        yield from _release_due(held.subject, held.name, held.start, now)
    rows = yield q.RESERVATION_GET, (reservation_id,)
    held = _Held.of(rows[0])
    if held.state == "settled":
        return _settled_before(held)
    if held.state == "released":
        decision = yield from _settle_expired(held, actual, now)
        return decision
    rows = yield q.USAGE_GET, (held.subject, held.name, held.start)
    used, granted, reserved = int(rows[0][0]), int(rows[0][1]), int(rows[0][2])
    # Up to the amount held is charged whatever it takes; the rest as far as the limit
    # allows, every other hold counted.
    base = min(actual, held.amount)
    room = max(0, held.limit + granted - used - (reserved - held.amount) - base)
    extra = min(actual - base, room)
    charged = base + extra
    decision = _decision(
        held.spot, True, held.limit, actual, used + charged, granted, now, held.key,
        reserved - held.amount,
    )  # fmt: skip
    decision = _with(decision, overage=actual - charged)
    marked = yield q.RESERVATION_SETTLE, (now, _outcome(decision), held.id, "held")
    if not marked:
        raise Abort(None, then=_settle(reservation_id, actual, now))
    yield (
        q.USAGE_UNRESERVE,
        (charged, held.amount, now, held.subject, held.name, held.start),
    )
    yield from _settled(decision, held, charged, held.amount, now)
    if held.thresholds and charged:
        fired = yield from _fire_thresholds(
            held.spot, held.limit, granted, used + charged, held.thresholds, now
        )
        if fired:
            return _with(decision, fired=fired)
    return decision


def _settle_expired(held: _Held, actual: int, now: float) -> Op[QuotaDecision]:
    """A settle after the hold was released: a new charge of `actual`, in the period of `now`."""
    spot = _spot(held.subject, held.name, _stored_period(held.period), held.tz, now)
    rows = yield q.USAGE_GET, (spot.subject, spot.name, spot.start)
    used, granted, reserved = (
        (int(rows[0][0]), int(rows[0][1]), int(rows[0][2])) if rows else (0, 0, 0)
    )
    allowed = actual == 0
    if actual and (rows or actual <= held.limit):
        allowed, used, granted, reserved = yield from _charge(spot, held.limit, actual, now)
    charged = actual if allowed else 0
    decision = _decision(spot, allowed, held.limit, actual, used, granted, now, held.key, reserved)
    decision = _with(decision, overage=actual - charged, expired=True)
    marked = yield q.RESERVATION_SETTLE, (now, _outcome(decision), held.id, "released")
    if not marked:
        raise Abort(None, then=_settle(held.id, actual, now))
    yield from _settled(decision, held, charged, 0, now)
    if held.thresholds and charged:
        fired = yield from _fire_thresholds(spot, held.limit, granted, used, held.thresholds, now)
        if fired:
            return _with(decision, fired=fired)
    return decision


def _settled(
    decision: QuotaDecision, held: _Held, charged: int, released: int, now: float
) -> Op[None]:
    """What follows a settle's charge (made by then, `decision` after it): its ledger entry."""
    entry = _entry(now, SETTLE, _with(decision, cost=charged))
    yield q.LEDGER_APPEND_RESERVATION, (*entry, held.id, released)


def _outcome(decision: QuotaDecision) -> str:
    """A settle's decision as stored, for `_settled_before`."""
    return json.dumps(dataclasses.asdict(decision))


def _settled_before(held: _Held) -> QuotaDecision:
    assert held.outcome is not None
    return _with(QuotaDecision(**json.loads(held.outcome)), fired=(), replayed=True)


def _release_due(subject: str, name: str, start: int, now: float) -> Op[tuple[int, int, int, int]]:
    """Release the holds of one usage row whose time is up, with a ``release`` entry each:
    (holds released, used, granted, reserved) after."""
    yield q.USAGE_LOCK, (subject, name, start)
    released = yield q.RESERVATION_RELEASE_DUE, (now, subject, name, start, now)
    amount = sum(int(row[1]) for row in released)
    rows = yield q.USAGE_UNRESERVE, (0, amount, now, subject, name, start)
    used, granted, reserved = int(rows[0][0]), int(rows[0][1]), int(rows[0][2])
    limit, end = _opt_int(rows[0][3]), int(rows[0][4])
    remaining = None if limit is None else max(0, limit + granted - used)
    for id_, held, key in sorted(released, key=lambda row: str(row[0])):
        yield (
            q.LEDGER_APPEND_RESERVATION,
            (now, subject, name, RELEASE, int(held), key, start, end, limit, used, remaining,
             id_, int(held)),
        )  # fmt: skip
    return len(released), used, granted, reserved


def release_expired(now: float, batch_size: int) -> Op[tuple[int, int]]:
    """Release the holds whose time is up, of at most `batch_size` usage rows:
    (holds released, usage rows visited). One transaction."""
    check_now(now)
    rows = yield q.RESERVATION_DUE_ROWS, (now, batch_size)
    released = 0
    for subject, name, start in rows:
        count, *_ = yield from _release_due(str(subject), str(name), int(start), now)
        released += count
    return released, len(rows)


def count_expired(now: float) -> Op[int]:
    """How many holds are due to be released at `now`."""
    rows = yield q.RESERVATION_COUNT_DUE, (now,)
    return int(rows[0][0])
