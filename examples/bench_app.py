"""The two apps `bench_http.py` measures: a trivial ASGI endpoint, bare and behind QuotaMiddleware.

    uvicorn examples.bench_app:bare
    QUOTA_DATABASE_URL=... QUOTA_HASH_SECRET=... uvicorn examples.bench_app:limited
    uvicorn examples.bench_app:no_database      # the middleware with a stand-in limiter

``BENCH_FACE`` picks the limiter behind the middleware: ``default`` (the
one the middleware opens itself: async, with group commit), ``async``
(`quota.connect_async`) or ``sync`` (`quota.connect`, run inline on the event
loop); for the last two ``BENCH_BATCHING=1`` turns on group commit and
``BENCH_DURABILITY=relaxed`` relaxed commits (PostgreSQL). The limit is so
high that every request is allowed: the benchmark measures the cost of
deciding, which every request pays.
"""

from __future__ import annotations

import os
from typing import Any

import quota
from quota.http import HttpConfig, RoutePolicy
from quota.http.asgi import QuotaMiddleware

_BODY = b"ok"
_HEADERS = [(b"content-type", b"text/plain"), (b"content-length", b"2")]


async def bare(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """A trivial ASGI endpoint (answers lifespan too, as uvicorn expects)."""
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    await send({"type": "http.response.start", "status": 200, "headers": _HEADERS})
    await send({"type": "http.response.body", "body": _BODY})


def _limited() -> QuotaMiddleware:
    url = os.environ.get("QUOTA_DATABASE_URL", "sqlite:///quota.sqlite3")
    config = HttpConfig.from_env(
        default=RoutePolicy(name="bench", rates=os.environ.get("BENCH_RATES", "1000000000/hour"))
    )
    face = os.environ.get("BENCH_FACE", "default")
    if face == "default":
        # What `app.add_middleware(QuotaMiddleware)` gets: its own async limiter on the URL.
        return QuotaMiddleware(bare, url=url, config=config)
    options: dict[str, Any] = {
        "batching": os.environ.get("BENCH_BATCHING") == "1",
        "durability": os.environ.get("BENCH_DURABILITY", "full"),
    }
    limiter = (
        quota.connect(url, **options) if face == "sync" else quota.connect_async(url, **options)
    )
    return QuotaMiddleware(bare, limiter=limiter, config=config)


def __getattr__(name: str) -> Any:
    # Built on first use, so `uvicorn examples.bench_app:bare` never opens a limiter.
    makers = {"limited": _limited, "no_database": _no_database}
    if name in makers:
        app = makers[name]()
        globals()[name] = app
        return app
    raise AttributeError(name)


class _NoDatabase:
    """A stand-in limiter that allows everything without a database: the middleware's own cost."""

    def __init__(self) -> None:
        import time

        from quota._core import Decision

        self._decision = Decision(True, "k", 10**9, 10**9 - 1, 1, 3600, int(time.time()) + 3600, 0)
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


def _no_database() -> QuotaMiddleware:
    config = HttpConfig.from_env(default=RoutePolicy(name="bench", rates="1000000000/hour"))
    return QuotaMiddleware(bare, limiter=_NoDatabase(), config=config)  # type: ignore[arg-type]
