"""The limiter feeds `quota.Metrics` and `quota.AbuseDetector`: decisions by source,
store errors and latency, and an alert when one key is hammered."""

from __future__ import annotations

import asyncio
from pathlib import Path

import quota
from quota import AbuseDetector, Fallback, Metrics
from tests._support import Clock


def _decisions(metrics: Metrics) -> dict[tuple[bool, str], int]:
    out: dict[tuple[bool, str], int] = {}
    for row in metrics.snapshot()["decisions"]:
        key = (row["outcome"] == "allowed", row["source"])
        out[key] = out.get(key, 0) + row["count"]
    return out


def test_decisions_and_latency_are_counted(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'm.db'}"
    quota.migrate(url)
    metrics = Metrics()
    with quota.connect(url, metrics=metrics, clock=Clock()) as limiter:
        for _ in range(5):
            limiter.rate_limit("k", 3, 60)
        limiter.rate_limit("k", 3, 60, algorithm="token_bucket")
    assert _decisions(metrics) == {(True, "store"): 4, (False, "store"): 2}
    assert metrics.snapshot()["store_latency"]["count"] == 6


def test_fallback_decisions_and_store_errors_are_counted() -> None:
    metrics = Metrics()
    url = "postgresql://root@127.0.0.1:1/x"  # refuses at once

    async def main() -> None:
        async with quota.connect_async(
            url, metrics=metrics, fallback=Fallback(timeout=0.1, probe_interval=60)
        ) as limiter:
            for _ in range(3):
                await limiter.rate_limit("k", 2, 60)

    asyncio.run(main())
    assert _decisions(metrics) == {(True, "fallback"): 2, (False, "fallback"): 1}
    assert sum(metrics.snapshot()["store_errors"].values()) >= 1


def test_denials_reach_the_abuse_detector(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'a.db'}"
    quota.migrate(url)
    clock = Clock()
    alerts: list[tuple[str, int]] = []
    abuse = AbuseDetector(
        threshold=3,
        window=60,
        interval=300,
        clock=clock,
        callback=lambda k, n: alerts.append((k, n)),
    )
    with quota.connect(url, abuse=abuse, clock=clock) as limiter:
        for _ in range(10):
            limiter.rate_limit("hammer", 1, 60)
        for _ in range(3):
            limiter.rate_limit("polite", 5, 60)
    assert [key for key, _ in alerts] == ["hammer"]


def test_the_http_middleware_labels_decisions_with_route_and_tier(tmp_path: Path) -> None:
    """A middleware given a `quota.Metrics` as its observer counts decisions by route and tier."""
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    from quota.http import HttpConfig, RoutePolicy
    from quota.http.asgi import QuotaMiddleware

    url = f"sqlite:///{tmp_path / 'h.db'}"
    quota.migrate(url)
    metrics = Metrics()

    async def ok(_request: object) -> PlainTextResponse:
        return PlainTextResponse("ok")

    app = Starlette(routes=[Route("/api/x", ok)])
    config = HttpConfig(
        policies=[RoutePolicy(name="api", paths=["/api"], rates="2/minute")], hash_secret="s" * 32
    )
    app.add_middleware(QuotaMiddleware, url=url, config=config, observer=metrics)
    with TestClient(app) as client:
        codes = [client.get("/api/x").status_code for _ in range(3)]
    assert codes == [200, 200, 429]
    rows = {
        (r["route"], r["tier"], r["outcome"]): r["count"] for r in metrics.snapshot()["decisions"]
    }
    assert rows == {("api", "anon", "allowed"): 2, ("api", "anon", "denied"): 1}
