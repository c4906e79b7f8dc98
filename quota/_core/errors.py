"""The exceptions `quota` raises, all under one root::

    QuotaError
    ├── ConfigurationError   bad argument, URL or setting (also a ValueError)
    ├── StorageError         the database failed or could not be reached
    │   └── SchemaError      the tables are missing or older than this code needs;
    │                        the message names the command that fixes it
    ├── ReservationNotFound  settle_quota/release_quota of an id no reservation has
    ├── Overloaded           too much work in flight: the request was shed; answer
    │                        503 with ``Retry-After: <retry_after>``
    └── RateLimitTimeout     a wait for a slot (``acquire``, a concurrency block)
                             ran out of time; ``decision`` is the last denial

Driver exceptions are never raised bare: a store wraps them in `StorageError`
(or `SchemaError`) with ``raise ... from exc`` so the original stays attached.
A URL in a message never shows its password.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from quota._core.redaction import redact_text

if TYPE_CHECKING:
    from quota._core.decision import Decision


class QuotaError(Exception):
    """Root of every error raised by `quota`.

    A URL in the message is shown without its password, whatever its scheme
    (and a ``password=`` parameter without its value), so that an error can
    be logged or printed as it is.
    """

    def __init__(self, *args: object) -> None:
        if args and isinstance(args[0], str) and ("://" in args[0] or "pass" in args[0].lower()):
            args = (redact_text(args[0]), *args[1:])
        super().__init__(*args)


class ConfigurationError(QuotaError, ValueError):
    """An argument, URL or setting is invalid; the message names it and its value."""


class StorageError(QuotaError):
    """The store failed: connection refused, timeout, or a database error.

    `outage` is True when the database could not be reached or did not answer
    in time, and False when it answered with an error about the statement
    (a fallback decides from memory during an outage, but does not take a
    statement error for one).
    """

    def __init__(self, message: str, *, outage: bool = True) -> None:
        super().__init__(message)
        self.outage = outage


class SchemaError(StorageError):
    """The quota tables are missing or behind; run ``quota migrate``."""


class ReservationNotFound(QuotaError, LookupError):
    """`settle_quota` or `release_quota` got an id that names no reservation.

    Never made here, or forgotten by ledger retention (``cleanup_ledger``).
    `reservation_id` is the id given.
    """

    def __init__(self, reservation_id: str) -> None:
        super().__init__(f"no reservation has the id {reservation_id!r}")
        self.reservation_id = reservation_id


class Overloaded(QuotaError):
    """Shed by a `ConcurrencyGuard`: too much work in flight. Answer 503.

    `retry_after` is the whole seconds to send in the ``Retry-After`` header.
    """

    def __init__(self, message: str, *, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class RateLimitTimeout(QuotaError):
    """A wait for a slot ran out of time before the hit was allowed; nothing was charged.

    `decision` is the last denied `Decision` (its `retry_after` tells how long the
    wait still had to go), or None where no decision was read.
    """

    def __init__(self, message: str, *, decision: Decision | None = None) -> None:
        super().__init__(message)
        self.decision = decision
