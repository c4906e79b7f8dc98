"""Hits while a cleanup catches up after days without one, on partitioned counters (PostgreSQL).

    python benchmarks/bench_partition_gap.py [ROWS]

In a scratch database made and dropped here (``QUOTA_BENCH_POSTGRES_URL``, default
``postgresql://root@127.0.0.1:5432/test``, names the server): a ``--partitioned-counters``
table whose cleanup last ran three days ago, ROWS (default 2,000,000) rows of the gap in
its DEFAULT partition, a hit in the running hour. One thread hits the table in a loop
while the cleanup creates the 25 missing partitions (a grace of 3 h keeps the gap's
rows: their row cleanup is not what is measured); prints the catch-up's seconds, the
hits' worst time and p99, and how many took over 100 ms. Targets 127.0.0.1 only.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import uuid
from urllib.parse import urlsplit

import psycopg

import quota

server = os.environ.get("QUOTA_BENCH_POSTGRES_URL", "postgresql://root@127.0.0.1:5432/test")
A = 1_750_003_200  # the last cleanup, hour-aligned
HOUR = 3600
H = A + 3 * 86400  # the hour of the cleanup that ends the gap


def main(rows: int) -> None:
    if urlsplit(server).hostname not in ("127.0.0.1", "localhost"):
        sys.exit("bench_partition_gap.py targets a server on 127.0.0.1 only")
    name = f"quota_bench_gap_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(server, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = urlsplit(server)._replace(path=f"/{name}").geturl()
    try:
        quota.migrate(url, counters_partitioned=True)
        now = [A + 10.0]
        with quota.connect(url, clock=lambda: now[0], pool_size=2) as limiter:
            limiter.cleanup(grace=0)  # the partitions around A; then three days without one
            with psycopg.connect(url, autocommit=True) as conn:
                conn.execute(
                    "INSERT INTO quota_counters SELECT '60:' || s || ':k:' || i, 'k:' || i, s, 60,"
                    " 1, 0 FROM generate_series(1, %s) AS i,"
                    " LATERAL (SELECT %s + i %% 40 * 60 AS s) AS w",
                    (rows, H - 2 * HOUR),
                )
                conn.execute("VACUUM ANALYZE quota_counters")
            now[0] = H + 10
            limiter.rate_limit("live", 10, HOUR)  # the running hour has rows in DEFAULT
            times: list[float] = []
            done = threading.Event()

            def hits() -> None:
                with quota.connect(url, clock=lambda: now[0], pool_size=1) as app:
                    while not done.is_set():
                        started = time.monotonic()
                        app.rate_limit("busy", 10**9, 60)
                        times.append(time.monotonic() - started)

            hitter = threading.Thread(target=hits)
            hitter.start()
            time.sleep(1)
            started = time.monotonic()
            try:
                limiter.cleanup(grace=3 * HOUR)
            finally:
                took = time.monotonic() - started
                time.sleep(1)
                done.set()
                hitter.join(30)
        times.sort()
        print(
            f"catch-up after a gap, {rows:,} rows in DEFAULT: {took:.1f} s; {len(times):,} hits,"
            f" worst {times[-1] * 1000:.0f} ms, p99 {times[int(len(times) * 0.99)] * 1000:.1f} ms,"
            f" {sum(t > 0.1 for t in times)} over 100 ms; load average {os.getloadavg()[0]:.1f}"
        )
    finally:
        with psycopg.connect(server, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2_000_000)
