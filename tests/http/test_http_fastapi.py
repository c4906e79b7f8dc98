"""The FastAPI dependency: one route limited, the same core as the middleware."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi import Depends, FastAPI
from starlette.testclient import TestClient

import quota
from quota.http import HttpConfig
from quota.http.fastapi import RateLimit, install
from tests._support import Clock

SECRET = "fastapi-test-secret-0123456789"


@pytest.fixture
def limiter(sqlite_url: str, clock: Clock) -> Iterator[quota.AsyncLimiter]:
    yield quota.connect_async(sqlite_url, clock=clock)


def _app(limiter: quota.AsyncLimiter, *, installed: bool) -> tuple[FastAPI, RateLimit]:
    app = FastAPI()
    if installed:
        install(app)
    search = RateLimit(
        "2/minute", name="search", tier_rates={"auth": "4/minute"}, limiter=limiter,
        config=HttpConfig(hash_secret=SECRET, runtime_policies=False),
    )  # fmt: skip

    @app.get("/search", dependencies=[Depends(search)])
    async def do_search() -> dict[str, Any]:
        return {"results": []}

    @app.get("/free")
    async def free() -> dict[str, Any]:
        return {}

    return app, search


def _client(app: FastAPI, limiter: quota.AsyncLimiter) -> Iterator[TestClient]:
    with TestClient(app) as client:
        yield client
        client.portal.call(limiter.aclose)  # type: ignore[union-attr]


@pytest.mark.parametrize("installed", [True, False])
def test_the_dependency_limits_its_route_only(limiter: quota.AsyncLimiter, installed: bool) -> None:
    app, search = _app(limiter, installed=installed)
    for client in _client(app, limiter):
        replies = [client.get("/search") for _ in range(3)]
        free = [client.get("/free") for _ in range(5)]
        authed = client.get("/search", headers={"authorization": "Bearer t"})

    assert [r.status_code for r in replies] == [200, 200, 429]
    assert [r.headers.get("x-ratelimit-remaining") for r in replies] == ["1", "0", "0"]
    assert replies[0].headers["ratelimit-policy"] == '"search";q=2;w=60'
    assert replies[0].json() == {"results": []}
    denied = replies[2]
    assert int(denied.headers["retry-after"]) >= 1
    if installed:
        assert denied.headers["content-type"] == "application/problem+json"
        assert denied.json()["code"] == "RATE_LIMITED"
    else:
        # FastAPI's own handler: still a 429 with the headers, the problem inside "detail".
        assert '"RATE_LIMITED"' in denied.json()["detail"]
    assert all(r.status_code == 200 and "x-ratelimit-limit" not in r.headers for r in free)
    assert authed.headers["x-ratelimit-limit"] == "4"
    assert search.metrics.get("blocked", route="search", tier="anon") == 1
