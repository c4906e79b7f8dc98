"""``quota bench``: decisions per second of quota beside the bare driver, in one run.

For each run the same workload goes through the bare driver (the same upsert,
prepared, with no library around it) and through quota, in alternating order;
the report gives the medians and the median of the per-run ratios. The bare
side computes the window and bucket key inline, as any caller would have to.

Concurrency means threads, each with its own connection, on the sync face,
and tasks sharing one limiter (a pool of `concurrency` connections for
PostgreSQL) on the async face. Limits are set high enough that every call is
allowed, so both sides do the same work.

``algorithm`` picks what the quota side runs (the rate scenario); the bare side
stays the fixed-window upsert, the baseline every algorithm is held to. On
``redis://`` the bare side is one EVALSHA of a plain INCRBY+EXPIRE script per
call (quota's decision is one EVALSHA too). ``memory://`` has no driver to
compare with: it reports quota's decisions per second on one thread.

With ``acquire`` both sides are quota on the same rate (``algorithm``): `hit` as the
baseline, `acquire` on the other side, every slot free, so the ratio is what waiting for
a slot costs a call that need not wait.

With ``telemetry`` both sides are quota too: without telemetry as the baseline, and with
``telemetry=`` on the other side, reporting to an OpenTelemetry SDK meter provider read by
an in-memory reader and an SDK tracer provider with no span processor: every instrument
and span is made as in production, and nothing is exported, so the ratio is quota's own
cost, not an exporter's.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import sqlite3
import statistics
import threading
import time
from collections.abc import AsyncIterator, Callable, Generator, Iterator
from dataclasses import dataclass, field
from typing import Any

from quota._core.algorithms import FIXED_WINDOW, Rate, check_algorithm
from quota._core.decision import stored_key
from quota._core.errors import ConfigurationError
from quota._core.url import StoreURL, parse_url
from quota._limiter import connect, connect_async
from quota._sql import ops as _ops
from quota._sql import statements as _sql
from quota._sql.migrate import migrate
from quota._sql.statements import Statement
from quota._sql.steps import Rows, Step
from quota._stores.sqlite import aset_up, set_up
from quota._wrappers.telemetry import Telemetry

WINDOW = 3600
LIMIT = 2**60
#: The start of every key the benchmark counts under; its rows are deleted when it ends.
KEY_PREFIX = "bench"


@dataclass
class BenchReport:
    """Medians of several runs, quota beside the bare driver."""

    url: str
    face: str
    driver: str
    concurrency: int
    keys: int
    duration: float
    bare: list[float] = field(default_factory=list)
    quota: list[float] = field(default_factory=list)
    scenario: str = "rate"
    """``rate`` (rate_limit), ``quota`` (consume_quota) or ``check``; see `quota._tools.bench_quotas`."""
    algorithm: str = FIXED_WINDOW
    """What the quota side of the rate scenario runs; the bare side is the fixed window."""
    fallback: bool = False
    """The baseline is quota itself without a fallback, the other side quota with one."""
    acquire: bool = False
    """The baseline is quota's `hit`, the other side `acquire` of the same rate."""
    telemetry: bool = False
    """The baseline is quota itself without telemetry, the other side quota with it."""

    @property
    def ratios(self) -> list[float]:
        return [q / b for q, b in zip(self.quota, self.bare, strict=True) if b]

    def as_dict(self) -> dict[str, Any]:
        bare = bool(self.bare)  # memory:// has no bare driver
        return {
            "scenario": self.scenario,
            "algorithm": self.algorithm,
            "fallback": self.fallback,
            "acquire": self.acquire,
            "telemetry": self.telemetry,
            "url": self.url,
            "face": self.face,
            "driver": self.driver,
            "concurrency": self.concurrency,
            "keys": self.keys,
            "duration_s": self.duration,
            "bare_per_s": [round(x) for x in self.bare],
            "quota_per_s": [round(x) for x in self.quota],
            "bare_median_per_s": round(statistics.median(self.bare)) if bare else None,
            "quota_median_per_s": round(statistics.median(self.quota)),
            "ratio_median": round(statistics.median(self.ratios), 3) if bare else None,
        }

    def table(self) -> str:
        d = self.as_dict()
        scenario = self.scenario if self.scenario != "rate" else f"rate, {self.algorithm}"
        lines = [
            f"quota bench ({scenario}): {self.driver} ({self.face} face),"
            f" {self.concurrency} callers,"
            f" {self.keys} keys, {len(self.quota)} runs of {self.duration:g}s",
            f"  {'':<22} {'median/s':>10}   runs",
        ]
        base, side = (
            ("quota, no fallback", "quota, fallback=True")
            if self.fallback
            else ("quota, no telemetry", "quota, telemetry")
            if self.telemetry
            else ("quota hit", "quota acquire")
            if self.acquire
            else ("bare " + self.driver, "quota")
        )
        if self.bare:
            lines.append(
                f"  {base:<22} {d['bare_median_per_s']:>10}   "
                + " ".join(str(x) for x in d["bare_per_s"])
            )
        lines.append(
            f"  {side:<22} {d['quota_median_per_s']:>10}   "
            + " ".join(str(x) for x in d["quota_per_s"])
        )
        if self.bare:
            what = (
                "fallback on/off"
                if self.fallback
                else "telemetry on/off"
                if self.telemetry
                else "acquire/hit"
                if self.acquire
                else "quota/bare"
            )
            lines.append(f"  ratio {what} (median of per-run ratios): {d['ratio_median']:.3f}")
        else:
            lines.append("  no bare driver to compare with: decisions per second on one thread")
        return "\n".join(lines)


