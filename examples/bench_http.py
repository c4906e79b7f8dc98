"""Requests per second of a trivial ASGI endpoint, bare and behind QuotaMiddleware, under uvicorn.

    python examples/bench_http.py                                   # the embedded SQLite default
    python examples/bench_http.py --url postgresql://user@127.0.0.1/db --batching

Each run starts uvicorn (one worker, on a free port of 127.0.0.1) for the
bare app and for the limited one (`examples/bench_app.py`), in alternating
order, and drives each for ``--duration`` seconds with ``--connections``
keep-alive connections spread over ``--keys`` API keys (so the limiter
updates that many rows, as with real clients). The load generator is wrk
when it is installed, else a small asyncio HTTP/1.1 client in this file.
Prints both rates per run, their medians and the median of the per-run
ratios. Only ever targets 127.0.0.1; every run is bounded in time and every
server it starts is stopped.
"""

from __future__ import annotations

import argparse
import asyncio
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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"
SECRET = "bench-hash-secret-0123456789"

WRK_SCRIPT = """
math.randomseed(%d)
request = function()
  return wrk.format("GET", "/", {["x-api-key"] = "key-" .. math.random(1, %d)})
end
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


#: ``--pin``: the server runs on CPU 0 and the load generator on CPU 1.
PIN: dict[str, list[str]] = {"server": [], "load": []}


def start_server(
    app: str, env: dict[str, str], port: int, timeout: float = 20.0
) -> subprocess.Popen[bytes]:
    """uvicorn serving `app` on `port`; waits (at most `timeout` s) until it answers."""
    proc = subprocess.Popen(
        [*PIN["server"], sys.executable, "-m", "uvicorn", app, "--host", HOST, "--port", str(port),
         "--log-level", "warning", "--no-access-log"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"uvicorn {app} exited: {proc.stderr.read().decode()[-2000:] if proc.stderr else ''}"
            )
        try:
            with socket.create_connection((HOST, port), timeout=0.5) as sock:
                sock.sendall(
                    b"GET / HTTP/1.1\r\nhost: x\r\nx-api-key: warm\r\nconnection: close\r\n\r\n"
                )
                if sock.recv(64).startswith(b"HTTP/1.1 200"):
                    return proc
        except OSError:
            time.sleep(0.1)
    stop_server(proc)
    raise RuntimeError(f"uvicorn {app} did not answer within {timeout}s")


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


def run_wrk(port: int, connections: int, duration: float, keys: int, seed: int) -> float:
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as script:
        script.write(WRK_SCRIPT % (seed, keys))
    try:
        done = subprocess.run(
            [*PIN["load"], "wrk", "-t1", f"-c{connections}", f"-d{duration:g}s", "-s", script.name,
             f"http://{HOST}:{port}/"],
            capture_output=True, text=True, timeout=duration + 30,
        )  # fmt: skip
    finally:
        os.unlink(script.name)
    if "Non-2xx" in done.stdout:
        raise RuntimeError(f"some requests were not answered 200:\n{done.stdout}")
    match = re.search(r"Requests/sec:\s+([\d.]+)", done.stdout)
    if match is None:
        raise RuntimeError(f"wrk failed:\n{done.stdout}\n{done.stderr}")
    return float(match.group(1))


async def _python_load(port: int, connections: int, duration: float, keys: int, seed: int) -> float:
    rng = random.Random(seed)
    deadline = time.perf_counter() + duration
    counts = [0] * connections

    async def connection(i: int) -> None:
        reader, writer = await asyncio.open_connection(HOST, port)
        try:
            while time.perf_counter() < deadline:
                key = rng.randrange(1, keys + 1)
                writer.write(
                    f"GET / HTTP/1.1\r\nhost: bench\r\nx-api-key: key-{key}\r\n\r\n".encode()
                )
                head = await reader.readuntil(b"\r\n\r\n")
                if not head.startswith(b"HTTP/1.1 200"):
                    raise RuntimeError(f"not a 200: {head[:80]!r}")
                length = int(re.search(rb"content-length: (\d+)", head, re.I).group(1))  # type: ignore[union-attr]
                await reader.readexactly(length)
                counts[i] += 1
        finally:
            writer.close()

    start = time.perf_counter()
    await asyncio.wait_for(
        asyncio.gather(*(connection(i) for i in range(connections))), duration + 30
    )
    return sum(counts) / (time.perf_counter() - start)


def run_python(port: int, connections: int, duration: float, keys: int, seed: int) -> float:
    return asyncio.run(_python_load(port, connections, duration, keys, seed))


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="store URL (default: a fresh SQLite file)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per measurement")
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--keys", type=int, default=1000)
    parser.add_argument(
        "--face", choices=["default", "async", "sync"], default="default",
        help="default: the limiter the middleware opens itself (async, group commit)",
    )  # fmt: skip
    parser.add_argument("--batching", action="store_true", help="group commit (async/sync faces)")
    parser.add_argument("--durability", choices=["full", "relaxed"], default="full")
    parser.add_argument("--loadgen", choices=["auto", "wrk", "python"], default="auto")
    parser.add_argument(
        "--pin", action="store_true", help="server on CPU 0, load generator on CPU 1 (taskset)"
    )
    parser.add_argument(
        "--no-database", action="store_true",
        help="measure the middleware with a stand-in limiter that answers without a database",
    )  # fmt: skip
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if not 1 <= args.runs <= 50 or not 0 < args.duration <= 60 or not 1 <= args.connections <= 256:
        parser.error("runs must be 1..50, duration 0..60 s, connections 1..256")
    loadgen = args.loadgen
    if loadgen == "auto":
        loadgen = "wrk" if shutil.which("wrk") else "python"
    drive = run_wrk if loadgen == "wrk" else run_python
    if args.pin:
        if loadgen != "wrk" or not shutil.which("taskset"):
            parser.error("--pin needs wrk and taskset")
        PIN.update(server=["taskset", "-c", "0"], load=["taskset", "-c", "1"])

    sys.path.insert(0, str(ROOT))
    import quota

    tmp = tempfile.mkdtemp(prefix="quota-bench-http-")
    url = args.url or f"sqlite:///{tmp}/bench.sqlite3"
    quota.migrate(url)
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "QUOTA_DATABASE_URL": url,
        "QUOTA_HASH_SECRET": SECRET,
        "BENCH_FACE": args.face,
        "BENCH_BATCHING": "1" if args.batching else "0",
        "BENCH_DURABILITY": args.durability,
    }
    rates: dict[str, list[float]] = {"bare": [], "limited": []}
    cpu: dict[str, list[float]] = {"bare": [], "limited": []}
    for run in range(args.runs):
        order = ("bare", "limited") if run % 2 == 0 else ("limited", "bare")
        for side in order:
            port = free_port()
            app = "no_database" if side == "limited" and args.no_database else side
            server = start_server(f"examples.bench_app:{app}", env, port)
            try:
                before = cpu_seconds(server.pid)
                rate = drive(port, args.connections, args.duration, args.keys, run)
                used = cpu_seconds(server.pid) - before
            finally:
                stop_server(server)
            rates[side].append(rate)
            cpu[side].append(used / (rate * args.duration) * 1e6)
        print(f"run {run + 1}/{args.runs}: bare {rates['bare'][-1]:.0f}/s, limited {rates['limited'][-1]:.0f}/s",
              file=sys.stderr)  # fmt: skip
    ratios = [lim / bare for lim, bare in zip(rates["limited"], rates["bare"], strict=True)]
    report: dict[str, object] = {
        "url": url.split("@")[-1],
        "face": args.face,
        "batching": args.batching,
        "durability": args.durability,
        "loadgen": loadgen,
        "pinned": args.pin,
        "no_database": args.no_database,
        "connections": args.connections,
        "keys": args.keys,
        "duration_s": args.duration,
        "bare_per_s": [round(r) for r in rates["bare"]],
        "limited_per_s": [round(r) for r in rates["limited"]],
        "bare_median_per_s": round(statistics.median(rates["bare"])),
        "limited_median_per_s": round(statistics.median(rates["limited"])),
        "ratio_median": round(statistics.median(ratios), 3),
        "server_cpu_us_per_request": {
            side: round(statistics.median(values), 1) for side, values in cpu.items()
        },
    }
    if args.no_database:
        face_label = "a stand-in limiter, no database"
    elif args.face == "default":
        face_label = "the middleware's own limiter: async, group commit"
    else:
        face_label = f"{args.face} limiter, batching={args.batching}"
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(
            f"{'no database' if args.no_database else report['url']} ({face_label}, {loadgen},"
            f" {args.connections} connections, {args.keys} keys, {args.runs} runs of {args.duration:g}s)\n"
            f"  bare     median {report['bare_median_per_s']:>7}/s   runs {report['bare_per_s']}\n"
            f"  limited  median {report['limited_median_per_s']:>7}/s   runs {report['limited_per_s']}\n"
            f"  ratio limited/bare (median of per-run ratios): {report['ratio_median']}\n"
            f"  server CPU per request (median, µs): bare {report['server_cpu_us_per_request']['bare']},"  # type: ignore[index]
            f" limited {report['server_cpu_us_per_request']['limited']}"  # type: ignore[index]
        )
    return report


if __name__ == "__main__":
    main()
