"""Entering and leaving a concurrency block, beside one rate-limit hit, on one thread.

    python benchmarks/bench_leases.py                                  # sqlite (a temp file)
    python benchmarks/bench_leases.py sqlite:///bench.sqlite3 postgresql://… redis://… memory://
    BENCH_DURABILITY=relaxed python benchmarks/bench_leases.py postgresql://…

For each store: the sync face, one thread, the same number of calls of each kind, in
alternating runs; it prints the median microseconds per call and calls per second of
``limiter.rate_limit(key, …)`` (one statement) and of ``with limiter.concurrency(key,
limit): pass`` (two: one takes a slot, one frees it). Keys rotate over 100, each block's
limit is 8 and always has a slot free, so neither side ever waits. SQL stores are
migrated first (a SQLite file is made in a temporary directory when no URL is given).
``BENCH_DURABILITY`` is the limiter's ``durability`` (``full``, the default, or
``relaxed``: PostgreSQL commits without waiting for the WAL flush).
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import quota

CALLS = 2000
RUNS = 5
KEYS = [f"bench-{i}" for i in range(100)]


def _timed(call: Callable[[str], None]) -> float:
    """Microseconds per call of `call`, over `CALLS` calls."""
    began = time.perf_counter()
    for i in range(CALLS):
        call(KEYS[i % len(KEYS)])
    return (time.perf_counter() - began) / CALLS * 1e6


def bench(url: str) -> tuple[float, float]:
    """Median microseconds per hit and per enter+leave on the store at `url`."""
    if url.startswith(("sqlite", "postgresql")):
        quota.migrate(url)
    durability = os.environ.get("BENCH_DURABILITY", "full")
    with quota.connect(url, pool_size=1, durability=durability) as limiter:

        def hit(key: str) -> None:
            limiter.rate_limit(key, 10**9, 3600)

        def block(key: str) -> None:
            with limiter.concurrency(key, 8):
                pass

        hit("warm")
        block("warm")
        hits, blocks = [], []
        for _ in range(RUNS):
            hits.append(_timed(hit))
            blocks.append(_timed(block))
    return statistics.median(hits), statistics.median(blocks)


def main(urls: list[str]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        urls = urls or [f"sqlite:///{Path(tmp) / 'bench.sqlite3'}"]
        print("| store | hit (µs) | enter+leave (µs) | hits/s | blocks/s |")
        print("|---|---:|---:|---:|---:|")
        for url in urls:
            hit, block = bench(url)
            store = url.split(":", 1)[0]
            print(f"| {store} | {hit:.0f} | {block:.0f} | {1e6 / hit:,.0f} | {1e6 / block:,.0f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