def _key_stream(keys: int, seed: int) -> Callable[[], str]:
    rng = random.Random(seed)
    names = [f"{KEY_PREFIX}:{i}" for i in range(keys)]
    return lambda: names[rng.randrange(keys)]


def _threads(
    concurrency: int, duration: float, work: Callable[[int, Callable[[], bool]], int]
) -> float:
    """Run `work(worker_id, go)` on `concurrency` threads; return calls per second."""
    counts = [0] * concurrency
    barrier = threading.Barrier(concurrency + 1)
    deadline = [0.0]

    def go() -> bool:
        return time.perf_counter() < deadline[0]

    def worker(i: int) -> None:
        barrier.wait()
        counts[i] = work(i, go)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(concurrency)]
    for t in threads:
        t.start()
    deadline[0] = time.perf_counter() + duration
    start = time.perf_counter()
    barrier.wait()
    for t in threads:
        t.join()
    return sum(counts) / (time.perf_counter() - start)


async def _tasks(
    concurrency: int, duration: float, work: Callable[[int, Callable[[], bool]], Any]
) -> float:
    deadline = time.perf_counter() + duration

    def go() -> bool:
        return time.perf_counter() < deadline

    start = time.perf_counter()
    counts: list[int] = await asyncio.gather(*(work(i, go) for i in range(concurrency)))
    return sum(counts) / (time.perf_counter() - start)


@contextlib.asynccontextmanager
async def _pg_connections(
    target: str, concurrency: int, **settings: Any
) -> AsyncIterator[list[Any]]:
    """`concurrency` asyncpg connections to `target` (with asyncpg's `settings`), one per
    task of a bare run, closed on the way out."""
    import asyncpg

    connections: list[Any] = []
    try:
        for _ in range(concurrency):
            connections.append(await asyncpg.connect(target, **settings))
        yield connections
    finally:
        for c in connections:
            await c.close()


def _bare_params(key: str) -> tuple[Any, ...]:
    now = time.time()
    second = int(now)
    start = second - second % WINDOW
    return (f"{WINDOW}:{start}:k:{key}", "k:" + key, start, WINDOW, 1, now)


#: The bare Redis baseline: the fixed window as anyone would script it by hand.
_BARE_REDIS = """
local n = redis.call('INCRBY', KEYS[1], ARGV[1])
if n == tonumber(ARGV[1]) then redis.call('EXPIRE', KEYS[1], ARGV[2]) end
return n
"""
_BARE_REDIS_PREFIX = "quota-bench-bare:"


def _redis_client(parsed: StoreURL, *, asynchronous: bool) -> Any:
    import redis
    import redis.asyncio

    from quota._stores.redis import split_url

    if parsed.dialect == "redis-cluster":
        import redis.asyncio.cluster
        import redis.cluster

        from quota._stores.redis_cluster import parse_cluster_url

        cluster = parse_cluster_url(parsed.url)
        module = redis.asyncio.cluster if asynchronous else redis.cluster
        nodes = [module.ClusterNode(host, port) for host, port in cluster.nodes]
        return module.RedisCluster(startup_nodes=nodes, **cluster.options)
    target, _prefix = split_url(parsed.url)
    factory = redis.asyncio.Redis if asynchronous else redis.Redis
    return factory.from_url(target)


