"""Concurrency leases without I/O: the arguments, the statements' parameters, the wait.

A concurrency block (``limiter.concurrency(key, limit)``) holds one of `limit` slots of
`key` while it runs: a row of ``quota_leases`` (a member of a Redis sorted set) with an
expiry its holder keeps moving on. Everything here is pure: validating the arguments,
naming a holder, the parameters of each ``LEASE_*`` statement of `quota._sql.statements`,
how long a waiter sleeps between two tries (`Backoff`), and the rows read back as a
`ConcurrencyUsage`. The two drivers, `quota._limiter.leases`, only run statements and
sleep.
"""

from __future__ import annotations

import math
import os
import random
import secrets
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from quota._core.decision import check_int, display_key, stored_key
from quota._core.errors import ConfigurationError

#: The most slots one key may have (each try looks at up to `limit` slot numbers).
MAX_SLOTS = 10_000
#: The shortest and longest lease, in seconds.
MIN_LEASE = 0.1
MAX_LEASE = 86_400.0
#: The longest wait for a slot, in seconds.
MAX_TIMEOUT = 86_400.0
#: A live holder renews its lease every `lease / RENEWALS` seconds, so two renewals in a
#: row may fail (a slow or briefly unreachable store) before the lease runs out.
RENEWALS = 3
#: A waiter's first sleep between tries, and its longest: a slot freed in another process
#: is taken within `LAST_POLL` plus one statement, at a cost of at most
#: ``1 / LAST_POLL`` statements a second per waiter.
FIRST_POLL = 0.005
LAST_POLL = 0.1


def _seconds(name: str, value: object, low: float, high: float) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or not low <= value <= high
    ):
        raise ConfigurationError(f"{name} must be seconds in [{low:g}, {high:g}], got {value!r}")
    return float(value)


@dataclass(frozen=True, slots=True)
class LeaseRequest:
    """One concurrency block's validated arguments."""

    key: str
    """The caller's key."""
    lease_key: str
    """The key as stored (`quota._core.decision.stored_key`)."""
    limit: int
    lease: float
    timeout: float


def lease_request(key: object, limit: object, lease: object, timeout: object) -> LeaseRequest:
    """The validated arguments of ``concurrency(key, limit, lease=, timeout=)``.

    Raises `ConfigurationError` naming the bad one: an empty or non-string `key`, a
    `limit` that is not an int in ``1..MAX_SLOTS``, a `lease` outside
    ``[MIN_LEASE, MAX_LEASE]`` seconds, a `timeout` outside ``[0, MAX_TIMEOUT]``.
    """
    lease_key = stored_key(key)
    check_int("limit", limit, maximum=MAX_SLOTS)
    assert isinstance(key, str) and isinstance(limit, int)
    return LeaseRequest(
        key, lease_key, limit,
        _seconds("lease", lease, MIN_LEASE, MAX_LEASE),
        _seconds("timeout", timeout, 0.0, MAX_TIMEOUT),
    )  # fmt: skip


def new_holder() -> str:
    """A name for one take of a slot, unique across hosts and time: ``host:pid:random``.

    Listings show it, so an operator can tell which process holds a slot.
    """
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(6)}"


def acquire_params(request: LeaseRequest, holder: str, now: float) -> tuple[Any, ...]:
    """`LEASE_ACQUIRE`'s parameters: the first slot number tried is random, so takers
    arriving together try different slots."""
    first = random.randrange(request.limit)
    return (
        request.lease_key,
        request.limit,
        first,
        holder,
        now,
        request.lease,
        now + request.lease,
    )


def renew_params(request: LeaseRequest, slot: int, holder: str, now: float) -> tuple[Any, ...]:
    """`LEASE_RENEW`'s parameters."""
    return (request.lease_key, slot, holder, now, request.lease, now + request.lease)


def release_params(request: LeaseRequest, slot: int, holder: str) -> tuple[Any, ...]:
    """`LEASE_RELEASE`'s parameters."""
    return (request.lease_key, slot, holder)


def abandon_params(request: LeaseRequest, holder: str) -> tuple[Any, ...]:
    """`LEASE_ABANDON`'s parameters."""
    return (request.lease_key, holder)


class Backoff:
    """How long a waiter sleeps before its next try: `FIRST_POLL`, doubling up to
    `LAST_POLL`, each with up to a fifth taken off at random (waiters started together
    drift apart), never past the deadline.

    `deadline` is on the same clock as the `now` passed to `next` (a monotonic one).
    """

    __slots__ = ("_deadline", "_delay")

    def __init__(self, deadline: float) -> None:
        self._deadline = deadline
        self._delay = FIRST_POLL

    def next(self, now: float) -> float | None:
        """Seconds to sleep before trying again, or None when the time is up."""
        left = self._deadline - now
        if left <= 0:
            return None
        delay = self._delay * (1.0 - random.random() / 5)
        self._delay = min(self._delay * 2, LAST_POLL)
        return min(delay, left)


def timeout_message(request: LeaseRequest) -> str:
    return (
        f"no concurrency slot of {request.key!r} (limit {request.limit}) came free"
        f" within {request.timeout:g}s"
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class ConcurrencyUsage:
    """Who holds the slots of one concurrency key right now."""

    key: str
    """The caller's key (a ``h:`` digest for long or binary keys)."""
    held: int
    """Live leases: blocks inside, or holders that died less than a lease ago."""
    limit: int | None
    """The limit asked for, else the largest limit the holders took their slots under;
    None when nobody holds one and no limit was asked for."""
    free: int | None
    """Slots a new block could take now (``limit - held``, never below 0); None with `limit`."""
    holders: tuple[str, ...] = ()
    """Each holder as ``host:pid:random``, by slot (empty in `quota top` listings)."""
    next_expiry: float | None = None
    """When the first live lease runs out unless renewed (epoch seconds); None when none."""


def usage_from_rows(key: str, rows: Sequence[Sequence[Any]], limit: int | None) -> ConcurrencyUsage:
    """`LEASE_HOLDERS`' rows (slot, holder, slots, acquired_at, expires_at) as a usage."""
    if limit is None and rows:
        limit = max(int(row[2]) for row in rows)
    held = len(rows)
    return ConcurrencyUsage(
        key=key, held=held, limit=limit,
        free=None if limit is None else max(0, limit - held),
        holders=tuple(str(row[1]) for row in rows),
        next_expiry=min((float(row[4]) for row in rows), default=None),
    )  # fmt: skip


def top_from_rows(rows: Sequence[Sequence[Any]]) -> list[ConcurrencyUsage]:
    """`LEASE_TOP`'s rows (lease_key, held, slots, next expiry) as usages, busiest first."""
    return [
        _top_row(str(key), int(held), int(slots), float(expiry))
        for key, held, slots, expiry in rows
    ]


def _top_row(lease_key: str, held: int, slots: int, expiry: float) -> ConcurrencyUsage:
    free = max(0, slots - held)
    return ConcurrencyUsage(
        key=display_key(lease_key), held=held, limit=slots, free=free, next_expiry=expiry
    )
