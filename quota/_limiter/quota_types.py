"""Durable quotas' types: what callers pass and get back, the bounds of a quota, and
what the drivers (`quota._limiter.drive_async`, `quota._limiter.drive_sync`) share.

The operations are in `quota._limiter.quotas`; see its docstring for the semantics.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from quota._core import periods as _periods
from quota._core.decision import (
    MAX_LIMIT,
    MAX_WINDOW,
    Decision,
    check_int,
    check_seconds,
)
from quota._core.decision import stored_key as _stored_key
from quota._core.errors import ConfigurationError, QuotaError, StorageError
from quota._sql.steps import Op

CONSUME = "consume"
DENY = "deny"
REFUND = "refund"
GRANT = "grant"
RATE_DENIED = "rate_denied"
RESERVE = "reserve"
SETTLE = "settle"
RELEASE = "release"
#: Every kind of ledger entry.
KINDS = (CONSUME, DENY, REFUND, GRANT, RATE_DENIED, RESERVE, SETTLE, RELEASE)

#: The stores that keep durable quotas (memory and Redis stores do not).
QUOTA_DIALECTS = ("sqlite", "postgresql")

#: Subjects and quota names are stored as given, so they are kept short
#: enough for one index entry (PostgreSQL btree rows stop near 2.7 kB).
MAX_NAME_BYTES = 200
MAX_IDEMPOTENCY_KEY_BYTES = 255
#: Attempts at an operation that raced a concurrent refund of its key.
ATTEMPTS = 5
#: The largest quota limit (and cost) accepted, and the most one period may have
#: granted on top of it. With these bounds every sum the statements compute
#: (``used + cost``, ``limit + granted``, ``granted + amount``) stays below 2**63,
#: so it fits PostgreSQL's bigint and stays an INTEGER on SQLite (which turns an
#: overflowing sum into a REAL that every later statement then chokes on).
MAX_QUOTA_LIMIT = 2**60
MAX_QUOTA_GRANTED = 2**61
#: The longest a reservation may wait to be settled before it releases itself (7 days).
MAX_RESERVATION_TTL = 7 * 86400


def check_text(argument: str, value: object, max_bytes: int = MAX_NAME_BYTES) -> str:
    """Return `value` if it is a non-empty str that fits a row; raise `ConfigurationError` naming `argument`."""
    if type(value) is not str:
        raise ConfigurationError(
            f"{argument} must be a str, got {value!r} ({type(value).__name__})"
        )
    if not value:
        raise ConfigurationError(f"{argument} must be a non-empty string, got ''")
    if "\x00" in value:
        raise ConfigurationError(f"{argument} must not contain NUL characters, got {value!r}")
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError:
        raise ConfigurationError(
            f"{argument} must be valid Unicode text (no lone surrogates), got {value!r}"
        ) from None
    if size > max_bytes:
        raise ConfigurationError(
            f"{argument} must be at most {max_bytes} bytes in UTF-8, got {size} bytes:"
            f" {value[:40]!r}…"
        )
    return value


#: The most thresholds one quota may carry.
MAX_THRESHOLDS = 20


def check_thresholds(thresholds: object) -> tuple[Decimal, ...]:
    """`thresholds` as exact decimals, smallest first; `ConfigurationError` naming it if bad.

    Each is a number in (0, 1] (an int, a float taken as the decimal it prints as, or a
    `decimal.Decimal`), none repeated; None or an empty sequence is no thresholds. Above
    1 is refused: a charge never takes usage past the limit with grants, so such a
    threshold could never fire.
    """
    if thresholds is None:
        return ()
    if isinstance(thresholds, (str, bytes)) or not isinstance(
        thresholds, Sequence | frozenset | set
    ):
        raise ConfigurationError(
            f"thresholds must be a sequence of numbers in (0, 1], got {thresholds!r}"
        )
    if len(thresholds) > MAX_THRESHOLDS:
        raise ConfigurationError(
            f"thresholds must hold at most {MAX_THRESHOLDS} numbers, got {len(thresholds)}"
        )
    checked: list[Decimal] = []
    for value in thresholds:
        exact = _exact(value)
        if exact is None or not 0 < exact <= 1:
            raise ConfigurationError(
                f"thresholds must be numbers in (0, 1] (fractions of the limit with grants),"
                f" got {value!r} in {thresholds!r}"
            )
        if exact in checked:
            raise ConfigurationError(
                f"thresholds must not repeat, got {value!r} twice in {thresholds!r}"
            )
        checked.append(exact)
    return tuple(sorted(checked))


def _exact(value: object) -> Decimal | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return Decimal(value)
    if isinstance(value, float):
        return Decimal(repr(value)) if math.isfinite(value) else None
    if isinstance(value, Decimal):
        return value.normalize() if value.is_finite() else None
    return None


def threshold_text(threshold: Decimal) -> str:
    """How a threshold is stored and sent: the shortest plain decimal (``0.8``, ``1``)."""
    return format(threshold.normalize(), "f")


def check_key(idempotency_key: object) -> str | None:
    if idempotency_key is None:
        return None
    return check_text("idempotency_key", idempotency_key, MAX_IDEMPOTENCY_KEY_BYTES)


# -- what callers get back -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ThresholdEvent:
    """A usage threshold of a quota crossed in a period: written once to the outbox.

    Each (subject, quota, period start, threshold) fires once; a refund or grant that
    takes usage back below the threshold re-arms it, and it may then fire again (a new
    event, with a new `id`).
    """

    id: int
    """Stable: the outbox row's id. Receivers de-duplicate deliveries by it."""
    subject: str
    quota: str
    """The quota's name."""
    period_start: int
    """Epoch second at which the period began."""
    threshold: Decimal
    """The fraction of `limit` crossed (``Decimal("0.8")``)."""
    used: int
    """Units used in the period right after the charge that crossed it."""
    limit: int
    """The period's limit with its grants at that charge: what `threshold` is a fraction of."""
    at: float
    """Epoch seconds of the charge (the limiter's clock)."""

    def payload(self) -> dict[str, Any]:
        """The event as the webhook sends it: JSON types, the threshold a number."""
        return {
            "id": self.id,
            "subject": self.subject,
            "quota": self.quota,
            "period_start": self.period_start,
            "threshold": float(self.threshold),
            "used": self.used,
            "limit": self.limit,
            "at": self.at,
        }


