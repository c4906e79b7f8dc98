"""Client CPU per request of quota's outbound transport: httpx bare and over `RateLimitedTransport`.

    python benchmarks/bench_outbound.py                               # a temporary SQLite file
    python benchmarks/bench_outbound.py --url memory:// --async --requests --aiohttp
    python benchmarks/bench_outbound.py --url postgresql://user@127.0.0.1/db --runs 7 --json out.json

One invocation sends ``--count`` GETs, one after the other, to a local HTTP/1.1
server (a ``ThreadingHTTPServer`` answering 200 on keep-alive connections, run
in a process of its own on a free port of 127.0.0.1, so its CPU is not counted)
from this process, in these setups:

- a bare ``httpx.Client`` (the baseline);
- ``httpx.Client(transport=RateLimitedTransport(limiter, "1000000/second"))``,
  a limit never reached, on the store at ``--url`` (default: a temporary
  SQLite file, migrated; ``postgresql://…`` is migrated too; ``memory://`` and
  ``redis://…`` need no migration);
- with ``--async``, a bare ``httpx.AsyncClient`` (the async baseline) and
  ``httpx.AsyncClient(transport=AsyncRateLimitedTransport(...))``;
- with ``--requests``, a bare ``requests.Session`` (its baseline) and one with
  ``RateLimitedAdapter`` mounted;
- with ``--aiohttp``, a bare ``aiohttp.ClientSession`` (its baseline) and one
  with ``rate_limit_middleware``.

A transport that quota does not provide (yet) is skipped, with the reason.
Each of ``--runs`` runs measures every setup in turn, in alternating order
(forwards, then backwards), after ``--warmup`` GETs that are not measured
(they open the connections). The figure is this process's CPU time per
request (user + system, ``time.process_time()``): the client's share, with
the embedded SQLite store's work in it, but not the server's, nor
PostgreSQL's or Redis's. The table gives, per setup, the median CPU per
request, the median of the per-run differences and ratios to that run's
baseline of the same client, and the median wall time per request; the
per-run figures follow. ``--json FILE`` writes all of it. Only ever targets
127.0.0.1; the server it starts is stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"
#: A limit no run comes near: every request is allowed, after a round trip to the store.
RATE = "1000000/second"
BODY = b'{"ok":true}'


# -- the server: this file run with --serve, in a process of its own -----------------------


def serve() -> None:
    """Answer every GET 200 with `BODY` on keep-alive connections; print the port, then serve."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True  # the head and the body go out at once: no 40 ms stalls

        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(BODY)))
            self.end_headers()
            self.wfile.write(BODY)

        def log_message(self, format: str, *args: object) -> None:
            pass

    class Server(ThreadingHTTPServer):
        daemon_threads = True

    with Server((HOST, 0), Handler) as server:
        print(server.server_address[1], flush=True)
        server.serve_forever()


@contextmanager
def running_server() -> Iterator[str]:
    """The server of `serve` in a child process; yields its base URL, stops it after."""
    proc = subprocess.Popen(
        [sys.executable, __file__, "--serve"], stdout=subprocess.PIPE, text=True, cwd=ROOT
    )
    try:
        assert proc.stdout is not None
        port = proc.stdout.readline().strip()
        if not port.isdigit():
            raise RuntimeError(f"the benchmark server did not start (it printed {port!r})")
        yield f"http://{HOST}:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


# -- the setups -----------------------------------------------------------------------------

#: A sync setup: a context manager yielding ``get(url)``; an async one yields an async ``get``.
SyncGet = Callable[[str], Any]
AsyncGet = Callable[[str], Awaitable[Any]]


@dataclass
class Setup:
    """One row of the table: a client, bare or over quota, and the baseline it is set against."""

    name: str
    label: str
    baseline: str
    open: Callable[[str], Any]
    is_async: bool = False
    #: Modules the setup imports: without one of them, it is skipped.
    needs: tuple[str, ...] = ()
    skipped: str | None = None
    runs: list[Measurement] = field(default_factory=list)