def _sync_bare_redis(parsed: StoreURL, concurrency: int, keys: int, duration: float) -> float:
    client = _redis_client(parsed, asynchronous=False)
    sha = client.script_load(_BARE_REDIS)

    def work(i: int, go: Callable[[], bool]) -> int:
        next_key, n = _key_stream(keys, i), 0
        while go():
            key = _BARE_REDIS_PREFIX + _bare_params(next_key())[0]
            client.execute_command("EVALSHA", sha, 1, key, 1, WINDOW)
            n += 1
        return n

    try:
        return _threads(concurrency, duration, work)
    finally:
        client.close()


async def _async_bare_redis(
    parsed: StoreURL, concurrency: int, keys: int, duration: float
) -> float:
    client = _redis_client(parsed, asynchronous=True)
    try:
        sha = await client.script_load(_BARE_REDIS)
        # Open the pool up front, as the quota side does.
        await asyncio.gather(*(client.ping() for _ in range(concurrency)))

        async def work(i: int, go: Callable[[], bool]) -> int:
            next_key, n = _key_stream(keys, i), 0
            while go():
                key = _BARE_REDIS_PREFIX + _bare_params(next_key())[0]
                await client.execute_command("EVALSHA", sha, 1, key, 1, WINDOW)
                n += 1
            return n

        return await _tasks(concurrency, duration, work)
    finally:
        await client.aclose()


# -- the sync face ------------------------------------------------------------


@contextlib.contextmanager
def _telemetry(on: bool) -> Iterator[Telemetry | None]:
    """With `on`, SDK providers that record everything and export nothing (see the module
    docstring), shut down afterwards; else None."""
    if not on:
        yield None
        return
    try:
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import InMemoryMetricReader
        from opentelemetry.sdk.trace import TracerProvider
    except ImportError as exc:
        raise ConfigurationError(
            "bench --telemetry needs the OpenTelemetry SDK: pip install opentelemetry-sdk"
        ) from exc
    meters = MeterProvider(metric_readers=[InMemoryMetricReader()])
    tracers = TracerProvider()
    try:
        yield Telemetry(meter_provider=meters, tracer_provider=tracers)
    finally:
        meters.shutdown()
        tracers.shutdown()


def _sync_quota(
    url: str, concurrency: int, keys: int, duration: float, algorithm: str = FIXED_WINDOW,
    fallback: bool = False, pool_size: int | None = None, call: str = "rate_limit",
    telemetry: bool = False,
) -> float:  # fmt: skip
    with (
        _telemetry(telemetry) as otel,
        connect(
            url, pool_size=pool_size or concurrency, fallback=fallback, telemetry=otel
        ) as limiter,
    ):

        def work(i: int, go: Callable[[], bool]) -> int:
            next_key, n = _key_stream(keys, i), 0
            limiter.rate_limit(next_key(), LIMIT, WINDOW)  # connect outside the clock
            if call != "rate_limit":  # hit or acquire of one Rate, side by side
                decide, rate = (
                    getattr(limiter, call),
                    Rate(limit=LIMIT, window=WINDOW, algorithm=algorithm),
                )
                while go():
                    decide(next_key(), rate)
                    n += 1
                return n
            if algorithm == FIXED_WINDOW:  # the call as the README shows it
                while go():
                    limiter.rate_limit(next_key(), LIMIT, WINDOW)
                    n += 1
                return n
            while go():
                limiter.rate_limit(next_key(), LIMIT, WINDOW, algorithm=algorithm)
                n += 1
            return n

        return _threads(concurrency, duration, work)


def _memory_quota(
    url: str, keys: int, duration: float, algorithm: str, call: str = "rate_limit"
) -> float:
    """Decisions per second on one thread, the harness kept out of the way.

    With no I/O a decision costs a few microseconds, as much as drawing a
    random key and reading the clock: the keys are drawn up front and the
    clock is read once per thousand calls.
    """
    draw = _key_stream(keys, 0)
    sequence = [draw() for _ in range(65_536)]
    with connect(url) as limiter:
        rate_limit, n = limiter.rate_limit, 0
        start = time.perf_counter()
        deadline = start + duration
        decide, rate = getattr(limiter, call), Rate(limit=LIMIT, window=WINDOW, algorithm=algorithm)
        while time.perf_counter() < deadline:
            batch = sequence[n % 65_536 : n % 65_536 + 1000]
            if call != "rate_limit":
                for key in batch:
                    decide(key, rate)
            elif algorithm == FIXED_WINDOW:  # the call as the README shows it
                for key in batch:
                    rate_limit(key, LIMIT, WINDOW)
            else:
                for key in batch:
                    rate_limit(key, LIMIT, WINDOW, algorithm=algorithm)
            n += len(batch)
        return n / (time.perf_counter() - start)


