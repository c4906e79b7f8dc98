"""Shared buckets beside the caller's own: the per-IP ceiling of unvalidated tokens, the tenant's.

Each test runs the ASGI middleware on Starlette and the WSGI one on Flask,
on SQLite (and the counting test on PostgreSQL too), through the frameworks'
test clients, with the injected clock.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Any

import http_sfv
import pytest

import quota
from quota import ConfigurationError
from quota.http import HttpConfig, Identity, Plans, RoutePolicy
from tests._http_support import HttpClient
from tests._support import Clock

SECRET = "test-hash-secret-0123456789"
ANON_LIMIT = 3
AUTH_MULTIPLIER = 5


def make_config(**changes: Any) -> HttpConfig:
    settings: dict[str, Any] = {
        "policies": [RoutePolicy(name="api", paths=["/api"], rates=f"{ANON_LIMIT}/minute")],
        "hash_secret": SECRET,
        "tier_multipliers": {"anon": 1, "auth": AUTH_MULTIPLIER},
        "runtime_policies": False,
    }
    settings.update(changes)
    return HttpConfig(**settings)


Make = Callable[..., HttpClient]


@pytest.fixture
def make(http_client: Callable[..., HttpClient], sqlite_url: str) -> Make:
    def build(config: HttpConfig | None = None, **options: Any) -> HttpClient:
        return http_client(sqlite_url, config or make_config(), **options)

    return build


def _fresh_token() -> str:
    return "Bearer " + secrets.token_urlsafe(12)


# -- unvalidated tokens -------------------------------------------------------------


def test_a_fresh_token_per_request_does_not_mint_buckets(make: Make) -> None:
    client = make()
    ceiling = ANON_LIMIT * AUTH_MULTIPLIER

    statuses = [client.get("/api/items", authorization=_fresh_token()).status for _ in range(50)]

    assert statuses.count(200) == ceiling
    assert statuses.count(429) == 50 - ceiling


def test_the_ceiling_is_per_client_ip(make: Make) -> None:
    first = make(peer="203.0.113.9")
    second = make(peer="198.51.100.7")
    ceiling = ANON_LIMIT * AUTH_MULTIPLIER

    for _ in range(ceiling):
        assert first.get("/api/items", authorization=_fresh_token()).status == 200
    denied = first.get("/api/items", authorization=_fresh_token())
    other = second.get("/api/items", authorization=_fresh_token())

    assert denied.status == 429
    assert denied.header("X-RateLimit-Scope") == "ip"
    assert other.status == 200


def test_each_token_keeps_its_own_bucket_under_the_ceiling(make: Make) -> None:
    client = make(make_config(unvalidated_token_ceiling=3.0))
    own = ANON_LIMIT * AUTH_MULTIPLIER

    for _ in range(own):
        assert client.get("/api/items", authorization="Bearer alice").status == 200
    alice = client.get("/api/items", authorization="Bearer alice")
    bob = client.get("/api/items", authorization="Bearer bob")

    assert alice.status == 429
    assert alice.header("X-RateLimit-Scope") == "caller"
    assert bob.status == 200
    assert bob.header("X-RateLimit-Limit") == str(own)


def test_the_ceiling_scales_and_can_be_turned_off(make: Make) -> None:
    doubled = make(make_config(unvalidated_token_ceiling=2.0), peer="192.0.2.1")
    off = make(make_config(unvalidated_token_ceiling=None), peer="192.0.2.2")

    doubled_ok = sum(
        doubled.get("/api/items", authorization=_fresh_token()).status == 200 for _ in range(40)
    )
    off_ok = sum(
        off.get("/api/items", authorization=_fresh_token()).status == 200 for _ in range(40)
    )

    assert doubled_ok == 2 * ANON_LIMIT * AUTH_MULTIPLIER
    assert off_ok == 40


def test_a_token_validator_lifts_the_ceiling_and_refused_tokens_are_anon(make: Make) -> None:
    accepted = {f"Bearer good-{i}" for i in range(40)}
    client = make(token_validator=lambda token: f"Bearer {token}" in accepted)

    good = [client.get("/api/items", authorization=token).status for token in sorted(accepted)]
    bad = [client.get("/api/items", authorization=_fresh_token()).status for _ in range(10)]

    assert good == [200] * 40
    assert bad.count(200) == ANON_LIMIT  # all in the client IP's anon bucket


def test_a_tier_rate_sets_the_ceiling(make: Make) -> None:
    policy = RoutePolicy(
        name="api", paths=["/api"], rates=f"{ANON_LIMIT}/minute", tier_rates={"auth": "4/minute"}
    )
    client = make(make_config(policies=[policy]))

    statuses = [client.get("/api/items", authorization=_fresh_token()).status for _ in range(10)]

    assert statuses.count(200) == 4


def test_every_request_is_counted_once_in_each_bucket(
    http_client: Callable[..., HttpClient], sql_url: str, clock: Clock
) -> None:
    client = http_client(sql_url, make_config())
    for _ in range(7):
        client.get("/api/items", authorization=_fresh_token())

    with quota.connect(sql_url, clock=clock) as limiter:
        usage = {u.key: u.count for u in limiter.top(100)}
    ceilings = {k: v for k, v in usage.items() if ":auth-ceiling:" in k}
    tokens = {k: v for k, v in usage.items() if ":auth:tok:" in k}
    assert list(ceilings.values()) == [7]
    assert sorted(tokens.values()) == [1] * 7


def test_the_ceiling_setting_from_the_environment() -> None:
    assert (
        HttpConfig.from_env({"QUOTA_UNVALIDATED_TOKEN_CEILING": "2.5"}).unvalidated_token_ceiling
        == 2.5
    )
    assert (
        HttpConfig.from_env({"QUOTA_UNVALIDATED_TOKEN_CEILING": "off"}).unvalidated_token_ceiling
        is None
    )
    with pytest.raises(ConfigurationError, match="QUOTA_UNVALIDATED_TOKEN_CEILING"):
        HttpConfig.from_env({"QUOTA_UNVALIDATED_TOKEN_CEILING": "lots"})
    with pytest.raises(ConfigurationError, match="unvalidated_token_ceiling"):
        HttpConfig(unvalidated_token_ceiling=0)


# -- the tenant's bucket ------------------------------------------------------------

TENANT_LIMIT = 10
USER_LIMIT = 5


def _tenant_client(make: Make, plans: Plans | None = None, **config: Any) -> HttpClient:
    policy = RoutePolicy(
        name="api", paths=["/api"], rates=f"{USER_LIMIT}/minute",
        tenant_rates=f"{TENANT_LIMIT}/minute",
    )  # fmt: skip

    def identify(request: Any) -> Identity | None:
        user = request.headers.get("x-user")
        return Identity("staff", f"user:{user}", tenant="acme") if user else None

    return make(
        make_config(policies=[policy], tier_multipliers={"staff": 1}, **config),
        identify=identify,
        plans=plans,
    )


def test_callers_of_one_tenant_share_its_bucket(make: Make) -> None:
    client = _tenant_client(make)
    statuses = {
        user: [client.get("/api/items", **{"x-user": user}).status for _ in range(USER_LIMIT)]
        for user in ("ann", "ben", "cat")
    }

    assert statuses["ann"] == [200] * USER_LIMIT
    assert statuses["ben"] == [200] * USER_LIMIT
    assert statuses["cat"] == [429] * USER_LIMIT  # the tenant's 10 are spent


def test_headers_name_the_deciding_bucket(make: Make) -> None:
    client = _tenant_client(make)
    first = client.get("/api/items", **{"x-user": "ann"})
    for _ in range(TENANT_LIMIT - 2):
        client.get("/api/items", **{"x-user": "ben" if _ < 4 else "cat"})
    last = client.get("/api/items", **{"x-user": "dan"})
    refused = client.get("/api/items", **{"x-user": "dan"})

    assert first.header("X-RateLimit-Scope") == "caller"
    assert first.header("X-RateLimit-Remaining") == str(USER_LIMIT - 1)
    assert first.header("X-RateLimit-Tenant-Remaining") == str(TENANT_LIMIT - 1)
    assert last.status == 200
    assert last.header("X-RateLimit-Scope") == "tenant"  # 0 left there, 4 in dan's own
    assert last.header("X-RateLimit-Remaining") == "0"
    assert refused.status == 429
    assert refused.header("X-RateLimit-Scope") == "tenant"
    assert refused.header("X-RateLimit-Limit") == str(TENANT_LIMIT)
    assert refused.header("X-RateLimit-Tenant-Remaining") == "0"
    assert refused.header("Retry-After") is not None

    policy = http_sfv.List()
    policy.parse((refused.header("RateLimit-Policy") or "").encode())
    names = {item.value: dict(item.params) for item in policy}
    assert names["api"]["q"] == USER_LIMIT
    assert names["api-tenant"]["q"] == TENANT_LIMIT
    current = http_sfv.List()
    current.parse((refused.header("RateLimit") or "").encode())
    assert current[0].value == "api-tenant"
    assert dict(current[0].params)["r"] == 0


def test_a_tenant_plan_scales_the_tenant_bucket(make: Make) -> None:
    plans = Plans()
    plans.seed("acme", "pro")  # 1.5x
    client = _tenant_client(make, plans)
    users = [f"u{i}" for i in range(4)]

    allowed = sum(
        client.get("/api/items", **{"x-user": user}).status == 200
        for user in users
        for _ in range(USER_LIMIT)
    )

    assert allowed == TENANT_LIMIT * 3 // 2


def test_callers_without_a_tenant_have_no_tenant_bucket(make: Make) -> None:
    client = _tenant_client(make)

    reply = client.get("/api/items")

    assert reply.status == 200
    assert reply.header("X-RateLimit-Scope") is None
    assert reply.header("X-RateLimit-Tenant-Remaining") is None


def test_tenant_rates_are_validated() -> None:
    with pytest.raises(ConfigurationError, match="tenant_rates"):
        RoutePolicy(name="api", rates="5/minute", tenant_rates="lots")


def test_partition_keys_name_each_bucket(make: Make) -> None:
    client = _tenant_client(make, partition_key=True)
    ann = client.get("/api/items", **{"x-user": "ann"})
    ben = client.get("/api/items", **{"x-user": "ben"})

    def partitions(reply: Any) -> dict[str, bytes]:
        current = http_sfv.List()
        current.parse((reply.header("RateLimit") or "").encode())
        return {item.value: dict(item.params)["pk"] for item in current}

    assert set(partitions(ann)) == {"api", "api-tenant"}
    assert partitions(ann)["api"] != partitions(ben)["api"]  # each caller's own
    assert partitions(ann)["api-tenant"] == partitions(ben)["api-tenant"]  # one tenant
