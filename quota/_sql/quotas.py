"""The durable-quota statements (`quota._sql.statements.Statement`), written once with ``?`` placeholders.

The same conventions as `quota._sql.statements`: each store renders these into its
driver's placeholder style (cached), and every statement runs unchanged on
SQLite 3.35+ and PostgreSQL. Operations in `quota._limiter.quotas` run them inside
one transaction each; none of them uses DML inside a CTE (SQLite cannot).
"""

from __future__ import annotations

from quota._sql.statements import Statement

USAGE = "quota_usage"
LEDGER = "quota_ledger"

_USAGE_INSERT = (
    "INSERT INTO quota_usage"
    " (subject, name, period_start, period_end, period, tz, quota_limit, used, granted, updated_at)"
)

#: Charge `cost` to a period unless that takes `used` plus what live reservations hold
#: over `limit` plus what was granted. A denial leaves the row alone and returns no
#: row (the row is still locked until the transaction ends). A new row always fits:
#: cost <= limit. No row comes back either when a reservation of the period is due
#: to be released (``next_expiry <= now``): the caller releases it and charges again,
#: so a charge stays one statement while nothing is due.
#: Params: subject, name, period_start, period_end, period, tz, limit, cost, now, now.
USAGE_CHARGE = Statement(
    "usage_charge",
    _USAGE_INSERT + " VALUES (?, ?, ?, ?, ?, ?, ?, ?, 0, ?)"
    " ON CONFLICT (subject, name, period_start) DO UPDATE"
    " SET used = quota_usage.used + excluded.used, quota_limit = excluded.quota_limit,"
    " period_end = excluded.period_end, period = excluded.period, tz = excluded.tz,"
    " updated_at = excluded.updated_at"
    " WHERE quota_usage.used + quota_usage.reserved + excluded.used"
    " <= excluded.quota_limit + quota_usage.granted"
    " AND (quota_usage.next_expiry IS NULL OR quota_usage.next_expiry > ?)"
    " RETURNING used, granted, reserved",
)

#: Hold `amount` for a reservation, as USAGE_CHARGE charges (the same rule, the same
#: answer when a release is due), keeping ``next_expiry`` the earliest expiry held.
#: Params: subject, name, period_start, period_end, period, tz, limit, now, amount,
#: expires_at, now.
USAGE_RESERVE = Statement(
    "usage_reserve",
    "INSERT INTO quota_usage (subject, name, period_start, period_end, period, tz,"
    " quota_limit, used, granted, updated_at, reserved, next_expiry)"
    " VALUES (?, ?, ?, ?, ?, ?, ?, 0, 0, ?, ?, ?)"
    " ON CONFLICT (subject, name, period_start) DO UPDATE"
    " SET reserved = quota_usage.reserved + excluded.reserved,"
    " next_expiry = CASE WHEN quota_usage.next_expiry IS NULL"
    " OR excluded.next_expiry < quota_usage.next_expiry"
    " THEN excluded.next_expiry ELSE quota_usage.next_expiry END,"
    " quota_limit = excluded.quota_limit, period_end = excluded.period_end,"
    " period = excluded.period, tz = excluded.tz, updated_at = excluded.updated_at"
    " WHERE quota_usage.used + quota_usage.reserved + excluded.reserved"
    " <= excluded.quota_limit + quota_usage.granted"
    " AND (quota_usage.next_expiry IS NULL OR quota_usage.next_expiry > ?)"
    " RETURNING used, granted, reserved",
)

#: Lock a usage row and read it. Params: subject, name, period_start.
USAGE_LOCK = Statement(
    "usage_lock",
    "UPDATE quota_usage SET updated_at = updated_at"
    " WHERE subject = ? AND name = ? AND period_start = ?"
    " RETURNING used, granted, reserved, next_expiry, quota_limit",
)

#: Charge `charge` and stop holding `unreserve`, with ``next_expiry`` read again from
#: the reservations still held (so mark them first). Params: charge, unreserve, now,
#: subject, name, period_start.
USAGE_UNRESERVE = Statement(
    "usage_unreserve",
    "UPDATE quota_usage SET used = used + ?, reserved = reserved - ?,"
    " next_expiry = (SELECT min(r.expires_at) FROM quota_reservations r"
    " WHERE r.subject = quota_usage.subject AND r.name = quota_usage.name"
    " AND r.period_start = quota_usage.period_start AND r.state = 'held'),"
    " updated_at = ? WHERE subject = ? AND name = ? AND period_start = ?"
    " RETURNING used, granted, reserved, quota_limit, period_end",
)