@dataclass
class Measurement:
    cpu_us: float
    wall_us: float
    over_us: float = float("nan")
    ratio: float = float("nan")


def _setups(
    store: str, explicit: bool, with_async: bool, with_requests: bool, with_aiohttp: bool
) -> list[Setup]:
    import httpx

    import quota

    @contextmanager
    def bare_httpx(_store: str) -> Iterator[SyncGet]:
        with httpx.Client() as client:
            yield client.get

    @contextmanager
    def quota_httpx(store: str) -> Iterator[SyncGet]:
        from quota.contrib.httpx import RateLimitedTransport

        with quota.connect(store, **_settings(store)) as limiter:
            transport = RateLimitedTransport(limiter, RATE)
            with httpx.Client(transport=transport) as client:
                yield client.get

    @asynccontextmanager
    async def bare_httpx_async(_store: str) -> AsyncIterator[AsyncGet]:
        async with httpx.AsyncClient() as client:
            yield client.get

    @asynccontextmanager
    async def quota_httpx_async(store: str) -> AsyncIterator[AsyncGet]:
        from quota.contrib.httpx import AsyncRateLimitedTransport

        async with quota.connect_async(store, **_settings(store)) as limiter:
            transport = AsyncRateLimitedTransport(limiter, RATE)
            async with httpx.AsyncClient(transport=transport) as client:
                yield client.get

    @asynccontextmanager
    async def bare_aiohttp(_store: str) -> AsyncIterator[AsyncGet]:
        import aiohttp

        async with aiohttp.ClientSession() as session:
            yield _aiohttp_get(session)

    @asynccontextmanager
    async def quota_aiohttp(store: str) -> AsyncIterator[AsyncGet]:
        import aiohttp

        from quota.contrib.aiohttp import rate_limit_middleware

        async with quota.connect_async(store, **_settings(store)) as limiter:
            middleware = rate_limit_middleware(limiter, RATE)
            async with aiohttp.ClientSession(middlewares=[middleware]) as session:
                yield _aiohttp_get(session)

    @contextmanager
    def bare_requests(_store: str) -> Iterator[SyncGet]:
        import requests

        with requests.Session() as session:
            yield session.get

    @contextmanager
    def quota_requests(store: str) -> Iterator[SyncGet]:
        import requests

        from quota.contrib.requests import RateLimitedAdapter

        with quota.connect(store, **_settings(store)) as limiter, requests.Session() as session:
            session.mount("http://", RateLimitedAdapter(limiter, RATE))
            yield session.get

    where = f"{_scheme(store)}://" if explicit else "SQLite (a temporary file)"
    httpx_quota = ("quota.contrib.httpx",)
    requests_quota = ("requests", "quota.contrib.requests")
    setups = [
        Setup("httpx", "httpx.Client (baseline)", "httpx", bare_httpx),
        Setup("httpx-quota", f"RateLimitedTransport, {where}", "httpx", quota_httpx,
              needs=httpx_quota),
    ]  # fmt: skip
    if with_async:
        setups += [
            Setup("async", "httpx.AsyncClient (baseline)", "async", bare_httpx_async,
                  is_async=True),
            Setup("async-quota", f"AsyncRateLimitedTransport, {where}", "async",
                  quota_httpx_async, is_async=True, needs=httpx_quota),
        ]  # fmt: skip
    if with_requests:
        setups += [
            Setup("requests", "requests.Session (baseline)", "requests", bare_requests,
                  needs=("requests",)),
            Setup("requests-quota", f"RateLimitedAdapter, {where}", "requests", quota_requests,
                  needs=requests_quota),
        ]  # fmt: skip
    if with_aiohttp:
        setups += [
            Setup("aiohttp", "aiohttp.ClientSession (baseline)", "aiohttp", bare_aiohttp,
                  is_async=True, needs=("aiohttp",)),
            Setup("aiohttp-quota", f"rate_limit_middleware, {where}", "aiohttp", quota_aiohttp,
                  is_async=True, needs=("aiohttp", "quota.contrib.aiohttp")),
        ]  # fmt: skip
    for setup in setups:
        setup.skipped = next(filter(None, map(_missing, setup.needs)), None)
    return setups


