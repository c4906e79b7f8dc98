"""Fixed-window decisions per second on Redis: quota beside a bare pipeline, limits and throttled-py.

    pip install -e '.[redis]' limits throttled-py
    python benchmarks/bench_redis.py                                  # redis://127.0.0.1:6379/0
    python benchmarks/bench_redis.py --url redis://host:6379/3 --runs 7 --json bench-redis.json
    python benchmarks/bench_redis.py --url redis+cluster://host:7000,host:7001/

One invocation measures, side by side, a fixed window of one hour (every call
allowed) on ``--keys`` keys drawn at random, in two parts:

- **one by one**, one thread: a bare redis-py pipeline of ``INCRBY`` and
  ``EXPIRE`` (the baseline: what a caller would write by hand, one round trip,
  not atomic), limits (``RedisStorage`` or ``RedisClusterStorage`` with
  ``FixedWindowRateLimiter.hit``), throttled-py (``Throttled`` with its Redis
  store and fixed window) and quota (``Limiter.rate_limit``);
- **concurrent**: ``--concurrency`` callers, as threads (sync) and as asyncio
  tasks (async): the bare pipeline, quota one by one, and quota with group
  commit (``batching=True``: the hits in flight together share one pipeline
  of scripts).

A side whose library is not installed is skipped, with the reason. Each of
``--runs`` runs measures every side for ``--duration`` seconds, in
alternating order (forwards, then backwards). The table gives, per side,
the median rate, the median of the per-run ratios to that run's bare
baseline, and the client's CPU time per decision (user + system of this
process: steadier than throughput on a shared machine; Redis's own CPU is not
in it); the per-run figures follow. ``--json FILE`` writes all of it. The
keys written carry prefixes of their own and are deleted at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import os
import random
import re
import statistics
import sys
import threading
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
WINDOW = 3600
LIMIT = 10**12
#: Every key this benchmark writes starts with one of these.
PREFIX = "quota-bench-redis:"
PREFIXES = {
    "bare": PREFIX + "bare:",
    "quota": PREFIX + "quota:",
    "limits": PREFIX + "limits",
    "throttled": PREFIX.rstrip(":") + "-throttled",
}
#: Keys drawn in advance per caller (the harness kept out of the measure).
SEQUENCE = 4096


@dataclass
class Side:
    """One row of the table."""

    name: str
    label: str
    part: str  # "one" (one thread, one by one) or "threads" or "tasks"
    skipped: str | None = None
    rates: list[float] = field(default_factory=list)
    cpu_us: list[float] = field(default_factory=list)
    ratios: list[float] = field(default_factory=list)


def _sequence(keys: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [f"k{rng.randrange(keys)}" for _ in range(SEQUENCE)]


def _window_start() -> int:
    second = int(time.time())
    return second - second % WINDOW


# -- one caller, one thread ---------------------------------------------------------------


def _one_thread(call: Callable[[str], Any], keys: int, duration: float) -> tuple[float, float]:
    """Decisions per second and client CPU µs per decision of `call` on one thread."""
    sequence = _sequence(keys, 0)
    for key in sequence[:100]:  # connected, scripts loaded: not what is measured
        call(key)
    done = 0
    cpu = time.process_time()
    start = time.perf_counter()
    deadline = start + duration
    while time.perf_counter() < deadline:
        for key in sequence[done % SEQUENCE : done % SEQUENCE + 64]:
            call(key)
        done += 64
    elapsed = time.perf_counter() - start
    return done / elapsed, (time.process_time() - cpu) / done * 1e6


# -- concurrent callers -------------------------------------------------------------------------


def _threads(
    call: Callable[[str], Any], keys: int, duration: float, callers: int
) -> tuple[float, float]:
    """`callers` threads calling `call` until the deadline: decisions/s and CPU µs each."""
    counts = [0] * callers
    barrier = threading.Barrier(callers + 1)
    deadline = [0.0]

    def work(i: int) -> None:
        sequence = _sequence(keys, i)
        call(sequence[0])
        barrier.wait()
        done = 0
        while time.perf_counter() < deadline[0]:
            for key in sequence[done % SEQUENCE : done % SEQUENCE + 8]:
                call(key)
            done += 8
        counts[i] = done

    workers = [threading.Thread(target=work, args=(i,)) for i in range(callers)]
    for worker in workers:
        worker.start()
    deadline[0] = time.perf_counter() + duration
    cpu = time.process_time()
    start = time.perf_counter()
    barrier.wait()
    for worker in workers:
        worker.join()
    elapsed = time.perf_counter() - start
    total = sum(counts)
    return total / elapsed, (time.process_time() - cpu) / total * 1e6


async def _tasks(
    call: Callable[[str], Awaitable[Any]], keys: int, duration: float, callers: int
) -> tuple[float, float]:
    """`callers` tasks awaiting `call` until the deadline: decisions/s and CPU µs each."""

    async def warm(i: int) -> None:
        await call(_sequence(keys, i)[0])

    await asyncio.gather(*(warm(i) for i in range(callers)))  # the pool opened
    deadline = time.perf_counter() + duration

    async def work(i: int) -> int:
        sequence = _sequence(keys, i)
        done = 0
        while time.perf_counter() < deadline:
            for key in sequence[done % SEQUENCE : done % SEQUENCE + 8]:
                await call(key)
            done += 8
        return done

    cpu = time.process_time()
    start = time.perf_counter()
    total = sum(await asyncio.gather(*(work(i) for i in range(callers))))
    elapsed = time.perf_counter() - start
    return total / elapsed, (time.process_time() - cpu) / total * 1e6


# -- the sides ------------------------------------------------------------------------------------


def _cluster(url: str) -> bool:
    return urllib.parse.urlsplit(url).scheme.endswith("+cluster")


def _plain_url(url: str) -> str:
    """redis-py's URL of `url`: a cluster URL's first node, as ``redis://`` (``rediss://``)."""
    parts = urllib.parse.urlsplit(url)
    if not _cluster(url):
        return url
    userinfo, _, hosts = parts.netloc.rpartition("@")
    first = hosts.split(",")[0]
    netloc = f"{userinfo}@{first}" if userinfo else first
    return parts._replace(scheme=parts.scheme.replace("+cluster", ""), netloc=netloc).geturl()


