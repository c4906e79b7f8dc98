"""End to end: the FastAPI example under uvicorn on PostgreSQL, driven by concurrent real HTTP clients.

Across every client, exactly the allowed number of requests per key gets 200
and the rest 429, each with valid headers. The server is a subprocess on a
free port of 127.0.0.1, waited for at most 30 s and always terminated; the
load is a fixed number of requests with a time bound.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

ROOT = Path(__file__).resolve().parents[2]
HOST = "127.0.0.1"
AUTHED_LIMIT = 9
ANON_LIMIT = 4
KEYS = 5
CLIENTS_PER_KEY = 3
REQUESTS_PER_CLIENT = 8
ANON_CLIENTS = 2


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture
def server(pg_url: str) -> Iterator[str]:
    import psycopg

    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute("TRUNCATE quota_counters, quota_state, quota_policies")
    port = _free_port()
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "QUOTA_DATABASE_URL": pg_url,
        "QUOTA_HASH_SECRET": "e2e-hash-secret-0123456789",
        "EXAMPLE_API_KEYS": ",".join(f"key-{k}" for k in range(KEYS)),
        # A week-long window: the test cannot straddle two windows.
        "QUOTA_POLICY_DIRECTORY_RATES": f"{ANON_LIMIT}/week",
        "QUOTA_POLICY_DIRECTORY_AUTHED_RATES": f"{AUTHED_LIMIT}/week",
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "examples.fastapi_app:app", "--host", HOST,
         "--port", str(port), "--log-level", "warning"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                output = proc.stdout.read().decode() if proc.stdout else ""
                pytest.fail(f"uvicorn exited with {proc.returncode}:\n{output[-3000:]}")
            try:
                if httpx.get(f"http://{HOST}:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("uvicorn did not answer /health within 30 s")
            time.sleep(0.1)
        yield f"http://{HOST}:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)
        if proc.stdout is not None:
            proc.stdout.close()


async def _client(base: str, headers: dict[str, str]) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=20) as client:
        return [await client.get("/api/directory") for _ in range(REQUESTS_PER_CLIENT)]


async def _drive(base: str) -> dict[str, list[httpx.Response]]:
    groups = {f"key-{k}": {"x-api-key": f"key-{k}"} for k in range(KEYS)}
    tasks = {
        name: [_client(base, headers) for _ in range(CLIENTS_PER_KEY)]
        for name, headers in groups.items()
    }
    tasks["anon"] = [_client(base, {}) for _ in range(ANON_CLIENTS)]
    names = [name for name, coros in tasks.items() for _ in coros]
    results = await asyncio.wait_for(
        asyncio.gather(*(c for coros in tasks.values() for c in coros)), timeout=120
    )
    by_key: dict[str, list[httpx.Response]] = {}
    for name, replies in zip(names, results, strict=True):
        by_key.setdefault(name, []).extend(replies)
    return by_key


def test_exactly_the_allowed_number_per_key_pass_across_concurrent_clients(server: str) -> None:
    by_key = asyncio.run(_drive(server))

    for name, replies in by_key.items():
        limit = ANON_LIMIT if name == "anon" else AUTHED_LIMIT
        allowed = [r for r in replies if r.status_code == 200]
        denied = [r for r in replies if r.status_code == 429]
        assert len(allowed) == limit, name
        assert len(denied) == len(replies) - limit, name
        # Every allowed request saw its own place in the window: limit-1 … 0.
        remaining = sorted(int(r.headers["x-ratelimit-remaining"]) for r in allowed)
        assert remaining == list(range(limit)), name
        assert {r.headers["x-ratelimit-limit"] for r in replies} == {str(limit)}
        assert len({r.headers["x-ratelimit-reset"] for r in replies}) == 1, "one window"
        assert all(
            r.headers["ratelimit-policy"] == f'"directory";q={limit};w=604800' for r in replies
        )
        for reply in denied:
            assert int(reply.headers["retry-after"]) >= 1
            assert reply.headers["x-ratelimit-remaining"] == "0"
            assert reply.headers["content-type"] == "application/problem+json"
            assert reply.json()["code"] == "RATE_LIMITED"
