"""The HTTP layer end to end in-process: every behaviour on Starlette and Flask, SQLite and PostgreSQL.

Each test runs four times: the ASGI middleware on Starlette (async limiter)
and the WSGI middleware on Flask (sync limiter), each on SQLite and on
PostgreSQL, through the frameworks' own test clients. Time comes from the
injected clock; nothing sleeps.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

import quota
from quota.admin import Admin, PolicyRow
from quota.http import (
    HttpConfig,
    HttpResponse,
    Identity,
    Plans,
    RoutePolicy,
    sign,
)
from tests._http_support import HttpClient, make_client
from tests._support import Clock, expected_retry_after

SECRET = "test-hash-secret-0123456789"
OLD_KEY = "old-signing-secret-0123456789"
NEW_KEY = "new-signing-secret-0123456789"
ANON_LIMIT = 3


def make_config(**changes: Any) -> HttpConfig:
    settings: dict[str, Any] = {
        "policies": [RoutePolicy(name="api", paths=["/api"], rates=f"{ANON_LIMIT}/minute")],
        "exclude": ["/health"],
        "hash_secret": SECRET,
        "hmac_keys": {"k1": OLD_KEY, "k2": NEW_KEY},
        "tier_multipliers": {"anon": 1, "auth": 5, "trusted": 10},
        "runtime_policies": False,
    }
    settings.update(changes)
    return HttpConfig(**settings)


Make = Callable[..., HttpClient]


@pytest.fixture
def make(http_client: Callable[..., HttpClient], sql_url: str) -> Make:
    def build(config: HttpConfig | None = None, **options: Any) -> HttpClient:
        return http_client(sql_url, config or make_config(), **options)

    return build


# -- the basic contract --------------------------------------------------------------


def test_under_the_limit_answers_200_with_headers_counting_down(make: Make, clock: Clock) -> None:
    client = make()
    replies = [client.get("/api/items") for _ in range(ANON_LIMIT)]

    assert [r.status for r in replies] == [200] * ANON_LIMIT
    assert [r.header("X-RateLimit-Remaining") for r in replies] == ["2", "1", "0"]
    assert {r.header("X-RateLimit-Limit") for r in replies} == {"3"}
    assert {r.header("RateLimit-Policy") for r in replies} == {'"api";q=3;w=60'}
    reset_in = expected_retry_after(int(replies[0].header("X-RateLimit-Reset") or 0), clock.now)
    assert [r.header("RateLimit") for r in replies] == [
        f'"api";r={left};t={reset_in}' for left in (2, 1, 0)
    ]
    assert all(r.header("Retry-After") is None for r in replies)


def test_over_the_limit_answers_429_with_retry_after_and_a_problem_body(
    make: Make, clock: Clock
) -> None:
    client = make()
    for _ in range(ANON_LIMIT):
        client.get("/api/items")
    handled = len(client.handled)

    denied = client.get("/api/items")

    assert denied.status == 429
    reset_at = int(denied.header("X-RateLimit-Reset") or 0)
    retry = expected_retry_after(reset_at, clock.now)
    assert denied.header("Retry-After") == str(retry)
    assert denied.header("Content-Type") == "application/problem+json"
    assert denied.header("X-RateLimit-Remaining") == "0"
    body = denied.json()
    assert body["type"] == "https://iana.org/assignments/http-problem-types#quota-exceeded"
    assert body["title"] == "Quota Exceeded"
    assert body["violated-policies"] == ["api"]
    assert body["status"] == 429
    assert body["code"] == "RATE_LIMITED"
    assert body["retry_after"] == retry
    assert "detail" in body
    assert len(client.handled) == handled, "a denied request must not reach the handler"


def test_an_authenticated_caller_gets_a_bigger_bucket_than_anon(make: Make) -> None:
    client = make()
    for _ in range(ANON_LIMIT):
        client.get("/api/items")
    assert client.get("/api/items").status == 429

    authed = client.get("/api/items", authorization="Bearer token-one")

    assert authed.status == 200
    assert authed.header("X-RateLimit-Limit") == str(ANON_LIMIT * 5)
    api_key = client.get("/api/items", x_api_key="key-two")
    assert api_key.header("X-RateLimit-Limit") == str(ANON_LIMIT * 5)


def _any_token(token: str) -> bool:
    """A token validator vouching for every token (the app checked them)."""
    return True


def test_limits_are_per_key_not_global(make: Make) -> None:
    client = make(token_validator=_any_token)
    for _ in range(ANON_LIMIT * 5):
        assert client.get("/api/items", authorization="Bearer alice").status == 200
    assert client.get("/api/items", authorization="Bearer alice").status == 429

    bob = client.get("/api/items", authorization="Bearer bob")
    anon = client.get("/api/items")

    assert bob.status == 200
    assert bob.header("X-RateLimit-Remaining") == str(ANON_LIMIT * 5 - 1)
    assert anon.status == 200
    assert anon.header("X-RateLimit-Remaining") == str(ANON_LIMIT - 1)


def test_the_window_resets_with_the_clock(make: Make, clock: Clock) -> None:
    client = make()
    for _ in range(ANON_LIMIT):
        client.get("/api/items")
    denied = client.get("/api/items")
    assert denied.status == 429

    clock.advance(int(denied.header("Retry-After") or 0))

    again = client.get("/api/items")
    assert again.status == 200
    assert again.header("X-RateLimit-Remaining") == str(ANON_LIMIT - 1)


def test_route_classes_count_apart_and_unmatched_routes_pass(make: Make) -> None:
    config = make_config(
        policies=[
            RoutePolicy(name="item", paths=["/api/items/{id}"], rates="1/minute"),
            RoutePolicy(name="api", paths=["/api"], rates=f"{ANON_LIMIT}/minute"),
        ]
    )
    client = make(config)

    assert client.get("/api/items/1").header("RateLimit-Policy") == '"item";q=1;w=60'
    assert client.get("/api/items/2").status == 429  # one class, whichever id
    assert client.get("/api/items").status == 200
    other = client.get("/other")
    assert other.status == 200
    assert other.header("X-RateLimit-Limit") is None


def test_a_default_class_covers_unmatched_routes(make: Make) -> None:
    client = make(make_config(default=RoutePolicy(name="rest", rates="1/minute")))

    assert client.get("/other").status == 200
    assert client.get("/other").status == 429
    assert client.get("/api/items").status == 200  # its own class, its own count


def test_excluded_paths_are_never_limited(make: Make) -> None:
    client = make(make_config(default=RoutePolicy(name="rest", rates="1/minute")))

    replies = [client.get("/health") for _ in range(5)]

    assert [r.status for r in replies] == [200] * 5
    assert all(r.header("X-RateLimit-Limit") is None for r in replies)


@pytest.mark.parametrize("where", ["config", "route"])
def test_mutations_only_leaves_safe_methods_free(make: Make, where: str) -> None:
    route = RoutePolicy(
        name="api", paths=["/api"], rates="1/minute", mutations_only=where == "route"
    )
    client = make(make_config(policies=[route], mutations_only=where == "config"))

    safe = [client.request(m, "/api/items") for m in ("GET", "HEAD", "OPTIONS", "GET")]
    assert [r.status for r in safe] == [200] * 4
    assert all(r.header("X-RateLimit-Limit") is None for r in safe)
    assert client.post("/api/items").status == 200
    assert client.request("DELETE", "/api/items").status == 429


def test_cost_counts_a_request_as_several_hits(make: Make) -> None:
    route = RoutePolicy(name="api", paths=["/api"], rates="5/minute", cost=2)
    client = make(make_config(policies=[route]))

    assert [client.post("/api/items").header("X-RateLimit-Remaining") for _ in range(2)] == [
        "3",
        "1",
    ]
    assert client.post("/api/items").status == 429


def test_a_token_bucket_class_bursts_then_refills_with_the_clock(make: Make, clock: Clock) -> None:
    client = make(
        make_config(policies=[RoutePolicy(name="api", paths=["/api"], rates="1/s burst 3")])
    )

    replies = [client.get("/api/items") for _ in range(4)]

    assert [r.status for r in replies] == [200, 200, 200, 429]
    assert [r.header("X-RateLimit-Remaining") for r in replies] == ["2", "1", "0", "0"]
    assert {r.header("X-RateLimit-Limit") for r in replies} == {"3"}
    assert replies[-1].header("Retry-After") == "1"
    clock.advance(1)
    assert client.get("/api/items").status == 200


def test_several_rates_on_one_class_all_apply(make: Make) -> None:
    route = RoutePolicy(name="api", paths=["/api"], rates="3/minute;4/hour")
    client = make(make_config(policies=[route]))

    replies = [client.get("/api/items") for _ in range(4)]

    assert [r.status for r in replies] == [200, 200, 200, 429]
    assert replies[0].header("RateLimit-Policy") == '"api-0";q=3;w=60, "api-1";q=4;w=3600'
    assert (replies[0].header("RateLimit") or "").startswith('"api-0";r=2;')


def test_shadow_mode_decides_and_reports_but_never_blocks(make: Make) -> None:
    client = make(make_config(shadow=True))

    replies = [client.get("/api/items") for _ in range(ANON_LIMIT + 3)]

    assert [r.status for r in replies] == [200] * (ANON_LIMIT + 3)
    assert replies[-1].header("X-RateLimit-Remaining") == "0"
    assert replies[-1].header("Retry-After") is None
    assert len(client.handled) == ANON_LIMIT + 3
    assert client.metrics.get("shadow_blocked", route="api", tier="anon") == 3
    assert client.metrics.get("blocked", route="api", tier="anon") == 0


def test_the_master_switch_turns_everything_off(make: Make) -> None:
    client = make(make_config(enabled=False))

    replies = [client.get("/api/items") for _ in range(ANON_LIMIT + 2)]

    assert [r.status for r in replies] == [200] * (ANON_LIMIT + 2)
    assert all(r.header("X-RateLimit-Limit") is None for r in replies)


# -- identity ------------------------------------------------------------------------

SIGNED_PATH = "/api/items"


def _signed(case: str, now: float) -> tuple[str, dict[str, str]]:
    """(path to request, headers) for one signature case."""
    if case == "valid":
        return SIGNED_PATH, sign("k1", OLD_KEY, "GET", SIGNED_PATH, now)
    if case == "rotated":
        return SIGNED_PATH, sign("k2", NEW_KEY, "GET", SIGNED_PATH, now)
    if case == "tampered":
        headers = sign("k1", OLD_KEY, "GET", SIGNED_PATH, now)
        last = headers["x-quota-signature"][-1]
        headers["x-quota-signature"] = headers["x-quota-signature"][:-1] + (
            "0" if last != "0" else "1"
        )
        return SIGNED_PATH, headers
    if case == "expired":
        return SIGNED_PATH, sign("k1", OLD_KEY, "GET", SIGNED_PATH, now - 301)
    if case == "wrong_path":
        return "/api/items/7", sign("k1", OLD_KEY, "GET", SIGNED_PATH, now)
    if case == "wrong_method":
        return SIGNED_PATH, sign("k1", OLD_KEY, "POST", SIGNED_PATH, now)
    if case == "huge_timestamp":
        return SIGNED_PATH, {
            **sign("k1", OLD_KEY, "GET", SIGNED_PATH, now),
            "x-quota-timestamp": "9" * 5000,
        }
    if case == "unknown_key":
        return SIGNED_PATH, sign("k9", OLD_KEY, "GET", SIGNED_PATH, now)
    if case == "wrong_secret":
        return SIGNED_PATH, sign("k1", NEW_KEY, "GET", SIGNED_PATH, now)
    raise AssertionError(case)


@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ("valid", None),
        ("rotated", None),
        ("tampered", "bad_signature"),
        ("expired", "expired"),
        ("wrong_path", "bad_signature"),
        ("wrong_method", "bad_signature"),
        ("unknown_key", "unknown_key"),
        ("wrong_secret", "bad_signature"),
        ("huge_timestamp", "malformed"),
    ],
)
def test_a_signed_caller_is_trusted_only_with_a_valid_signature(
    make: Make, clock: Clock, case: str, reason: str | None
) -> None:
    client = make()
    path, headers = _signed(case, clock.now)

    reply = client.request("GET", path, headers)

    assert reply.status == 200
    if reason is None:
        assert reply.header("X-RateLimit-Limit") == str(ANON_LIMIT * 10)
        assert client.metrics.snapshot() == {"ratelimit.hits{route=api,tier=trusted}": 1}
    else:
        # Falls back to the lower tier (anon here: no token), counted, never a 500.
        assert reply.header("X-RateLimit-Limit") == str(ANON_LIMIT)
        assert client.metrics.get("hmac_rejected", reason=reason) == 1


def test_a_signature_stays_valid_for_five_minutes_either_way(make: Make, clock: Clock) -> None:
    client = make()
    early = sign("k1", OLD_KEY, "GET", SIGNED_PATH, clock.now + 300)
    late = sign("k1", OLD_KEY, "GET", SIGNED_PATH, clock.now - 300)

    assert client.request("GET", SIGNED_PATH, early).header("X-RateLimit-Limit") == "30"
    assert client.request("GET", SIGNED_PATH, late).header("X-RateLimit-Limit") == "30"


def test_a_rotated_out_key_is_refused_and_the_new_one_kept(make: Make, clock: Clock) -> None:
    client = make(make_config(hmac_keys={"k2": NEW_KEY}))

    old = client.request("GET", SIGNED_PATH, sign("k1", OLD_KEY, "GET", SIGNED_PATH, clock.now))
    new = client.request("GET", SIGNED_PATH, sign("k2", NEW_KEY, "GET", SIGNED_PATH, clock.now))

    assert old.header("X-RateLimit-Limit") == str(ANON_LIMIT)
    assert client.metrics.get("hmac_rejected", reason="unknown_key") == 1
    assert new.header("X-RateLimit-Limit") == str(ANON_LIMIT * 10)


def test_a_bad_signature_with_a_token_falls_back_to_the_auth_tier(make: Make, clock: Clock) -> None:
    client = make()
    headers = sign("k1", OLD_KEY, "GET", "/elsewhere", clock.now)
    headers["authorization"] = "Bearer t"

    reply = client.request("GET", SIGNED_PATH, headers)

    assert reply.header("X-RateLimit-Limit") == str(ANON_LIMIT * 5)


def test_a_spoofed_forwarded_for_from_an_untrusted_peer_does_not_change_the_key(
    make: Make,
) -> None:
    client = make(make_config(trusted_proxies=["10.0.0.0/8"]), peer="198.51.100.7")

    replies = [
        client.get("/api/items", x_forwarded_for=f"192.0.2.{i}", cf_connecting_ip=f"192.0.2.{i}")
        for i in range(ANON_LIMIT + 1)
    ]

    assert [r.header("X-RateLimit-Remaining") for r in replies] == ["2", "1", "0", "0"]
    assert replies[-1].status == 429


def test_a_trusted_proxy_forwards_the_client_address(make: Make) -> None:
    client = make(make_config(trusted_proxies=["10.0.0.0/8"]), peer="10.0.0.2")

    # The client is the rightmost hop that is not a trusted proxy; what it
    # put further left (a forged address) does not matter.
    first = client.get("/api/items", x_forwarded_for="1.1.1.1, 192.0.2.1, 10.0.0.5")
    forged = client.get("/api/items", x_forwarded_for="8.8.8.8, 192.0.2.1, 10.0.0.5")
    other = client.get("/api/items", x_forwarded_for="192.0.2.2, 10.0.0.5")

    assert first.header("X-RateLimit-Remaining") == "2"
    assert forged.header("X-RateLimit-Remaining") == "1"
    assert other.header("X-RateLimit-Remaining") == "2"


def test_no_raw_ip_or_token_reaches_the_database(make: Make, sql_url: str, clock: Clock) -> None:
    client = make(token_validator=_any_token)
    client.get("/api/items")
    client.get("/api/items", authorization="Bearer secret-token-value")

    with quota.connect(sql_url, clock=clock) as limiter:
        keys = [usage.key for usage in limiter.top(10)]

    assert len(keys) == 2
    assert all("203.0.113.9" not in k and "secret-token-value" not in k for k in keys)
    assert {k.split(":")[2] for k in keys} == {"anon", "auth"}


def test_an_identify_hook_supplies_the_tier_and_a_tenant_plan_scales_it(make: Make) -> None:
    plans = Plans()
    plans.seed("acme", "enterprise")

    def identify(request: Any) -> Identity | None:
        user = request.headers.get("x-user")
        return Identity("staff", f"user:{user}", tenant="acme") if user else None

    client = make(make_config(tier_multipliers={"staff": 2}), identify=identify, plans=plans)

    staff = client.get("/api/items", x_user="7")
    anon = client.get("/api/items")

    assert staff.header("X-RateLimit-Limit") == str(ANON_LIMIT * 2 * 3)
    assert anon.header("X-RateLimit-Limit") == str(ANON_LIMIT)


def test_a_failing_identify_hook_falls_back_to_the_built_in_tiers(make: Make) -> None:
    def identify(_request: Any) -> Identity | None:
        raise RuntimeError("session store down")

    client = make(identify=identify)

    reply = client.get("/api/items", authorization="Bearer t")

    assert reply.status == 200
    assert reply.header("X-RateLimit-Limit") == str(ANON_LIMIT * 5)
    assert client.metrics.get("hook_failed", hook="identify") == 1


def test_pressure_lowers_capacity_for_non_exempt_tiers(make: Make, clock: Clock) -> None:
    pressure = [0.9]
    client = make(make_config(adaptive=True), pressure=lambda: pressure[0])

    anon = client.get("/api/items", x_api_key="")
    authed = client.get("/api/items", authorization="Bearer t")
    trusted = client.request("GET", SIGNED_PATH, sign("k1", OLD_KEY, "GET", SIGNED_PATH, clock.now))
    pressure[0] = 0.1
    calm = client.get("/api/items", authorization="Bearer t")

    assert anon.header("X-RateLimit-Limit") == "1"  # floor(3 * 0.55)
    assert authed.header("X-RateLimit-Limit") == "10"  # floor(15 * 0.7)
    assert trusted.header("X-RateLimit-Limit") == "30"  # exempt
    assert calm.header("X-RateLimit-Limit") == "15"
    assert calm.header("X-RateLimit-Remaining") == "13", "the bucket kept its count"


# -- failures ------------------------------------------------------------------------


def test_a_handler_that_raises_is_still_counted_once(make: Make) -> None:
    client = make()

    crashed = client.get("/api/boom")
    after = client.get("/api/items")

    assert crashed.status == 500
    assert after.status == 200
    assert after.header("X-RateLimit-Remaining") == str(ANON_LIMIT - 2)
    assert client.handled == ["/api/boom", "/api/items"]


def _dead_url(url: str, tmp_path: Any) -> str:
    if url.startswith("sqlite"):
        blocker = tmp_path / "a-directory"
        blocker.mkdir()
        return f"sqlite:///{blocker}"  # cannot be opened: a directory, not a database file
    return "postgresql://root@127.0.0.1:1/nowhere"  # nothing listens on port 1


@pytest.mark.parametrize("fail_open", [True, False], ids=["fail-open", "fail-closed"])
def test_a_limiter_whose_database_is_down_never_yields_a_500(
    framework: str, sql_url: str, clock: Clock, tmp_path: Any, fail_open: bool
) -> None:
    dead = _dead_url(sql_url, tmp_path)
    route = RoutePolicy(name="api", paths=["/api"], rates="3/minute", fail_open=fail_open)
    config = make_config(policies=[route], runtime_policies=True)
    client = make_client(framework, dead, clock, config)
    try:
        replies = [client.get("/api/items") for _ in range(3)]
    finally:
        client.close()

    if fail_open:
        assert [r.status for r in replies] == [200] * 3
        assert all(r.header("X-RateLimit-Limit") is None for r in replies)
    else:
        assert [r.status for r in replies] == [503] * 3
        assert all(r.header("Retry-After") == "5" for r in replies)
        assert replies[0].json()["code"] == "RATE_LIMIT_UNAVAILABLE"
        assert replies[0].header("Content-Type") == "application/problem+json"
    mode = "open" if fail_open else "closed"
    assert client.metrics.get("errors", route="api", mode=mode) == 3
    assert client.metrics.get("policy_refresh_failed") == 1, "read once per cache period"


def test_a_failing_response_factory_falls_back_to_the_default_429(make: Make) -> None:
    def factory(_denial: Any) -> HttpResponse:
        raise RuntimeError("factory bug")

    client = make(make_config(policies=[RoutePolicy(name="api", paths=["/api"], rates="1/minute")]),
                  response_factory=factory)  # fmt: skip
    client.get("/api/items")

    denied = client.get("/api/items")

    assert denied.status == 429
    assert denied.json()["code"] == "RATE_LIMITED"


def test_a_response_factory_shapes_the_mcp_answer_as_json_rpc(make: Make) -> None:
    def jsonrpc(denial: Any) -> HttpResponse | None:
        if not denial.request.path.startswith("/mcp"):
            return None
        body = json.dumps({
            "jsonrpc": "2.0", "id": None,
            "error": {"code": -32029, "message": "rate limited",
                      "data": {"retry_after": denial.retry_after}},
        }).encode()  # fmt: skip
        return HttpResponse(429, (("Content-Type", "application/json"), *denial.headers), body)

    config = make_config(
        policies=[
            RoutePolicy(name="mcp", paths=["/mcp"], rates="1/minute"),
            RoutePolicy(name="api", paths=["/api"], rates="1/minute"),
        ]
    )
    client = make(config, response_factory=jsonrpc)
    client.post("/mcp")
    client.get("/api/items")

    mcp = client.post("/mcp")
    rest = client.get("/api/items")

    assert mcp.status == 429
    assert mcp.json()["error"]["code"] == -32029
    assert mcp.json()["error"]["data"]["retry_after"] == int(mcp.header("Retry-After") or 0)
    assert rest.json()["code"] == "RATE_LIMITED"


def test_cross_origin_requests_can_read_the_headers(make: Make, framework: str) -> None:
    client = make(cors=True) if framework == "starlette" else make()

    reply = client.get("/api/items", origin="https://app.example")
    same_origin = client.get("/api/items")

    exposed = {
        h.strip().lower() for h in (reply.header("Access-Control-Expose-Headers") or "").split(",")
    }
    assert {"x-ratelimit-remaining", "x-ratelimit-reset", "ratelimit", "retry-after"} <= exposed
    if framework == "starlette":
        assert "x-custom" in exposed, "the app's own exposed headers are kept"
    assert same_origin.header("Access-Control-Expose-Headers") is None


# -- runtime policy ------------------------------------------------------------------


def test_a_policy_change_in_the_database_applies_at_a_boundary_of_the_cache_period(
    make: Make, sql_url: str, clock: Clock
) -> None:
    client = make(make_config(runtime_policies=True, policy_cache_seconds=5))
    assert client.get("/api/items").header("X-RateLimit-Limit") == "3"

    # Written 0.75 s before a boundary (the clock starts 4.25 s into a 5 s
    # period): not applied there, but at the next one, on every worker at once.
    with quota.connect(sql_url, clock=clock) as limiter:
        Admin(limiter).set_policy(PolicyRow(route="api", rates="10/minute"))
    clock.advance(4)
    cached = client.get("/api/items")
    clock.advance(2)
    fresh = client.get("/api/items")

    assert cached.header("X-RateLimit-Limit") == "3"
    assert fresh.header("X-RateLimit-Limit") == "10"
    assert fresh.header("X-RateLimit-Remaining") == "7", "the count carried over"


def test_overrides_for_a_tier_a_caller_and_an_exemption(
    make: Make, sql_url: str, clock: Clock
) -> None:
    client = make(
        make_config(runtime_policies=True, policy_cache_seconds=5), token_validator=_any_token
    )
    subject = client.middleware.guard.subject("tok", "vip")
    with quota.connect(sql_url) as limiter:
        Admin(limiter).set_policy(PolicyRow(route="api", subject="tier:auth", rates="7/minute"))
        Admin(limiter).set_policy(PolicyRow(route="*", subject=subject, rates="100/minute"))
        Admin(limiter).set_policy(PolicyRow(route="api", subject="tier:trusted", exempt=True))

    authed = client.get("/api/items", authorization="Bearer someone")
    vip = client.get("/api/items", authorization="Bearer vip")
    trusted = client.request("GET", SIGNED_PATH, sign("k1", OLD_KEY, "GET", SIGNED_PATH, clock.now))

    assert authed.header("X-RateLimit-Limit") == "7", "exact: no tier multiplier"
    assert vip.header("X-RateLimit-Limit") == "100"
    assert trusted.status == 200
    assert trusted.header("X-RateLimit-Limit") is None
    assert client.metrics.get("exempt", route="api") == 1


def test_a_missing_policies_table_leaves_the_code_defaults(
    framework: str, tmp_path: Any, clock: Clock
) -> None:
    url = f"sqlite:///{tmp_path / 'old.db'}"
    quota.migrate(url, revision="0003_algorithms")
    import sqlite3

    # The counters work (pretend the code needs only 0003) but the table is absent.
    with sqlite3.connect(tmp_path / "old.db") as conn:
        conn.execute("UPDATE quota_alembic_version SET version_num = '0004_policies'")
    config = make_config(runtime_policies=True)
    client = make_client(framework, url, clock, config)
    try:
        replies = [client.get("/api/items") for _ in range(2)]
    finally:
        client.close()

    assert [r.header("X-RateLimit-Remaining") for r in replies] == ["2", "1"]
    assert client.metrics.get("policy_refresh_failed") == 1


def test_a_failed_policy_read_leaves_a_fallback_limiter_on_the_database(
    framework: str, tmp_path: Any, clock: Clock
) -> None:
    url = f"sqlite:///{tmp_path / 'q.db'}"
    quota.migrate(url)
    import sqlite3

    with sqlite3.connect(tmp_path / "q.db") as conn:
        conn.execute("DROP TABLE quota_policies")
    connect = quota.connect_async if framework == "starlette" else quota.connect
    limiter = connect(url, clock=clock, fallback=True)
    client = make_client(framework, url, clock, make_config(runtime_policies=True), limiter=limiter)
    try:
        replies = [client.get("/api/items") for _ in range(2)]
        store_up = limiter.store.up
    finally:
        client.close()

    assert [r.header("X-RateLimit-Remaining") for r in replies] == ["2", "1"]
    assert client.metrics.get("policy_refresh_failed") == 1
    assert store_up, "reading the overrides must not mark the database down"
    with quota.connect(url, clock=clock) as plain:
        assert [u.count for u in plain.top(10)] == [2], "the hits were counted in the database"