@dataclass(frozen=True, slots=True)
class QuotaDecision:
    """The outcome of one quota consumption. Times are whole epoch seconds."""

    allowed: bool
    """True when the cost was charged (or, when `replayed`, was charged before)."""
    used: int
    """Units used in this period, this charge included when allowed."""
    remaining: int
    """Units left in this period: ``limit + granted - used``, never negative."""
    limit: int
    """Units per period, as passed in (before grants)."""
    period_start: int
    """Epoch second at which the period began."""
    resets_at: int
    """Epoch second at which the period ends and usage starts from zero again."""
    retry_after: int
    """Whole seconds until the period resets: at least 1 when denied, 0 when allowed."""
    subject: str
    """Who is charged (a user, an API key, an IP address)."""
    name: str
    """Which quota (``llm_calls``, ``demo_extractions``)."""
    cost: int
    """Units this call asked for."""
    granted: int = 0
    """Extra units granted for this period on top of `limit`."""
    idempotency_key: str | None = None
    """The key the call carried, if any."""
    replayed: bool = False
    """True when the key already held a charge: this is that original decision, nothing was charged now."""
    reserved: int = 0
    """Units live reservations hold in this period (not counted in `used` or `remaining`:
    a charge fits when ``used + reserved + cost <= limit + granted``)."""
    overage: int = 0
    """`settle_quota`: units of the actual amount not charged because they did not fit."""
    expired: bool = False
    """`settle_quota`: the reservation had expired (and was released) before the settle."""
    fired: tuple[ThresholdEvent, ...] = ()
    """The thresholds this charge fired (written to the outbox with it); empty when none."""


@dataclass(frozen=True, slots=True)
class RefundResult:
    """What `refund_quota` did. A refund that does nothing says why in `status`."""

    refunded: bool
    """True when a charge was given back by this call."""
    status: str
    """``refunded``, ``already_refunded`` or ``unknown_key`` (no charge ever held this key)."""
    subject: str
    name: str
    idempotency_key: str
    amount: int
    """Units given back (0 when nothing was refunded)."""
    used: int | None = None
    """Units used in the charge's period after the refund (None when nothing was refunded)."""
    period_start: int | None = None
    """Start of the period the charge was taken from."""


REFUNDED = "refunded"
ALREADY_REFUNDED = "already_refunded"
UNKNOWN_KEY = "unknown_key"


@dataclass(frozen=True, slots=True)
class QuotaUsage:
    """One quota of one subject in one period, as `quota_usage` lists it."""

    subject: str
    name: str
    period: str | int
    """``day``, ``week``, ``month`` or seconds, as last used."""
    tz: str | None
    """The time zone calendar periods follow (None for periods of seconds)."""
    period_start: int
    resets_at: int
    limit: int | None
    """The limit of the last consumption (None when the period only saw grants)."""
    used: int
    granted: int
    remaining: int | None
    """``limit + granted - used``, never negative (None when the limit is unknown)."""
    reserved: int = 0
    """Units live reservations hold, read with `used` in one snapshot (not in `remaining`)."""