def _sync_bare(parsed: StoreURL, concurrency: int, keys: int, duration: float) -> float:
    if parsed.kind.speaks_redis:
        return _sync_bare_redis(parsed, concurrency, keys, duration)
    if parsed.dialect == "sqlite":

        def work(i: int, go: Callable[[], bool]) -> int:
            conn = sqlite3.connect(parsed.target, isolation_level=None, check_same_thread=False)
            set_up(conn, 10.0)
            next_key, n, sql = _key_stream(keys, i), 0, _sql.HIT
            while go():
                conn.execute(sql, _bare_params(next_key())).fetchall()
                n += 1
            conn.close()
            return n

        return _threads(concurrency, duration, work)
    import psycopg

    # Prepared once per connection, as quota does, unless the URL says a transaction
    # pooler is in front (?prepared_statements=false): then unnamed statements.
    threshold = 0 if parsed.prepared_statements else None

    def pg_work(i: int, go: Callable[[], bool]) -> int:
        with psycopg.connect(parsed.target, autocommit=True, prepare_threshold=threshold) as conn:
            next_key, n, sql = _key_stream(keys, i), 0, _sql.render(_sql.HIT, "format")
            while go():
                conn.execute(sql, _bare_params(next_key())).fetchall()
                n += 1
            return n

    return _threads(concurrency, duration, pg_work)


# -- the async face -----------------------------------------------------------


async def _async_quota(
    url: str, concurrency: int, keys: int, duration: float, algorithm: str = FIXED_WINDOW,
    fallback: bool = False, pool_size: int | None = None, call: str = "rate_limit",
    telemetry: bool = False,
) -> float:  # fmt: skip
    pool_size = pool_size or concurrency
    with _telemetry(telemetry) as otel:
        return await _async_quota_with(
            url, concurrency, keys, duration, algorithm, fallback, pool_size, call, otel
        )


async def _async_quota_with(
    url: str, concurrency: int, keys: int, duration: float, algorithm: str, fallback: bool,
    pool_size: int, call: str, telemetry: Telemetry | None,
) -> float:  # fmt: skip
    async with connect_async(
        url, pool_size=pool_size, fallback=fallback, telemetry=telemetry
    ) as limiter:
        # Open the pool up front: connecting is not what is measured.
        await asyncio.gather(
            *(limiter.rate_limit(f"{KEY_PREFIX}:warm", LIMIT, WINDOW) for _ in range(pool_size))
        )

        async def work(i: int, go: Callable[[], bool]) -> int:
            next_key, n = _key_stream(keys, i), 0
            if call != "rate_limit":  # hit or acquire of one Rate, side by side
                decide, rate = (
                    getattr(limiter, call),
                    Rate(limit=LIMIT, window=WINDOW, algorithm=algorithm),
                )
                while go():
                    await decide(next_key(), rate)
                    n += 1
                return n
            if algorithm == FIXED_WINDOW:  # the call as the README shows it
                while go():
                    await limiter.rate_limit(next_key(), LIMIT, WINDOW)
                    n += 1
                return n
            while go():
                await limiter.rate_limit(next_key(), LIMIT, WINDOW, algorithm=algorithm)
                n += 1
            return n

        return await _tasks(concurrency, duration, work)


async def _async_bare(parsed: StoreURL, concurrency: int, keys: int, duration: float) -> float:
    if parsed.kind.speaks_redis:
        return await _async_bare_redis(parsed, concurrency, keys, duration)
    if parsed.dialect == "sqlite":
        import aiosqlite

        async with aiosqlite.connect(parsed.target, isolation_level=None) as conn:
            await aset_up(conn, 10.0)

            async def work(i: int, go: Callable[[], bool]) -> int:
                next_key, n = _key_stream(keys, i), 0
                while go():
                    await conn.execute_fetchall(_sql.HIT, _bare_params(next_key()))
                    n += 1
                return n

            return await _tasks(concurrency, duration, work)
    cache = 100 if parsed.prepared_statements else 0
    async with _pg_connections(
        parsed.target, concurrency, statement_cache_size=cache
    ) as connections:
        sql = _sql.render(_sql.HIT, "numeric_dollar")
        if parsed.prepared_statements:
            statements = [await c.prepare(sql) for c in connections]

            async def pg_work(i: int, go: Callable[[], bool]) -> int:
                stmt, next_key, n = statements[i], _key_stream(keys, i), 0
                while go():
                    await stmt.fetch(*_bare_params(next_key()))
                    n += 1
                return n

        else:  # behind a transaction pooler: unnamed statements, as quota sends them there

            async def pg_work(i: int, go: Callable[[], bool]) -> int:
                conn, next_key, n = connections[i], _key_stream(keys, i), 0
                while go():
                    await conn.fetch(sql, *_bare_params(next_key()))
                    n += 1
                return n

        return await _tasks(concurrency, duration, pg_work)


