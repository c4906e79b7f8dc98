"""Capacity figures: what one decision costs the server, on PostgreSQL and on Redis.

    python benchmarks/capacity.py --url postgresql://root@127.0.0.1:5432/quota_capacity
    python benchmarks/capacity.py --redis-url redis://127.0.0.1:6379/0 --only redis
    python benchmarks/capacity.py --url … --redis-url … --runs 5 --duration 5 --json cap.json

Every figure of the capacity page (docs/capacity.md), printed as the page's tables:

- ``decisions``: decisions per second through the async limiter (``connect_async``),
  one by one and batched (``batching=True``), for the fixed window and the token
  bucket, on the counters table as ``quota migrate`` makes it (UNLOGGED) and as
  ``--logged-counters`` makes it, with ``durability="full"`` and ``"relaxed"``;
  for each, the server's CPU time per decision (user + system of the backends
  serving the run, from ``/proc/<pid>/stat``: the server must run on this host and
  its processes be readable), the transaction ids (``pg_current_xact_id()``) and
  the WAL bytes (``pg_current_wal_insert_lsn()``) per decision. Transaction ids
  and WAL are the whole cluster's: a quiet period of the same length is measured
  first and subtracted (printed as the "idle" line);
- ``rows``: bytes per row of ``quota_counters`` and ``quota_state`` (table, indexes,
  total) after 100,000 decisions on distinct keys, and again after each row was
  updated once more;
- ``cleanup``: time and WAL of the cleanup (``limiter.cleanup()``, what ``quota
  cleanup`` runs) of 100,000 expired rows: row by row on the plain table (UNLOGGED
  and logged) and on the state table, and by dropping a partition of a
  ``--partitioned-counters`` table; ``--cleanup-rows 1000000,10000000`` times
  the UNLOGGED table's row by row cleanup on those backlogs too;
- ``redis``: decisions per second through the async limiter and the Redis server's
  CPU per decision (``INFO cpu``, user + system, main thread and all), with the
  per-call time of every command the run sent (``INFO commandstats``), for the
  fixed window and the token bucket, one by one and, when the store accepts it,
  batched. ``redis+cluster://h1:p1,h2:p2/`` URLs are read on every node listed.

The PostgreSQL sections work in schemas of their own (``capacity_unlogged``,
``capacity_logged``, ``capacity_partitioned``) of the database ``--url`` names,
dropped at the end; the Redis section uses the keys under ``?prefix=`` (default
``quota-capacity:``), deleted at the end. The PostgreSQL sections hold at most
``--pool-size`` + 2 connections. Keys look like the HTTP layer's (``ip:`` and 32
hex digits). Figures are medians of ``--runs`` runs; the machine's load average
is printed before and after. A script of the repository, not part of the package.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import sys
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
ROWS = 100_000
LIMIT = 2**60
WINDOW = 3600
SCHEMAS = {"unlogged": "capacity_unlogged", "logged": "capacity_logged"}
PARTITIONED = "capacity_partitioned"
SECTIONS = ("decisions", "rows", "cleanup", "redis")
TICK = os.sysconf("SC_CLK_TCK")


def _keys(n: int, seed: int = 7) -> list[str]:
    rng = random.Random(seed)
    return [f"ip:{rng.getrandbits(128):032x}" for _ in range(n)]


def _with_query(url: str, **params: str) -> str:
    parts = urllib.parse.urlsplit(url)
    query = urllib.parse.parse_qsl(parts.query) + list(params.items())
    return parts._replace(query=urllib.parse.urlencode(query)).geturl()


def _dsn(url: str) -> str:
    """A URL asyncpg takes: our own query parameters dropped."""
    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme.split("+")[0]
    return parts._replace(scheme=scheme, query="").geturl()


# -- the server's side: CPU of the backends, transaction ids, WAL --------------------


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a process of this host, or None when unreadable."""
    try:
        data = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = data[data.rfind(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / TICK


@dataclass
class ServerMark:
    cpu: dict[int, float | None]
    xid: int
    lsn: int
    at: float


async def _mark(conn: Any) -> ServerMark:
    """The backends of this database (but `conn`'s own) with their CPU, the next xid, the WAL."""
    pids = await conn.fetch(
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
        " AND pid <> pg_backend_pid() AND backend_type = 'client backend'"
    )
    xid = int(await conn.fetchval("SELECT pg_current_xact_id()::text::bigint"))
    lsn = int(await conn.fetchval("SELECT pg_current_wal_insert_lsn()"))  # asyncpg: an int
    return ServerMark({r[0]: _cpu_seconds(r[0]) for r in pids}, xid, lsn, time.perf_counter())


async def _diff(conn: Any, before: ServerMark) -> tuple[float | None, int, int]:
    """(backend CPU seconds, xids, WAL bytes) since `before`; the xid and WAL figures
    leave out what this measuring connection itself spends (one xid per mark)."""
    after = await _mark(conn)
    cpu: float | None = 0.0
    for pid, end in after.cpu.items():
        start = before.cpu.get(pid, 0.0)
        if end is None or start is None:
            cpu = None
            break
        assert cpu is not None
        cpu += end - start
    return cpu, after.xid - before.xid - 1, after.lsn - before.lsn


# -- PostgreSQL: decisions ------------------------------------------------------------


@dataclass
class Case:
    table: str  # unlogged | logged
    durability: str
    algorithm: str
    batching: bool
    runs: list[dict[str, float | None]] = field(default_factory=list)

    @property
    def label(self) -> str:
        table = "UNLOGGED" if self.table == "unlogged" else "logged"
        how = "batched" if self.batching else "one by one"
        return f"{self.algorithm}, {how}, {table}, durability={self.durability}"

    def median(self, name: str) -> float | None:
        values = [r[name] for r in self.runs if r[name] is not None]
        return statistics.median(values) if values else None  # type: ignore[type-var]


CASES = [
    Case(table, durability, algorithm, batching)
    for table, durability in (("unlogged", "full"), ("logged", "full"), ("logged", "relaxed"))
    for algorithm, batching in (("fixed_window", False), ("fixed_window", True),
                                ("token_bucket", False))
]  # fmt: skip


async def _idle(conn: Any, seconds: float) -> tuple[float, float]:
    """xids and WAL bytes per second the cluster spends without us (other databases' work)."""
    before = await _mark(conn)
    await asyncio.sleep(seconds)
    _cpu, xids, wal = await _diff(conn, before)
    return xids / seconds, wal / seconds


async def _decisions_run(
    url: str, conn: Any, case: Case, keys: list[str], callers: int, pool_size: int,
    duration: float, idle: tuple[float, float],
) -> dict[str, float | None]:  # fmt: skip
    import quota

    async with quota.connect_async(
        url, pool_size=pool_size, batching=case.batching, durability=case.durability
    ) as limiter:
        kwargs = {} if case.algorithm == "fixed_window" else {"algorithm": case.algorithm}
        # Open the pool up front: connecting is not what is measured.
        await asyncio.gather(*(limiter.rate_limit(k, LIMIT, WINDOW, **kwargs) for k in keys[:64]))
        deadline = [0.0]

        async def caller(i: int) -> int:
            rng, n = random.Random(i), 0
            while time.perf_counter() < deadline[0]:
                await limiter.rate_limit(keys[rng.randrange(len(keys))], LIMIT, WINDOW, **kwargs)
                n += 1
            return n

        before = await _mark(conn)
        deadline[0] = time.perf_counter() + duration
        counts = await asyncio.gather(*(caller(i) for i in range(callers)))
        elapsed = time.perf_counter() - before.at
        cpu, xids, wal = await _diff(conn, before)
    decisions = sum(counts)
    xids_net = max(0.0, xids - idle[0] * elapsed)
    wal_net = max(0.0, wal - idle[1] * elapsed)
    return {
        "decisions_per_s": decisions / elapsed,
        "server_cpu_us": None if cpu is None else cpu * 1e6 / decisions,
        "xids": xids_net / decisions,
        "wal_bytes": wal_net / decisions,
        "decisions_per_xid": decisions / xids_net if xids_net else None,
    }


# -- PostgreSQL: rows and cleanup ------------------------------------------------------


async def _rows(url: str, conn: Any, schema: str, pool_size: int) -> dict[str, dict[str, float]]:
    """Bytes per row of the counters and the state table after ROWS decisions on distinct keys."""
    import quota

    await conn.execute(f"TRUNCATE {schema}.quota_counters, {schema}.quota_state")
    keys = _keys(ROWS, seed=11)
    sizes: dict[str, dict[str, float]] = {}
    for table, algorithm in (("quota_counters", "fixed_window"), ("quota_state", "token_bucket")):
        kwargs = {} if algorithm == "fixed_window" else {"algorithm": algorithm}
        for rounds in (1, 2):
            async with quota.connect_async(
                url, pool_size=pool_size, batching=algorithm == "fixed_window"
            ) as limiter:
                queue = iter(keys)

                async def caller(
                    limiter: Any = limiter, queue: Iterator[str] = queue, kwargs: Any = kwargs
                ) -> None:
                    for key in queue:
                        await limiter.rate_limit(key, LIMIT, 86400, **kwargs)

                await asyncio.gather(*(caller() for _ in range(64)))
            heap, indexes, total, rows = await conn.fetchrow(
                f"SELECT pg_table_size('{schema}.{table}'), pg_indexes_size('{schema}.{table}'),"
                f" pg_total_relation_size('{schema}.{table}'), (SELECT count(*) FROM {schema}.{table})"
            )
            sizes[f"{table}, after {'insert' if rounds == 1 else 'one update each'}"] = {
                "rows": rows, "table_bytes": heap / rows, "index_bytes": indexes / rows,
                "total_bytes": total / rows,
            }  # fmt: skip
    return sizes


async def _insert_expired_counters(
    conn: Any, schema: str, start: int, window: int, rows: int = ROWS
) -> None:
    """`rows` fixed-window rows that ended before `start + window`, shaped as the limiter
    writes them (keys ``k:ip:`` and 32 hex digits, made on the server: 10M of them would
    not fit a Python list), in one window: all end at once, as a busy minute's do."""
    await conn.execute(
        f"INSERT INTO {schema}.quota_counters"
        " (bucket_key, client_key, window_start, window_seconds, count, updated_at)"
        " SELECT $2::int || ':' || $1::bigint || ':' || k, k, $1::bigint, $2::int, 1, $1::float8"
        " FROM (SELECT 'k:ip:' || md5('13:' || i) AS k FROM generate_series(1, $3::int) AS i) AS g",
        start, window, rows,
    )  # fmt: skip
    await conn.execute(f"ANALYZE {schema}.quota_counters")


async def _insert_expired_state(conn: Any, schema: str, expired_at: float) -> None:
    await conn.execute(
        f"INSERT INTO {schema}.quota_state"
        " (bucket_key, client_key, window_seconds, value, prev_value, stamp, allowed, expires_at)"
        " SELECT 'tb:60:' || k, k, 60, 1.0, 0.0, $1::float8, 1, $1::float8"
        " FROM unnest($2::text[]) AS k",
        expired_at, ["k:" + key for key in _keys(ROWS, seed=17)],
    )  # fmt: skip


async def _timed_cleanup(url: str, conn: Any) -> dict[str, float]:
    import quota

    async with quota.connect_async(url, pool_size=2) as limiter:
        await limiter.peek("warm", 10, 60)
        before = await _mark(conn)
        start = time.perf_counter()
        result = await limiter.cleanup(grace=60)
        seconds = time.perf_counter() - start
        _cpu, _xids, wal = await _diff(conn, before)
    deleted = result.deleted
    return {
        "rows": deleted, "seconds": seconds, "us_per_row": seconds * 1e6 / max(1, deleted),
        "wal_bytes": wal, "wal_bytes_per_row": wal / max(1, deleted),
    }  # fmt: skip


async def _cleanups(base: str, conn: Any, rows: list[int]) -> dict[str, dict[str, float]]:
    now = time.time()
    old = int(now) - 7200
    old -= old % 60
    out: dict[str, dict[str, float]] = {}
    for kind, schema in SCHEMAS.items():
        await conn.execute(f"TRUNCATE {schema}.quota_counters, {schema}.quota_state")
        await _insert_expired_counters(conn, schema, old, 60)
        out[f"quota_counters, {kind}, row DELETE"] = await _timed_cleanup(
            _with_query(base, schema=schema), conn
        )
    # The per-row cost must not grow with the backlog (a cleanup that did not run for a
    # while, a short cleanup interval at a million keys a minute): the same on more rows.
    schema = SCHEMAS["unlogged"]
    for count in rows:
        if count == ROWS:
            continue
        await conn.execute(f"TRUNCATE {schema}.quota_counters")
        print(f"capacity: cleanup of {count:,} rows", file=sys.stderr)
        await _insert_expired_counters(conn, schema, old, 60, count)
        out[f"quota_counters, unlogged, row DELETE, {count:,} rows"] = await _timed_cleanup(
            _with_query(base, schema=schema), conn
        )
        await conn.execute(f"TRUNCATE {schema}.quota_counters")
    schema = SCHEMAS["unlogged"]
    await _insert_expired_state(conn, schema, old + 60.0)
    out["quota_state, unlogged, row DELETE"] = await _timed_cleanup(
        _with_query(base, schema=schema), conn
    )
    # The partition of the hour before this one: dropped whole once the hour has
    # ended and every window in it too, i.e. from a minute past the hour (the grace).
    hour = int(time.time()) // 3600 * 3600
    wait = hour + 75 - time.time()
    if wait > 0:
        print(f"capacity: waiting {wait:.0f}s for the previous hour's partition to expire",
              file=sys.stderr)  # fmt: skip
        await asyncio.sleep(wait)
    await _insert_expired_counters(conn, PARTITIONED, hour - 3600, 60)
    out["quota_counters, partitioned (UNLOGGED), partition drop"] = await _timed_cleanup(
        _with_query(base, schema=PARTITIONED), conn
    )
    return out


# -- Redis -----------------------------------------------------------------------------


def _redis_nodes(url: str) -> list[Any]:
    """A client for every node the URL names (one, or each of a cluster URL's hosts)."""
    import redis

    parts = urllib.parse.urlsplit(url)
    userinfo, _, hosts = parts.netloc.rpartition("@")
    user, _, password = userinfo.partition(":")
    nodes = []
    for host in hosts.split(","):
        name, _, port = host.rpartition(":") if ":" in host else (host, "", "6379")
        nodes.append(
            redis.Redis(
                host=name or "127.0.0.1", port=int(port or 6379), username=user or None,
                password=password or None, ssl=parts.scheme.startswith("rediss"),
            )
        )  # fmt: skip
    return nodes


def _redis_stats(nodes: list[Any]) -> tuple[float, dict[str, tuple[int, float]]]:
    """(CPU seconds, {command: (calls, usec)}) summed over `nodes`."""
    cpu, commands = 0.0, {}
    for node in nodes:
        info = node.info("cpu")
        cpu += float(info["used_cpu_user"]) + float(info["used_cpu_sys"])
        for name, stat in node.info("commandstats").items():
            calls, usec = commands.get(name, (0, 0.0))
            commands[name] = (calls + int(stat["calls"]), usec + float(stat["usec"]))
    return cpu, commands


async def _redis_run(
    url: str, nodes: list[Any], algorithm: str, batching: bool, keys: list[str], callers: int,
    duration: float,
) -> dict[str, Any]:  # fmt: skip
    import quota

    kwargs = {} if algorithm == "fixed_window" else {"algorithm": algorithm}
    async with quota.connect_async(url, batching=batching) as limiter:
        await asyncio.gather(*(limiter.rate_limit(k, LIMIT, WINDOW, **kwargs) for k in keys[:64]))
        deadline = [0.0]

        async def caller(i: int) -> int:
            rng, n = random.Random(i), 0
            while time.perf_counter() < deadline[0]:
                await limiter.rate_limit(keys[rng.randrange(len(keys))], LIMIT, WINDOW, **kwargs)
                n += 1
            return n

        cpu0, cmd0 = _redis_stats(nodes)
        start = time.perf_counter()
        deadline[0] = start + duration
        counts = await asyncio.gather(*(caller(i) for i in range(callers)))
        elapsed = time.perf_counter() - start
        cpu1, cmd1 = _redis_stats(nodes)
    decisions = sum(counts)
    commands = {}
    for name, (calls, usec) in cmd1.items():
        d_calls = calls - cmd0.get(name, (0, 0.0))[0]
        d_usec = usec - cmd0.get(name, (0, 0.0))[1]
        if d_calls > 0 and name not in ("cmdstat_info",):
            commands[name.removeprefix("cmdstat_")] = {
                "calls_per_decision": d_calls / decisions, "usec_per_call": d_usec / d_calls,
            }  # fmt: skip
    return {
        "decisions_per_s": decisions / elapsed,
        "redis_cpu_us": (cpu1 - cpu0) * 1e6 / decisions,
        "commands": commands,
    }


async def _redis(url: str, runs: int, duration: float, callers: int, keys: int) -> dict[str, Any]:
    import redis

    from quota import ConfigurationError

    nodes = _redis_nodes(url)
    key_list = _keys(keys)
    out: dict[str, Any] = {}
    try:
        for algorithm, batching in (("fixed_window", False), ("fixed_window", True),
                                    ("token_bucket", False)):  # fmt: skip
            label = f"{algorithm}, {'batched' if batching else 'one by one'}"
            results = []
            for _ in range(runs):
                try:
                    results.append(
                        await _redis_run(
                            url, nodes, algorithm, batching, key_list, callers, duration
                        )
                    )
                except ConfigurationError as exc:
                    out[label] = {"skipped": str(exc)}
                    break
            if results:
                cmds: dict[str, dict[str, float]] = {}
                for name in results[-1]["commands"]:
                    cmds[name] = {
                        m: statistics.median(r["commands"].get(name, {m: 0.0})[m] for r in results)
                        for m in ("calls_per_decision", "usec_per_call")
                    }
                out[label] = {
                    "decisions_per_s": statistics.median(r["decisions_per_s"] for r in results),
                    "redis_cpu_us": statistics.median(r["redis_cpu_us"] for r in results),
                    "runs": [round(r["redis_cpu_us"], 2) for r in results],
                    "commands": cmds,
                }
    finally:
        prefix = urllib.parse.parse_qs(urllib.parse.urlsplit(url).query).get("prefix", [""])[0]
        for node in nodes:
            with contextlib.suppress(redis.RedisError):
                for key in node.scan_iter(match=prefix + "*", count=1000):
                    node.delete(key)
            node.close()
    return out


# -- the report ------------------------------------------------------------------------


def _fmt(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def _print_decisions(cases: list[Case], idle: tuple[float, float]) -> None:
    print(f"\nidle cluster (subtracted): {idle[0]:.1f} xids/s, {idle[1]:,.0f} WAL bytes/s")
    print("\n| counters table | durability | algorithm | mode | decisions/s | server CPU µs"
          " per decision | decisions per xid | WAL bytes per decision |")  # fmt: skip
    print("|---|---|---|---|---:|---:|---:|---:|")
    for c in cases:
        table = "UNLOGGED" if c.table == "unlogged" else "logged"
        mode = "batched" if c.batching else "one by one"
        print(
            f"| {table} | {c.durability} | {c.algorithm} | {mode}"
            f" | {_fmt(c.median('decisions_per_s'), 0)} | {_fmt(c.median('server_cpu_us'))}"
            f" | {_fmt(c.median('decisions_per_xid'))} | {_fmt(c.median('wal_bytes'))} |"
        )
    print("\nper run (server CPU µs per decision):")
    for c in cases:
        print(f"  {c.label}: " + ", ".join(_fmt(r["server_cpu_us"]) for r in c.runs))


def _print_rows(sizes: dict[str, dict[str, float]]) -> None:
    print("\n| table | rows | table bytes/row | index bytes/row | total bytes/row |")
    print("|---|---:|---:|---:|---:|")
    for name, s in sizes.items():
        print(f"| {name} | {s['rows']:,.0f} | {s['table_bytes']:.0f} | {s['index_bytes']:.0f}"
              f" | {s['total_bytes']:.0f} |")  # fmt: skip


def _print_cleanup(cleanups: dict[str, dict[str, float]]) -> None:
    print("\n| cleanup of expired rows | rows | seconds | µs per row | WAL bytes | WAL bytes/row |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, s in cleanups.items():
        print(f"| {name} | {s['rows']:,.0f} | {s['seconds']:.3f} | {s['us_per_row']:.1f}"
              f" | {s['wal_bytes']:,.0f} | {s['wal_bytes_per_row']:.1f} |")  # fmt: skip


def _print_redis(results: dict[str, Any]) -> None:
    print("\n| Redis | decisions/s | Redis CPU µs per decision | commands per decision"
          " (µs per call) |")  # fmt: skip
    print("|---|---:|---:|---|")
    for label, r in results.items():
        if "skipped" in r:
            print(f"| {label} | not run: {r['skipped']} | | |")
            continue
        cmds = ", ".join(
            f"{name} {c['calls_per_decision']:.2f} ({c['usec_per_call']:.1f})"
            for name, c in sorted(
                r["commands"].items(), key=lambda kv: -kv[1]["calls_per_decision"]
            )
        )
        print(f"| {label} | {r['decisions_per_s']:,.0f} | {r['redis_cpu_us']:.1f} | {cmds} |")
    print("\nper run (Redis CPU µs per decision): "
          + "; ".join(f"{k}: {v.get('runs')}" for k, v in results.items()))  # fmt: skip


async def _postgres(args: argparse.Namespace, report: dict[str, Any]) -> None:
    import asyncpg

    import quota

    conn = await asyncpg.connect(_dsn(args.url))
    try:
        for kind, schema in SCHEMAS.items():
            await conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
            await asyncio.to_thread(
                quota.migrate,
                _with_query(args.url, schema=schema),
                counters_logged=kind == "logged",
            )
        if "cleanup" in args.only:
            await conn.execute(f"DROP SCHEMA IF EXISTS {PARTITIONED} CASCADE")
            await asyncio.to_thread(
                quota.migrate, _with_query(args.url, schema=PARTITIONED), counters_partitioned=True
            )
        if "decisions" in args.only:
            idle = await _idle(conn, args.duration)
            keys = _keys(args.keys)
            cases = [c for c in CASES if c.algorithm in args.algorithms]
            for run in range(args.runs):
                for case in cases if run % 2 == 0 else cases[::-1]:
                    url = _with_query(args.url, schema=SCHEMAS[case.table])
                    result = await _decisions_run(
                        url, conn, case, keys, args.callers, args.pool_size, args.duration, idle
                    )
                    case.runs.append(result)
                    print(f"capacity: run {run + 1}/{args.runs} {case.label}:"
                          f" {result['decisions_per_s']:,.0f}/s", file=sys.stderr)  # fmt: skip
            _print_decisions(cases, idle)
            report["idle"] = {"xids_per_s": idle[0], "wal_bytes_per_s": idle[1]}
            report["decisions"] = [asdict(c) for c in cases]
        if "rows" in args.only:
            sizes = await _rows(
                _with_query(args.url, schema=SCHEMAS["unlogged"]), conn, SCHEMAS["unlogged"],
                args.pool_size,
            )  # fmt: skip
            _print_rows(sizes)
            report["rows"] = sizes
        if "cleanup" in args.only:
            cleanups = await _cleanups(args.url, conn, args.cleanup_rows)
            _print_cleanup(cleanups)
            report["cleanup"] = cleanups
    finally:
        for schema in (*SCHEMAS.values(), PARTITIONED):
            await conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
        await conn.close()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="PostgreSQL URL of a database to work in (own schemas)")
    parser.add_argument("--redis-url", help="Redis URL (redis://, redis+cluster://h1:p1,h2:p2/)")
    parser.add_argument(
        "--only", default=",".join(SECTIONS),
        help=f"comma-separated sections to run, of {', '.join(SECTIONS)} (default: all)",
    )  # fmt: skip
    parser.add_argument(
        "--cleanup-rows", type=lambda text: [int(n) for n in text.split(",")], default=[ROWS],
        help="cleanup: also time the UNLOGGED counters' row DELETE on these backlogs"
        " (comma-separated, e.g. 100000,1000000,10000000)",
    )  # fmt: skip
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per measurement")
    parser.add_argument("--callers", type=int, default=64, help="concurrent asyncio tasks")
    parser.add_argument("--pool-size", type=int, default=6, help="PostgreSQL connections")
    parser.add_argument("--keys", type=int, default=10_000, help="distinct keys")
    parser.add_argument("--algorithms", default="fixed_window,token_bucket", help="comma-separated")
    parser.add_argument("--json", metavar="FILE", help="also write the results to FILE as JSON")
    args = parser.parse_args(argv)
    args.only = set(args.only.split(","))
    args.algorithms = set(args.algorithms.split(","))
    if args.only - set(SECTIONS):
        parser.error(f"--only takes {', '.join(SECTIONS)}")
    if not 1 <= args.runs <= 50 or not 0 < args.duration <= 120 or not 1 <= args.callers <= 1024:
        parser.error("runs must be 1..50, duration 0..120 s, callers 1..1024")
    sys.path.insert(0, str(ROOT))
    report: dict[str, Any] = {"load_before": os.getloadavg(), "cpus": os.cpu_count()}
    print(f"load average {report['load_before'][0]:.2f}, {report['cpus']} CPUs;"
          f" {args.runs} runs of {args.duration:g}s, {args.callers} callers, {args.keys:,} keys")  # fmt: skip
    if args.url and args.only & {"decisions", "rows", "cleanup"}:
        asyncio.run(_postgres(args, report))
    if args.redis_url and "redis" in args.only:
        url = args.redis_url
        if "prefix=" not in url:
            url = _with_query(url, prefix="quota-capacity:")
        results = asyncio.run(_redis(url, args.runs, args.duration, args.callers, args.keys))
        _print_redis(results)
        report["redis"] = results
    report["load_after"] = os.getloadavg()
    print(f"\nload average after: {report['load_after'][0]:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str))
    return report


if __name__ == "__main__":
    main()
