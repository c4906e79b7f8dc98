"""Code that runs in worker processes (``spawn``), and the parent side that runs them.

Workers build their own limiter from a URL, on a fixed clock (a plain float,
so no window boundary is ever crossed), open their connections, then wait
on a barrier so that every process starts hammering at the same moment.
"""

from __future__ import annotations

import asyncio
import os
import queue
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import quota
from tests._support import T0

#: The instant every worker lives at: mid-hour, mid-minute.
FIXED_NOW = T0
#: Seconds a worker waits for the others at the barrier.
BARRIER_TIMEOUT = 60.0
#: Seconds the parent waits for all results.
RESULTS_TIMEOUT = 120.0

#: (key, limit, window, count_denied): one counter a worker hits.
Lane = tuple[str, int, int, bool]


def _entry(
    target: Callable[..., Any], barrier: Any, results: Any, index: int, args: tuple[Any, ...]
) -> None:
    try:
        value = target(barrier, *args)
    except BaseException:
        barrier.abort()  # the others fail fast instead of waiting out the timeout
        results.put((index, False, traceback.format_exc()))
    else:
        results.put((index, True, value))


def run_processes(
    context: Any, target: Callable[..., Any], arguments: Sequence[tuple[Any, ...]]
) -> list[Any]:
    """Run ``target(barrier, *args)`` in one process per entry of `arguments`; return the results.

    Fails (AssertionError) if a worker raises or if they do not all finish in
    `RESULTS_TIMEOUT` seconds; stragglers are terminated.
    """
    barrier = context.Barrier(len(arguments))
    results = context.Queue()
    processes = [
        context.Process(target=_entry, args=(target, barrier, results, i, args), daemon=True)
        for i, args in enumerate(arguments)
    ]
    for process in processes:
        process.start()
    found: dict[int, Any] = {}
    failures: list[str] = []
    try:
        deadline = time.monotonic() + RESULTS_TIMEOUT
        while len(found) + len(failures) < len(processes):
            try:
                index, ok, value = results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(
                    f"only {len(found)} of {len(processes)} workers finished in {RESULTS_TIMEOUT}s"
                ) from None
            if ok:
                found[index] = value
            else:
                failures.append(f"worker {index} failed:\n{value}")
    finally:
        for process in processes:
            process.join(timeout=10)
        for process in processes:
            if process.is_alive():
                process.terminate()
                process.join(timeout=10)
        results.close()
        results.join_thread()
    assert not failures, "\n".join(failures)
    return [found[i] for i in range(len(processes))]


def _clock(now: float) -> Callable[[], float]:
    return lambda: now


def hit_worker(
    barrier: Any, url: str, face: str, lanes: Sequence[Lane], hits: int, tasks: int, now: float
) -> dict[str, int]:
    """Hit every lane `hits` times, interleaved; return how many hits each key was allowed.

    ``face="sync"`` uses `quota.connect` in one thread; ``face="async"`` uses
    `quota.connect_async` with `tasks` concurrent tasks sharing the hits.
    """
    if face == "async":
        return asyncio.run(_hit_async(barrier, url, lanes, hits, tasks, now))
    limiters = [
        quota.connect(url, clock=_clock(now), count_denied=count_denied)
        for _key, _limit, _window, count_denied in lanes
    ]
    try:
        for limiter, (key, limit, window, _) in zip(limiters, lanes, strict=True):
            limiter.peek(key, limit, window)  # connect and check the schema before the start
        barrier.wait(timeout=BARRIER_TIMEOUT)
        allowed = dict.fromkeys((lane[0] for lane in lanes), 0)
        for _ in range(hits):
            for limiter, (key, limit, window, _) in zip(limiters, lanes, strict=True):
                allowed[key] += limiter.rate_limit(key, limit, window).allowed
        return allowed
    finally:
        for limiter in limiters:
            limiter.close()


async def _hit_async(
    barrier: Any, url: str, lanes: Sequence[Lane], hits: int, tasks: int, now: float
) -> dict[str, int]:
    limiters = [
        quota.connect_async(url, clock=_clock(now), count_denied=count_denied, pool_size=tasks)
        for _key, _limit, _window, count_denied in lanes
    ]
    allowed = dict.fromkeys((lane[0] for lane in lanes), 0)

    async def task(share: int) -> None:
        for _ in range(share):
            for limiter, (key, limit, window, _) in zip(limiters, lanes, strict=True):
                decision = await limiter.rate_limit(key, limit, window)
                allowed[key] += decision.allowed

    try:
        for limiter, (key, limit, window, _) in zip(limiters, lanes, strict=True):
            await limiter.peek(key, limit, window)
        shares = [hits // tasks + (i < hits % tasks) for i in range(tasks)]
        barrier.wait(timeout=BARRIER_TIMEOUT)  # blocks the loop, on purpose: nothing runs yet
        await asyncio.gather(*(task(share) for share in shares))
        return allowed
    finally:
        for limiter in limiters:
            await limiter.aclose()


def cleanup_worker(barrier: Any, url: str, now: float, batch_size: int) -> dict[str, Any]:
    """One cleanup with ``grace=0`` at `now`; return what it did."""
    with quota.connect(url, clock=_clock(now)) as limiter:
        limiter.peek("warm-up", 1, 60)  # connect before the start
        barrier.wait(timeout=BARRIER_TIMEOUT)
        result = limiter.cleanup(grace=0, batch_size=batch_size)
    return {"deleted": result.deleted, "skipped": result.skipped}


def wal_worker(barrier: Any, url: str, path: str, face: str, seconds: float) -> tuple[int, int]:
    """Hit fresh keys as fast as one process can for `seconds` (real time, real clock).

    Returns (hits, the largest size of ``path``-wal seen, sampled every 50 hits).
    """

    def sample(peak: int) -> int:
        try:
            return max(peak, os.stat(path + "-wal").st_size)
        except OSError:
            return peak

    async def hammer_async() -> tuple[int, int]:
        async with quota.connect_async(url) as limiter:
            await limiter.peek("warm", 10, 60)
            barrier.wait(timeout=BARRIER_TIMEOUT)
            hits, peak, end = 0, 0, time.monotonic() + seconds
            while time.monotonic() < end:
                await limiter.rate_limit(f"k{os.getpid()}-{hits % 20_000}", 10, 60)
                hits += 1
                if hits % 50 == 0:
                    peak = sample(peak)
            return hits, peak

    if face == "async":
        return asyncio.run(hammer_async())
    limiter = quota.connect(url)
    try:
        limiter.peek("warm", 10, 60)
        barrier.wait(timeout=BARRIER_TIMEOUT)
        hits, peak, end = 0, 0, time.monotonic() + seconds
        while time.monotonic() < end:
            limiter.rate_limit(f"k{os.getpid()}-{hits % 20_000}", 10, 60)
            hits += 1
            if hits % 50 == 0:
                peak = sample(peak)
        return hits, peak
    finally:
        limiter.close()
