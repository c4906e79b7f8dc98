"""Fixtures of the dashboard tests: a seeded database of each SQL dialect, and clients."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

import quota
from tests.conftest import SQL_DIALECTS, backend_params, store_url

starlette = pytest.importorskip("starlette")
from starlette.testclient import TestClient  # noqa: E402

from quota.dashboard import create_app  # noqa: E402

TOKEN = "dashboard-test-token-0123456789"
HOT_KEY = "user:hot"
HTML_KEY = "<script>window.pwned=1;alert(1)</script>"
SUBJECT = "tenant:acme"
BROWSER = {"accept": "text/html,application/xhtml+xml"}


@dataclass
class Seeded:
    url: str
    limiter: quota.Limiter


def seed(url: str) -> quota.Limiter:
    """The limiter of `url` with a hot key, a key holding HTML and a subject's quota charged."""
    limiter = quota.connect(url, pool_size=2)
    for _ in range(7):
        limiter.hit(HOT_KEY, "1000/hour")
    limiter.hit(HTML_KEY, "1000/hour")
    limiter.consume_quota(SUBJECT, "api-calls", 100, "day", cost=3, idempotency_key="job-1")
    limiter.consume_quota(SUBJECT, "api-calls", 100, "day", cost=2, idempotency_key="job-2")
    return limiter


@pytest.fixture(params=backend_params(*SQL_DIALECTS))
def seeded(request: pytest.FixtureRequest) -> Iterator[Seeded]:
    """A database of each SQL dialect, seeded (see `seed`)."""
    url = store_url(request, request.param)
    limiter = seed(url)
    try:
        yield Seeded(url, limiter)
    finally:
        limiter.close()


@pytest.fixture
def app(seeded: Seeded) -> Iterator[object]:
    built = create_app(seeded.url, token=TOKEN)
    yield built
    built.state.dashboard.admin.close()


@pytest.fixture
def client(app: object) -> Iterator[TestClient]:
    """A client without credentials."""
    with TestClient(app, base_url="http://testserver") as c:  # type: ignore[arg-type]
        yield c


def login(client: TestClient, base: str = "") -> str:
    """Log `client` in through the form; returns the session's CSRF token (read off a page)."""
    page = client.get(f"{base}/login", headers=BROWSER)
    assert page.status_code == 200
    nonce = page.text.split('name="csrf_token" value="', 1)[1].split('"', 1)[0]
    r = client.post(
        f"{base}/login",
        data={"token": TOKEN, "csrf_token": nonce, "next": "/"},
        headers=BROWSER,
        follow_redirects=False,
    )
    assert r.status_code == 303, r.text
    return csrf_of(client.get(f"{base}/policies", headers=BROWSER).text)


def csrf_of(html: str) -> str:
    return html.split('name="csrf_token" value="', 1)[1].split('"', 1)[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def quota_command(*args: str) -> list[str]:
    return [sys.executable, "-c", "from quota._cli import main; main()", *args]


@contextlib.contextmanager
def served(url: str, *args: str, token: str | None = TOKEN) -> Iterator[str]:
    """`quota dashboard` on a private loopback port: its base URL while it runs; stopped after."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "QUOTA_DASHBOARD_TOKEN"}
    if token is not None:
        env["QUOTA_DASHBOARD_TOKEN"] = token
    proc = subprocess.Popen(
        quota_command("dashboard", "--url", url, "--host", "127.0.0.1", "--port", str(port), *args),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                raise AssertionError(
                    f"quota dashboard exited {proc.returncode}: {proc.stdout.read()}"
                )  # type: ignore[union-attr]
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError("quota dashboard did not answer /health within 30 s")
            time.sleep(0.1)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()
