"""p99 of 64 batched decisions while a table they never touch is dropped or counted (PostgreSQL).

    python examples/bench_drop_alone.py [drop|count] [RUNS]

The control experiment for the partition-cleanup figure of `quota bench
--report`: a standalone UNLOGGED table shaped like ``quota_counters`` with
1,000,000 rows is dropped (or counted) while 64 batched callers decide on
the counters table, in a scratch database made and dropped here. The two
share no lock, so whatever the p99 of the decisions gains during the drop
is the machine's CPU: on a 2-core machine the kernel freeing the table's
pages competes with the callers and the server. Targets 127.0.0.1 only.
"""

from __future__ import annotations

import asyncio
import os
import sys
import uuid
from urllib.parse import urlsplit

import asyncpg

from quota import _bench_report as br
from quota._migrate import migrate

server = os.environ.get("QUOTA_BENCH_POSTGRES_URL", "postgresql://root@127.0.0.1:5432/test")
action = sys.argv[1] if len(sys.argv) > 1 else "drop"


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
        _, load = await br.under_load(url, lambda: conn.execute("DROP TABLE junk"))
    else:
        _, load = await br.under_load(url, lambda: conn.fetchval("SELECT count(*) FROM junk"))
    await conn.close()
    before, during = load.p99_ms(load.before), load.p99_ms(load.during)
    print(
        f"{action}: {load.seconds * 1000:.0f} ms; p99 of the decisions {before} ms before,"
        f" {during} ms during ({len(load.during)} decisions): {during / before:.2f}x",
        flush=True,
    )


def main() -> None:
    for _ in range(int(sys.argv[2]) if len(sys.argv) > 2 else 3):
        name = f"quota_bench_{uuid.uuid4().hex[:8]}"
        br._admin(server, f'CREATE DATABASE "{name}"')
        url = urlsplit(server)._replace(path="/" + name).geturl()
        try:
            migrate(url)
            asyncio.run(run(url, url))
        finally:
            br._admin(server, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


if __name__ == "__main__":
    main()