def _aiohttp_get(session: Any) -> AsyncGet:
    """``get(url)`` on an aiohttp session: the body read, the response released."""

    async def get(url: str) -> Any:
        async with session.get(url) as response:
            await response.read()
            return response

    return get


def _missing(module: str) -> str | None:
    import importlib

    try:
        importlib.import_module(module)
    except ImportError as exc:
        return f"{module} cannot be imported ({exc})"
    return None


def _settings(store: str) -> dict[str, Any]:
    """One connection: the requests go one after the other."""
    return {"pool_size": 1} if _scheme(store) in ("postgres", "postgresql") else {}


def _scheme(url: str) -> str:
    return urllib.parse.urlsplit(url).scheme.split("+")[0]


# -- measuring ------------------------------------------------------------------------------


def measure(setup: Setup, store: str, server: str, count: int, warmup: int) -> Measurement:
    """CPU and wall microseconds per GET of `setup`, after `warmup` GETs not counted."""
    if setup.is_async:
        return asyncio.run(_measure_async(setup, store, server, count, warmup))
    url = server + "/"
    with setup.open(store) as get:
        for _ in range(warmup):
            _ok(get(url))
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(count):
            _ok(get(url))
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    return Measurement(cpu / count * 1e6, wall / count * 1e6)


async def _measure_async(
    setup: Setup, store: str, server: str, count: int, warmup: int
) -> Measurement:
    url = server + "/"
    async with setup.open(store) as get:
        for _ in range(warmup):
            _ok(await get(url))
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(count):
            _ok(await get(url))
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    return Measurement(cpu / count * 1e6, wall / count * 1e6)


def _ok(response: Any) -> None:
    status = getattr(response, "status_code", None) or response.status  # aiohttp: .status
    if status != 200:
        raise RuntimeError(f"the server answered {status}")


