"""Requests per second of a trivial FastAPI endpoint under uvicorn, bare and behind each limiter.

    pip install -e '.[bench]'
    python benchmarks/bench_http.py                                   # no PostgreSQL row
    python benchmarks/bench_http.py --url postgresql://user@127.0.0.1/db --json bench-http.json

One invocation measures, side by side, the same ``GET /`` endpoint
(`benchmarks/bench_app.py`) served by uvicorn (one worker, on a free port of
127.0.0.1) in these setups:

- no limiter: the baseline;
- slowapi, memory storage, rate-limit headers on (skipped, with the reason,
  when slowapi is not installed);
- quota's ``QuotaMiddleware`` on ``memory://``;
- quota's ``QuotaMiddleware`` on the embedded SQLite default (a temporary file);
- quota's ``QuotaMiddleware`` on PostgreSQL with group commit
  (``batching=True``), when ``--url postgresql://…`` is given;
- with ``--no-database``, also quota's middleware with a stand-in limiter that
  answers without any store: the middleware's own cost.

Every limited app allows every request (a limit of 10^9 an hour) and counts
the same keys: the load generator spreads ``--connections`` keep-alive
connections' requests over ``--keys`` API keys (the ``X-API-Key`` header),
so each limiter updates that many counters, as with real clients. Each of
``--runs`` runs starts every setup's server in turn, in alternating order
(forwards, then backwards), and drives it for ``--duration`` seconds. The
load generator is wrk when it is installed, else a small asyncio HTTP/1.1
client in this file (which needs about as much CPU as the server: on a small
machine it narrows the differences). The table gives, per setup, the median rate, the median
of the per-run ratios to that run's baseline, the median p50 and p99 latency,
and the server's CPU time per request (user + system, from ``/proc``: steadier
than throughput on a shared machine); the per-run figures follow. ``--json
FILE`` writes all of it. Only ever targets 127.0.0.1; every run is bounded in
time and every server it starts is stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import importlib.util
import json
import os
import random
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

ROOT = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"
SECRET = "bench-hash-secret-0123456789"

WRK_SCRIPT = """
math.randomseed(%d)
request = function()
  return wrk.format("GET", "/", {["x-api-key"] = "key-" .. math.random(1, %d)})
