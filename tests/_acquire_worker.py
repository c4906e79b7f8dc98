"""One process of the cross-process `acquire` test: `tasks` tasks wait for slots of one key.

``python -m tests._acquire_worker URL RATE TASKS`` connects, prints ``ready``, reads
``START END`` (epoch seconds) from stdin, sleeps until START, and then each task calls
``acquire(timeout=END - now)`` until the time is up. It prints one JSON line: the
admissions, the worst overrun of a call past its timeout, the longest call, the
timeouts, and how the admissions spread over the tasks (the most one task got, and how
many tasks got any).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable

import quota


async def run(
    url: str, rate: str, tasks: int, when: Callable[[], Awaitable[tuple[float, float]]]
) -> dict[str, float]:
    per_task = [0] * tasks
    overrun = longest = 0.0
    timeouts = 0
    async with quota.connect_async(url, pool_size=2) as limiter:
        await limiter.peek("warm-up", 1, 1)  # connect before the clock starts
        start, end = await when()

        async def task(i: int) -> None:
            nonlocal overrun, longest, timeouts
            while (left := end - time.time()) > 0:
                t0 = time.time()
                try:
                    await limiter.acquire("shared", rate, timeout=left)
                except quota.RateLimitTimeout:
                    timeouts += 1
                    break
                finally:
                    took = time.time() - t0
                    overrun = max(overrun, took - left)
                    longest = max(longest, took)
                per_task[i] += 1

        await asyncio.sleep(max(0.0, start - time.time()))
        await asyncio.gather(*(task(i) for i in range(tasks)))
    return {
        "admitted": sum(per_task), "overrun": overrun, "longest": longest,
        "timeouts": timeouts, "most_per_task": max(per_task),
        "tasks_admitted": sum(1 for n in per_task if n),
    }  # fmt: skip


async def _from_stdin() -> tuple[float, float]:
    print("ready", flush=True)
    line = await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    start, end = (float(x) for x in line.split())
    return start, end


if __name__ == "__main__":
    url, rate, tasks = sys.argv[1:4]
    print(json.dumps(asyncio.run(run(url, rate, int(tasks), _from_stdin))))
