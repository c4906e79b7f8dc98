"""Requests per second of a trivial Django view under gunicorn, bare and behind each limiter.

    pip install -e '.[bench]'
    python benchmarks/bench_django.py                                   # no PostgreSQL rows
    python benchmarks/bench_django.py --url postgresql://user@127.0.0.1/db --json bench-django.json
    python benchmarks/bench_django.py --drf --url postgresql://user@127.0.0.1/db   # DRF throttles

One invocation measures, side by side, the same ``GET /`` view (a plain
``HttpResponse``) served by gunicorn (``--workers`` sync workers, the same
for every setup, on a free port of 127.0.0.1) in these setups:

- no limiter: the baseline;
- django-ratelimit's ``@ratelimit`` with the local-memory cache (one counter
  per worker process: not a shared limit, shown for its cost);
- django-ratelimit with Django's ``RedisCache`` (``--redis``, a database
  number of its own, flushed before and after; skipped, with the reason,
  when Redis does not answer);
- quota's ``@ratelimit`` (``quota.contrib.django``) on SQLite, a temporary file;
- quota's ``QuotaMiddleware`` on the same SQLite file;
- both of quota's on PostgreSQL, in a database of their own on the server
  of ``--url`` (created, migrated with ``manage.py migrate`` and dropped).

Every limited view allows every request (10^9 an hour) and counts the same
keys: wrk spreads ``--connections`` keep-alive connections' requests over
``--keys`` API keys (the ``X-API-Key`` header, ``key="header:x-api-key"``
for the decorators), so each limiter updates that many counters.

``--drf`` measures Django REST framework's throttles instead, on a trivial
``APIView`` (``GET /`` answering ``Response({"ok": True})``, JSON renderer
only, no authentication classes, ``NUM_PROXIES = 1``):

- no throttle: the baseline;
- DRF's ``AnonRateThrottle`` on Django's ``LocMemCache`` (DRF's default
  cache when ``CACHES`` is not set: one history per worker process);
- DRF's ``AnonRateThrottle`` on Django's ``RedisCache`` (``--redis``, shared
  by the workers; its database is flushed before each of its runs, so every
  run starts with empty histories);
- ``quota.contrib.drf.AnonRateThrottle`` on SQLite, a temporary file;
- ``quota.contrib.drf.AnonRateThrottle`` on PostgreSQL (as above).

The ``anon`` rate is 10^9 an hour, so nothing is throttled and each request
pays for one decision; wrk sends each request from one of ``--keys``
client addresses (``X-Forwarded-For``, which ``get_ident`` reads), so each
throttle keeps that many histories or counters. Each of
``--runs`` runs starts every setup's server in turn, in alternating order
(forwards, then backwards), and drives it for ``--duration`` seconds. The
table gives, per setup, the median rate, the median of the per-run ratios
to that run's baseline, the median p50 and p99 latency and the server's CPU
time per request (all its processes, user + system, from ``/proc``); the
per-run figures follow, and the 1-minute load average before and after.
Only ever targets 127.0.0.1; every server it starts is stopped (its whole
process group) and every database it creates is dropped.

This file is also the Django project it serves (settings, URLconf and WSGI
application, chosen by ``BENCH_DJANGO_SETUP``), built only when gunicorn or
``manage.py`` imports it as ``bench_django``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The helpers the HTTP benchmark has already (this directory is on sys.path: a script's own).
from bench_http import WRK_SCRIPT, _median, _safe, free_port
from bench_http import _wrk_percentile as _percentile

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
HOST = "127.0.0.1"
SECRET = "bench-hash-secret-0123456789"
RATE = "1000000000/h"
# --drf: DRF's throttles key anonymous requests by client address (get_ident).
WRK_SCRIPT_DRF = """
math.randomseed(%d)
request = function()
  local n = math.random(1, %d)
  local xff = "10." .. math.floor(n / 65536) .. "." .. math.floor(n / 256) %% 256 .. "." .. n %% 256
  return wrk.format("GET", "/", {["x-forwarded-for"] = xff})
