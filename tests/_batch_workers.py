"""Worker processes for the batching tests (``spawn``): many tasks or threads, one key, batched."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import quota
from tests._workers import BARRIER_TIMEOUT, FIXED_NOW


def batched_hit_worker(
    barrier: Any, url: str, face: str, key: str, limit: int, callers: int, hits: int
) -> list[int]:
    """`callers` concurrent callers (tasks or threads) each hit `key` `hits` times, batched.

    Returns the count every hit was handed, so the parent can check that the
    positions of all processes together are exactly 1..total, each once.
    """
    if face == "async":
        return asyncio.run(_async(barrier, url, key, limit, callers, hits))
    with quota.connect(url, clock=lambda: FIXED_NOW, batching=True) as limiter:
        limiter.peek(key, limit, 3600)  # connect before the start
        counts: list[int] = []
        lock = threading.Lock()

        def caller() -> None:
            mine = [limiter.rate_limit(key, limit, 3600).count for _ in range(hits)]
            with lock:
                counts.extend(mine)

        threads = [threading.Thread(target=caller) for _ in range(callers)]
        barrier.wait(timeout=BARRIER_TIMEOUT)
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return counts


async def _async(
    barrier: Any, url: str, key: str, limit: int, callers: int, hits: int
) -> list[int]:
    async with quota.connect_async(
        url, clock=lambda: FIXED_NOW, batching=True, pool_size=4
    ) as limiter:
        await limiter.peek(key, limit, 3600)
        await asyncio.to_thread(barrier.wait, BARRIER_TIMEOUT)

        async def caller() -> list[int]:
            return [(await limiter.rate_limit(key, limit, 3600)).count for _ in range(hits)]

        results = await asyncio.gather(*(caller() for _ in range(callers)))
        return [count for counts in results for count in counts]
