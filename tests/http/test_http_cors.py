"""CORS works whichever order quota's and the CORS middleware are added in.

A browser sends a preflight (``OPTIONS`` + ``Origin`` +
``Access-Control-Request-Method``) before a cross-origin request: quota must
never count or refuse it. And a 429 (or a fail-closed 503) that quota
answers itself must carry ``Access-Control-Allow-Origin`` and expose
Retry-After, or browser code cannot read the status at all.

Starlette's ``add_middleware`` makes the *last* added the outermost, so
"quota outside" means CORS was added first.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import quota
from quota.http import HttpConfig, RoutePolicy
from tests._support import Clock

SECRET = "test-hash-secret-0123456789"
ORIGIN = "https://app.example"
PREFLIGHT = {"Origin": ORIGIN, "Access-Control-Request-Method": "GET"}
ORDERS = ("quota_outside", "quota_inside")


def make_config(**changes: Any) -> HttpConfig:
    settings: dict[str, Any] = {
        "policies": [RoutePolicy(name="api", paths=["/api"], rates="2/minute")],
        "hash_secret": SECRET,
        "runtime_policies": False,
    }
    settings.update(changes)
    return HttpConfig(**settings)


def exposed(response: Any) -> set[str]:
    value = response.headers.get("Access-Control-Expose-Headers") or ""
    return {name.strip().lower() for name in value.split(",") if name.strip()}


Starlette = Callable[..., Any]


@pytest.fixture
def starlette_client(sqlite_url: str, clock: Clock) -> Iterator[Starlette]:
    from starlette.applications import Starlette
    from starlette.middleware.cors import CORSMiddleware
    from starlette.requests import Request
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    from quota.http.asgi import QuotaMiddleware

    opened: list[tuple[Any, Any]] = []

    def build(order: str, config: HttpConfig | None = None, **options: Any) -> Any:
        async def items(request: Request) -> PlainTextResponse:
            return PlainTextResponse("ok")

        app = Starlette(routes=[Route("/api/items", items, methods=["GET", "POST"])])
        limiter = options.pop("limiter", None) or quota.connect_async(sqlite_url, clock=clock)
        quota_options = {"limiter": limiter, "config": config or make_config(), **options}
        cors_options = {"allow_origins": [ORIGIN], "expose_headers": []}
        if order == "quota_outside":  # the last added is the outermost
            app.add_middleware(CORSMiddleware, **cors_options)
            app.add_middleware(QuotaMiddleware, **quota_options)
        else:
            app.add_middleware(QuotaMiddleware, **quota_options)
            app.add_middleware(CORSMiddleware, **cors_options)
        client = TestClient(app)
        client.__enter__()
        opened.append((client, limiter))
        return client

    yield build
    for client, limiter in opened:
        if isinstance(limiter, quota.AsyncLimiter):
            client.portal.call(limiter.aclose)
        client.__exit__(None, None, None)


@pytest.mark.parametrize("order", ORDERS)
def test_starlette_preflights_are_never_counted_or_refused(
    starlette_client: Starlette, order: str
) -> None:
    client = starlette_client(order)
    for _ in range(5):
        reply = client.options("/api/items", headers=PREFLIGHT)
        assert reply.status_code == 200
        assert reply.headers["Access-Control-Allow-Origin"] == ORIGIN
    # The preflights used up none of the GET limit.
    assert [client.get("/api/items", headers={"Origin": ORIGIN}).status_code for _ in range(2)] == [
        200,
        200,
    ]
    assert client.get("/api/items", headers={"Origin": ORIGIN}).status_code == 429


@pytest.mark.parametrize("order", ORDERS)
def test_starlette_429_is_readable_cross_origin(starlette_client: Starlette, order: str) -> None:
    client = starlette_client(order)
    for _ in range(2):
        assert client.get("/api/items", headers={"Origin": ORIGIN}).status_code == 200
    denied = client.get("/api/items", headers={"Origin": ORIGIN})
    assert denied.status_code == 429
    assert denied.headers["Access-Control-Allow-Origin"] == ORIGIN
    assert "origin" in {v.strip().lower() for v in denied.headers.get("Vary", "").split(",")}
    assert {"retry-after", "ratelimit", "x-ratelimit-remaining"} <= exposed(denied)


@pytest.mark.parametrize("order", ORDERS)
def test_starlette_429_gives_no_cors_grant_to_other_origins(
    starlette_client: Starlette, order: str
) -> None:
    client = starlette_client(order)
    evil = {"Origin": "https://evil.example"}
    replies = [client.get("/api/items", headers=evil) for _ in range(3)]
    assert replies[-1].status_code == 429
    assert "Access-Control-Allow-Origin" not in replies[-1].headers


def test_starlette_explicit_cors_origins_without_a_cors_middleware(
    sqlite_url: str, clock: Clock
) -> None:
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    from quota.http.asgi import QuotaMiddleware

    app = Starlette(routes=[Route("/api/items", lambda r: PlainTextResponse("ok"))])
    limiter = quota.connect_async(sqlite_url, clock=clock)
    app.add_middleware(QuotaMiddleware, limiter=limiter, config=make_config(), cors_origins="*")
    with TestClient(app) as client:
        replies = [client.get("/api/items", headers={"Origin": ORIGIN}) for _ in range(3)]
        assert replies[-1].status_code == 429
        assert replies[-1].headers["Access-Control-Allow-Origin"] == "*"
        assert "retry-after" in exposed(replies[-1])
        client.portal.call(limiter.aclose)


@pytest.mark.parametrize("order", ORDERS)
def test_starlette_fail_closed_503_is_readable_cross_origin(
    starlette_client: Starlette, order: str, tmp_path: Any
) -> None:
    blocker = tmp_path / "a-directory"
    blocker.mkdir()
    dead = quota.connect_async(f"sqlite:///{blocker}")  # a directory: it cannot be opened
    policy = RoutePolicy(name="api", paths=["/api"], rates="2/minute", fail_open=False)
    client = starlette_client(order, config=make_config(policies=[policy]), limiter=dead)
    denied = client.get("/api/items", headers={"Origin": ORIGIN})
    assert denied.status_code == 503
    assert denied.headers["Access-Control-Allow-Origin"] == ORIGIN
    assert "retry-after" in exposed(denied)


# -- WSGI ---------------------------------------------------------------------


def _plain_wsgi(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"ok"]


def test_wsgi_preflights_pass_through_and_429_is_readable(sqlite_url: str, clock: Clock) -> None:
    """Without flask-cors: the app answers preflights itself; quota is told the origins."""
    from werkzeug.test import Client

    from quota.http.wsgi import QuotaWSGIMiddleware

    seen: list[str] = []

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        seen.append(environ["REQUEST_METHOD"])
        return _plain_wsgi(environ, start_response)

    limiter = quota.connect(sqlite_url, clock=clock)
    middleware = QuotaWSGIMiddleware(
        app, limiter=limiter, config=make_config(), cors_origins=[ORIGIN]
    )
    client = Client(middleware)
    try:
        for _ in range(5):
            assert client.options("/api/items", headers=PREFLIGHT).status_code == 200
        assert seen == ["OPTIONS"] * 5
        statuses = [client.get("/api/items", headers={"Origin": ORIGIN}).status_code for _ in "abc"]
        assert statuses == [200, 200, 429]
        denied = client.get("/api/items", headers={"Origin": ORIGIN})
        assert denied.headers["Access-Control-Allow-Origin"] == ORIGIN
        assert "Origin" in denied.headers.get("Vary", "")
        assert "retry-after" in exposed(denied)
        other = client.get("/api/items", headers={"Origin": "https://evil.example"})
        assert other.status_code == 429
        assert "Access-Control-Allow-Origin" not in other.headers
    finally:
        limiter.close()


@pytest.mark.skipif(
    importlib.util.find_spec("flask_cors") is None, reason="flask-cors is not installed"
)
def test_flask_cors_preflights_and_429(sqlite_url: str, clock: Clock) -> None:
    from flask import Flask
    from flask_cors import CORS

    from quota.http.wsgi import QuotaWSGIMiddleware

    app = Flask("quota_cors_test")

    @app.route("/api/items")
    def items() -> str:
        return "ok"

    CORS(app, origins=[ORIGIN])
    limiter = quota.connect(sqlite_url, clock=clock)
    app.wsgi_app = QuotaWSGIMiddleware(  # type: ignore[method-assign]
        app.wsgi_app, limiter=limiter, config=make_config(), cors_origins=[ORIGIN]
    )
    client = app.test_client()
    try:
        for _ in range(5):
            assert client.options("/api/items", headers=PREFLIGHT).status_code == 200
        statuses = [client.get("/api/items", headers={"Origin": ORIGIN}).status_code for _ in "abc"]
        assert statuses == [200, 200, 429]
        denied = client.get("/api/items", headers={"Origin": ORIGIN})
        assert denied.headers["Access-Control-Allow-Origin"] == ORIGIN
        assert "retry-after" in exposed(denied)
    finally:
        limiter.close()


def test_cors_origins_is_checked_at_construction(sqlite_url: str) -> None:
    from quota.http.wsgi import QuotaWSGIMiddleware

    limiter = quota.connect(sqlite_url)
    try:
        with pytest.raises(quota.ConfigurationError, match="cors_origins"):
            QuotaWSGIMiddleware(_plain_wsgi, limiter=limiter, config=make_config(), cors_origins=5)  # type: ignore[arg-type]
        never = QuotaWSGIMiddleware(
            _plain_wsgi, limiter=limiter, config=make_config(), cors_origins=()
        )
        assert never.cors is not None and never.cors.grant(ORIGIN) == []
    finally:
        limiter.close()