def run_bench(
    url: str, *, concurrency: int = 8, keys: int = 1000, duration: float = 3.0, runs: int = 3,
    face: str = "auto", scenario: str = "rate", algorithm: str = FIXED_WINDOW,
    fallback: bool = False, pool_size: int | None = None, acquire: bool = False,
    telemetry: bool = False, progress: Callable[[str], None] | None = None,
) -> BenchReport:  # fmt: skip
    """Measure `runs` alternating pairs of (bare driver, quota) runs on `url`; see the module doc.

    `scenario` is ``rate`` (rate_limit, the default), ``quota`` (consume_quota
    with idempotency keys) or ``check`` (two rate windows and a quota); see
    `quota._tools.bench_quotas`. `algorithm` is what the rate scenario's quota side
    runs. On ``memory://`` only quota's side runs, on one thread. With
    `fallback`, the baseline is quota without a fallback and the other side
    quota with ``fallback=True``: what the resilience layer costs a healthy store.
    With `acquire`, the baseline is quota's ``hit`` of the rate and the other side
    ``acquire`` of it, every slot free: what waiting costs a call that need not wait.
    With `telemetry`, the baseline is quota without telemetry and the other side quota
    with it (SDK providers, nothing exported): what OpenTelemetry costs.
    `pool_size` bounds quota's connections (default: one per caller; the bare
    side always has one per caller): fewer shows what sharing them costs.
    `progress`, when given, receives one line as the measuring starts and one
    per side of each run, as it ends.
    """
    from quota._tools import bench_quotas as _bench_quotas

    if scenario not in _bench_quotas.SCENARIOS:
        raise ConfigurationError(
            f"scenario must be one of {', '.join(_bench_quotas.SCENARIOS)}, got {scenario!r}"
        )
    if pool_size is not None and (type(pool_size) is not int or pool_size < 1):
        raise ConfigurationError(f"pool_size must be a positive integer, got {pool_size!r}")
    for name, value in (("concurrency", concurrency), ("keys", keys), ("runs", runs)):
        if type(value) is not int or value < 1:
            raise ConfigurationError(f"{name} must be a positive integer, got {value!r}")
    if not 0 < duration <= 600:
        raise ConfigurationError(f"duration must be in (0, 600] seconds, got {duration!r}")
    check_algorithm(algorithm)
    if algorithm != FIXED_WINDOW and scenario != "rate":
        raise ConfigurationError(
            f"algorithm applies to the rate scenario only, got scenario {scenario!r}"
        )
    parsed = parse_url(url)
    if parsed.kind.in_process:
        concurrency = 1  # no driver, no I/O: one thread is the measure
    if face == "auto":
        face = parsed.kind.preferred_face
    driver = parsed.driver_for(asynchronous=face == "async")
    plain = url.split("://", 1)
    # Without a +driver suffix; the schemeless stores' schemes have none (and say TLS, cluster).
    base_url = url if not parsed.kind.sql else f"{parsed.dialect}://{plain[1]}"
    if parsed.kind.sql:
        migrate(url)
    if fallback and (scenario != "rate" or not parsed.kind.sql):
        raise ConfigurationError("fallback compares the rate scenario on SQLite or PostgreSQL")
    if acquire and (scenario != "rate" or fallback):
        raise ConfigurationError("acquire compares hit and acquire in the rate scenario only")
    if telemetry and (scenario != "rate" or fallback or acquire or not parsed.kind.sql):
        raise ConfigurationError(
            "telemetry compares the rate scenario on SQLite or PostgreSQL, alone"
            " (without fallback or acquire)"
        )
    report = BenchReport(
        url, face, driver, concurrency, keys, duration, scenario=scenario, algorithm=algorithm,
        fallback=fallback, acquire=acquire, telemetry=telemetry,
    )  # fmt: skip
    say = progress or (lambda _line: None)
    say(
        f"bench: {scenario} scenario on {driver} ({face} face), {concurrency} callers,"
        f" {keys} keys, {runs} run(s) of {duration:g}s per side"
    )
    labels = (
        {"bare": "quota without fallback", "quota": "quota with fallback"}
        if fallback
        else {"bare": "quota without telemetry", "quota": "quota with telemetry"}
        if telemetry
        else {"bare": "quota hit", "quota": "quota acquire"}
        if acquire
        else {"bare": f"bare {driver}", "quota": "quota"}
    )
    try:
        _measure(report, parsed, base_url, runs, labels, pool_size, say)
    finally:
        # Whatever happened: the keys it counted, none other (as `quota demo`).
        if not parsed.kind.in_process:
            removed = _remove_keys(base_url, parsed, keys, quotas=scenario != "rate")
            say(f"bench: removed its {keys + 1} keys' rows ({removed} row(s))")
    return report


