"""Helpers for the `limits` adapter tests: an injected clock, a blocking face, process workers.

Kept out of the test module so spawned worker processes can import them by name.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

import limits.aio.storage.memory
import limits.aio.strategies
import limits.storage.memory
import limits.strategies
from limits import parse
from limits.storage import storage_from_string

import quota.contrib.limits as adapter
from tests._workers import BARRIER_TIMEOUT

#: Every module that reads the time for a `limits` storage or strategy: `limits`
#: calls ``time.time()`` on the module it imported, so each gets a fake `time`.
TIME_READERS: tuple[ModuleType, ...] = (
    adapter,
    limits.strategies,
    limits.aio.strategies,
    limits.storage.memory,
    limits.aio.storage.memory,
)


class FakeTime:
    """Stands in for the `time` module: ``time()`` reads `now`, everything else is the real one."""

    def __init__(self, now: Callable[[], float]) -> None:
        self._now = now

    def time(self) -> float:
        return self._now()

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


class Blocking:
    """`target` with plain methods: an async method's coroutine runs to completion on `loop`."""

    def __init__(self, target: Any, loop: asyncio.AbstractEventLoop | None) -> None:
        self.target = target
        self._loop = loop

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self.target, name)
        if not callable(attribute) or self._loop is None:
            return attribute
        loop = self._loop

        def call(*args: Any, **kwargs: Any) -> Any:
            value = attribute(*args, **kwargs)
            return loop.run_until_complete(value) if inspect.isawaitable(value) else value

        return call


# -- worker processes ---------------------------------------------------------------

#: (strategy name, limit string, identifier): one limit a worker hammers.
Lane = tuple[str, str, str]


def _freeze_time(now: float) -> None:
    fake = FakeTime(lambda: now)
    for module in TIME_READERS:
        module.time = fake  # type: ignore[attr-defined]


def hit_worker(
    barrier: Any, uri: str, lanes: list[Lane], hits: int, tasks: int, now: float
) -> dict[str, int]:
    """Hit every lane `hits` times through `limits`' strategies; return how many each allowed.

    Time stands still at `now` (no window boundary is crossed). An
    ``async+…`` URI runs `tasks` concurrent tasks sharing the hits.
    """
    _freeze_time(now)
    if uri.startswith("async+"):
        return asyncio.run(_hit_async(barrier, uri, lanes, hits, tasks))
    storage = storage_from_string(uri)
    try:
        assert storage.check(), "the storage is not healthy"  # connects before the start
        limiters = [(limits.strategies.STRATEGIES[s](storage), parse(t), i) for s, t, i in lanes]
        barrier.wait(timeout=BARRIER_TIMEOUT)
        allowed = dict.fromkeys((lane[2] for lane in lanes), 0)
        for _ in range(hits):
            for limiter, item, identifier in limiters:
                allowed[identifier] += limiter.hit(item, identifier)
        return allowed
    finally:
        storage.close()  # type: ignore[union-attr]


async def _hit_async(
    barrier: Any, uri: str, lanes: list[Lane], hits: int, tasks: int
) -> dict[str, int]:
    storage = storage_from_string(uri)
    limiters = [(limits.aio.strategies.STRATEGIES[s](storage), parse(t), i) for s, t, i in lanes]
    allowed = dict.fromkeys((lane[2] for lane in lanes), 0)

    async def task(share: int) -> None:
        for _ in range(share):
            for limiter, item, identifier in limiters:
                # Await first: `allowed[i] += await …` would read allowed[i]
                # before the await and write it back after, losing other tasks' adds.
                hit = await limiter.hit(item, identifier)
                allowed[identifier] += hit

    try:
        assert await storage.check(), "the storage is not healthy"  # type: ignore[misc]
        shares = [hits // tasks + (i < hits % tasks) for i in range(tasks)]
        barrier.wait(timeout=BARRIER_TIMEOUT)  # blocks the loop, on purpose: nothing runs yet
        await asyncio.gather(*(task(share) for share in shares))
        return allowed
    finally:
        await storage.aclose()  # type: ignore[union-attr]
