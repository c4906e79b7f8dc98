"""Exporting durable quotas: usage per period and ledger entries, for billing and audits.

`Limiter.export` and `AsyncLimiter.export` read in batches: every batch is one
short statement of its own (`quota._sql.export`) that picks up after the last
row of the batch before, so an export of any size holds no transaction, no
connection between batches, and memory for one batch only.

What a record holds is the table's columns, as the two column tables below
name them (`USAGE_COLUMNS`, `LEDGER_COLUMNS`): a column added to
``quota_usage`` or ``quota_ledger`` is exported by adding one line to its
table and one field to its record (a test checks that the two agree).
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from quota._core.decision import check_int
from quota._core.errors import ConfigurationError
from quota._limiter.quota_types import check_text
from quota._sql import export as _sql
from quota._sql.steps import Op, Row

#: Records per batch unless told otherwise, and the most a batch may hold.
DEFAULT_BATCH_SIZE = 1000
MAX_BATCH_SIZE = 100_000
#: The moments an export range may name: years 1 to 9999, in epoch seconds.
_EARLIEST = -62_135_596_800
_LATEST = 253_402_300_799

#: What `since` and `until` take: a datetime with a time zone, a date (its midnight UTC),
#: or epoch seconds.
Moment = dt.datetime | dt.date | float


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _opt_str(value: Any) -> str | None:
    return None if value is None else str(value)


def _period(value: Any) -> str | int:
    text = str(value)
    return int(text) if text.isdigit() else text


@dataclass(frozen=True, slots=True)
class Column:
    """One exported column: its field in the record, its column in the table, and how it is read."""

    field: str
    sql: str
    read: Callable[[Any], Any]


@dataclass(frozen=True, slots=True)
class UsageRecord:
    """One quota of one subject in one period, as ``quota_usage`` stores it (``type`` ``usage``).

    Times are epoch seconds. `used` counts every charge of the period (refunds
    taken off), `granted` what was granted on top of the limit.
    """

    type: str = field(default="usage", init=False)
    subject: str
    name: str
    period: str | int
    """``day``, ``week``, ``month`` or seconds, as last used."""
    tz: str | None
    """The time zone calendar periods follow (None for periods of seconds)."""
    period_start: int
    resets_at: int
    """When the period ends (the ``period_end`` column)."""
    limit: int | None
    """The limit of the last consumption (None when the period only saw grants)."""
    used: int
    granted: int
    reserved: int
    """Units live reservations held when read (not in `used`)."""
    updated_at: float
    """When the row last changed."""

    def as_dict(self) -> dict[str, Any]:
        """The record as a dict, `type` first (what a JSON line of ``quota export`` holds)."""
        return {name: getattr(self, name) for name in USAGE_FIELDS}


@dataclass(frozen=True, slots=True)
class LedgerRecord:
    """One ledger entry (``type`` ``ledger``): a ``consume``, ``deny``, ``refund``, ``grant``,
    ``rate_denied``, ``reserve``, ``settle`` or ``release``, as ``quota_ledger`` stores it.

    `id` is stable and unique: use it as the idempotency identifier of a
    billing meter event, so that an upload retried is counted once. A charge that was refunded keeps its ``consume`` entry
    (with `refunded_at` set) and gets a ``refund`` entry of its own, dated
    when the refund was made and holding the charge's `period_start`.
    """

    type: str = field(default="ledger", init=False)
    id: int
    at: float
    """Epoch seconds of the entry (the limiter's clock)."""
    subject: str
    name: str
    """The quota name; ``rate:<window>s`` for a rate-window denial."""
    kind: str
    cost: int
    """Units charged (``consume``, ``settle``), asked for (``deny``), given back, granted,
    held (``reserve``) or released unused (``release``)."""
    idempotency_key: str | None
    period_start: int | None
    resets_at: int | None
    limit: int | None
    used: int | None
    """Units used in the period after this entry."""
    remaining: int | None
    refunded_at: float | None
    """For a charge: when it was refunded, if it was (as of the export)."""
    reservation_id: str | None
    """For ``reserve``, ``settle`` and ``release``: the reservation's id."""
    reserved: int | None
    """For ``reserve``, ``settle`` and ``release``: the units the reservation held."""

    def as_dict(self) -> dict[str, Any]:
        """The record as a dict, `type` first."""
        return {name: getattr(self, name) for name in LEDGER_FIELDS}


ExportRecord = UsageRecord | LedgerRecord

#: What a usage record holds, in the order of its fields.
USAGE_COLUMNS: tuple[Column, ...] = (
    Column("subject", "subject", str),
    Column("name", "name", str),
    Column("period", "period", _period),
    Column("tz", "tz", _opt_str),
    Column("period_start", "period_start", int),
    Column("resets_at", "period_end", int),
    Column("limit", "quota_limit", _opt_int),
    Column("used", "used", int),
    Column("granted", "granted", int),
    Column("reserved", "reserved", int),
    Column("updated_at", "updated_at", float),
)
#: What a ledger record holds, in the order of its fields.
LEDGER_COLUMNS: tuple[Column, ...] = (
    Column("id", "id", int),
    Column("at", "at", float),
    Column("subject", "subject", str),
    Column("name", "name", str),
    Column("kind", "kind", str),
    Column("cost", "cost", int),
    Column("idempotency_key", "idempotency_key", _opt_str),
    Column("period_start", "period_start", _opt_int),
    Column("resets_at", "period_end", _opt_int),
    Column("limit", "quota_limit", _opt_int),
    Column("used", "used", _opt_int),
    Column("remaining", "remaining", _opt_int),
    Column("refunded_at", "refunded_at", _opt_float),
    Column("reservation_id", "reservation_id", _opt_str),
    Column("reserved", "reserved", _opt_int),
)

#: The fields of each record, `type` first.
USAGE_FIELDS = tuple(f.name for f in fields(UsageRecord))
LEDGER_FIELDS = tuple(f.name for f in fields(LedgerRecord))
_USAGE_SQL = tuple(c.sql for c in USAGE_COLUMNS)
_LEDGER_SQL = tuple(c.sql for c in LEDGER_COLUMNS)
_USAGE_READ = tuple(c.read for c in USAGE_COLUMNS)
_LEDGER_READ = tuple(c.read for c in LEDGER_COLUMNS)


def _usage_record(row: Row) -> UsageRecord:
    return UsageRecord(*[read(value) for read, value in zip(_USAGE_READ, row, strict=True)])


def _ledger_record(row: Row) -> LedgerRecord:
    return LedgerRecord(*[read(value) for read, value in zip(_LEDGER_READ, row, strict=True)])


# -- what an export is asked for -------------------------------------------------------------


def check_moment(argument: str, value: object) -> float:
    """`value` (an aware datetime, a date: its midnight UTC, or epoch seconds) as epoch seconds.

    Raises `ConfigurationError` naming `argument` for anything else, a naive
    datetime included (its time zone would be a guess).
    """
    if isinstance(value, dt.datetime):
        if value.tzinfo is None or value.utcoffset() is None:
            raise ConfigurationError(
                f"{argument} must be a datetime with a time zone, a date or epoch seconds,"
                f" got the naive datetime {value!r}"
            )
        seconds = value.timestamp()
    elif isinstance(value, dt.date):
        seconds = dt.datetime(
            value.year, value.month, value.day, tzinfo=dt.timezone.utc
        ).timestamp()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        raise ConfigurationError(
            f"{argument} must be a datetime with a time zone, a date or epoch seconds,"
            f" got {value!r} ({type(value).__name__})"
        )
    if not (math.isfinite(seconds) and _EARLIEST <= seconds <= _LATEST):
        raise ConfigurationError(
            f"{argument} must be a moment of the years 1 to 9999, got {value!r}"
        )
    return seconds


@dataclass(frozen=True, slots=True)
class ExportPlan:
    """A checked export request: the time range ``[since, until)`` in epoch seconds."""

    since: float
    until: float
    subject: str | None
    ledger: bool
    batch_size: int


def plan(
    since: object, until: object, *, subject: object, ledger: object, batch_size: object
) -> ExportPlan:
    """The checked arguments of `export`; `ConfigurationError` naming the first bad one."""
    start = check_moment("since", since)
    end = check_moment("until", until)
    if end <= start:
        raise ConfigurationError(f"until must be after since, got since={since!r}, until={until!r}")
    if subject is not None:
        subject = check_text("subject", subject)
    if not isinstance(ledger, bool):
        raise ConfigurationError(f"ledger must be a bool, got {ledger!r}")
    size = check_int("batch_size", batch_size, maximum=MAX_BATCH_SIZE)
    return ExportPlan(start, end, subject, ledger, size)


# -- the batches ------------------------------------------------------------------------------


def usage_batch(plan: ExportPlan, after: UsageRecord | None) -> Op[list[UsageRecord]]:
    """The usage rows after `after` (from the first when None) whose period starts in the range,
    at most ``plan.batch_size``, in (subject, name, period_start) order."""
    # period_start is whole seconds: p >= since exactly when p >= ceil(since), and p < until
    # exactly when p < ceil(until). Whole bounds keep the parameters integers, as the column.
    params: list[Any] = []
    if plan.subject is not None:
        params.append(plan.subject)
    if after is not None:
        if plan.subject is None:
            params.append(after.subject)
        params += [after.name, after.period_start]
    params += [math.ceil(plan.since), math.ceil(plan.until), plan.batch_size]
    statement = _sql.usage_batch(_USAGE_SQL, subject=plan.subject is not None, first=after is None)
    rows = yield statement, params
    return [_usage_record(row) for row in rows]


def ledger_bounds(plan: ExportPlan) -> Op[tuple[int, int] | None]:
    """The lowest and highest id of the range's ledger entries; None when it holds none."""
    params: list[Any] = [] if plan.subject is None else [plan.subject]
    rows = yield (
        _sql.ledger_bounds(subject=plan.subject is not None),
        [*params, plan.since, plan.until],
    )
    if not rows or rows[0][0] is None:
        return None
    return int(rows[0][0]), int(rows[0][1])


def ledger_batch(plan: ExportPlan, after_id: int, last_id: int) -> Op[list[LedgerRecord]]:
    """The range's ledger entries with ids in ``(after_id, last_id]``, at most
    ``plan.batch_size``, by id."""
    params: list[Any] = [after_id, last_id]
    if plan.subject is not None:
        params.append(plan.subject)
    params += [plan.since, plan.until, plan.batch_size]
    rows = yield _sql.ledger_batch(_LEDGER_SQL, subject=plan.subject is not None), params
    return [_ledger_record(row) for row in rows]


def fields_of(records: Sequence[type[UsageRecord] | type[LedgerRecord]]) -> list[str]:
    """The fields of the record types in `records`, each once, in order (a CSV header)."""
    names: dict[str, None] = {}
    for kind in records:
        names.update(dict.fromkeys(USAGE_FIELDS if kind is UsageRecord else LEDGER_FIELDS))
    return list(names)
