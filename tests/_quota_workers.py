"""Durable-quota code that runs in worker processes (``spawn``).

Run through `tests._workers.run_processes` (``target(barrier, *args)``), except
`consume_until_killed`, which the parent SIGKILLs at a random moment. Workers
live at a fixed instant, so no period boundary is ever crossed.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Sequence
from typing import Any

import quota
from tests._workers import BARRIER_TIMEOUT


def _clock(now: float) -> Callable[[], float]:
    return lambda: now


def consume_worker(
    barrier: Any, url: str, face: str, subject: str, name: str, limit: int, period: str,
    keys: Sequence[str | None], now: float,
) -> list[tuple[bool, int, bool, str | None]]:  # fmt: skip
    """One `consume_quota` per entry of `keys` (None: no idempotency key), in order.

    Returns ``(allowed, used, replayed, key)`` per call.
    """
    if face == "async":
        return asyncio.run(_consume_async(barrier, url, subject, name, limit, period, keys, now))
    with quota.connect(url, clock=_clock(now)) as limiter:
        limiter.quota_usage(subject)  # connect and check the schema before the start
        barrier.wait(timeout=BARRIER_TIMEOUT)
        out = []
        for key in keys:
            d = limiter.consume_quota(subject, name, limit, period, idempotency_key=key)
            out.append((d.allowed, d.used, d.replayed, key))
        return out


async def _consume_async(
    barrier: Any, url: str, subject: str, name: str, limit: int, period: str,
    keys: Sequence[str | None], now: float,
) -> list[tuple[bool, int, bool, str | None]]:  # fmt: skip
    async with quota.connect_async(url, clock=_clock(now)) as limiter:
        await limiter.quota_usage(subject)
        barrier.wait(timeout=BARRIER_TIMEOUT)  # blocks the loop, on purpose: nothing runs yet
        out = []
        for key in keys:
            d = await limiter.consume_quota(subject, name, limit, period, idempotency_key=key)
            out.append((d.allowed, d.used, d.replayed, key))
        return out


def check_worker(
    barrier: Any, url: str, subject: str, rounds: int, reverse: bool, now: float
) -> int:
    """`rounds` checks of two rate windows and two quotas; `reverse` passes them in the other order.

    Returns how many were allowed. Every check touches the same four rows, so
    checks in the two orders would deadlock if rows were locked in argument order.
    """
    limits: list[quota.RateWindow | quota.QuotaLimit] = [
        quota.RateWindow(f"{subject}:a", 10**6, 3600),
        quota.QuotaLimit(subject, "first", 10**6, "day"),
        quota.RateWindow(f"{subject}:b", 10**6, 3600),
        quota.QuotaLimit(subject, "second", 10**6, "day"),
    ]
    if reverse:
        limits.reverse()
    with quota.connect(url, clock=_clock(now)) as limiter:
        limiter.quota_usage(subject)
        barrier.wait(timeout=BARRIER_TIMEOUT)
        return sum(limiter.check(*limits).allowed for _ in range(rounds))


def consume_until_killed(url: str, subject: str, seed: int, ready: Any, now: float) -> None:
    """Consume (and now and then refund) in a tight loop until SIGKILLed.

    Sends one message on `ready` once connected, then one per operation, so
    the parent can pick a random moment inside the loop.
    """
    rng = random.Random(seed)
    with quota.connect(url, clock=_clock(now)) as limiter:
        limiter.quota_usage(subject)
        ready.send(0)
        i = 0
        while True:
            key = f"{seed}:{i}"
            limiter.consume_quota(subject, "llm", 10**9, "day", rng.randint(1, 5), key)
            if i % 4 == 3:
                limiter.refund_quota(subject, "llm", f"{seed}:{i - 1}")
            ready.send(i)
            i += 1


def consume_and_stall(url: str, subject: str, ready: Any, now: float) -> None:
    """Start one consume and stall it between its usage charge and its ledger entry.

    The store's statement driver is wrapped so that, just before the ledger
    INSERT, the worker tells the parent and blocks forever: the parent
    SIGKILLs it at exactly that point, inside the transaction.
    """
    import threading

    from quota._stores import postgres as _postgres
    from quota._stores import sqlite as _sqlite

    module: Any = _sqlite if url.startswith("sqlite") else _postgres
    original = module.drive

    def drive(op: Any, execute: Callable[..., Any]) -> Any:
        def stalling(sql: str, params: Any) -> Any:
            if sql.startswith("INSERT INTO quota_ledger"):
                ready.send("charged, ledger entry not yet written")
                threading.Event().wait()  # until SIGKILL
            return execute(sql, params)

        return original(op, stalling)

    module.drive = drive
    with quota.connect(url, clock=_clock(now)) as limiter:
        limiter.consume_quota(subject, "llm", 100, "day", cost=3, idempotency_key="stalled")