@dataclass(frozen=True, slots=True)
class LedgerEntry:
    """One row of the append-only ledger."""

    id: int
    """Increases with every entry (gaps are possible)."""
    at: float
    """Epoch seconds of the entry (the limiter's clock)."""
    subject: str
    name: str
    """The quota name; ``rate:<window>s`` for a rate-window denial."""
    kind: str
    """``consume``, ``deny``, ``refund``, ``grant``, ``rate_denied``, ``reserve``,
    ``settle`` or ``release``."""
    cost: int
    """Units charged (``consume``, ``settle``), asked for (``deny``), given back, granted,
    held (``reserve``) or released unused (``release``, at a reservation's expiry)."""
    idempotency_key: str | None
    period_start: int | None
    resets_at: int | None
    limit: int | None
    used: int | None
    """Units used in the period after this entry."""
    remaining: int | None
    refunded_at: float | None
    """For a charge: when it was refunded, if it was."""
    reservation_id: str | None = None
    """For ``reserve``, ``settle`` and ``release``: the reservation's id."""
    reserved: int | None = None
    """For ``reserve``, ``settle`` and ``release``: the units the reservation held
    (0 for a settle after its expiry)."""


@dataclass(frozen=True, slots=True)
class Reservation:
    """The outcome of `reserve_quota`: units held until settled, released or expired."""

    allowed: bool
    """True when the amount is held; False when it did not fit (nothing is held)."""
    id: str | None
    """Pass it to `settle_quota` or `release_quota`; None when not allowed."""
    expires_at: float | None
    """Epoch seconds at which an unsettled hold releases itself; None when not allowed."""
    decision: QuotaDecision
    """The quota as the reservation left it (``cost`` is the amount; ``reserved`` includes
    it when allowed; ``retry_after`` until the period resets when denied)."""


@dataclass(frozen=True)
class RateWindow:
    """A fixed rate window for `check`: the same counter `rate_limit(key, limit, window)` uses."""

    key: str
    """The caller's key, as given to `rate_limit`."""
    limit: int
    """Hits allowed per window."""
    window: int
    """Window length in seconds (also taken as a duration like ``"30m"`` or a
    `datetime.timedelta`, kept as seconds)."""

    def __post_init__(self) -> None:
        _stored_key(self.key)
        check_int("limit", self.limit, maximum=MAX_LIMIT)
        object.__setattr__(self, "window", check_seconds("window", self.window, maximum=MAX_WINDOW))


@dataclass(frozen=True)
class QuotaLimit:
    """A durable quota for `check`: the same usage `consume_quota` charges."""

    subject: str
    """Who is charged."""
    name: str
    """Which quota."""
    limit: int
    """Units per period."""
    period: str | int
    """``day``, ``week`` (ISO, from Monday), ``month``, or whole seconds."""
    tz: str | None = None
    """IANA time zone calendar periods follow; None for UTC."""
    thresholds: tuple[Decimal, ...] = ()
    """Fractions of the limit with grants (numbers in (0, 1]) that fire a `ThresholdEvent`
    once per period when usage reaches them; kept as exact decimals, smallest first."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "thresholds", check_thresholds(self.thresholds))
        check_text("subject", self.subject)
        check_text("name", self.name)
        check_int("limit", self.limit, maximum=MAX_QUOTA_LIMIT)
        object.__setattr__(self, "period", _periods.check_period(self.period))
        _periods.load_zone(self.tz, self.period)


Limit = RateWindow | QuotaLimit


@dataclass(frozen=True, slots=True)
class CheckDecision:
    """The outcome of an all-or-nothing `check` of several limits."""

    allowed: bool
    """True when every limit allowed and all were charged; False when none was charged."""
    denied_by: RateWindow | QuotaLimit | None
    """The first limit (in the order given) that denied, or None."""
    retry_after: int
    """The longest `retry_after` of the limits that denied (0 when allowed)."""
    decisions: tuple[Decision | QuotaDecision, ...]
    """One decision per limit, in the order given. When denied, nothing was charged and
    each says whether that limit alone would have allowed the call, with its counts
    as they stand (the charge not included)."""
    replayed: bool = False
    """True when the idempotency key already held this check's charge: nothing was charged now."""


# -- driving operations ------------------------------------------------------------------


class Abort(QuotaError):
    """Raised inside an operation to roll its transaction back and answer `result` instead.

    With `then`, the driver runs that operation next, in a transaction of its
    own, and answers what it returns. A `QuotaError` so that every store lets
    it through unwrapped; it never leaves the drivers.
    """

    def __init__(self, result: Any, then: Op[Any] | None = None) -> None:
        super().__init__("rolled back on purpose")
        self.result = result
        self.then = then


#: SQLSTATEs of a transaction the database gave up on to let another through
#: (serialization_failure, deadlock_detected): rolled back whole, safe to run again.
_RETRYABLE = ("40001", "40P01")


def retryable(exc: StorageError) -> bool:
    return getattr(exc.__cause__, "sqlstate", None) in _RETRYABLE
