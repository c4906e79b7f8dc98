"""Concurrency blocks in worker processes (``spawn``), for tests/limiter/test_leases.py.

Each worker builds its own limiter from a URL. What the tests measure, the workers
record outside quota: every holder appends a line to a shared file opened with
``O_APPEND`` (one ``write`` per line, so lines never interleave) right after entering its
block and right before leaving it, and the test replays the file.
"""

from __future__ import annotations

import asyncio
import os
import random
import threading
import time
from typing import Any

import quota

#: Seconds a worker waits for a slot before giving up (a failure of the test).
WAIT = 120.0


def _record(fd: int, line: str) -> None:
    os.write(fd, line.encode())


def crowd_async(barrier: Any, url: str, path: str, key: str, limit: int, tasks: int) -> int:
    """`tasks` tasks, each entering one block of `key` and holding it a few milliseconds."""

    async def main() -> int:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        limiter = quota.connect_async(url, pool_size=4)
        try:
            await limiter.concurrency_usage(key)  # connections open before the start
            barrier.wait()

            async def one(i: int) -> None:
                async with limiter.concurrency(key, limit, timeout=WAIT):
                    _record(fd, f"+ {os.getpid()}.{i}\n")
                    await asyncio.sleep(random.uniform(0.002, 0.012))
                    _record(fd, f"- {os.getpid()}.{i}\n")

            await asyncio.gather(*(one(i) for i in range(tasks)))
            return tasks
        finally:
            await limiter.aclose()
            os.close(fd)

    return asyncio.run(main())


def crowd_threads(barrier: Any, url: str, path: str, key: str, limit: int, tasks: int) -> int:
    """`crowd_async` with threads and the sync face."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    limiter = quota.connect(url, pool_size=4)
    done: list[int] = []
    errors: list[BaseException] = []
    try:
        limiter.concurrency_usage(key)
        barrier.wait()

        def one(i: int) -> None:
            try:
                with limiter.concurrency(key, limit, timeout=WAIT):
                    _record(fd, f"+ {os.getpid()}.{i}\n")
                    time.sleep(random.uniform(0.002, 0.012))
                    _record(fd, f"- {os.getpid()}.{i}\n")
                done.append(i)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(tasks)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(WAIT + 30)
        if errors:
            raise errors[0]
        return len(done)
    finally:
        limiter.close()
        os.close(fd)


def crowd_either(barrier: Any, index: int, *args: Any) -> int:
    """`crowd_async` for an even `index`, `crowd_threads` for an odd one."""
    return (crowd_threads if index % 2 else crowd_async)(barrier, *args)


def hold(
    url: str, key: str, limit: int, blocks: int, lease: float, seconds: float, out: Any
) -> None:
    """Enter `blocks` blocks of `key`, say so on `out`, hold them `seconds`, leave, say when.

    ``("in", slots)`` once inside; ``("left", time.time())`` just before the first block
    starts leaving (what a waiter elsewhere can take from then on).
    """
    limiter = quota.connect(url, pool_size=2)
    try:
        blocks_in = [
            limiter.concurrency(key, limit, lease=lease, timeout=WAIT) for _ in range(blocks)
        ]
        for block in blocks_in:
            block.__enter__()
        out.put(("in", [block.slot for block in blocks_in]))
        time.sleep(seconds)
        out.put(("left", time.time()))
        for block in blocks_in:
            block.__exit__(None, None, None)
        out.put(("out", time.time()))
    finally:
        limiter.close()


def hand_over(url: str, key: str, rounds: int, out: Any, inbox: Any) -> None:
    """`rounds` times: take `key`'s one slot, hold it 1 to 2 s (a waiter elsewhere polls at
    its slowest by then; a random time, so the release falls anywhere between two of its
    tries), say ``("left", time)`` just before leaving, then wait on `inbox` until that
    waiter got in."""
    limiter = quota.connect(url, pool_size=2)
    try:
        limiter.concurrency_usage(key)
        for _ in range(rounds):
            with limiter.concurrency(key, 1, lease=10.0, timeout=WAIT):
                out.put(("in", time.time()))
                time.sleep(random.uniform(1.0, 2.0))
                out.put(("left", time.time()))
            inbox.get(timeout=WAIT)
    finally:
        limiter.close()
