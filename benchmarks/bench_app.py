"""The apps `bench_http.py` measures: one trivial FastAPI endpoint, bare and behind each limiter.

    uvicorn benchmarks.bench_app:bare
    uvicorn benchmarks.bench_app:with_slowapi                 # slowapi, memory storage
    QUOTA_HASH_SECRET=... BENCH_STORE=memory:// uvicorn benchmarks.bench_app:with_quota
    QUOTA_HASH_SECRET=... BENCH_STORE=sqlite:///bench.sqlite3 uvicorn benchmarks.bench_app:with_quota
    QUOTA_HASH_SECRET=... uvicorn benchmarks.bench_app:with_quota_no_database

``GET /`` answers ``{"ok": true}``. Every limited app allows each request
(the limit, ``BENCH_RATES``, defaults to 1000000000/hour), so the benchmark
measures the cost of deciding, which every request pays, and keys it by the
``X-API-Key`` header, so all of them count the same keys:

- ``with_slowapi``: ``Limiter(key_func=<the X-API-Key header>,
  headers_enabled=True, storage_uri="memory://")`` and the endpoint decorated
  with ``@limiter.limit(...)``, as slowapi documents it (the endpoint then
  takes ``request`` and ``response``).
- ``with_quota``: ``QuotaMiddleware`` with one route class. On a SQL
  ``BENCH_STORE`` (``sqlite:///…``, ``postgresql://…``; migrated first) it is
  the middleware's own limiter, what ``app.add_middleware(QuotaMiddleware)``
  gets: async, with group commit (``batching=True``). On ``memory://`` it is
  ``quota.connect_async("memory://")`` (a memory store has nothing to batch).
  An API key makes the caller ``auth``, keyed by a keyed hash of the key.
- ``with_quota_no_database``: the same middleware with a stand-in limiter that
  answers without any store: the middleware's own cost.
"""

from __future__ import annotations

import os
import time
from typing import Any

from fastapi import FastAPI, Request, Response

import quota
from quota.http import HttpConfig, RoutePolicy
from quota.http.asgi import QuotaMiddleware

RATES = os.environ.get("BENCH_RATES", "1000000000/hour")


def _bare() -> FastAPI:
    app = FastAPI()

    @app.get("/")
    async def root() -> dict[str, bool]:
        return {"ok": True}

    return app


def _with_slowapi() -> FastAPI:
    from slowapi import Limiter, _rate_limit_exceeded_handler
    from slowapi.errors import RateLimitExceeded

    def api_key(request: Request) -> str:
        return request.headers.get("x-api-key") or "anonymous"

    limiter = Limiter(key_func=api_key, headers_enabled=True, storage_uri="memory://")
    app = FastAPI()
    app.state.limiter = limiter
    app.add_exception_handler(RateLimitExceeded, _rate_limit_exceeded_handler)  # type: ignore[arg-type]

    # Request and Response are module-level names: FastAPI resolves these annotations (strings
    # here) in the module's namespace, and slowapi needs both parameters.
    @app.get("/")
    @limiter.limit(RATES)
    async def root(request: Request, response: Response) -> dict[str, bool]:
        return {"ok": True}

    return app


def _config() -> HttpConfig:
    return HttpConfig.from_env(default=RoutePolicy(name="bench", rates=RATES))


def _with_quota() -> FastAPI:
    url = os.environ.get("BENCH_STORE", "sqlite:///quota.sqlite3")
    app = _bare()
    if url.startswith("memory:"):
        app.add_middleware(QuotaMiddleware, limiter=quota.connect_async(url), config=_config())
    else:
        app.add_middleware(QuotaMiddleware, url=url, config=_config())
    return app


def _with_quota_no_database() -> FastAPI:
    app = _bare()
    app.add_middleware(QuotaMiddleware, limiter=_NoDatabase(), config=_config())
    return app


def __getattr__(name: str) -> Any:
    # Built on first use, so `uvicorn benchmarks.bench_app:bare` imports no limiter's app.
    makers = {
        "bare": _bare,
        "with_slowapi": _with_slowapi,
        "with_quota": _with_quota,
        "with_quota_no_database": _with_quota_no_database,
    }
    if name in makers:
        app = makers[name]()
        globals()[name] = app
        return app
    raise AttributeError(name)


class _NoDatabase:
    """A stand-in limiter that allows everything without a store: the middleware's own cost."""

    def __init__(self) -> None:
        self._decision = quota.Decision(
            True, "k", 10**9, 10**9 - 1, 1, 3600, int(time.time()) + 3600, 0
        )
        self.store = _NoStore()
        self.options = quota.Options()

    async def rate_limit(self, *_args: Any, **_kwargs: Any) -> Any:
        return self._decision

    async def hit(self, *_args: Any, **_kwargs: Any) -> Any:
        return self._decision


class _NoStore:
    dialect = "sqlite"

    async def execute(self, *_args: Any) -> list[Any]:
        return []

    async def run(self, *_args: Any, **_kwargs: Any) -> list[Any]:
        return []  # no policy overrides
