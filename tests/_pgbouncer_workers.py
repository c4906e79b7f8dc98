"""Code that runs in worker processes (``spawn``) for tests/stores/test_pgbouncer.py.

Run through `tests._workers.run_processes` (``target(barrier, *args)``). Each
worker builds its own limiter from a URL (through a PgBouncer, usually with
``?prepared_statements=false``), opens its connections, then waits on the barrier
so that every process starts at the same moment. Pools are tiny: the bouncers in
front of the shared server have two server connections each.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

import quota
from tests._workers import BARRIER_TIMEOUT


def _clock(now: float | None) -> Callable[[], float]:
    """The real clock for None, else a clock stopped at `now`."""
    if now is None:
        return time.time
    return lambda: now


def hit_worker(
    barrier: Any, url: str, face: str, key: str, limit: int, window: int, hits: int,
    options: dict[str, Any],
) -> int:  # fmt: skip
    """`hits` calls of ``rate_limit(key, limit, window)`` on the real clock; how many were allowed.

    `options`: ``pool_size`` (default 2), ``batching`` (default False) and, for
    ``face="async"``, ``tasks``: concurrent tasks sharing the hits (default 3).
    """
    if face == "async":
        return asyncio.run(_hit_async(barrier, url, key, limit, window, hits, options))
    with quota.connect(
        url, pool_size=options.get("pool_size", 2), batching=options.get("batching", False)
    ) as limiter:
        limiter.peek(key, limit, window)  # connect and check the schema before the start
        barrier.wait(timeout=BARRIER_TIMEOUT)
        return sum(limiter.rate_limit(key, limit, window).allowed for _ in range(hits))


async def _hit_async(
    barrier: Any, url: str, key: str, limit: int, window: int, hits: int, options: dict[str, Any]
) -> int:
    tasks = options.get("tasks", 3)
    async with quota.connect_async(
        url, pool_size=options.get("pool_size", 2), batching=options.get("batching", False)
    ) as limiter:
        await limiter.peek(key, limit, window)

        async def task(share: int) -> int:
            allowed = 0
            for _ in range(share):
                allowed += (await limiter.rate_limit(key, limit, window)).allowed
            return allowed

        shares = [hits // tasks + (i < hits % tasks) for i in range(tasks)]
        barrier.wait(timeout=BARRIER_TIMEOUT)  # blocks the loop, on purpose: nothing runs yet
        return sum(await asyncio.gather(*(task(share) for share in shares)))


def cost_of(key: str) -> int:
    """The cost every consume of idempotency key `key` charges: 1 to 3, fixed by the key."""
    return int(key.rsplit("-", 1)[1]) % 3 + 1


def quota_worker(
    barrier: Any, url: str, face: str, subject: str, name: str, keys: Sequence[str],
    refund_keys: Sequence[str], grant: int, now: float, seed: int, pool_size: int = 2,
) -> dict[str, list[Any]]:  # fmt: skip
    """Durable quotas from one process, in two phases all processes start together.

    Phase 1: one `consume_quota` per key of `keys` (in an order of its own, by
    `seed`; every process consumes every key, so each one's charge races the
    others') and one `grant_quota` of `grant`. Phase 2: one `refund_quota` per key
    of `refund_keys`. Returns the outcomes: ``consumed`` as (key, allowed, used,
    replayed), ``refunded`` as (key, refunded, status, amount), ``granted`` as the
    granted total each grant returned.
    """
    if face == "async":
        return asyncio.run(
            _quotas_async(
                barrier, url, subject, name, keys, refund_keys, grant, now, seed, pool_size
            )
        )
    rng = random.Random(seed)
    order, refunds = rng.sample(list(keys), len(keys)), rng.sample(refund_keys, len(refund_keys))
    out: dict[str, list[Any]] = {"consumed": [], "refunded": [], "granted": []}
    with quota.connect(url, clock=_clock(now), pool_size=pool_size) as limiter:
        limiter.quota_usage(subject)  # connect and check the schema before the start
        barrier.wait(timeout=BARRIER_TIMEOUT)
        for i, key in enumerate(order):
            d = limiter.consume_quota(subject, name, 10**6, "day", cost_of(key), key)
            out["consumed"].append((key, d.allowed, d.used, d.replayed))
            if i == len(order) // 2:
                out["granted"].append(limiter.grant_quota(subject, name, grant, "day").granted)
        barrier.wait(timeout=BARRIER_TIMEOUT)  # every charge is made before any refund
        for key in refunds:
            r = limiter.refund_quota(subject, name, key)
            out["refunded"].append((key, r.refunded, r.status, r.amount))
    return out


async def _quotas_async(
    barrier: Any, url: str, subject: str, name: str, keys: Sequence[str],
    refund_keys: Sequence[str], grant: int, now: float, seed: int, pool_size: int,
) -> dict[str, list[Any]]:  # fmt: skip
    rng = random.Random(seed)
    order, refunds = rng.sample(list(keys), len(keys)), rng.sample(refund_keys, len(refund_keys))
    out: dict[str, list[Any]] = {"consumed": [], "refunded": [], "granted": []}
    async with quota.connect_async(url, clock=_clock(now), pool_size=pool_size) as limiter:
        await limiter.quota_usage(subject)
        barrier.wait(timeout=BARRIER_TIMEOUT)  # blocks the loop, on purpose: nothing runs yet
        for i, key in enumerate(order):
            d = await limiter.consume_quota(subject, name, 10**6, "day", cost_of(key), key)
            out["consumed"].append((key, d.allowed, d.used, d.replayed))
            if i == len(order) // 2:
                usage = await limiter.grant_quota(subject, name, grant, "day")
                out["granted"].append(usage.granted)
        barrier.wait(timeout=BARRIER_TIMEOUT)
        for key in refunds:
            r = await limiter.refund_quota(subject, name, key)
            out["refunded"].append((key, r.refunded, r.status, r.amount))
    return out
