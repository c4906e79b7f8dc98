"""The batching report: the scenarios of the batching work, side by side with the bare driver.

A script of the repository (not in the wheel), run from a checkout with quota
installed (``pip install -e .``; ``-e '.[plots]'`` for the PNG plots)::

    python benchmarks/report.py DIR [--url URL] [-d 3] [-r 3] [--cleanup-rows N] [--json]

It always measures the embedded SQLite store; ``--url`` (default
``$QUOTA_DATABASE_URL``) adds PostgreSQL's grid and the cleanup scenario when
it names a PostgreSQL database. It prints the table (``--json``: the whole
report) on stdout and a line per step on stderr (on a terminal, or with
``--progress``).

Every figure is measured in the same run as its bare-driver baseline, and
the runs alternate between the sides, so a noisy machine moves both alike.

* **Grid**: decisions/s and p50/p99 latency at 1, 8, 64 and 256 concurrent
  callers (asyncio tasks), for 1,000 distinct keys and for one hot key, per
  store: the bare driver's per-request upsert, quota one by one, quota
  batched. PostgreSQL's bare side is asyncpg with a prepared upsert on up to
  64 connections; SQLite's is plain `sqlite3`, one connection per thread
  (callers beyond 64 share them).
* **Cleanup** (PostgreSQL): 1,000,000 expired rows removed by the batched
  row DELETE of a plain table and by dropping the partitions of a partitioned
  one (both in scratch databases made and dropped here), with the p99 of
  batched decisions (64 callers) during the cleanup against the p99 of the
  same load just before it.

Writes ``report.json`` and, when matplotlib is installed (``pip install -e
'.[plots]'``), ``throughput.png``, ``latency.png`` and ``cleanup.png``.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import click

import quota
from quota._core.url import parse_url
from quota._limiter import connect_async
from quota._sql import partitions as _partitions
from quota._sql import statements as _sql
from quota._sql.migrate import migrate
from quota._stores.sqlite import set_up
from quota._tools.bench import LIMIT, WINDOW, _bare_params, _key_stream

T = TypeVar("T")

CONCURRENCY = (1, 8, 64, 256)
KEYS = (1000, 1)
SIDES = ("bare", "one-by-one", "batched")
#: Most connections any side opens (the server's max_connections is ~100).
MAX_CONNECTIONS = 64
CLEANUP_ROWS = 1_000_000


@dataclass
class Cell:
    """One (store, keys, concurrency, side): medians over the runs."""

    store: str
    keys: int
    concurrency: int
    side: str
    per_s: list[float] = field(default_factory=list)
    p50_ms: list[float] = field(default_factory=list)
    p99_ms: list[float] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        return {
            "store": self.store, "keys": self.keys, "concurrency": self.concurrency,
            "side": self.side, "per_s": round(statistics.median(self.per_s)),
            "p50_ms": round(statistics.median(self.p50_ms), 4),
            "p99_ms": round(statistics.median(self.p99_ms), 4),
            "runs_per_s": [round(x) for x in self.per_s],
        }  # fmt: skip


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


Work = Callable[[int, Callable[[], bool], list[float]], Awaitable[int]]


async def _drive(concurrency: int, duration: float, work: Work) -> tuple[float, list[float]]:
    """Run `work` on `concurrency` tasks for `duration` seconds; calls/s and latencies (s)."""
    deadline = time.perf_counter() + duration
    latencies: list[float] = []

    def go() -> bool:
        return time.perf_counter() < deadline

    start = time.perf_counter()
    counts = await asyncio.gather(*(work(i, go, latencies) for i in range(concurrency)))
    return sum(counts) / (time.perf_counter() - start), latencies


async def _quota_side(
    url: str, concurrency: int, keys: int, duration: float, batching: bool
) -> tuple[float, list[float]]:
    pool = min(concurrency, MAX_CONNECTIONS)
    async with connect_async(url, pool_size=pool, batching=batching) as limiter:
        await asyncio.gather(
            *(limiter.rate_limit("bench:warm", LIMIT, WINDOW) for _ in range(pool))
        )

        async def work(i: int, go: Callable[[], bool], lat: list[float]) -> int:
            next_key, n, clock = _key_stream(keys, i), 0, time.perf_counter
            while go():
                t = clock()
                await limiter.rate_limit(next_key(), LIMIT, WINDOW)
                lat.append(clock() - t)
                n += 1
            return n

        return await _drive(concurrency, duration, work)


async def _bare_postgres(
    dsn: str, concurrency: int, keys: int, duration: float
) -> tuple[float, list[float]]:
    import asyncpg

    n_conn = min(concurrency, MAX_CONNECTIONS)
    connections = [await asyncpg.connect(dsn) for _ in range(n_conn)]
    try:
        text = _sql.render(_sql.HIT, "numeric_dollar")
        idle: asyncio.Queue[Any] = asyncio.Queue()
        for conn in connections:
            idle.put_nowait(await conn.prepare(text))

        async def work(i: int, go: Callable[[], bool], lat: list[float]) -> int:
            next_key, n, clock = _key_stream(keys, i), 0, time.perf_counter
            while go():
                t = clock()
                stmt = await idle.get()
                try:
                    await stmt.fetch(*_bare_params(next_key()))
                finally:
                    idle.put_nowait(stmt)
                lat.append(clock() - t)
                n += 1
            return n

        return await _drive(concurrency, duration, work)
    finally:
        for conn in connections:
            await conn.close()


def _bare_sqlite(
    path: str, concurrency: int, keys: int, duration: float
) -> tuple[float, list[float]]:
    """Plain sqlite3: one thread per caller up to MAX_CONNECTIONS, callers beyond share them."""
    threads_n = min(concurrency, MAX_CONNECTIONS)
    per_thread = [
        concurrency // threads_n + (i < concurrency % threads_n) for i in range(threads_n)
    ]
    counts = [0] * threads_n
    latencies: list[list[float]] = [[] for _ in range(threads_n)]
    barrier = threading.Barrier(threads_n + 1)
    deadline = [0.0]

    def worker(i: int) -> None:
        conn = sqlite3_connect(path)
        streams = [_key_stream(keys, i * 1000 + j) for j in range(per_thread[i])]
        lat, clock, n = latencies[i], time.perf_counter, 0
        barrier.wait()
        while clock() < deadline[0]:
            for next_key in streams:  # the thread's callers take turns
                t = clock()
                conn.execute(_sql.HIT, _bare_params(next_key())).fetchall()
                lat.append(clock() - t)
                n += 1
        counts[i] = n
        conn.close()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(threads_n)]
    for thread in threads:
        thread.start()
    deadline[0] = time.perf_counter() + duration
    start = time.perf_counter()
    barrier.wait()
    for thread in threads:
        thread.join()
    return sum(counts) / (time.perf_counter() - start), [x for lat in latencies for x in lat]


def sqlite3_connect(path: str) -> Any:
    import sqlite3

    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    set_up(conn, 10.0)
    return conn


def _measure(
    store: str, url: str, side: str, concurrency: int, keys: int, duration: float
) -> tuple[float, list[float]]:
    if side == "bare":
        target = parse_url(url).target
        if store == "sqlite":
            return _bare_sqlite(target, concurrency, keys, duration)
        return asyncio.run(_bare_postgres(target, concurrency, keys, duration))
    return asyncio.run(_quota_side(url, concurrency, keys, duration, side == "batched"))


def run_grid(
    stores: dict[str, str], *, duration: float, runs: int, echo: Callable[[str], None]
) -> list[Cell]:
    """Every (store, keys, concurrency): `runs` rounds of the three sides, in rotating order."""
    cells: list[Cell] = []
    for store, url in stores.items():
        for keys in KEYS:
            for concurrency in CONCURRENCY:
                row = {side: Cell(store, keys, concurrency, side) for side in SIDES}
                for run in range(runs):
                    order = SIDES[run % 3 :] + SIDES[: run % 3]
                    for side in order:
                        rate, lat = _measure(store, url, side, concurrency, keys, duration)
                        cell = row[side]
                        cell.per_s.append(rate)
                        cell.p50_ms.append(_percentile(lat, 0.50) * 1000)
                        cell.p99_ms.append(_percentile(lat, 0.99) * 1000)
                cells.extend(row.values())
                echo(
                    f"  {store:<10} keys={keys:<5} callers={concurrency:<4} "
                    + "  ".join(
                        f"{side} {statistics.median(row[side].per_s):>8.0f}/s" for side in SIDES
                    )
                )
    return cells


# -- cleanup: 1,000,000 expired rows ----------------------------------------------------------


@dataclass
class CleanupFigures:
    table: str
    rows: int
    seconds: float
    deleted: int
    p99_before_ms: float
    p99_during_ms: float
    decisions_during: int


def _admin(server_url: str, sql: str) -> None:
    import psycopg

    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(sql)


def _seed(url: str, rows: int, partitioned: bool, now: float) -> None:
    """`rows` expired 60 s windows, all started in one hour that ended two hours before `now`."""
    import psycopg

    hour = int(now) - int(now) % _partitions.PARTITION_SECONDS - 3 * _partitions.PARTITION_SECONDS
    with psycopg.connect(url, autocommit=True) as conn:
        if partitioned:
            conn.execute(_partitions.create_partition_sql(hour, logged=False))
        conn.execute(
            "INSERT INTO quota_counters SELECT '60:' || ws || ':k:seed' || i, 'k:seed' || i,"
            " ws, 60, 1, ws FROM (SELECT i, %s + (i %% 60) * 60 AS ws"
            " FROM generate_series(1, %s) AS i) AS s",
            (hour, rows),
        )
        conn.execute("VACUUM ANALYZE quota_counters")


@dataclass
class UnderLoad:
    """Latencies (s) of 64 batched callers: the 2 s before an action, and during it."""

    seconds: float
    before: list[float]
    during: list[float]

    def p99_ms(self, side: list[float]) -> float:
        return round(_percentile(side, 0.99) * 1000, 3)


async def under_load(url: str, action: Callable[[], Awaitable[T]]) -> tuple[T, UnderLoad]:
    """Run `action` while 64 batched callers decide on `url` over 1,000 keys."""
    async with connect_async(url, pool_size=8, batching=True) as limiter:
        await limiter.rate_limit("bench:warm", LIMIT, WINDOW)
        stop = asyncio.Event()
        marks: list[tuple[float, float]] = []  # (start, latency)

        async def caller(i: int) -> None:
            next_key, clock = _key_stream(1000, i), time.perf_counter
            while not stop.is_set():
                t = clock()
                await limiter.rate_limit(next_key(), LIMIT, WINDOW)
                marks.append((t, clock() - t))

        tasks = [asyncio.ensure_future(caller(i)) for i in range(64)]
        await asyncio.sleep(3.0)
        before_from = time.perf_counter() - 2.0
        start = time.perf_counter()
        result = await action()
        end = time.perf_counter()
        await asyncio.sleep(0.2)
        stop.set()
        await asyncio.gather(*tasks)
    before = [lat for t, lat in marks if before_from <= t < start]
    during = [lat for t, lat in marks if start <= t < end]
    return result, UnderLoad(round(end - start, 3), before, during)


async def _cleanup_under_load(url: str, table: str, rows: int) -> CleanupFigures:
    async with connect_async(url, pool_size=1) as sweeper:
        result, load = await under_load(url, lambda: sweeper.cleanup(grace=0, batch_size=10_000))
    return CleanupFigures(
        table, rows, load.seconds, result.deleted, load.p99_ms(load.before),
        load.p99_ms(load.during), len(load.during),
    )  # fmt: skip


def run_cleanup(server_url: str, *, rows: int, echo: Callable[[str], None]) -> list[CleanupFigures]:
    """Row DELETE on a plain table, then partition drop on a partitioned one, each in a scratch database."""
    figures = []
    for partitioned in (False, True):
        name = f"quota_bench_{uuid.uuid4().hex[:8]}"
        _admin(server_url, f'CREATE DATABASE "{name}"')
        url = urlsplit(server_url)._replace(path="/" + name).geturl()
        try:
            migrate(url, counters_partitioned=partitioned)
            _seed(url, rows, partitioned, time.time())
            table = "partitioned (drop)" if partitioned else "plain (row DELETE)"
            figures.append(asyncio.run(_cleanup_under_load(url, table, rows)))
            echo(f"  cleanup {table}: {figures[-1]}")
        finally:
            _admin(server_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    return figures


# -- the report ---------------------------------------------------------------------------------


def _ratio(a: float, b: float) -> float:
    return round(a / b, 2) if b else 0.0


def table(cells: list[Cell], cleanup: list[CleanupFigures]) -> str:
    """The report as Markdown tables."""
    by = {(c.store, c.keys, c.concurrency, c.side): c.summary() for c in cells}
    lines = [
        "| store | keys | callers | bare/s | one-by-one/s | batched/s | batched / bare"
        " | p50 ms bare / 1-by-1 / batched | p99 ms bare / 1-by-1 / batched |",
        "|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for store, keys, concurrency in dict.fromkeys((c.store, c.keys, c.concurrency) for c in cells):
        bare, one, batched = (by[(store, keys, concurrency, side)] for side in SIDES)
        lines.append(
            f"| {store} | {keys} | {concurrency} | {bare['per_s']} | {one['per_s']}"
            f" | {batched['per_s']} | {_ratio(batched['per_s'], bare['per_s'])}x"
            f" | {bare['p50_ms']} / {one['p50_ms']} / {batched['p50_ms']}"
            f" | {bare['p99_ms']} / {one['p99_ms']} / {batched['p99_ms']} |"
        )
    if cleanup:
        lines += [
            "",
            "| cleanup of expired rows | rows | seconds | p99 ms before | p99 ms during | decisions during |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        lines += [
            f"| {f.table} | {f.deleted} | {f.seconds} | {f.p99_before_ms} | {f.p99_during_ms}"
            f" | {f.decisions_during} |"
            for f in cleanup
        ]
    return "\n".join(lines)


def plot(cells: list[Cell], cleanup: list[CleanupFigures], out: Path) -> list[Path]:
    """PNG plots of the report; [] when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    written = []
    panels = list(dict.fromkeys((c.store, c.keys) for c in cells))
    for metric, name, label in (
        ("per_s", "throughput.png", "decisions/s"),
        ("p99_ms", "latency.png", "p99 latency (ms)"),
    ):
        fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
        for ax, (store, keys) in zip(axes[0], panels, strict=True):
            for side in SIDES:
                points = sorted(
                    (c.concurrency, c.summary()[metric])
                    for c in cells
                    if (c.store, c.keys, c.side) == (store, keys, side)
                )
                ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=side)
            ax.set_xscale("log", base=2)
            ax.set_xticks(CONCURRENCY, [str(c) for c in CONCURRENCY])
            if metric == "p99_ms":
                ax.set_yscale("log")
            ax.set_title(f"{store}, {'one hot key' if keys == 1 else f'{keys} keys'}", fontsize=10)
            ax.set_xlabel("concurrent callers")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / name, dpi=80)
        plt.close(fig)
        written.append(out / name)
    if cleanup:
        fig, (left, right) = plt.subplots(1, 2, figsize=(8, 3.2))
        names = [f.table for f in cleanup]
        left.bar(names, [f.seconds for f in cleanup], color=["tab:red", "tab:green"])
        left.set_yscale("log")
        left.set_ylabel("seconds")
        left.set_title(f"cleanup of {cleanup[0].rows:,} expired rows", fontsize=10)
        width = 0.38
        xs = range(len(cleanup))
        right.bar(
            [x - width / 2 for x in xs], [f.p99_before_ms for f in cleanup], width, label="before"
        )
        right.bar(
            [x + width / 2 for x in xs], [f.p99_during_ms for f in cleanup], width, label="during"
        )
        right.set_xticks(list(xs), names)
        right.set_ylabel("p99 of decisions (ms)")
        right.set_title("64 batched callers, before vs during cleanup", fontsize=10)
        right.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "cleanup.png", dpi=80)
        plt.close(fig)
        written.append(out / "cleanup.png")
    return written