def _client(url: str, *, asynchronous: bool = False) -> Any:
    import redis
    import redis.asyncio
    import redis.asyncio.cluster
    import redis.cluster

    if _cluster(url):
        factory: Any = (
            redis.asyncio.cluster.RedisCluster if asynchronous else redis.cluster.RedisCluster
        )
    else:
        factory = redis.asyncio.Redis if asynchronous else redis.Redis
    return factory.from_url(_plain_url(url))


def _quota_url(url: str) -> str:
    return f"{url}{'&' if '?' in url else '?'}prefix={PREFIXES['quota']}"


def bare_one(url: str, keys: int, duration: float) -> tuple[float, float]:
    client = _client(url)
    prefix = PREFIXES["bare"]

    def call(key: str) -> int:
        name = f"{prefix}{{{key}}}:{_window_start()}"
        pipe = client.pipeline(transaction=False)
        pipe.incrby(name, 1)
        pipe.expire(name, WINDOW)
        count: int = pipe.execute()[0]
        return count

    try:
        return _one_thread(call, keys, duration)
    finally:
        client.close()


def limits_one(url: str, keys: int, duration: float) -> tuple[float, float]:
    from limits import RateLimitItemPerHour
    from limits.storage import storage_from_string
    from limits.strategies import FixedWindowRateLimiter

    storage = storage_from_string(url, key_prefix=PREFIXES["limits"])
    limiter, item = FixedWindowRateLimiter(storage), RateLimitItemPerHour(LIMIT)
    return _one_thread(lambda key: limiter.hit(item, key), keys, duration)


def throttled_one(url: str, keys: int, duration: float) -> tuple[float, float]:
    from throttled import Throttled, rate_limiter, store

    throttle = Throttled(
        using="fixed_window", quota=rate_limiter.per_hour(LIMIT), store=store.RedisStore(server=url),
        key_prefix=PREFIXES["throttled"],
    )  # fmt: skip
    return _one_thread(throttle.limit, keys, duration)


def quota_one(url: str, keys: int, duration: float) -> tuple[float, float]:
    import quota

    with quota.connect(_quota_url(url)) as limiter:
        return _one_thread(lambda key: limiter.rate_limit(key, LIMIT, WINDOW), keys, duration)


def bare_threads(url: str, keys: int, duration: float, callers: int) -> tuple[float, float]:
    client = _client(url)
    prefix = PREFIXES["bare"]

    def call(key: str) -> None:
        name = f"{prefix}{{{key}}}:{_window_start()}"
        pipe = client.pipeline(transaction=False)
        pipe.incrby(name, 1)
        pipe.expire(name, WINDOW)
        pipe.execute()

    try:
        return _threads(call, keys, duration, callers)
    finally:
        client.close()


