"""A middleware that opens its own limiter does so on every store a URL can name."""

from __future__ import annotations

import asyncio
import uuid

import httpx
import pytest

from quota.http import HttpConfig, RoutePolicy

CONFIG = HttpConfig(
    policies=[RoutePolicy(name="api", rates="2/minute")], hash_secret="own-limiter-secret-0123"
)


def _asgi_statuses(url: str) -> list[int]:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    from quota.http.asgi import QuotaMiddleware

    async def ok(_request: Request) -> PlainTextResponse:
        return PlainTextResponse("ok")

    app = Starlette(routes=[Route("/", ok)])
    app.add_middleware(QuotaMiddleware, url=url, config=CONFIG)

    async def run() -> list[int]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return [(await client.get("/")).status_code for _ in range(3)]

    return asyncio.run(run())


def _wsgi_statuses(url: str) -> list[int]:
    from flask import Flask

    from quota.http.wsgi import QuotaWSGIMiddleware

    app = Flask(__name__)
    app.add_url_rule("/", "ok", lambda: "ok")
    app.wsgi_app = QuotaWSGIMiddleware(app.wsgi_app, url=url, config=CONFIG)  # type: ignore[method-assign]
    client = app.test_client()
    return [client.get("/").status_code for _ in range(3)]


@pytest.mark.parametrize("drive", [_asgi_statuses, _wsgi_statuses], ids=["asgi", "wsgi"])
def test_a_memory_url_gets_a_working_limiter(drive: object) -> None:
    # main: the middleware asked for group commit, which the memory store refuses: 500s.
    url = f"memory://own-limiter-{uuid.uuid4().hex}"  # named stores are shared in a process
    assert drive(url) == [200, 200, 429]  # type: ignore[operator]


@pytest.mark.parametrize("drive", [_asgi_statuses, _wsgi_statuses], ids=["asgi", "wsgi"])
def test_a_sqlite_url_gets_a_working_limiter(drive: object, sqlite_url: str) -> None:
    assert drive(sqlite_url) == [200, 200, 429]  # type: ignore[operator]


@pytest.mark.redis
def test_a_redis_url_gets_group_commit_like_the_sql_stores(redis_url: str) -> None:
    """Concurrent requests' scripts share one pipeline (one round trip) on Redis too."""
    from quota.http.asgi import Limiters
    from quota.http.wsgi import QuotaWSGIMiddleware

    wsgi = QuotaWSGIMiddleware(lambda environ, start: [], url=redis_url, config=CONFIG)
    try:
        assert wsgi.limiter.options.batching
    finally:
        wsgi.limiter.close()

    async def asgi_batching() -> bool:
        limiters = Limiters(None, redis_url)
        try:
            return limiters.get().options.batching
        finally:
            await limiters.aclose()

    assert asyncio.run(asgi_batching())
