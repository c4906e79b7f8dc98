"""The example Django project under gunicorn, for the end-to-end tests and the benchmark.

`postgres_database` makes a database of its own on the server and drops it
(``WITH (FORCE)``) however the block ends; `manage` runs the project's
``manage.py``; `gunicorn` serves it on a free port of 127.0.0.1 in a process
group of its own, waits (at most 30 s) until ``/health`` answers and kills
the whole group afterwards; `burst` sends a fixed number of GETs from a
bounded pool of threads, each on its own connection, released together.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from tests._support import with_database

ROOT = Path(__file__).resolve().parents[3]
PROJECT = ROOT / "examples" / "django_project"
HOST = "127.0.0.1"
HASH_SECRET = "django-e2e-hash-secret-0123456789"
START_TIMEOUT = 30.0
STOP_TIMEOUT = 10.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


def _admin(server_url: str, sql: str) -> None:
    import psycopg

    with psycopg.connect(server_url, autocommit=True, connect_timeout=10) as conn:
        conn.execute(sql)


@contextlib.contextmanager
def postgres_database(server_url: str, prefix: str = "quota_django_e2e") -> Iterator[str]:
    """A new, empty database on the server of `server_url`; dropped afterwards."""
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    _admin(server_url, f'CREATE DATABASE "{name}"')
    try:
        yield with_database(server_url, name)
    finally:
        _admin(server_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def truncate_counters(url: str) -> None:
    import psycopg

    with psycopg.connect(url, autocommit=True, connect_timeout=10) as conn:
        conn.execute("TRUNCATE quota_counters, quota_state")


def project_env(**extra: str) -> dict[str, str]:
    """The environment the example project runs in: this checkout first on the path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("QUOTA_", "RATE_LIMIT_"))}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    env.update(PYTHONPATH=f"{ROOT}{os.pathsep}{PROJECT}", QUOTA_HASH_SECRET=HASH_SECRET)
    env.update(extra)
    return env


def manage(env: Mapping[str, str], *args: str, timeout: float = 120) -> str:
    """``python manage.py ARGS`` in the project; its output, or `RuntimeError` with it."""
    done = subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=PROJECT, env=dict(env), capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"manage.py {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}")
    return done.stdout


@dataclass
class Server:
    base: str
    port: int
    process: subprocess.Popen[bytes]
    log: Path


@contextlib.contextmanager
def gunicorn(
    env: Mapping[str, str],
    *,
    workers: int = 4,
    worker_class: str = "sync",
    threads: int = 1,
    app: str = "example.wsgi:application",
    cwd: Path = PROJECT,
    extra: tuple[str, ...] = (),
) -> Iterator[Server]:
    """gunicorn serving `app` on a free port; stopped (its whole process group) afterwards."""
    port = free_port()
    log = Path(tempfile.mkstemp(prefix="quota-gunicorn-", suffix=".log")[1])
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "gunicorn", "--bind", f"{HOST}:{port}",
             "--workers", str(workers), "--worker-class", worker_class,
             "--threads", str(threads), "--graceful-timeout", "3", "--log-level", "warning",
             *extra, app],
            cwd=cwd, env=dict(env), stdout=out, stderr=out, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
    server = Server(f"http://{HOST}:{port}", port, process, log)
    try:
        _wait_ready(server)
        yield server
    finally:
        stop(process)
        log.unlink(missing_ok=True)


def _tail(server: Server) -> str:
    return server.log.read_text(errors="replace")[-3000:]


def _wait_ready(server: Server) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        if server.process.poll() is not None:
            raise RuntimeError(
                f"gunicorn exited with {server.process.returncode}:\n{_tail(server)}"
            )
        try:
            status, _, _ = get(server.port, "/health", timeout=2)
        except OSError:
            pass
        else:
            if status == 200:
                return
            raise RuntimeError(f"/health answered {status}:\n{_tail(server)}")
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"gunicorn did not answer within {START_TIMEOUT:g} s:\n{_tail(server)}"
            )
        time.sleep(0.1)


def stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the process group, SIGKILL if it lingers; reaped either way."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(STOP_TIMEOUT)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(STOP_TIMEOUT)
    # Workers that outlived their arbiter still belong to the group.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)


def get(
    port: int, path: str, headers: Mapping[str, str] | None = None, timeout: float = 20
) -> tuple[int, dict[str, str], bytes]:
    """One GET on a connection of its own: status, headers (lower-case names), body."""
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        conn.request("GET", path, headers=dict(headers or {}))
        response = conn.getresponse()
        body = response.read()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, body
    finally:
        conn.close()


def burst(
    port: int, path: str, count: int, *, concurrency: int = 16, timeout: float = 60
) -> list[tuple[int, dict[str, str], bytes]]:
    """`count` GETs of `path` from `concurrency` threads, started together."""
    start = threading.Barrier(min(concurrency, count), timeout=timeout)

    def one(i: int) -> tuple[int, dict[str, str], bytes]:
        if i < concurrency:
            start.wait()
        return get(port, path)

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        futures = [pool.submit(one, i) for i in range(count)]
        return [f.result(timeout=timeout) for f in futures]