#: Add to what a period grants. Params: subject, name, period_start, period_end,
#: period, tz, amount, now.
USAGE_GRANT = Statement(
    "usage_grant",
    _USAGE_INSERT + " VALUES (?, ?, ?, ?, ?, ?, NULL, 0, ?, ?)"
    " ON CONFLICT (subject, name, period_start) DO UPDATE"
    " SET granted = quota_usage.granted + excluded.granted, period_end = excluded.period_end,"
    " period = excluded.period, tz = excluded.tz, updated_at = excluded.updated_at"
    " RETURNING used, granted, quota_limit",
)

#: Give a charge back. Params: cost, now, subject, name, period_start.
USAGE_REFUND = Statement(
    "usage_refund",
    "UPDATE quota_usage SET used = used - ?, updated_at = ?"
    " WHERE subject = ? AND name = ? AND period_start = ?"
    " RETURNING used, granted, quota_limit",
)

#: Params: subject, name, period_start.
USAGE_GET = Statement(
    "usage_get",
    "SELECT used, granted, reserved, next_expiry FROM quota_usage"
    " WHERE subject = ? AND name = ? AND period_start = ?",
)

_USAGE_COLUMNS = (
    "SELECT subject, name, period, tz, period_start, period_end, quota_limit, used, granted,"
    " reserved, next_expiry FROM quota_usage"
)
#: Periods still running. Params: subject, now.
USAGE_CURRENT = Statement(
    "usage_current",
    _USAGE_COLUMNS + " WHERE subject = ? AND period_end > ? ORDER BY name, period_start",
)
#: Every period ever used, newest first per quota. Params: subject.
USAGE_ALL = Statement(
    "usage_all", _USAGE_COLUMNS + " WHERE subject = ? ORDER BY name, period_start DESC"
)

