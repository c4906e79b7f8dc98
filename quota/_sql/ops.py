"""Operations on the counters table, written once for both faces.

Each operation is a generator that yields ``(sql, params)`` and receives the
rows (see `quota._sql.steps`); the sync and async limiters only drive them. The
hot path is two plain calls (`quota._core.decision.hit_params`, then
`quota._core.decision.decide`) in `quota._limiter` instead, so a decision costs no generator machinery.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator
from dataclasses import dataclass

from quota._core.algorithms import (
    FIXED_WINDOW,
    SLIDING_WINDOW,
    TOKEN_BUCKET,
    Rate,
    bucket_decision,
    bucket_step,
    gcra_decision,
    gcra_params,
    gcra_step,
    sliding_decision,
    sliding_step,
    state_key,
)
from quota._core.decision import (
    Decision,
    check_int,
    check_now,
    display_key,
    hit_params,
    peek_decision,
    stored_key,
)
from quota._core.errors import ConfigurationError, SchemaError
from quota._sql import partitions as _partitions
from quota._sql import statements as _sql
from quota._sql.steps import Rows, Step


def peek(key: str, rate: Rate, now: float) -> Generator[Step, Rows, Decision]:
    """The state of `key` under `rate` without counting a hit.

    ``allowed`` says whether one more hit (cost 1) would pass right now.
    """
    if rate.algorithm == FIXED_WINDOW:
        bucket_key, _, start, _, _, _ = hit_params(key, rate.limit, rate.window, now)
        rows = yield _sql.PEEK, (bucket_key,)
        return peek_decision(
            key, rate.limit, rate.window, start, now, int(rows[0][0]) if rows else 0
        )
    bucket_key = state_key(rate.algorithm, rate.window, stored_key(key))
    rows = yield _sql.STATE_PEEK, (bucket_key,)
    value, prev_value, stamp = (float(x) for x in rows[0]) if rows else (None, None, None)
    if rate.algorithm == SLIDING_WINDOW:
        state = None if value is None else (value, prev_value or 0.0, stamp or 0.0)
        fresh, _ = sliding_step(state, now, rate.window, rate.limit, 0)
        _, allowed = sliding_step(fresh, now, rate.window, rate.limit, 1)
        return sliding_decision(key, rate, 1, now, fresh, allowed)
    if rate.algorithm == TOKEN_BUCKET:
        capacity = float(rate.capacity)
        bucket = None if value is None else (value, stamp or 0.0)
        (tokens, stamp2), _ = bucket_step(bucket, now, capacity, rate.rate, 0)
        _, allowed = bucket_step((tokens, stamp2), now, capacity, rate.rate, 1)
        return bucket_decision(key, rate, 1, now, tokens, allowed)
    increment, tolerance = gcra_params(rate, 1)
    tat = now if value is None else value
    _, allowed = gcra_step(tat, now, increment, tolerance)
    return gcra_decision(key, rate, 1, now, tat, allowed)


def reset(stored_key: str, window: int | None) -> Generator[Step, Rows, int]:
    """Delete every window and state of a key (of one window length if given); return rows deleted."""
    deleted = 0
    for every, one in (
        (_sql.RESET_ALL, _sql.RESET_WINDOW),
        (_sql.STATE_RESET_ALL, _sql.STATE_RESET_WINDOW),
    ):
        rows = yield (every, (stored_key,)) if window is None else (one, (stored_key, window))
        deleted += len(rows)
    return deleted


#: The longest grace `cleanup` takes: ten years of 366 days (no window is longer
#: than 366 days, and the cutoff must stay a 64-bit integer).
MAX_GRACE = 10 * 366 * 86400


#: SQLite cleanup: rows deleted per slice (a few milliseconds of the write lock) and the
#: pause between slices (longer than a waiting writer's first busy-handler sleeps).
SQLITE_SLICE_ROWS = 1000
SQLITE_SLICE_PAUSE = 0.01


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
    released: int = 0
    """Reservations of durable quotas released because their time was up."""


def cleanup(
    dialect: str, now: float, *, grace: int, batch_size: int, dry_run: bool,
    progress: Callable[[int], None] | None = None,
) -> Generator[Step, Rows, CleanupResult]:  # fmt: skip
    """Delete windows that ended more than `grace` seconds before `now`, `batch_size` rows at a time.

    Each batch commits on its own, so a long sweep never holds locks for
    long; on SQLite batches are at most `SQLITE_SLICE_ROWS` rows with a pause
    between them, so writers waiting for the file get their turn. On
    PostgreSQL a transaction-scoped advisory lock lets one cleanup run at a
    time across all instances; a second one returns ``skipped=True``.

    `progress`, when given, is called with the rows deleted so far after each
    statement that deleted some (each has committed by then). Whatever it
    raises (KeyboardInterrupt, say) stops the sweep there, the lock released.

    Raises `ConfigurationError` for a `grace` that is not an int in
    ``0..MAX_GRACE``, a `batch_size` that is not an int in ``1..1000000``, a
    `dry_run` that is not a bool, or a clock that gave no usable `now`.
    """
    if type(grace) is not int or not 0 <= grace <= MAX_GRACE:
        raise ConfigurationError(
            f"grace must be a whole number of seconds between 0 and {MAX_GRACE} (ten years),"
            f" got {grace!r}"
        )
    check_int("batch_size", batch_size, maximum=1_000_000)
    if not isinstance(dry_run, bool):
        raise ConfigurationError(f"dry_run must be a bool, got {dry_run!r}")
    check_now(now)
    # Ends are whole seconds: `end < ceil(now) - grace` is exactly `end + grace < now`
    # (int(now) kept a window that ended at E until E + 1).
    cutoff = math.ceil(now) - grace
    # Rate windows end at window_start + window; algorithm state expires at expires_at,
    # and so do concurrency leases (a dead holder's: a live one keeps moving it on).
    locking = dialect == "postgresql"
    tables = (
        (_sql.COUNT_EXPIRED, _sql.PG_DELETE_EXPIRED if locking else _sql.DELETE_EXPIRED),
        (
            _sql.STATE_COUNT_EXPIRED,
            _sql.PG_STATE_DELETE_EXPIRED if locking else _sql.STATE_DELETE_EXPIRED,
        ),
        (_sql.LEASE_COUNT_EXPIRED, _sql.LEASE_DELETE_EXPIRED),
    )
    if dry_run:
        expired = 0
        for count, _ in tables:
            try:
                rows = yield count, (cutoff,)
            except SchemaError as exc:
                if _skip_leases(count, exc):
                    continue
                raise
            expired += int(rows[0][0])
        return CleanupResult(deleted=0, expired=expired, dry_run=True)
    if locking:
        rows = yield _sql.PG_TRY_LOCK, (_sql.CLEANUP_LOCK_ID,)
        if not rows[0][0]:
            return CleanupResult(deleted=0, expired=0, skipped=True)
    deleted = 0
    try:
        if locking:  # a partitioned counters table sheds whole partitions first
            # Whole partitions only once their range has surely ended.
            shed = yield from _partitions.maintain(now, int(now) - grace)
            deleted += shed
            if shed and progress is not None:
                progress(deleted)
        # SQLite has one write lock for the whole file: slices short enough to keep the
        # lock well under a fallback's budget, with a pause after each for the writers
        # that queued behind it.
        sliced = dialect == "sqlite"
        batch = min(batch_size, SQLITE_SLICE_ROWS) if sliced else batch_size
        for _, delete in tables:
            after = _sql.PG_FIRST_CTID  # PostgreSQL: where the next batch starts
            while True:
                try:
                    if delete.name in _sql.PG_KEYSET_DELETES:
                        rows = yield delete, (after, cutoff, batch, cutoff)
                        swept, after = int(rows[0][0]), rows[0][1]
                    else:
                        rows = yield delete, (cutoff, batch, cutoff)
                        swept = len(rows)
                except SchemaError as exc:
                    if _skip_leases(delete, exc):
                        break
                    raise
                deleted += swept
                if swept and progress is not None:
                    progress(deleted)
                if swept < batch:
                    break
                if sliced:
                    yield _sql.PAUSE, (SQLITE_SLICE_PAUSE,)
    finally:
        if locking:
            yield _sql.PG_UNLOCK, (_sql.CLEANUP_LOCK_ID,)
    return CleanupResult(deleted=deleted, expired=deleted)


def _skip_leases(statement: _sql.Statement, exc: SchemaError) -> bool:
    """Whether cleanup goes on without the leases table: a database not yet at the
    revision that makes it (0006_leases) has no leases to sweep."""
    return statement.sql.find(_sql.LEASES) >= 0 and not exc.outage


@dataclass(frozen=True, slots=True)
class Usage:
    """One key's count in one running window, as `top` lists it."""

    key: str
    """The caller's key (a ``h:`` digest for long or binary keys)."""
    window: int
    count: int
    reset_at: int


def windows(key: str, now: float) -> Generator[Step, Rows, list[Usage]]:
    """`key`'s fixed windows that have not ended yet, whatever their limit, shortest first."""
    rows = yield _sql.KEY_WINDOWS, (stored_key(key), int(now))
    return [
        Usage(display_key(str(k)), int(w), int(c), int(start) + int(w)) for k, w, start, c in rows
    ]


def top(now: float, limit: int) -> Generator[Step, Rows, list[Usage]]:
    """The busiest keys in windows that have not ended yet, busiest first."""
    check_int("n", limit, maximum=100_000)
    rows = yield _sql.TOP, (int(now), limit)
    return [
        Usage(display_key(str(k)), int(w), int(c), int(start) + int(w)) for k, w, start, c in rows
    ]