def quota_threads(
    url: str, keys: int, duration: float, callers: int, *, batching: bool
) -> tuple[float, float]:
    import quota

    with quota.connect(_quota_url(url), batching=batching) as limiter:
        return _threads(lambda key: limiter.rate_limit(key, LIMIT, WINDOW), keys, duration, callers)


def bare_tasks(url: str, keys: int, duration: float, callers: int) -> tuple[float, float]:
    async def main() -> tuple[float, float]:
        client = _client(url, asynchronous=True)
        prefix = PREFIXES["bare"]

        async def call(key: str) -> None:
            name = f"{prefix}{{{key}}}:{_window_start()}"
            pipe = client.pipeline(transaction=False)
            pipe.incrby(name, 1)
            pipe.expire(name, WINDOW)
            await pipe.execute()

        try:
            return await _tasks(call, keys, duration, callers)
        finally:
            await client.aclose()

    return asyncio.run(main())


def quota_tasks(
    url: str, keys: int, duration: float, callers: int, *, batching: bool
) -> tuple[float, float]:
    import quota

    async def main() -> tuple[float, float]:
        async with quota.connect_async(_quota_url(url), batching=batching) as limiter:
            return await _tasks(
                lambda key: limiter.rate_limit(key, LIMIT, WINDOW), keys, duration, callers
            )

    return asyncio.run(main())


def _measure(side: Side, args: argparse.Namespace) -> tuple[float, float]:
    url, keys, duration, callers = args.url, args.keys, args.duration, args.concurrency
    one = {"bare": bare_one, "limits": limits_one, "throttled": throttled_one, "quota": quota_one}
    if side.part == "one":
        return one[side.name](url, keys, duration)
    if side.name == "bare":
        bare = bare_threads if side.part == "threads" else bare_tasks
        return bare(url, keys, duration, callers)
    many = quota_threads if side.part == "threads" else quota_tasks
    return many(url, keys, duration, callers, batching=side.name == "quota-batching")