end
"""


@dataclass
class Setup:
    """One row of the table: an app of `benchmarks/bench_app.py` and its environment."""

    name: str
    label: str
    app: str
    env: dict[str, str] = field(default_factory=dict)
    skipped: str | None = None
    runs: list[Measurement] = field(default_factory=list)


@dataclass
class Measurement:
    rate: float
    p50_ms: float | None
    p99_ms: float | None
    cpu_us: float
    ratio: float = float("nan")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


#: ``--pin``: the server runs on CPU 0 and the load generator on CPU 1.
PIN: dict[str, list[str]] = {"server": [], "load": []}
#: uvicorn's event loop (``--loop``): asyncio, its default, or uvloop.
LOOP = ["--loop", "asyncio"]


def start_server(
    app: str, env: dict[str, str], port: int, log: IO[bytes], timeout: float = 30.0
) -> subprocess.Popen[bytes]:
    """uvicorn serving `app` on `port`; waits (at most `timeout` s) until it answers."""
    proc = subprocess.Popen(
        [*PIN["server"], sys.executable, "-m", "uvicorn", app, "--host", HOST, "--port", str(port),
         "--workers", "1", "--log-level", "warning", "--no-access-log", *LOOP],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=log,
    )  # fmt: skip
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"uvicorn {app} exited: {_tail(log)}")
        try:
            with socket.create_connection((HOST, port), timeout=0.5) as sock:
                sock.sendall(
                    b"GET / HTTP/1.1\r\nhost: x\r\nx-api-key: warm\r\nconnection: close\r\n\r\n"
                )
                head = sock.recv(64)
                if head.startswith(b"HTTP/1.1 200"):
                    return proc
                if head:
                    stop_server(proc)
                    raise RuntimeError(f"uvicorn {app} answered {head[:40]!r}: {_tail(log)}")
        except OSError:
            time.sleep(0.1)
    stop_server(proc)
    raise RuntimeError(f"uvicorn {app} did not answer within {timeout}s: {_tail(log)}")


def _tail(log: IO[bytes]) -> str:
    log.flush()
    return Path(log.name).read_bytes().decode(errors="replace")[-2000:]


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds the process has used so far (Linux), or NaN."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


_UNIT_MS = {"us": 1e-3, "ms": 1.0, "s": 1e3}


def _wrk_percentile(output: str, percent: int) -> float | None:
    match = re.search(rf"^\s*{percent}%\s+([\d.]+)(us|ms|s)\s*$", output, re.M)
    return float(match.group(1)) * _UNIT_MS[match.group(2)] if match else None


def run_wrk(
    port: int, connections: int, duration: float, keys: int, seed: int
) -> tuple[float, float | None, float | None]:
    """Requests per second, p50 and p99 latency (ms) measured by wrk."""
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as script:
        script.write(WRK_SCRIPT % (seed, keys))
    try:
        done = subprocess.run(
            [*PIN["load"], "wrk", "-t1", f"-c{connections}", f"-d{duration:g}s", "--latency",
             "-s", script.name, f"http://{HOST}:{port}/"],
            capture_output=True, text=True, timeout=duration + 30,
        )  # fmt: skip
    finally:
        os.unlink(script.name)
    if "Non-2xx" in done.stdout:
        raise RuntimeError(f"some requests were not answered 200:\n{done.stdout}")
    match = re.search(r"Requests/sec:\s+([\d.]+)", done.stdout)
    if match is None:
        raise RuntimeError(f"wrk failed:\n{done.stdout}\n{done.stderr}")
    return float(match.group(1)), _wrk_percentile(done.stdout, 50), _wrk_percentile(done.stdout, 99)


async def _python_load(
    port: int, connections: int, duration: float, keys: int, seed: int
) -> tuple[float, float | None, float | None]:
    rng = random.Random(seed)
    deadline = time.perf_counter() + duration
    latencies: list[list[float]] = [[] for _ in range(connections)]

    async def connection(i: int) -> None:
        reader, writer = await asyncio.open_connection(HOST, port)
        mine = latencies[i]
        try:
            while (sent := time.perf_counter()) < deadline:
                key = rng.randrange(1, keys + 1)
                writer.write(
                    f"GET / HTTP/1.1\r\nhost: bench\r\nx-api-key: key-{key}\r\n\r\n".encode()
                )
                head = await reader.readuntil(b"\r\n\r\n")
                if not head.startswith(b"HTTP/1.1 200"):
                    raise RuntimeError(f"not a 200: {head[:80]!r}")
                length = int(re.search(rb"content-length: (\d+)", head, re.I).group(1))  # type: ignore[union-attr]
                await reader.readexactly(length)
                mine.append(time.perf_counter() - sent)
        finally:
            writer.close()

    start = time.perf_counter()
    await asyncio.wait_for(
        asyncio.gather(*(connection(i) for i in range(connections))), duration + 30
    )
    elapsed = time.perf_counter() - start
    every = sorted(x for mine in latencies for x in mine)
    if len(every) < 2:
        return len(every) / elapsed, None, None
    cuts = statistics.quantiles(every, n=100)
    return len(every) / elapsed, cuts[49] * 1e3, cuts[98] * 1e3


def run_python(
    port: int, connections: int, duration: float, keys: int, seed: int
) -> tuple[float, float | None, float | None]:
    """Requests per second, p50 and p99 latency (ms) measured by the asyncio client above."""
    return asyncio.run(_python_load(port, connections, duration, keys, seed))


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _fmt(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--url", help="PostgreSQL URL for the PostgreSQL row (without it the row is skipped)"
    )
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per measurement")
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--keys", type=int, default=1000)
    parser.add_argument("--loadgen", choices=["auto", "wrk", "python"], default="auto")
    parser.add_argument(
        "--pin", action="store_true", help="server on CPU 0, load generator on CPU 1 (taskset)"
    )
    parser.add_argument(
        "--no-database", action="store_true",
        help="add a row: quota's middleware with a stand-in limiter that answers without a store",
    )  # fmt: skip
    parser.add_argument(
        "--loop", choices=["asyncio", "uvloop"], default="asyncio",
        help="uvicorn's event loop (uvloop: pip install uvloop, or uvicorn[standard])",
    )  # fmt: skip
    parser.add_argument("--json", metavar="FILE", help="also write the results to FILE as JSON")
    args = parser.parse_args(argv)
    LOOP[1] = args.loop
    if not 1 <= args.runs <= 50 or not 0 < args.duration <= 60 or not 1 <= args.connections <= 256:
        parser.error("runs must be 1..50, duration 0..60 s, connections 1..256")
    if args.keys < 1:
        parser.error("keys must be at least 1")
    loadgen = args.loadgen
    if loadgen == "auto":
        loadgen = "wrk" if shutil.which("wrk") else "python"
    elif loadgen == "wrk" and not shutil.which("wrk"):
        parser.error("--loadgen wrk: wrk is not installed")
    if loadgen == "wrk" and args.duration != int(args.duration):
        parser.error("wrk takes whole seconds: --duration must be an integer with wrk")
    drive = run_wrk if loadgen == "wrk" else run_python
    if args.pin:
        if loadgen != "wrk" or not shutil.which("taskset"):
            parser.error("--pin needs wrk and taskset")
        PIN.update(server=["taskset", "-c", "0"], load=["taskset", "-c", "1"])

    sys.path.insert(0, str(ROOT))
    import quota

    scheme = urllib.parse.urlsplit(args.url).scheme.split("+")[0] if args.url else None
    if args.url is not None and scheme not in ("postgres", "postgresql"):
        parser.error(
            "--url must be a postgresql:// URL (SQLite and memory:// have rows of their own)"
        )

    tmp = tempfile.mkdtemp(prefix="quota-bench-http-")
    sqlite_url = f"sqlite:///{tmp}/bench.sqlite3"
    setups = [
        Setup("bare", "no limiter (baseline)", "bare"),
        Setup("slowapi", "slowapi, memory://", "with_slowapi"),
        Setup("quota-memory", "quota, memory://", "with_quota", {"BENCH_STORE": "memory://"}),
        Setup("quota-sqlite", "quota, SQLite (embedded default)", "with_quota",
              {"BENCH_STORE": sqlite_url}),
        Setup("quota-postgresql", "quota, PostgreSQL, batching=True", "with_quota",
              {"BENCH_STORE": args.url or ""}),
    ]  # fmt: skip
    if args.no_database:
        setups.append(Setup("quota-no-store", "quota, stand-in limiter, no store",
                            "with_quota_no_database"))  # fmt: skip
    by_name = {setup.name: setup for setup in setups}
    if importlib.util.find_spec("slowapi") is None:
        by_name["slowapi"].skipped = "slowapi is not installed (pip install -e '.[bench]')"
    quota.migrate(sqlite_url)
    if args.url is None:
        by_name["quota-postgresql"].skipped = "no --url postgresql://… given"
    else:
        try:
            quota.migrate(args.url)
        except Exception as exc:  # a server that is down or refuses us: measure the rest
            by_name["quota-postgresql"].skipped = f"cannot migrate {_safe(args.url)}: {exc}"
    for setup in setups:
        if setup.skipped:
            print(f"skipping {setup.label}: {setup.skipped}", file=sys.stderr)
    measured = [setup for setup in setups if not setup.skipped]

    base_env = {**os.environ, "PYTHONPATH": str(ROOT), "QUOTA_HASH_SECRET": SECRET}
    load_before = os.getloadavg()[0]
    try:
        with open(Path(tmp) / "servers.log", "w+b") as log:
            for run in range(args.runs):
                order = measured if run % 2 == 0 else measured[::-1]
                for setup in order:
                    port = free_port()
                    server = start_server(
                        f"benchmarks.bench_app:{setup.app}", {**base_env, **setup.env}, port, log
                    )
                    try:
                        before = cpu_seconds(server.pid)
                        rate, p50, p99 = drive(
                            port, args.connections, args.duration, args.keys, run
                        )
                        used = cpu_seconds(server.pid) - before
                    finally:
                        stop_server(server)
                    setup.runs.append(
                        Measurement(rate, p50, p99, used / (rate * args.duration) * 1e6)
                    )
                bare = by_name["bare"].runs[-1].rate
                for setup in measured:
                    setup.runs[-1].ratio = setup.runs[-1].rate / bare
                print(f"run {run + 1}/{args.runs}: "
                      + ", ".join(f"{s.name} {s.runs[-1].rate:.0f}/s" for s in measured),
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
                median_per_s=round(statistics.median(m.rate for m in runs)),
                ratio_median=round(statistics.median(m.ratio for m in runs), 3),
                p50_ms_median=_round(_median([m.p50_ms for m in runs]), 2),
                p99_ms_median=_round(_median([m.p99_ms for m in runs]), 2),
                server_cpu_us_per_request_median=round(statistics.median(m.cpu_us for m in runs), 1),
                runs=[{"per_s": round(m.rate), "ratio": round(m.ratio, 3),
                       "p50_ms": _round(m.p50_ms, 2), "p99_ms": _round(m.p99_ms, 2),
                       "server_cpu_us_per_request": round(m.cpu_us, 1)} for m in runs],
            )  # fmt: skip
        rows.append(row)
    report: dict[str, object] = {
        "command": " ".join(["python", "benchmarks/bench_http.py", *_safe_argv(argv)]),
        "postgresql": _safe(args.url) if args.url else None,
        "loadgen": loadgen,
        "pinned": args.pin,
        "loop": args.loop,
        "connections": args.connections,
        "keys": args.keys,
        "runs": args.runs,
        "duration_s": args.duration,
        "cpus": os.cpu_count(),
        # 1-minute load average before and after: how busy the machine was (this included).
        "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "versions": {
            p: _version(p) for p in ("uvicorn", "fastapi", "starlette", "slowapi", args.loop)
        },
        "setups": rows,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    print(_table(report, rows))
    return report


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def _safe(url: str) -> str:
    """`url` without its password."""
    return re.sub(r"//([^:/@]+):[^@]*@", r"//\1:***@", url)


def _safe_argv(argv: list[str] | None) -> list[str]:
    return [_safe(a) for a in (sys.argv[1:] if argv is None else argv)]


def _table(report: dict[str, object], rows: list[dict[str, object]]) -> str:
    versions = ", ".join(f"{p} {v}" for p, v in report["versions"].items() if v)  # type: ignore[attr-defined]
    lines = [
        f"{report['loadgen']}, {report['connections']} connections, {report['keys']} keys,"
        f" {report['runs']} runs of {report['duration_s']:g}s, {report['cpus']} CPUs"
        f"{', pinned' if report['pinned'] else ''}, {report.get('loop', 'asyncio')} loop, load average"
        f" {report['load_average'][0]} -> {report['load_average'][1]}; {versions}",  # type: ignore[index]
        "",
        f"{'setup':<36} {'req/s':>7} {'x bare':>7} {'p50 ms':>7} {'p99 ms':>7} {'CPU us/req':>11}",
    ]
    for row in rows:
        if "skipped" in row:
            lines.append(f"{row['label']:<36} skipped: {row['skipped']}")
            continue
        lines.append(
            f"{row['label']:<36} {row['median_per_s']:>7} {row['ratio_median']:>7.2f}"
            f" {_fmt(row['p50_ms_median'], 2):>7} {_fmt(row['p99_ms_median'], 2):>7}"  # type: ignore[arg-type]
            f" {row['server_cpu_us_per_request_median']:>11}"
        )
    lines += ["", "per run (req/s, ratio to that run's baseline):"]
    for row in rows:
        if "skipped" not in row:
            cells = " ".join(f"{r['per_s']}({r['ratio']:.2f})" for r in row["runs"])  # type: ignore[attr-defined]
            lines.append(f"  {row['name']:<17} {cells}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