# -- the command ----------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--url", help="the store: sqlite:///…, postgresql://…, memory://, redis://… "
        "(default: a temporary SQLite file)",
    )  # fmt: skip
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--count", type=int, default=2000, help="measured GETs per setup and run")
    parser.add_argument("--warmup", type=int, default=200, help="GETs before each measurement")
    parser.add_argument(
        "--async", dest="with_async", action="store_true",
        help="add httpx.AsyncClient, bare and over AsyncRateLimitedTransport",
    )  # fmt: skip
    parser.add_argument(
        "--requests", dest="with_requests", action="store_true",
        help="add requests.Session, bare and with RateLimitedAdapter",
    )  # fmt: skip
    parser.add_argument(
        "--aiohttp", dest="with_aiohttp", action="store_true",
        help="add aiohttp.ClientSession, bare and with rate_limit_middleware",
    )  # fmt: skip
    parser.add_argument("--json", metavar="FILE", help="also write the results to FILE as JSON")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        serve()
        return {}
    if not 1 <= args.runs <= 50 or not 1 <= args.count <= 1_000_000 or args.warmup < 0:
        parser.error("runs must be 1..50, count 1..1000000, warmup at least 0")

    sys.path.insert(0, str(ROOT))
    import quota

    tmp = tempfile.mkdtemp(prefix="quota-bench-outbound-")
    store = args.url or f"sqlite:///{tmp}/bench.sqlite3"
    scheme = _scheme(store)
    if scheme not in ("sqlite", "postgres", "postgresql", "memory", "redis", "rediss"):
        parser.error(f"--url: no store for the scheme {scheme!r}")
    try:
        if scheme in ("sqlite", "postgres", "postgresql"):
            quota.migrate(store)
        setups = _setups(
            store, args.url is not None, args.with_async, args.with_requests, args.with_aiohttp
        )
        for setup in setups:
            if setup.skipped:
                print(f"skipping {setup.label}: {setup.skipped}", file=sys.stderr)
        measured = [setup for setup in setups if not setup.skipped]
        by_name = {setup.name: setup for setup in setups}
        load_before = os.getloadavg()[0]
        with running_server() as server:
            for run in range(args.runs):
                order = measured if run % 2 == 0 else measured[::-1]
                for setup in order:
                    setup.runs.append(measure(setup, store, server, args.count, args.warmup))
                for setup in measured:
                    base = by_name[setup.baseline].runs[-1].cpu_us
                    setup.runs[-1].over_us = setup.runs[-1].cpu_us - base
                    setup.runs[-1].ratio = setup.runs[-1].cpu_us / base
                print(f"run {run + 1}/{args.runs}: "
                      + ", ".join(f"{s.name} {s.runs[-1].cpu_us:.0f} us" for s in measured),
                      file=sys.stderr)  # fmt: skip
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    rows: list[dict[str, object]] = []
    for setup in setups:
        row: dict[str, object] = {"name": setup.name, "label": setup.label}
        if setup.skipped:
            row["skipped"] = setup.skipped
        else:
            runs = setup.runs
            row.update(
                baseline=setup.baseline,
                cpu_us_per_request_median=round(statistics.median(m.cpu_us for m in runs), 1),
                over_baseline_us_median=round(statistics.median(m.over_us for m in runs), 1),
                ratio_median=round(statistics.median(m.ratio for m in runs), 3),
                wall_us_per_request_median=round(statistics.median(m.wall_us for m in runs), 1),
                runs=[{"cpu_us": round(m.cpu_us, 1), "over_us": round(m.over_us, 1),
                       "ratio": round(m.ratio, 3), "wall_us": round(m.wall_us, 1)} for m in runs],
            )  # fmt: skip
        rows.append(row)
    report: dict[str, object] = {
        "command": " ".join(["python", "benchmarks/bench_outbound.py", *_safe_argv(argv)]),
        "store": _safe(store) if args.url else "a temporary SQLite file",
        "runs": args.runs,
        "count": args.count,
        "warmup": args.warmup,
        "cpus": os.cpu_count(),
        # 1-minute load average before and after: how busy the machine was (this included).
        "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "versions": {
            p: _version(p) for p in ("httpx", "httpcore", "requests", "urllib3", "aiohttp")
        },
        "setups": rows,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    print(_table(report, rows))
    return report


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _safe(url: str) -> str:
    """`url` without its password."""
    return re.sub(r"//([^:/@]+):[^@]*@", r"//\1:***@", url)


def _safe_argv(argv: list[str] | None) -> list[str]:
    return [_safe(a) for a in (sys.argv[1:] if argv is None else argv)]


def _table(report: dict[str, object], rows: list[dict[str, object]]) -> str:
    versions = ", ".join(f"{p} {v}" for p, v in report["versions"].items() if v)  # type: ignore[attr-defined]
    lines = [
        f"{report['store']}: {report['runs']} runs of {report['count']} GETs"
        f" (after {report['warmup']}), {report['cpus']} CPUs, load average"
        f" {report['load_average'][0]} -> {report['load_average'][1]}; {versions}",  # type: ignore[index]
        "",
        f"{'setup':<52} {'CPU us/req':>10} {'+us':>7} {'x base':>7} {'wall us/req':>11}",
    ]
    for row in rows:
        if "skipped" in row:
            lines.append(f"{row['label']:<52} skipped: {row['skipped']}")
            continue
        lines.append(
            f"{row['label']:<52} {row['cpu_us_per_request_median']:>10}"
            f" {row['over_baseline_us_median']:>7} {row['ratio_median']:>7.2f}"
            f" {row['wall_us_per_request_median']:>11}"
        )
    lines += ["", "per run (CPU us per request, ratio to that run's baseline):"]
    for row in rows:
        if "skipped" not in row:
            cells = " ".join(f"{r['cpu_us']}({r['ratio']:.2f})" for r in row["runs"])  # type: ignore[attr-defined]
            lines.append(f"  {row['name']:<15} {cells}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
