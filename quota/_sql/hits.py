"""The statement deciding one hit, per algorithm: the SQL layer's side of `quota._core.algorithms`.

The arithmetic is the core's (`quota._core.algorithms`); here each algorithm name
picks its atomic statement of `quota._sql.statements`, with every parameter computed
once so that all stores start from the same doubles. `quota._core.algorithms.decide_rows`
turns the rows back into a `Decision`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from quota._core.algorithms import (
    FIXED_WINDOW,
    SLIDING_WINDOW,
    TOKEN_BUCKET,
    Rate,
    expiry,
    gcra_params,
)
from quota._core.decision import Decision, hit_params, stored_key
from quota._sql import statements as _sql
from quota._sql.statements import Statement


def statement(
    stored_key: str, rate: Rate, cost: int, now: float, count_denied: bool = True
) -> tuple[Statement, tuple[Any, ...]]:
    """The one atomic statement deciding a hit under `rate`, with its parameters.

    The parameters are a tuple in the order of the statement's `Statement.names`.
    For the fixed window this is the database-clock form (the app-clock form
    is the positional hot path in `quota._limiter`). Every float parameter is
    computed here once, so all stores start from the same doubles.
    """
    algorithm, window = rate.algorithm, rate.window
    if algorithm == FIXED_WINDOW:
        named = _sql.HIT_DB_CLOCK if count_denied else _sql.HIT_DB_CLOCK_CAPPED
        return named, (stored_key, window, cost, now, rate.limit)
    bucket_key = rate._state_prefix + stored_key  # state_key, inlined
    if algorithm == SLIDING_WINDOW:
        second = int(now)
        ws = float(second - second % window)  # window_start, inlined
        horizon = 2.0 * window
        return _sql.SLIDING_WINDOW, (
            bucket_key, stored_key, window, float(cost), now, ws, (window - (now - ws)) / window,
            rate._float_limit, horizon, expiry(now, horizon),
        )  # fmt: skip
    if algorithm == TOKEN_BUCKET:
        capacity, per_second = rate.capacity, rate.rate
        horizon = capacity / per_second
        return _sql.TOKEN_BUCKET, (
            bucket_key, stored_key, window, float(cost), now, float(capacity), per_second,
            horizon, expiry(now, horizon),
        )  # fmt: skip
    increment, tolerance = gcra_params(rate, cost)
    return _sql.GCRA, (
        bucket_key, stored_key, window, float(cost), now, increment, tolerance, tolerance,
        expiry(now, tolerance),
    )  # fmt: skip


def plan(
    key: str, rate: Rate, cost: int, now: float, *, count_denied: bool, database_clock: bool
) -> tuple[Statement, Sequence[Any]]:
    """The statement and parameters deciding one hit of `key` under `rate`.

    The fixed window on the app clock is the positional hot statement; every
    other case is a named one (see `statement`). `rate.check_cost` must have
    passed.
    """
    if rate.algorithm == FIXED_WINDOW and not database_clock:
        params = hit_params(key, rate.limit, rate.window, now, cost)
        return (_sql.HIT, params) if count_denied else (_sql.HIT_CAPPED, (*params, rate.limit))
    return statement(stored_key(key), rate, cost, now, count_denied)


def give_back(
    key: str, rate: Rate, cost: int, decision: Decision
) -> tuple[Statement, tuple[Any, ...]]:
    """The statement taking back the hit of `cost` under `rate` that `decision` allowed.

    Where the hit was counted comes from the decision itself: a window's start
    is its ``reset_at`` less the window (a sliding window's, the window the
    store counted it in), so a database clock needs no second reading.
    """
    algorithm, window, skey = rate.algorithm, rate.window, stored_key(key)
    if algorithm == FIXED_WINDOW:
        return _sql.UNDO_FIXED_WINDOW, (f"{window}:{decision.reset_at - window}:{skey}", cost)
    bucket_key = rate._state_prefix + skey
    if algorithm == SLIDING_WINDOW:
        stamp = float(decision.reset_at - window)
        return _sql.UNDO_SLIDING_WINDOW, (bucket_key, float(cost), stamp, window)
    if algorithm == TOKEN_BUCKET:
        return _sql.UNDO_TOKEN_BUCKET, (bucket_key, float(cost), float(rate.capacity))
    return _sql.UNDO_GCRA, (bucket_key, gcra_params(rate, cost)[0])