_LEDGER_INSERT = (
    "INSERT INTO quota_ledger (at, subject, name, kind, cost, idempotency_key,"
    " period_start, period_end, quota_limit, used, remaining)"
    " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)
#: Append one entry. Params: at, subject, name, kind, cost, idempotency_key,
#: period_start, period_end, limit, used, remaining. (Every statement returns
#: rows: psycopg's fetchall refuses a statement that returns none.)
LEDGER_APPEND = Statement("ledger_append", _LEDGER_INSERT + " RETURNING id")

#: Append a charge, claiming its idempotency key; no row comes back when the
#: key already holds a charge that was not refunded (the partial unique index
#: ``uq_quota_ledger_idempotency``; on PostgreSQL this waits for a concurrent
#: claim of the same key to commit or roll back). A NULL key never conflicts.
#: Params: as LEDGER_APPEND.
LEDGER_CHARGE = Statement(
    "ledger_charge",
    _LEDGER_INSERT + " ON CONFLICT (subject, name, idempotency_key)"
    " WHERE kind = 'consume' AND refunded_at IS NULL DO NOTHING RETURNING id",
)

#: The charge an idempotency key holds. Params: subject, name, idempotency_key.
LEDGER_HELD = Statement(
    "ledger_held",
    "SELECT cost, quota_limit, used, remaining, period_start, period_end FROM quota_ledger"
    " WHERE subject = ? AND name = ? AND idempotency_key = ? AND kind = 'consume'"
    " AND refunded_at IS NULL",
)

#: Mark the charge a key holds as refunded. Params: now, subject, name, idempotency_key.
LEDGER_MARK_REFUNDED = Statement(
    "ledger_mark_refunded",
    "UPDATE quota_ledger SET refunded_at = ?"
    " WHERE subject = ? AND name = ? AND idempotency_key = ? AND kind = 'consume'"
    " AND refunded_at IS NULL"
    " RETURNING cost, period_start, period_end",
)

#: Whether a key ever charged. Params: subject, name, idempotency_key.
LEDGER_KEY_SEEN = Statement(
    "ledger_key_seen",
    "SELECT count(*) FROM quota_ledger"
    " WHERE subject = ? AND name = ? AND idempotency_key = ? AND kind = 'consume'",
)

_LEDGER_COLUMNS = (
    "SELECT id, at, subject, name, kind, cost, idempotency_key, period_start, period_end,"
    " quota_limit, used, remaining, refunded_at, reservation_id, reserved FROM quota_ledger"
)
#: Params: subject.
LEDGER_LIST = Statement("ledger_list", _LEDGER_COLUMNS + " WHERE subject = ? ORDER BY id")
#: Params: subject, since.
LEDGER_LIST_SINCE = Statement(
    "ledger_list_since", _LEDGER_COLUMNS + " WHERE subject = ? AND at >= ? ORDER BY id"
)

#: Append an entry of a reservation (``reserve``, ``settle``, ``release``). Params: as
#: LEDGER_APPEND, then reservation_id, reserved.
LEDGER_APPEND_RESERVATION = Statement(
    "ledger_append_reservation",
    "INSERT INTO quota_ledger (at, subject, name, kind, cost, idempotency_key,"
    " period_start, period_end, quota_limit, used, remaining, reservation_id, reserved)"
    " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) RETURNING id",
)

# -- reservations (quota_reservations, revision 0007_reservations) ----------------------

RESERVATIONS = "quota_reservations"

_RESERVATION_COLUMNS = (
    "SELECT id, subject, name, period_start, period_end, period, tz, quota_limit, amount,"
    " idempotency_key, created_at, expires_at, state, outcome, thresholds FROM quota_reservations"
)

#: Record a hold, claiming its idempotency key; no row comes back when the key already
#: holds a reservation. Params: id, subject, name, period_start, period_end, period, tz,
#: limit, amount, idempotency_key, created_at, expires_at, thresholds.
RESERVATION_INSERT = Statement(
    "reservation_insert",
    "INSERT INTO quota_reservations (id, subject, name, period_start, period_end, period, tz,"
    " quota_limit, amount, idempotency_key, created_at, expires_at, thresholds, state)"
    " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 'held')"
    " ON CONFLICT (subject, name, idempotency_key) WHERE idempotency_key IS NOT NULL"
    " DO NOTHING RETURNING id",
)

#: Params: id.
RESERVATION_GET = Statement("reservation_get", _RESERVATION_COLUMNS + " WHERE id = ?")

#: The reservation an idempotency key holds. Params: subject, name, idempotency_key.
RESERVATION_BY_KEY = Statement(
    "reservation_by_key",
    _RESERVATION_COLUMNS + " WHERE subject = ? AND name = ? AND idempotency_key = ?",
)

#: End a reservation in `state` with a settle's outcome. Params: now, outcome, id, state.
RESERVATION_SETTLE = Statement(
    "reservation_settle",
    "UPDATE quota_reservations SET state = 'settled', ended_at = ?, outcome = ?"
    " WHERE id = ? AND state = ? RETURNING id",
)

#: Release the holds of one usage row whose time is up. Params: now, subject, name,
#: period_start, now.
RESERVATION_RELEASE_DUE = Statement(
    "reservation_release_due",
    "UPDATE quota_reservations SET state = 'released', ended_at = ?"
    " WHERE subject = ? AND name = ? AND period_start = ? AND state = 'held'"
    " AND expires_at <= ? RETURNING id, amount, idempotency_key",
)

#: Usage rows holding reservations whose time is up. Params: now, limit.
RESERVATION_DUE_ROWS = Statement(
    "reservation_due_rows",
    "SELECT DISTINCT subject, name, period_start FROM quota_reservations"
    " WHERE state = 'held' AND expires_at <= ? ORDER BY subject, name, period_start LIMIT ?",
)

#: Params: now.
RESERVATION_COUNT_DUE = Statement(
    "reservation_count_due",
    "SELECT count(*) FROM quota_reservations WHERE state = 'held' AND expires_at <= ?",
)

#: Retention of ended reservations, with the ledger. Params: cutoff, batch size.
RESERVATION_COUNT_OLD = Statement(
    "reservation_count_old",
    "SELECT count(*) FROM quota_reservations WHERE state <> 'held' AND ended_at < ?",
)
RESERVATION_DELETE_OLD = Statement(
    "reservation_delete_old",
    "DELETE FROM quota_reservations WHERE id IN (SELECT id FROM quota_reservations"
    " WHERE state <> 'held' AND ended_at < ? LIMIT ?) RETURNING 1",
)

#: Retention. Params: cutoff (and batch size).
LEDGER_COUNT_OLD = Statement("ledger_count_old", "SELECT count(*) FROM quota_ledger WHERE at < ?")
LEDGER_DELETE_OLD = Statement(
    "ledger_delete_old",
    "DELETE FROM quota_ledger WHERE id IN (SELECT id FROM quota_ledger WHERE at < ? LIMIT ?)"
    " RETURNING 1",
)