end
"""


# -- the Django project (when imported by gunicorn or manage.py) ------------------------------

SETUP = os.environ.get("BENCH_DJANGO_SETUP")
if SETUP is not None:
    SECRET_KEY = "bench-only"
    DEBUG = False
    ALLOWED_HOSTS = ["*"]
    ROOT_URLCONF = "bench_django"
    USE_TZ = True
    INSTALLED_APPS: list[str] = []
    MIDDLEWARE: list[str] = []
    _database = os.environ.get("BENCH_DATABASE", "")
    if _database.startswith("postgresql://"):
        _parts = urllib.parse.urlsplit(_database)
        DATABASES = {
            "default": {
                "ENGINE": "django.db.backends.postgresql",
                "NAME": _parts.path.lstrip("/"),
                "USER": _parts.username or "",
                "HOST": _parts.hostname or "",
                "PORT": str(_parts.port or ""),
            }
        }
    else:
        DATABASES = {
            "default": {"ENGINE": "django.db.backends.sqlite3", "NAME": _database or ":memory:"}
        }
    if SETUP.startswith("drf"):
        INSTALLED_APPS = ["rest_framework"]
        _throttles = {
            "drf-locmem": "rest_framework.throttling.AnonRateThrottle",
            "drf-redis": "rest_framework.throttling.AnonRateThrottle",
            "drf-quota-sqlite": "quota.contrib.drf.AnonRateThrottle",
            "drf-quota-postgresql": "quota.contrib.drf.AnonRateThrottle",
        }
        REST_FRAMEWORK = {
            # No django.contrib.auth: no authentication, request.user is None (anonymous).
            "DEFAULT_AUTHENTICATION_CLASSES": [],
            "UNAUTHENTICATED_USER": None,
            "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
            "NUM_PROXIES": 1,
            "DEFAULT_THROTTLE_CLASSES": [_throttles[SETUP]] if SETUP in _throttles else [],
            "DEFAULT_THROTTLE_RATES": {"anon": RATE},
        }
        if SETUP.startswith("drf-quota"):
            INSTALLED_APPS.append("quota.contrib.django")
            QUOTA = {"OPTIONS": {"pool_size": 2}}
        elif SETUP == "drf-locmem":
            CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}
        elif SETUP == "drf-redis":
            CACHES = {
                "default": {
                    "BACKEND": "django.core.cache.backends.redis.RedisCache",
                    "LOCATION": os.environ["BENCH_REDIS"],
                }
            }
    elif SETUP.startswith("quota"):
        INSTALLED_APPS = ["quota.contrib.django"]
        QUOTA = {
            "OPTIONS": {"pool_size": 2},
            "HTTP": {"default": {"name": "bench", "rates": RATE}, "hash_secret": SECRET},
        }
        if SETUP.startswith("quota-middleware"):
            MIDDLEWARE = ["quota.contrib.django.middleware.QuotaMiddleware"]
    elif SETUP == "ratelimit-locmem":
        CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}
    elif SETUP == "ratelimit-redis":
        CACHES = {
            "default": {
                "BACKEND": "django.core.cache.backends.redis.RedisCache",
                "LOCATION": os.environ["BENCH_REDIS"],
            }
        }


def _view() -> Any:
    from django.http import HttpResponse

    if SETUP is not None and SETUP.startswith("drf"):
        from rest_framework.response import Response
        from rest_framework.views import APIView

        class Hello(APIView):
            def get(self, request: Any) -> Any:
                return Response({"ok": True})

        return Hello.as_view()

    def view(request: Any) -> Any:
        return HttpResponse(b"ok", content_type="text/plain")

    if SETUP in ("ratelimit-locmem", "ratelimit-redis"):
        from django_ratelimit.decorators import ratelimit as django_ratelimit

        return django_ratelimit(key="header:x-api-key", rate=RATE, block=True)(view)
    if SETUP is not None and SETUP.startswith("quota-decorator"):
        from quota.contrib.django import ratelimit

        return ratelimit(key="header:x-api-key", rate=RATE, block=True)(view)
    return view


def __getattr__(name: str) -> Any:
    # Built on first use: the script itself imports no Django.
    if name == "urlpatterns":
        from django.urls import path

        value: Any = [path("", _view())]
    elif name == "application":
        from django.core.wsgi import get_wsgi_application

        value = get_wsgi_application()
    else:
        raise AttributeError(name)
    globals()[name] = value
    return value


# -- the benchmark -------------------------------------------------------------------------------


@dataclass
class Setup:
    name: str
    label: str
    env: dict[str, str] = field(default_factory=dict)
    skipped: str | None = None
    runs: list[dict[str, float | None]] = field(default_factory=list)


def _project_env(setup: Setup) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("QUOTA_", "RATE_LIMIT_"))}
    env.update(
        PYTHONPATH=f"{ROOT}{os.pathsep}{HERE}",
        DJANGO_SETTINGS_MODULE="bench_django",
        BENCH_DJANGO_SETUP=setup.name,
        **setup.env,
    )
    return env


def migrate(setup: Setup) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "django", "migrate", "--no-input", "-v", "0"],
        cwd=HERE, env=_project_env(setup), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"migrate failed for {setup.name}:\n{done.stdout}\n{done.stderr}")


@contextlib.contextmanager
def serve(setup: Setup, workers: int, log: Path) -> Iterator[tuple[int, subprocess.Popen[bytes]]]:
    """gunicorn serving the setup; waits (30 s at most) for a 200; kills its process group."""
    port = free_port()
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gunicorn", "--bind", f"{HOST}:{port}", "--workers",
             str(workers), "--worker-class", "sync", "--log-level", "warning",
             "bench_django:application"],
            cwd=HERE, env=_project_env(setup), stdout=out, stderr=out,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
    try:
        _wait(proc, port, log)
        yield port, proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def _wait(proc: subprocess.Popen[bytes], port: int, log: Path) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"gunicorn exited: {log.read_text(errors='replace')[-2000:]}")
        try:
            with socket.create_connection((HOST, port), timeout=1) as sock:
                sock.sendall(
                    b"GET / HTTP/1.1\r\nhost: x\r\nx-api-key: warm\r\nconnection: close\r\n\r\n"
                )
                head = sock.recv(64)
            if head.startswith(b"HTTP/1.1 200"):
                return
            if head:
                raise RuntimeError(
                    f"answered {head[:40]!r}: {log.read_text(errors='replace')[-2000:]}"
                )
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(
        f"gunicorn did not answer within 30 s: {log.read_text(errors='replace')[-2000:]}"
    )


def group_cpu_seconds(pgid: int) -> float:
    """User + system CPU seconds of every live process in group `pgid` (Linux)."""
    total = 0.0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # the fields after ")" start at state (3rd): pgrp is 5th
            total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def run_wrk(
    port: int, connections: int, duration: int, keys: int, seed: int, template: str = WRK_SCRIPT
) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as script:
        script.write(template % (seed, keys))
    try:
        done = subprocess.run(
            ["wrk", "-t1", f"-c{connections}", f"-d{duration}s", "--latency", "-s", script.name,
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
    return {
        "rate": float(match.group(1)),
        "p50_ms": _percentile(done.stdout, 50),
        "p99_ms": _percentile(done.stdout, 99),
    }


def _redis_ok(url: str) -> str | None:
    """None when Redis answers at `url` (flushing its database), else why not."""
    try:
        import redis
    except ImportError:
        return "the redis package is not installed"
    try:
        client = redis.Redis.from_url(url, socket_timeout=2)
        client.flushdb()
        client.close()
    except Exception as exc:
        return f"Redis at {url} does not answer: {exc}"
    return None


def _admin(server_url: str, sql: str) -> None:
    import psycopg

    with psycopg.connect(server_url, autocommit=True, connect_timeout=10) as conn:
        conn.execute(sql)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--url", help="PostgreSQL server URL (a database is created on it)")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/14", help="Redis for the cache")
    parser.add_argument("--workers", type=int, default=2, help="gunicorn sync workers, every setup")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--duration", type=int, default=5, help="seconds per measurement")
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--keys", type=int, default=1000)
    parser.add_argument("--json", metavar="FILE", help="also write the results to FILE as JSON")
    parser.add_argument(
        "--drf", action="store_true", help="DRF's throttles on an APIView instead of the limiters"
    )
    args = parser.parse_args(argv)
    if not 1 <= args.runs <= 50 or not 1 <= args.duration <= 60 or not 1 <= args.workers <= 16:
        parser.error("runs must be 1..50, duration 1..60 s, workers 1..16")
    if args.drf and not 1 <= args.keys <= 65536:
        parser.error("--drf takes 1..65536 keys (client addresses)")
    if shutil.which("wrk") is None:
        parser.error("wrk is not installed")
    scheme = urllib.parse.urlsplit(args.url).scheme if args.url else None
    if args.url is not None and scheme not in ("postgres", "postgresql"):
        parser.error("--url must be a postgresql:// URL")

    tmp = Path(tempfile.mkdtemp(prefix="quota-bench-django-"))
    sqlite = str(tmp / "bench.sqlite3")
    pg_database: str | None = None
    redis = {"BENCH_REDIS": args.redis}
    on_sqlite = {"BENCH_DATABASE": sqlite}
    if args.drf:
        setups = [
            Setup("drf-bare", "no throttle (baseline)"),
            Setup("drf-locmem", "DRF AnonRateThrottle, locmem"),
            Setup("drf-redis", "DRF AnonRateThrottle, Redis cache", dict(redis)),
            Setup("drf-quota-sqlite", "quota AnonRateThrottle, SQLite", dict(on_sqlite)),
            Setup("drf-quota-postgresql", "quota AnonRateThrottle, PostgreSQL"),
        ]
    else:
        setups = [
            Setup("bare", "no limiter (baseline)"),
            Setup("ratelimit-locmem", "django-ratelimit, locmem cache"),
            Setup("ratelimit-redis", "django-ratelimit, Redis cache", dict(redis)),
            Setup("quota-decorator-sqlite", "quota @ratelimit, SQLite", dict(on_sqlite)),
            Setup("quota-middleware-sqlite", "quota middleware, SQLite", dict(on_sqlite)),
            Setup("quota-decorator-postgresql", "quota @ratelimit, PostgreSQL"),
            Setup("quota-middleware-postgresql", "quota middleware, PostgreSQL"),
        ]
    baseline = setups[0]
    on_redis = [s for s in setups if "BENCH_REDIS" in s.env]
    sqlite_setups = [s for s in setups if s.name.endswith("-sqlite")]
    pg_setups = [s for s in setups if s.name.endswith("-postgresql")]
    redis_down = _redis_ok(args.redis)
    for setup in on_redis:
        setup.skipped = redis_down
    load_before = os.getloadavg()[0]
    try:
        migrate(sqlite_setups[0])
        if args.url is None:
            for setup in pg_setups:
                setup.skipped = "no --url postgresql://… given"
        else:
            name = f"quota_bench_django_{uuid.uuid4().hex[:12]}"
            _admin(args.url, f'CREATE DATABASE "{name}"')
            pg_database = name
            pg = urllib.parse.urlsplit(args.url)._replace(path="/" + name).geturl()
            for setup in pg_setups:
                setup.env["BENCH_DATABASE"] = pg
            migrate(pg_setups[0])
        for setup in setups:
            if setup.skipped:
                print(f"skipping {setup.label}: {setup.skipped}", file=sys.stderr)
        measured = [s for s in setups if not s.skipped]
        log = tmp / "servers.log"
        for run in range(args.runs):
            for setup in measured if run % 2 == 0 else measured[::-1]:
                if args.drf and setup in on_redis:
                    # DRF's history per key grows with every allowed request: start each run empty.
                    _redis_ok(args.redis)
                with serve(setup, args.workers, log) as (port, proc):
                    before = group_cpu_seconds(proc.pid)
                    result = run_wrk(port, args.connections, args.duration, args.keys, run,
                                     WRK_SCRIPT_DRF if args.drf else WRK_SCRIPT)  # fmt: skip
                    used = group_cpu_seconds(proc.pid) - before
                result["cpu_us"] = used / (result["rate"] * args.duration) * 1e6
                setup.runs.append(result)
            bare = baseline.runs[-1]["rate"]
            for setup in measured:
                setup.runs[-1]["ratio"] = setup.runs[-1]["rate"] / bare  # type: ignore[operator]
            print(f"run {run + 1}/{args.runs}: "
                  + ", ".join(f"{s.name} {s.runs[-1]['rate']:.0f}/s" for s in measured),
                  file=sys.stderr)  # fmt: skip
    finally:
        if pg_database is not None and args.url is not None:
            _admin(args.url, f'DROP DATABASE IF EXISTS "{pg_database}" WITH (FORCE)')
        if on_redis and not redis_down:
            _redis_ok(args.redis)  # flushes the benchmark's database again
        shutil.rmtree(tmp, ignore_errors=True)

    rows: list[dict[str, Any]] = []
    for setup in setups:
        row: dict[str, Any] = {"name": setup.name, "label": setup.label}
        if setup.skipped:
            row["skipped"] = setup.skipped
        else:
            runs = setup.runs
            row.update(
                median_per_s=round(statistics.median(r["rate"] for r in runs)),  # type: ignore[type-var]
                ratio_median=round(statistics.median(r["ratio"] for r in runs), 3),  # type: ignore[type-var]
                p50_ms_median=_median([r["p50_ms"] for r in runs]),
                p99_ms_median=_median([r["p99_ms"] for r in runs]),
                server_cpu_us_per_request_median=round(
                    statistics.median(r["cpu_us"] for r in runs), 1  # type: ignore[type-var]
                ),
                runs=[{k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()}
                      for r in runs],
            )  # fmt: skip
        rows.append(row)
    report: dict[str, Any] = {
        "command": " ".join(["python", "benchmarks/bench_django.py",
                             *[_safe(a) for a in (sys.argv[1:] if argv is None else argv)]]),
        "scenario": "drf" if args.drf else "django",
        "workers": args.workers,
        "connections": args.connections,
        "keys": args.keys,
        "runs": args.runs,
        "duration_s": args.duration,
        "cpus": os.cpu_count(),
        "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "setups": rows,
    }  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    print(_table(report, rows))
    return report


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _table(report: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lines = [
        f"gunicorn {report['workers']} sync workers, wrk {report['connections']} connections,"
        f" {report['keys']} keys, {report['runs']} runs of {report['duration_s']}s,"
        f" {report['cpus']} CPUs, load average {report['load_average'][0]} ->"
        f" {report['load_average'][1]}",
        "",
        f"{'setup':<36} {'req/s':>7} {'x bare':>7} {'p50 ms':>7} {'p99 ms':>7} {'CPU us/req':>11}",
    ]
    for row in rows:
        if "skipped" in row:
            lines.append(f"{row['label']:<36} skipped: {row['skipped']}")
            continue
        lines.append(
            f"{row['label']:<36} {row['median_per_s']:>7} {row['ratio_median']:>7.2f}"
            f" {_fmt(row['p50_ms_median']):>7} {_fmt(row['p99_ms_median']):>7}"
            f" {row['server_cpu_us_per_request_median']:>11}"
        )
    lines += ["", "per run (req/s, ratio to that run's baseline):"]
    for row in rows:
        if "skipped" not in row:
            cells = " ".join(f"{r['rate']:.0f}({r['ratio']:.2f})" for r in row["runs"])
            lines.append(f"  {row['name']:<28} {cells}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
