"""Operations on the counters table, written once for both faces.

Each operation is a generator that yields ``(sql, params)`` and receives the
rows (see `quota._store`); the sync and async limiters only drive them. The
hot path is two plain calls (`quota._core.hit_params`, then
`quota._core.decide`) in `quota._limiter` instead, so a decision costs no generator machinery.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass

from quota import _sql
from quota._core import Decision, check_int, display_key, hit_params, peek_decision
from quota._errors import ConfigurationError
from quota._store import Rows, Statement


def peek(key: str, limit: int, window: int, now: float) -> Generator[Statement, Rows, Decision]:
    """The window's state for `key` without counting a hit."""
    bucket_key, _, start, _, _, _ = hit_params(key, limit, window, now)
    rows = yield _sql.PEEK, (bucket_key,)
    return peek_decision(key, limit, window, start, now, int(rows[0][0]) if rows else 0)


def reset(stored_key: str, window: int | None) -> Generator[Statement, Rows, int]:
    """Delete every window of a key (of one window length if given); return rows deleted."""
    if window is None:
        rows = yield _sql.RESET_ALL, (stored_key,)
    else:
        rows = yield _sql.RESET_WINDOW, (stored_key, window)
    return len(rows)


@dataclass(frozen=True, slots=True)
class CleanupResult:
    """What one cleanup run did."""

    deleted: int
    """Rows deleted (0 on a dry run)."""
    expired: int
    """Expired rows found: equal to `deleted` unless this was a dry run."""
    skipped: bool = False
    """True when another cleanup held the lock, so this one did nothing."""
    dry_run: bool = False
    """True when rows were only counted."""


def cleanup(
    dialect: str, now: float, *, grace: int, batch_size: int, dry_run: bool
) -> Generator[Statement, Rows, CleanupResult]:
    """Delete windows that ended more than `grace` seconds before `now`, `batch_size` rows at a time.

    Each batch commits on its own, so a long sweep never holds locks for
    long. On PostgreSQL a session advisory lock lets one cleanup run at a
    time across all instances; a second one returns ``skipped=True``.
    """
    if type(grace) is not int or grace < 0:
        raise ConfigurationError(f"grace must be a whole number of seconds >= 0, got {grace!r}")
    check_int("batch_size", batch_size, maximum=1_000_000)
    cutoff = int(now) - grace
    if dry_run:
        rows = yield _sql.COUNT_EXPIRED, (cutoff,)
        return CleanupResult(deleted=0, expired=int(rows[0][0]), dry_run=True)
    locking = dialect == "postgresql"
    if locking:
        rows = yield _sql.PG_TRY_LOCK, (_sql.CLEANUP_LOCK_ID,)
        if not rows[0][0]:
            return CleanupResult(deleted=0, expired=0, skipped=True)
    deleted = 0
    try:
        while True:
            rows = yield _sql.DELETE_EXPIRED, (cutoff, batch_size)
            deleted += len(rows)
            if len(rows) < batch_size:
                break
    finally:
        if locking:
            yield _sql.PG_UNLOCK, (_sql.CLEANUP_LOCK_ID,)
    return CleanupResult(deleted=deleted, expired=deleted)


@dataclass(frozen=True, slots=True)
class Usage:
    """One key's count in one running window, as `top` lists it."""

    key: str
    """The caller's key (a ``h:`` digest for long or binary keys)."""
    window: int
    count: int
    reset_at: int


def top(now: float, limit: int) -> Generator[Statement, Rows, list[Usage]]:
    """The busiest keys in windows that have not ended yet, busiest first."""
    check_int("limit", limit, maximum=100_000)
    rows = yield _sql.TOP, (int(now), limit)
    return [
        Usage(display_key(str(k)), int(w), int(c), int(start) + int(w)) for k, w, start, c in rows
    ]