def run_report(
    postgres_url: str | None, out: Path, *, duration: float = 2.0, runs: int = 3,
    cleanup_rows: int = CLEANUP_ROWS, echo: Callable[[str], None] = print,
) -> dict[str, Any]:  # fmt: skip
    """Run every scenario, write ``report.json`` (and the plots) to `out`; return the report."""
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        sqlite_url = f"sqlite:///{Path(tmp) / 'bench.sqlite3'}"
        migrate(sqlite_url)
        stores = {"sqlite": sqlite_url}
        if postgres_url is not None:
            migrate(postgres_url)
            stores = {"postgresql": postgres_url, **stores}
        echo(f"grid: {len(stores)} store(s), {runs} runs of {duration:g}s per side")
        cells = run_grid(stores, duration=duration, runs=runs, echo=echo)
    cleanup = run_cleanup(postgres_url, rows=cleanup_rows, echo=echo) if postgres_url else []
    report = {
        "duration_s": duration,
        "runs": runs,
        "grid": [cell.summary() for cell in cells],
        "cleanup": [asdict(f) for f in cleanup],
        "table": table(cells, cleanup),
    }
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    report["plots"] = [str(p) for p in plot(cells, cleanup, out)]
    return report


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("out", type=click.Path(file_okay=False, path_type=Path))
@click.option(
    "--url", envvar="QUOTA_DATABASE_URL", default=None,
    help="A PostgreSQL database to measure besides the embedded SQLite store"
    " (the cleanup scenario needs it). Env: QUOTA_DATABASE_URL.",
)  # fmt: skip
@click.option(
    "--duration", "-d", type=click.FloatRange(0, 86400, min_open=True), default=3.0,
    show_default=True, help="Seconds per measurement.",
)  # fmt: skip
@click.option(
    "--runs", "-r", type=click.IntRange(min=1), default=3, show_default=True,
    help="Runs; medians are reported.",
)  # fmt: skip
@click.option(
    "--cleanup-rows", type=click.IntRange(min=1), default=CLEANUP_ROWS, show_default=True,
    help="Expired rows the cleanup scenario removes.",
)  # fmt: skip
@click.option(
    "--progress/--no-progress", default=None,
    help="Report progress on stderr as the work goes (default: only when stderr is a terminal).",
)  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def main(
    out: Path,
    url: str | None,
    duration: float,
    runs: int,
    cleanup_rows: int,
    progress: bool | None,
    as_json: bool,
) -> None:
    """Run the batching report and write report.json and PNG plots into OUT.

    1/8/64/256 callers, distinct keys and one hot key, bare driver / one by
    one / batched, on SQLite and on --url if PostgreSQL; the cleanup of
    --cleanup-rows expired rows on PostgreSQL. Prints the table.
    """
    show = progress if progress is not None else sys.stderr.isatty()

    def say(line: str) -> None:
        if show:
            click.echo(line, err=True)

    try:
        pg = url if url is not None and parse_url(url).dialect == "postgresql" else None
        result = run_report(
            pg, out, duration=duration, runs=runs, cleanup_rows=cleanup_rows, echo=say
        )
    except quota.ConfigurationError as exc:
        raise click.UsageError(str(exc)) from exc
    except quota.QuotaError as exc:
        click.echo(f"Error: {exc}", err=True)
        sys.exit(3)
    click.echo(json.dumps(result, indent=2, sort_keys=True) if as_json else result["table"])


if __name__ == "__main__":
    main()