def _clean(url: str) -> int:
    """Delete every key of this benchmark; how many."""
    client = _client(url)
    try:
        found = list(client.scan_iter(match=PREFIX.rstrip(":") + "*", count=1000))
        for key in found:  # one by one: a cluster's keys live on several nodes
            client.delete(key)
        return len(found)
    finally:
        client.close()


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _safe(url: str) -> str:
    """`url` without its password."""
    return re.sub(r"//([^:/@]*):[^@]*@", r"//\1:***@", url)


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--url", default="redis://127.0.0.1:6379/0",
        help="redis://host:port/db, or redis+cluster://host:port,host:port/ for a Redis Cluster",
    )  # fmt: skip
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--duration", type=float, default=3.0, help="seconds per measurement")
    parser.add_argument("--keys", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=64, help="concurrent callers")
    parser.add_argument(
        "--parts", default="one,threads,tasks",
        help="comma-separated: one (one thread), threads, tasks (default: all three)",
    )  # fmt: skip
    parser.add_argument("--json", metavar="FILE", help="also write the results to FILE as JSON")
    args = parser.parse_args(argv)
    if not 1 <= args.runs <= 50 or not 0 < args.duration <= 60 or not 1 <= args.concurrency <= 512:
        parser.error("runs must be 1..50, duration 0..60 s, concurrency 1..512")
    if args.keys < 1:
        parser.error("keys must be at least 1")
    parts = [part.strip() for part in args.parts.split(",") if part.strip()]
    if not parts or set(parts) - {"one", "threads", "tasks"}:
        parser.error("--parts takes one, threads and tasks, comma-separated")
    scheme = urllib.parse.urlsplit(args.url).scheme
    if scheme not in ("redis", "rediss", "redis+cluster", "rediss+cluster"):
        parser.error(
            "--url must be a redis://, rediss://, redis+cluster:// or rediss+cluster:// URL"
        )

    sys.path.insert(0, str(ROOT))
    import quota

    sides: list[Side] = []
    if "one" in parts:
        sides += [
            Side("bare", "bare pipeline INCRBY+EXPIRE", "one"),
            Side("limits", "limits FixedWindowRateLimiter", "one"),
            Side("throttled", "throttled-py fixed window", "one"),
            Side("quota", "quota, one by one", "one"),
        ]
    for part in ("threads", "tasks"):
        if part in parts:
            sides += [
                Side("bare", f"bare pipeline, {args.concurrency} {part}", part),
                Side("quota", f"quota one by one, {args.concurrency} {part}", part),
                Side("quota-batching", f"quota batching=True, {args.concurrency} {part}", part),
            ]
    for side, package in (("limits", "limits"), ("throttled", "throttled-py")):
        if _version(package) is None:
            for row in sides:
                if row.name == side:
                    row.skipped = f"{package} is not installed (pip install {package})"
    try:  # does quota open this URL?
        quota.connect(_quota_url(args.url)).close()
    except quota.ConfigurationError as exc:
        for row in sides:
            if row.name.startswith("quota"):
                row.skipped = f"quota cannot open {_safe(args.url)}: {exc}"
    for side in sides:
        if side.skipped:
            print(f"skipping {side.label}: {side.skipped}", file=sys.stderr)
    measured = [side for side in sides if not side.skipped]

    load_before = os.getloadavg()[0]
    try:
        for run in range(args.runs):
            order = measured if run % 2 == 0 else measured[::-1]
            for side in order:
                rate, cpu = _measure(side, args)
                side.rates.append(rate)
                side.cpu_us.append(cpu)
            for part in parts:
                bare = next((s for s in measured if s.part == part and s.name == "bare"), None)
                for side in measured:
                    if side.part == part and bare is not None:
                        side.ratios.append(side.rates[-1] / bare.rates[-1])
            print(f"run {run + 1}/{args.runs}: "
                  + ", ".join(f"{s.part}/{s.name} {s.rates[-1]:.0f}/s" for s in measured),
                  file=sys.stderr)  # fmt: skip
    finally:
        _clean(args.url)

    rows: list[dict[str, object]] = []
    for side in sides:
        row: dict[str, object] = {"name": side.name, "part": side.part, "label": side.label}
        if side.skipped:
            row["skipped"] = side.skipped
        else:
            row.update(
                median_per_s=round(statistics.median(side.rates)),
                ratio_median=round(statistics.median(side.ratios), 3) if side.ratios else None,
                client_cpu_us_median=round(statistics.median(side.cpu_us), 1),
                per_s=[round(rate) for rate in side.rates],
                ratios=[round(ratio, 3) for ratio in side.ratios],
                client_cpu_us=[round(cpu, 1) for cpu in side.cpu_us],
            )
        rows.append(row)
    report: dict[str, object] = {
        "command": " ".join(
            ["python", "benchmarks/bench_redis.py", *map(_safe, argv or sys.argv[1:])]
        ),
        "url": _safe(args.url),
        "keys": args.keys,
        "concurrency": args.concurrency,
        "runs": args.runs,
        "duration_s": args.duration,
        "cpus": os.cpu_count(),
        # 1-minute load average before and after: how busy the machine was (this included).
        "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "versions": {p: _version(p) for p in ("redis", "limits", "throttled-py", "quota")},
        "sides": rows,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    print(_table(report, rows))
    return report


def _table(report: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    versions = ", ".join(f"{p} {v}" for p, v in report["versions"].items() if v)
    lines = [
        f"{report['url']}: fixed window, {report['keys']} keys, {report['runs']} runs of"
        f" {report['duration_s']:g}s, {report['cpus']} CPUs, load average"
        f" {report['load_average'][0]} -> {report['load_average'][1]}; {versions}",
        "",
        f"{'side':<44} {'decisions/s':>11} {'x bare':>7} {'client CPU us':>14}",
    ]
    for row in rows:
        if "skipped" in row:
            lines.append(f"{row['label']:<44} skipped: {row['skipped']}")
            continue
        ratio = "-" if row["ratio_median"] is None else f"{row['ratio_median']:.2f}"
        lines.append(
            f"{row['label']:<44} {row['median_per_s']:>11} {ratio:>7}"
            f" {row['client_cpu_us_median']:>14}"
        )
    lines += ["", "per run (decisions/s, ratio to that run's bare pipeline):"]
    for row in rows:
        if "skipped" not in row:
            cells = " ".join(
                f"{rate}({ratio:.2f})"
                for rate, ratio in zip(row["per_s"], row["ratios"], strict=False)
            )
            lines.append(f"  {row['part'] + '/' + row['name']:<22} {cells}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
