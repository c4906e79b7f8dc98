"""p99 of 64 batched decisions while a table they never touch is dropped or counted (PostgreSQL).

    python benchmarks/bench_drop_alone.py [drop|count] [RUNS]

The control experiment for the partition-cleanup figure of the batching
report (`benchmarks/report.py`): a standalone UNLOGGED table shaped like ``quota_counters`` with
1,000,000 rows is dropped (or counted) while 64 batched callers decide on
the counters table, in a scratch database made and dropped here. The two
share no lock, so whatever the p99 of the decisions gains during the drop
is the machine's CPU: on a 2-core machine the kernel freeing the table's
pages competes with the callers and the server. Targets 127.0.0.1 only.
"""

from __future__ import annotations

import asyncio
import os
import random
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit

import asyncpg
import psycopg

import quota

server = os.environ.get("QUOTA_BENCH_POSTGRES_URL", "postgresql://root@127.0.0.1:5432/test")
action = sys.argv[1] if len(sys.argv) > 1 else "drop"
LIMIT, WINDOW = 2**60, 3600  # never denies: every decision is a full hit


def admin(sql: str) -> None:
    with psycopg.connect(server, autocommit=True) as conn:
        conn.execute(sql)


def p99_ms(latencies: list[float]) -> float:
    ordered = sorted(latencies)
    return round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1000, 3)


async def under_load(
    url: str, act: Callable[[], Awaitable[object]]
) -> tuple[float, list[float], list[float]]:
    """Run `act` while 64 batched callers decide on `url` over 1,000 keys.

    Returns its seconds and the callers' latencies (s) in the 2 s before it and during it.
    """
    async with quota.connect_async(url, pool_size=8, batching=True) as limiter:
        await limiter.rate_limit("bench:warm", LIMIT, WINDOW)
        stop = asyncio.Event()
        marks: list[tuple[float, float]] = []  # (start, latency)

        async def caller(seed: int) -> None:
            rng, clock = random.Random(seed), time.perf_counter
            while not stop.is_set():
                t = clock()
                await limiter.rate_limit(f"bench:{rng.randrange(1000)}", LIMIT, WINDOW)
                marks.append((t, clock() - t))

        tasks = [asyncio.ensure_future(caller(i)) for i in range(64)]
        await asyncio.sleep(3.0)
        before_from = time.perf_counter() - 2.0
        start = time.perf_counter()
        await act()
        end = time.perf_counter()
        await asyncio.sleep(0.2)
        stop.set()
        await asyncio.gather(*tasks)
    before = [lat for t, lat in marks if before_from <= t < start]
    during = [lat for t, lat in marks if start <= t < end]
    return round(end - start, 3), before, during


async def run(url: str, dsn: str) -> None:
    conn = await asyncpg.connect(dsn)
    await conn.execute(
        'CREATE UNLOGGED TABLE junk (bucket_key TEXT COLLATE "C" PRIMARY KEY, client_key TEXT, window_start BIGINT, window_seconds INT, count BIGINT, updated_at FLOAT8) WITH (fillfactor=70)'
    )
    await conn.execute("CREATE INDEX ON junk ((window_start + window_seconds))")
    await conn.execute(
        "INSERT INTO junk SELECT '60:' || i || ':k:seed' || i, 'k:seed' || i, i, 60, 1, i FROM generate_series(1, 1000000) i"
    )
    await conn.execute("VACUUM ANALYZE junk")
    if action == "drop":
        seconds, before, during = await under_load(url, lambda: conn.execute("DROP TABLE junk"))
    else:
        seconds, before, during = await under_load(
            url, lambda: conn.fetchval("SELECT count(*) FROM junk")
        )
    await conn.close()
    p99_before, p99_during = p99_ms(before), p99_ms(during)
    print(
        f"{action}: {seconds * 1000:.0f} ms; p99 of the decisions {p99_before} ms before,"
        f" {p99_during} ms during ({len(during)} decisions): {p99_during / p99_before:.2f}x",
        flush=True,
    )


def main() -> None:
    for _ in range(int(sys.argv[2]) if len(sys.argv) > 2 else 3):
        name = f"quota_bench_{uuid.uuid4().hex[:8]}"
        admin(f'CREATE DATABASE "{name}"')
        url = urlsplit(server)._replace(path="/" + name).geturl()
        try:
            quota.migrate(url)
            asyncio.run(run(url, url))
        finally:
            admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


if __name__ == "__main__":
    main()
