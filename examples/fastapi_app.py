"""A small FastAPI app behind quota's ASGI middleware, on the embedded SQLite default.

    pip install 'quota[fastapi]' uvicorn
    export QUOTA_HASH_SECRET=$(python -c 'import secrets; print(secrets.token_urlsafe(32))')
    uvicorn examples.fastapi_app:app

Then ``curl -i localhost:8000/api/directory`` a few times and watch
``X-RateLimit-Remaining`` count down to a 429. Every number can be tuned from
the environment (``QUOTA_POLICY_DIRECTORY_RATES=5/minute``,
``RATE_LIMIT_CHAT_AUTHED_PER_MIN=100``, ``QUOTA_SHADOW=true``…) and, at run
time, with ``quota policy set``. Point ``QUOTA_DATABASE_URL`` at PostgreSQL
to share the limits between app instances.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI

import quota
from quota.http import Denial, HttpConfig, HttpResponse, RoutePolicy
from quota.http.asgi import QuotaMiddleware
from quota.http.fastapi import RateLimit, install

#: Route classes, first match wins.
POLICIES = [
    RoutePolicy(
        name="chat",
        paths=["/api/chat"],
        rates="10/minute",
        tier_rates={"auth": "60/minute"},
        fail_open=False,
    ),
    RoutePolicy(name="directory", paths=["/api/directory"], rates="30/minute"),
    RoutePolicy(name="mcp", paths=["/mcp"], rates="30/minute", tier_rates={"auth": "300/minute"}),
    RoutePolicy(name="writes", paths=["/api"], rates="20/minute", mutations_only=True),
]


def mcp_errors(denial: Denial) -> HttpResponse | None:
    """Denials on /mcp as a JSON-RPC error object (MCP clients read those); others stay problem+json."""
    if not denial.request.path.startswith("/mcp"):
        return None
    body = json.dumps({
        "jsonrpc": "2.0", "id": None,
        "error": {"code": -32029, "message": "rate limited",
                  "data": {"code": denial.reason, "retry_after": denial.retry_after}},
    }).encode()  # fmt: skip
    status = 429 if denial.decision is not None else 503
    return HttpResponse(status, (("Content-Type", "application/json"), *denial.headers), body)


#: The API keys this example accepts (``EXAMPLE_API_KEYS=key-1,key-2``); a real app
#: checks its own key store. A key that passes is keyed on its own; without a
#: validator, every key sent from one IP would share that IP's ceiling.
API_KEYS = frozenset(k.strip() for k in os.environ.get("EXAMPLE_API_KEYS", "").split(",") if k)


def known_api_key(token: str) -> bool:
    return token in API_KEYS


#: One limiter for the middleware and the dependency; group commit shares statements.
limiter = quota.connect_async(quota.default_url(), batching=True)


@asynccontextmanager
async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
    # An example's convenience: a real deployment runs `quota migrate` in its deploy step.
    # (In a thread: migrating a PostgreSQL URL runs an event loop of its own.)
    await asyncio.to_thread(quota.migrate, quota.default_url())
    yield
    await limiter.aclose()


config = HttpConfig.from_env(policies=POLICIES, exclude=["/health"])
app = FastAPI(title="quota example", lifespan=lifespan)
app.add_middleware(
    QuotaMiddleware, limiter=limiter, config=config, response_factory=mcp_errors,
    token_validator=known_api_key,
)  # fmt: skip
install(app)

#: One route limited by a dependency instead (on top of the middleware's class).
export_limit = RateLimit("2/minute", name="export", config=config, limiter=limiter)


@app.get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


@app.get("/api/directory")
async def directory() -> dict[str, Any]:
    return {"namespaces": ["alpha", "beta"]}


@app.post("/api/chat")
async def chat(message: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"reply": "hello", "echo": message}


@app.post("/api/notes")
async def notes() -> dict[str, str]:
    return {"saved": "yes"}


@app.get("/api/export", dependencies=[Depends(export_limit)])
async def export() -> dict[str, str]:
    return {"export": "started"}


@app.post("/mcp")
async def mcp(call: dict[str, Any]) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": call.get("id"), "result": {"tools": []}}
