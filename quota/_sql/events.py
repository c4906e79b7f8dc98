"""The statements of usage thresholds' outbox, ``quota_events`` (revision 0008_thresholds).

Written once with ``?`` placeholders, as `quota._sql.quotas`; every statement runs
unchanged on SQLite 3.35+ and PostgreSQL and returns rows. The operations that run
them are in `quota._limiter.thresholds`.
"""

from __future__ import annotations

import functools

from quota._sql.statements import Statement

EVENTS = "quota_events"

_EVENT_COLUMNS = "id, subject, quota, period_start, threshold, used, quota_limit, at"
_FIRE_ROW = "(?, ?, ?, ?, ?, ?, ?, 0)"


@functools.lru_cache(maxsize=64)
def fire(n: int) -> Statement:
    """Fire `n` thresholds of one period at once; the rows that come back are the events
    written, and a threshold whose armed event exists already comes back as no row (the
    partial unique index ``uq_quota_events_armed``; on PostgreSQL this waits for a
    concurrent insert of the same key to commit or roll back).

    Params, `n` times: subject, quota, period_start, threshold, used, limit, at.
    """
    return Statement(
        f"events_fire_{n}",
        "INSERT INTO quota_events"
        " (subject, quota, period_start, threshold, used, quota_limit, at, attempts)"
        " VALUES " + ", ".join([_FIRE_ROW] * n) + " ON CONFLICT (subject, quota, period_start,"
        " threshold) WHERE rearmed_at IS NULL DO NOTHING RETURNING " + _EVENT_COLUMNS,
    )


#: The armed events of one period. Params: subject, quota, period_start.
ARMED = Statement(
    "events_armed",
    "SELECT id, threshold FROM quota_events"
    " WHERE subject = ? AND quota = ? AND period_start = ? AND rearmed_at IS NULL",
)

#: Re-arm one event. Params: now, id.
REARM = Statement(
    "events_rearm",
    "UPDATE quota_events SET rearmed_at = ? WHERE id = ? AND rearmed_at IS NULL RETURNING id",
)

#: Whether the table is there (a probe; its rows say nothing).
PROBE = Statement("events_probe", "SELECT id FROM quota_events WHERE id < 0")

#: Claim up to `batch` events due for delivery: undelivered, and neither claimed by a
#: live lease nor waiting out a backoff. The outer condition is checked again on the row
#: a concurrent claim left (PostgreSQL), so two workers never both claim one event.
#: Params: until, holder, now, batch, now.
CLAIM = Statement(
    "events_claim",
    "UPDATE quota_events SET claimed_until = ?, claimed_by = ?, attempts = attempts + 1"
    " WHERE id IN (SELECT id FROM quota_events WHERE delivered_at IS NULL"
    " AND (claimed_until IS NULL OR claimed_until <= ?) ORDER BY id LIMIT ?)"
    " AND delivered_at IS NULL AND (claimed_until IS NULL OR claimed_until <= ?)"
    " RETURNING " + _EVENT_COLUMNS + ", attempts",
)

#: Params: now, id.
DELIVERED = Statement(
    "events_delivered",
    "UPDATE quota_events SET delivered_at = ?, claimed_until = NULL, claimed_by = NULL,"
    " last_error = NULL WHERE id = ? AND delivered_at IS NULL RETURNING id",
)

#: A failed delivery: try again at `retry_at`, unless another worker claimed it since.
#: Params: retry_at, error, id, holder.
FAILED = Statement(
    "events_failed",
    "UPDATE quota_events SET claimed_until = ?, claimed_by = NULL, last_error = ?"
    " WHERE id = ? AND claimed_by = ? AND delivered_at IS NULL RETURNING id",
)

#: Events not delivered yet, and the earliest time one is due. Params: none.
PENDING = Statement(
    "events_pending",
    "SELECT count(*), min(coalesce(claimed_until, 0)) FROM quota_events WHERE delivered_at IS NULL",
)

#: Retention of delivered events. Params: cutoff (and batch size).
COUNT_OLD = Statement(
    "events_count_old",
    "SELECT count(*) FROM quota_events WHERE delivered_at IS NOT NULL AND delivered_at < ?",
)
DELETE_OLD = Statement(
    "events_delete_old",
    "DELETE FROM quota_events WHERE id IN (SELECT id FROM quota_events"
    " WHERE delivered_at IS NOT NULL AND delivered_at < ? LIMIT ?) RETURNING 1",
)

#: Params: subject.
LIST = Statement(
    "events_list",
    "SELECT " + _EVENT_COLUMNS + ", delivered_at, attempts, last_error, rearmed_at"
    " FROM quota_events WHERE subject = ? ORDER BY id",
)
