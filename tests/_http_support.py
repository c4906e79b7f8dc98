"""One small app per framework, behind one client interface, for the HTTP-layer tests.

`make_client(framework, url, clock, config, ...)` builds the same app
(``/api/items``, ``/api/items/{id}``, ``/api/boom`` which raises,
``/health``, ``/mcp``, ``/other``) on Starlette (ASGI middleware, async
limiter) or Flask (WSGI middleware, sync limiter) and returns an `HttpClient`
whose responses look alike, so every behaviour test runs on both.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import quota
from quota.http import HttpConfig

FRAMEWORKS = ("starlette", "flask")


@dataclass
class Reply:
    status: int
    headers: Mapping[str, str]  # case-insensitive in both frameworks
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    def header(self, name: str) -> str | None:
        return self.headers.get(name)


@dataclass
class HttpClient:
    framework: str
    send: Callable[[str, str, dict[str, str]], Reply]
    middleware: Any
    limiter: Any
    close: Callable[[], None]
    handled: list[str] = field(default_factory=list)

    def get(self, path: str, **headers: str) -> Reply:
        return self.send("GET", path, _headers(headers))

    def post(self, path: str, **headers: str) -> Reply:
        return self.send("POST", path, _headers(headers))

    def request(self, method: str, path: str, headers: dict[str, str] | None = None) -> Reply:
        return self.send(method, path, headers or {})

    @property
    def metrics(self) -> Any:
        return self.middleware.metrics


def _headers(kwargs: dict[str, str]) -> dict[str, str]:
    return {k.replace("_", "-"): v for k, v in kwargs.items()}


def make_client(
    framework: str, url: str, clock: Callable[[], float], config: HttpConfig,
    *, peer: str = "203.0.113.9", limiter: Any = None, cors: bool = False, **hooks: Any,
) -> HttpClient:  # fmt: skip
    if framework == "starlette":
        return _starlette(url, clock, config, peer, limiter, cors, hooks)
    return _flask(url, clock, config, peer, limiter, hooks)


def _starlette(
    url: str, clock: Callable[[], float], config: HttpConfig, peer: str, limiter: Any,
    cors: bool, hooks: dict[str, Any],
) -> HttpClient:  # fmt: skip
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.middleware.cors import CORSMiddleware
    from starlette.requests import Request
    from starlette.responses import JSONResponse, PlainTextResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    from quota.http.asgi import QuotaMiddleware

    handled: list[str] = []

    async def items(request: Request) -> PlainTextResponse:
        handled.append(request.url.path)
        return PlainTextResponse("ok")

    async def boom(request: Request) -> PlainTextResponse:
        handled.append(request.url.path)
        raise RuntimeError("the handler failed")

    async def mcp(request: Request) -> JSONResponse:
        handled.append(request.url.path)
        return JSONResponse({"jsonrpc": "2.0", "id": 1, "result": {}})

    routes = [
        Route("/api/items", items, methods=["GET", "POST", "HEAD", "OPTIONS", "DELETE"]),
        Route("/api/items/{id}", items, methods=["GET", "POST"]),
        Route("/api/boom", boom, methods=["GET", "POST"]),
        Route("/health", items),
        Route("/other", items, methods=["GET", "POST"]),
        Route("/mcp", mcp, methods=["POST"]),
    ]
    if limiter is None:
        limiter = quota.connect_async(url, clock=clock)
    # Quota outermost, so its headers reach even the answers CORS makes.
    middleware = [Middleware(QuotaMiddleware, limiter=limiter, config=config, **hooks)]
    if cors:
        middleware.append(
            Middleware(CORSMiddleware, allow_origins=["*"], expose_headers=["X-Custom"])
        )
    app = Starlette(routes=routes, middleware=middleware)
    client = TestClient(app, client=(peer, 50000), raise_server_exceptions=False)
    client.__enter__()

    def send(method: str, path: str, headers: dict[str, str]) -> Reply:
        response = client.request(method, path, headers=headers)
        return Reply(response.status_code, response.headers, response.content)

    def close() -> None:
        if isinstance(limiter, quota.AsyncLimiter):
            client.portal.call(limiter.aclose)  # type: ignore[union-attr]
        else:
            limiter.close()
        client.__exit__(None, None, None)

    # Build the stack now (Starlette builds it on the first request) to reach the middleware.
    app.middleware_stack = app.build_middleware_stack()
    found = _find(app.middleware_stack, QuotaMiddleware)
    return HttpClient("starlette", send, found, limiter, close, handled)


def _find(app: Any, kind: type) -> Any:
    while app is not None and not isinstance(app, kind):
        app = getattr(app, "app", None)
    return app


def _flask(
    url: str, clock: Callable[[], float], config: HttpConfig, peer: str, limiter: Any,
    hooks: dict[str, Any],
) -> HttpClient:  # fmt: skip
    from flask import Flask, jsonify, request

    from quota.http.wsgi import QuotaWSGIMiddleware

    app = Flask("quota_test")
    handled: list[str] = []

    @app.route("/api/items", methods=["GET", "POST", "HEAD", "OPTIONS", "DELETE"])
    @app.route("/api/items/<item>", methods=["GET", "POST"])
    @app.route("/health")
    @app.route("/other", methods=["GET", "POST"])
    def items(item: str | None = None) -> str:
        handled.append(request.path)
        return "ok"

    @app.route("/api/boom", methods=["GET", "POST"])
    def boom() -> str:
        handled.append(request.path)
        raise RuntimeError("the handler failed")

    @app.route("/mcp", methods=["POST"])
    def mcp() -> Any:
        handled.append(request.path)
        return jsonify({"jsonrpc": "2.0", "id": 1, "result": {}})

    if limiter is None:
        limiter = quota.connect(url, clock=clock)
    middleware = QuotaWSGIMiddleware(app.wsgi_app, limiter=limiter, config=config, **hooks)
    app.wsgi_app = middleware  # type: ignore[method-assign]
    client = app.test_client()

    def send(method: str, path: str, headers: dict[str, str]) -> Reply:
        response = client.open(
            path, method=method, headers=headers, environ_base={"REMOTE_ADDR": peer}
        )
        return Reply(response.status_code, response.headers, response.get_data())

    return HttpClient("flask", send, middleware, limiter, limiter.close, handled)
