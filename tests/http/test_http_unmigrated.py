"""A database never migrated is a deployment error: the middlewares refuse it, never pass all.

Run on a new SQLite file and a new PostgreSQL database, both without quota's
tables: the ASGI middleware fails the lifespan startup naming ``quota
migrate``; without a lifespan (a mounted app, a WSGI app) every limited
request is answered 503 (never passed unlimited, whatever the class's
``fail_open`` or shadow mode), with an ERROR line naming the command that is
not repeated on every request. A fallback to memory never decides a missing
schema from memory either.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sqlite3
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest

import quota
from quota import Fallback, SchemaError
from quota.http import HttpConfig, RoutePolicy
from quota.http.asgi import QuotaMiddleware
from quota.http.wsgi import QuotaWSGIMiddleware

pytest.importorskip("starlette")
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Mount, Route
from starlette.testclient import TestClient

SECRET = "unmigrated-test-secret-0123456789"


def config(**more: Any) -> HttpConfig:
    api = RoutePolicy(name="api", paths=["/api"], rates="100/minute", **more)
    return HttpConfig(policies=[api], hash_secret=SECRET)


def ok(_request: Any) -> PlainTextResponse:
    return PlainTextResponse("ok")


def starlette_app(url: str, **more: Any) -> Starlette:
    app = Starlette(routes=[Route("/api/x", ok)])
    app.add_middleware(QuotaMiddleware, url=url, config=config(**more))
    return app


def errors(caplog: Any) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.ERROR and "quota migrate" in r.getMessage()
    ]


def test_asgi_startup_fails_naming_quota_migrate(sql_empty_url: str) -> None:
    with (
        pytest.raises(SchemaError, match="quota migrate"),
        TestClient(starlette_app(sql_empty_url)),
    ):
        pass


def test_asgi_startup_succeeds_once_migrated(sql_empty_url: str) -> None:
    quota.migrate(sql_empty_url)
    with TestClient(starlette_app(sql_empty_url)) as client:
        assert client.get("/api/x").status_code == 200


def test_a_bare_asgi_app_gets_startup_failed_from_the_middleware(sql_empty_url: str) -> None:
    """An app that acknowledges the startup but reports no error: the middleware does."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            else:
                await send({"type": "lifespan.shutdown.complete"})
                return

    middleware = QuotaMiddleware(app, url=sql_empty_url, config=config())
    sent: list[dict[str, Any]] = []

    async def run() -> None:
        inbox = [{"type": "lifespan.startup"}]

        async def receive() -> dict[str, Any]:
            return inbox.pop(0)

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        await middleware({"type": "lifespan"}, receive, send)

    with pytest.raises(SchemaError):
        asyncio.run(run())
    assert [m["type"] for m in sent] == ["lifespan.startup.failed"]
    assert "quota migrate" in sent[0]["message"]


@pytest.mark.parametrize("more", [{}, {"fail_open": True}, {"shadow": True}], ids=str)
def test_asgi_without_lifespan_answers_503_never_passes(
    sql_empty_url: str, more: dict[str, Any], caplog: Any
) -> None:
    """A mounted app gets no lifespan: each request finds the tables missing and is refused."""
    inner = starlette_app(sql_empty_url, **more)
    outer = Starlette(routes=[Mount("/", app=inner)])
    with caplog.at_level(logging.WARNING, logger="quota"), TestClient(outer) as client:
        codes = [client.get("/api/x").status_code for _ in range(30)]
    assert codes == [503] * 30
    logged = errors(caplog)
    assert len(logged) == 1, logged  # once per 10 s, not once per request


def wsgi_app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"ok"]


def wsgi_get(app: Any, path: str) -> str:
    status: list[str] = []
    environ = {"REQUEST_METHOD": "GET", "PATH_INFO": path, "REMOTE_ADDR": "203.0.113.7"}
    b"".join(app(environ, lambda s, h, e=None: status.append(s)))
    return status[0]


@pytest.mark.parametrize("more", [{}, {"fail_open": True}], ids=str)
def test_wsgi_answers_503_never_passes(
    sql_empty_url: str, more: dict[str, Any], caplog: Any
) -> None:
    app = QuotaWSGIMiddleware(wsgi_app, url=sql_empty_url, config=config(**more))
    try:
        with caplog.at_level(logging.WARNING, logger="quota"):
            statuses = [wsgi_get(app, "/api/x") for _ in range(30)]
        assert {s.split()[0] for s in statuses} == {"503"}
        assert len(errors(caplog)) == 1
        assert wsgi_get(app, "/other").startswith("200")  # not a limited path
        quota.migrate(sql_empty_url)
        assert wsgi_get(app, "/api/x").startswith("200")  # migrating is the whole fix
    finally:
        app.limiter.close()


def test_a_fallback_never_decides_a_missing_schema_from_memory(sql_empty_url: str) -> None:
    limiter = quota.connect(sql_empty_url, fallback=Fallback(timeout=2, probe_interval=5))
    try:
        for _ in range(3):
            with pytest.raises(SchemaError, match="quota migrate"):
                limiter.rate_limit("k", limit=1, window=60)
    finally:
        limiter.close()


def test_an_async_fallback_never_decides_a_missing_schema_from_memory(sql_empty_url: str) -> None:
    async def run() -> None:
        fallback = Fallback(timeout=2, probe_interval=5)
        async with quota.connect_async(sql_empty_url, fallback=fallback) as limiter:
            for _ in range(3):
                with pytest.raises(SchemaError, match="quota migrate"):
                    await limiter.rate_limit("k", limit=1, window=60)
            with pytest.raises(SchemaError):
                await limiter.hit("k", "1/minute", fail_closed=True)

    asyncio.run(run())


def test_uvicorn_exits_at_startup_naming_quota_migrate(tmp_path: Path) -> None:
    """The README's FastAPI snippet, served by uvicorn before `quota migrate`: no server."""
    pytest.importorskip("uvicorn")
    pytest.importorskip("fastapi")
    (tmp_path / "readme_app.py").write_text(
        "from fastapi import FastAPI\n"
        "from quota.http import HttpConfig, RoutePolicy\n"
        "from quota.http.asgi import QuotaMiddleware\n"
        "app = FastAPI()\n"
        'api = RoutePolicy(name="api", paths=["/api"], rates="100/minute")\n'
        "app.add_middleware(QuotaMiddleware, config=HttpConfig.from_env(policies=[api]))\n"
    )
    # The app's own database, never migrated for quota (a missing file is refused too,
    # with a message of its own).
    sqlite3.connect(tmp_path / "never-migrated.sqlite3").close()
    url = f"sqlite:///{tmp_path / 'never-migrated.sqlite3'}"
    env = {**os.environ, "QUOTA_DATABASE_URL": url, "QUOTA_HASH_SECRET": SECRET}
    done = subprocess.run(
        [sys.executable, "-m", "uvicorn", "readme_app:app", "--port", "0"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 3, done.stderr
    assert "the quota tables are missing from this database" in done.stderr
    assert f"quota migrate --url '{url}'" in done.stderr
    assert "Application startup failed" in done.stderr
