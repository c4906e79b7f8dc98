"""N fixed-window decisions in a loop, through quota or through the bare driver, one caller.

    python benchmarks/bench_hot_path.py sqlite|postgresql bare|quota N [URL]

The workload of `quota bench` (the same upsert, the same keys, a limit never
reached) without its threads, tasks and clock: made to be counted by
callgrind, whose instruction counts repeat from run to run on a machine too
busy for wall-clock ratios. The difference between two counts (N and 3N
calls) over 2N is the cost of one call in the client process::

    valgrind --tool=callgrind --callgrind-out-file=cg.out \\
        python benchmarks/bench_hot_path.py sqlite quota 3000
    callgrind_annotate cg.out | grep "PROGRAM TOTALS"

SQLite runs in the process, so its count includes the database's own work;
PostgreSQL's count is the client's (the driver, the event loop, quota). The
URL defaults to ``sqlite:////tmp/quota-hot-path.db`` (migrated here) and
``$QUOTA_BENCH_POSTGRES_URL`` or ``postgresql://root@127.0.0.1:5432/test``.

With ``QUOTA_BENCH_OPCODES=1`` the loop runs under a tracer that counts the
Python bytecode instructions each function executes and prints them per call,
most first: a count that repeats exactly from run to run, without valgrind,
of the Python each side runs (the driver's C code and the database are not in
it). Run each side after a first run, so every key's row is there already.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import sqlite3
import sys
import time
from collections.abc import Iterator
from types import FrameType
from typing import Any

import quota
from quota._sql import statements as _sql
from quota._sql.migrate import migrate
from quota._stores.sqlite import set_up
from quota._tools.bench import LIMIT, WINDOW, _bare_params

KEYS = [f"bench:{i}" for i in range(1000)]
OPCODES: collections.Counter[str] = collections.Counter()


@contextlib.contextmanager
def counting() -> Iterator[None]:
    """Count the bytecode instructions run inside, by function, when asked to."""
    if not os.environ.get("QUOTA_BENCH_OPCODES"):
        yield
        return

    def trace(frame: FrameType, event: str, arg: Any) -> Any:
        frame.f_trace_opcodes = True
        if event == "opcode":
            code = frame.f_code
            OPCODES[f"{'/'.join(code.co_filename.split('/')[-2:])}:{code.co_name}"] += 1
        return trace

    sys.settrace(trace)
    try:
        yield
    finally:
        sys.settrace(None)


def sqlite_side(url: str, side: str, n: int) -> float:
    migrate(url)
    start = time.perf_counter()
    if side == "bare":
        conn = sqlite3.connect(url.removeprefix("sqlite:///"), isolation_level=None)
        set_up(conn, 10.0)
        start = time.perf_counter()
        with counting():
            for i in range(n):
                conn.execute(_sql.HIT, _bare_params(KEYS[i % 1000])).fetchall()
        conn.close()
    else:
        with quota.connect(url, pool_size=1) as limiter:
            for key in KEYS:  # steady state: every key seen once, as in a long run
                limiter.rate_limit(key, LIMIT, WINDOW)
            start = time.perf_counter()
            with counting():
                for i in range(n):
                    limiter.rate_limit(KEYS[i % 1000], LIMIT, WINDOW)
    return n / (time.perf_counter() - start)


async def postgresql_side(url: str, side: str, n: int) -> float:
    if side == "bare":
        import asyncpg

        conn = await asyncpg.connect(url)
        statement = await conn.prepare(_sql.render(_sql.HIT, "numeric_dollar"))
        start = time.perf_counter()
        with counting():
            for i in range(n):
                await statement.fetch(*_bare_params(KEYS[i % 1000]))
        elapsed = time.perf_counter() - start
        await conn.close()
        return n / elapsed
    async with quota.connect_async(url, pool_size=1) as limiter:
        for key in KEYS:  # steady state: every key seen once, as in a long run
            await limiter.rate_limit(key, LIMIT, WINDOW)
        start = time.perf_counter()
        with counting():
            for i in range(n):
                await limiter.rate_limit(KEYS[i % 1000], LIMIT, WINDOW)
        return n / (time.perf_counter() - start)


def main() -> None:
    dialect, side, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if dialect == "sqlite":
        url = sys.argv[4] if len(sys.argv) > 4 else "sqlite:////tmp/quota-hot-path.db"
        rate = sqlite_side(url, side, n)
    else:
        default = os.environ.get(
            "QUOTA_BENCH_POSTGRES_URL", "postgresql://root@127.0.0.1:5432/test"
        )
        url = sys.argv[4] if len(sys.argv) > 4 else default
        migrate(url)
        rate = asyncio.run(postgresql_side(url, side, n))
    print(f"{dialect} {side}: {rate:,.0f} calls/s")
    if OPCODES:
        print(f"bytecode instructions per call: {sum(OPCODES.values()) / n:,.0f}")
        for where, count in OPCODES.most_common(12):
            print(f"  {count / n:7.1f}  {where}")


if __name__ == "__main__":
    main()