def _bench_keys(keys: int) -> list[str]:
    """Every key the benchmark counts under: its callers' and the warm-up's."""
    return [f"{KEY_PREFIX}:{i}" for i in range(keys)] + [f"{KEY_PREFIX}:warm"]


def _remove_keys(url: str, parsed: StoreURL, keys: int, *, quotas: bool = False) -> int:
    """Delete the windows and states of the benchmark's keys, and with `quotas` the usage
    and ledger rows of its quota (``bench``) for them; the rows deleted."""
    with connect(url) as limiter:
        if not parsed.kind.sql:
            return sum(limiter.reset(key) for key in _bench_keys(keys))
        return limiter.run(_reset_all(_bench_keys(keys), quotas), transaction=True)


#: The benchmark's own quota rows (its quota is named `bench_quotas.NAME`). Params: subject.
_DELETE_USAGE = Statement(
    "bench_delete_usage",
    "DELETE FROM quota_usage WHERE subject = ? AND name = 'bench' RETURNING 1",
)
_DELETE_LEDGER = Statement(
    "bench_delete_ledger",
    "DELETE FROM quota_ledger WHERE subject = ? AND name = 'bench' RETURNING 1",
)


def _reset_all(keys: list[str], quotas: bool) -> Generator[Step, Rows, int]:
    deleted = 0
    for key in keys:
        deleted += yield from _ops.reset(stored_key(key), None)
        if quotas:
            for statement in (_DELETE_USAGE, _DELETE_LEDGER):
                deleted += len((yield statement, (key,)))
    return deleted


def _measure(
    report: BenchReport, parsed: StoreURL, base_url: str, runs: int, labels: dict[str, str],
    pool_size: int | None, say: Callable[[str], None],
) -> None:  # fmt: skip
    from quota._tools import bench_quotas as _bench_quotas

    face, scenario, algorithm = report.face, report.scenario, report.algorithm
    concurrency, keys, duration, fallback, acquire = (
        report.concurrency, report.keys, report.duration, report.fallback, report.acquire,
    )  # fmt: skip
    telemetry = report.telemetry
    for run in range(runs):
        order: tuple[str, ...] = ("bare", "quota") if run % 2 == 0 else ("quota", "bare")
        if parsed.kind.in_process and not acquire:
            order = ("quota",)
        for side in order:
            call = ("hit" if side == "bare" else "acquire") if acquire else "rate_limit"
            if parsed.kind.in_process and scenario == "rate":
                rate = _memory_quota(base_url, keys, duration, algorithm, call)
            elif scenario != "rate":
                rate = _bench_quotas.measure(
                    scenario, side, face, parsed, base_url, concurrency, keys, duration
                )
            elif fallback or acquire or telemetry or side == "quota":
                # With `fallback`, `acquire` or `telemetry`, both sides are quota.
                on = fallback and side == "quota"
                traced = telemetry and side == "quota"
                rate = (
                    _sync_quota(
                        base_url, concurrency, keys, duration, algorithm, fallback=on,
                        pool_size=pool_size, call=call, telemetry=traced,
                    )
                    if face == "sync"
                    else asyncio.run(
                        _async_quota(
                            base_url, concurrency, keys, duration, algorithm, fallback=on,
                            pool_size=pool_size, call=call, telemetry=traced,
                        )
                    )
                )  # fmt: skip
            elif face == "sync":
                rate = _sync_bare(parsed, concurrency, keys, duration)
            else:
                rate = asyncio.run(_async_bare(parsed, concurrency, keys, duration))
            (report.bare if side == "bare" else report.quota).append(rate)
            say(f"bench: run {run + 1}/{runs}: {labels[side]} {rate:,.0f}/s")
