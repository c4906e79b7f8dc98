"""Usage thresholds: the operations that fire and re-arm them, and the outbox's delivery.

A quota may carry thresholds, fractions of its limit with grants (``0.8``, ``0.9``,
``1``). A charge that takes usage to or past ``threshold * (limit + granted)`` fires
the threshold: it writes a `ThresholdEvent` into the outbox table ``quota_events`` in
the charge's own transaction, unless an armed event of the same (subject, quota,
period start, threshold) is there already. The rule is compared exactly (as
fractions, never floats), and the partial unique index of armed events makes it hold
however many processes race: a threshold fires once per period. A refund or a grant
that takes usage back below a threshold re-arms its event (``rearmed_at``), so the
threshold fires again if usage climbs back.

Written once for both faces as generators of statements (`quota._sql.steps`); `fire`
is the one step every charge runs after it charged (holds and reservations never
fire). The outbox's delivery (claim with a lease, mark delivered, back off) is here
too, driven by `quota.notify`.
"""

from __future__ import annotations

from collections.abc import Sequence
from decimal import Decimal
from fractions import Fraction
from typing import Any

from quota._core.decision import check_int, check_now
from quota._core.errors import ConfigurationError
from quota._limiter.quota_types import ThresholdEvent, threshold_text
from quota._sql import events as _events
from quota._sql.ops import CleanupResult
from quota._sql.steps import Op

#: Delivered events are kept this long by ``quota cleanup`` unless told otherwise.
DEFAULT_EVENT_RETENTION = 30 * 86400


def crossed(thresholds: Sequence[Decimal], used: int, total: int) -> list[Decimal]:
    """The thresholds `used` units reach out of `total` (the limit with grants): exact."""
    return [t for t in thresholds if used >= Fraction(t) * total]


def fire(
    subject: str, name: str, period_start: int, limit: int, granted: int, used: int,
    thresholds: Sequence[Decimal], now: float,
) -> Op[tuple[ThresholdEvent, ...]]:  # fmt: skip
    """Write an event for each threshold usage reaches that has no armed event yet.

    Runs in the transaction of the charge that took usage to `used` (its usage row
    locked), after it; returns the events written, smallest threshold first. No
    statement when no threshold is reached.
    """
    reached = crossed(thresholds, used, limit + granted)
    if not reached:
        return ()
    params: list[Any] = []
    for threshold in reached:
        params += [
            subject, name, period_start, threshold_text(threshold), used, limit + granted, now,
        ]  # fmt: skip
    rows = yield _events.fire(len(reached)), tuple(params)
    return tuple(sorted((event_of(row) for row in rows), key=lambda e: e.threshold))


def rearm(
    subject: str, name: str, period_start: int, used: int, limit: int | None, granted: int,
    now: float,
) -> Op[int]:  # fmt: skip
    """Re-arm the events of a period whose threshold usage is now below; how many were.

    Runs in the transaction of the refund or grant that changed usage, after it.
    """
    if limit is None:  # only grants so far: nothing was charged, nothing fired
        return 0
    rows = yield _events.ARMED, (subject, name, period_start)
    total = limit + granted
    rearmed = 0
    for event_id, text in rows:
        if used < Fraction(Decimal(str(text))) * total:
            done = yield _events.REARM, (now, int(event_id))
            rearmed += len(done)
    return rearmed


def probe() -> Op[None]:
    """Raises `SchemaError` when the outbox table is not there."""
    yield _events.PROBE, ()


def event_of(row: Sequence[Any]) -> ThresholdEvent:
    event_id, subject, name, start, threshold, used, limit, at = row[:8]
    return ThresholdEvent(
        id=int(event_id), subject=str(subject), quota=str(name), period_start=int(start),
        threshold=Decimal(str(threshold)), used=int(used), limit=int(limit), at=float(at),
    )  # fmt: skip


# -- delivery (quota.notify) -----------------------------------------------------------------


def claim(
    holder: str, now: float, lease: float, batch: int
) -> Op[list[tuple[ThresholdEvent, int]]]:
    """Claim up to `batch` events due now for `lease` seconds: (event, attempts so far)."""
    rows = yield _events.CLAIM, (now + lease, holder, now, batch, now)
    return sorted(((event_of(row), int(row[8])) for row in rows), key=lambda pair: pair[0].id)


def delivered(event_id: int, now: float) -> Op[bool]:
    rows = yield _events.DELIVERED, (now, event_id)
    return bool(rows)


def failed(event_id: int, holder: str, retry_at: float, error: str) -> Op[bool]:
    rows = yield _events.FAILED, (retry_at, error[:1000], event_id, holder)
    return bool(rows)


def pending() -> Op[tuple[int, float | None]]:
    """How many events are undelivered, and when the earliest is due (None: none)."""
    rows = yield _events.PENDING, ()
    count = int(rows[0][0])
    return count, None if not count else float(rows[0][1])


def cleanup_events(
    now: float, older_than: object, *, batch_size: object, dry_run: object
) -> Op[CleanupResult]:
    """Delete events delivered more than `older_than` seconds before `now`; never an
    undelivered one. Run it without a transaction: each batch commits on its own."""
    check_now(now)
    seconds = check_int("older_than", older_than, maximum=100 * 366 * 86400)
    size = check_int("batch_size", batch_size, maximum=1_000_000)
    if not isinstance(dry_run, bool):
        raise ConfigurationError(f"dry_run must be a bool, got {dry_run!r}")
    return _cleanup(now - seconds, size, dry_run)


def _cleanup(cutoff: float, batch_size: int, dry_run: bool) -> Op[CleanupResult]:
    if dry_run:
        rows = yield _events.COUNT_OLD, (cutoff,)
        return CleanupResult(deleted=0, expired=int(rows[0][0]), dry_run=True)
    deleted = 0
    while True:
        rows = yield _events.DELETE_OLD, (cutoff, batch_size)
        deleted += len(rows)
        if len(rows) < batch_size:
            return CleanupResult(deleted=deleted, expired=deleted)
