"""`Guard.plan` and `Guard.verdict` as pure steps: no server, no store, no clock.

Each guard here has a clock that fails the test when read: time reaches
`plan` and `verdict` as an argument, and the pressure reading too.
"""

from __future__ import annotations

from typing import Any

import pytest

from quota._core.decision import Decision
from quota.http import HttpConfig, RequestInfo, RoutePolicy
from quota.http._core import Guard
from quota.http._planning import Hit, Plan

NOW = 1_750_000_000.5
SECRET = b"guard-test-secret-0123456789"


def _no_clock() -> float:
    raise AssertionError("the pure steps read no clock")


def _guard(pressure: Any = None, **settings: Any) -> Guard:
    route = RoutePolicy(name="api", paths=["/api"], rates="10/minute")
    config = HttpConfig(policies=[route], hash_secret=SECRET, velocity=False, **settings)
    return Guard(config, dialect="sqlite", clock=_no_clock, pressure=pressure)


def _request(**headers: str) -> RequestInfo:
    return RequestInfo("GET", "/api", "/api", headers, "198.51.100.1")


def _plan(guard: Guard, request: RequestInfo, pressure: float = 0.0) -> Plan:
    route = guard.config.route_for("GET", "/api")
    assert route is not None
    plan = guard.plan(route, request, NOW, pressure)
    assert plan is not None
    return plan


def _decision(hit: Hit, allowed: bool = True, remaining: int = 5) -> Decision:
    limit = hit.rates[0].limit
    return Decision(allowed, hit.key, limit, remaining, limit - remaining, 60, int(NOW) + 30,
                    0 if allowed else 30)  # fmt: skip


def test_an_anonymous_caller_is_planned_by_ip_at_the_anon_rate() -> None:
    plan = _plan(_guard(), _request())
    assert plan.identity.tier == "anon"
    assert plan.hit.key.startswith("http:api:anon:ip:")
    assert [(r.limit, r.window) for r in plan.hit.rates] == [(10, 60)]
    assert plan.extra == ()


def test_an_unvalidated_token_is_counted_with_the_ceiling_of_its_ip() -> None:
    plan = _plan(_guard(), _request(**{"x-api-key": "k-1"}))
    assert plan.identity.tier == "auth"
    assert plan.hit.key.startswith("http:api:auth:tok:")
    assert [hit.scope for hit in plan.extra] == ["ip"]
    assert plan.extra[0].key.startswith("http:api:auth-ceiling:ip:")


def test_a_repeat_caller_gets_the_same_plan_until_the_config_changes() -> None:
    guard = _guard()
    first = _plan(guard, _request(**{"x-api-key": "k-1"}))
    assert _plan(guard, _request(**{"x-api-key": "k-1"})) is first
    assert _plan(guard, _request(**{"x-api-key": "k-2"})) is not first
    guard.set_tier_multiplier("auth", 2.0)
    again = _plan(guard, _request(**{"x-api-key": "k-1"}))
    assert again is not first
    assert (first.hit.rates[0].limit, again.hit.rates[0].limit) == (50, 20)  # 10 x 5, then x 2


def test_pressure_is_an_argument_and_squeezes_the_tiers_it_applies_to() -> None:
    guard = _guard(adaptive=True, pressure_factors={"anon": 0.5}, pressure=lambda: 1 / 0)
    calm = _plan(guard, _request(), pressure=0.1)
    pressed = _plan(guard, _request(), pressure=0.9)
    assert calm.hit.rates[0].limit == 10
    assert pressed.hit.rates[0].limit == 5


def test_an_allowed_decision_gives_the_headers_and_calls_the_app() -> None:
    guard = _guard()
    plan = _plan(guard, _request())
    verdict = guard.verdict(plan, _request(), _decision(plan.hit), NOW)
    assert verdict.response is None
    headers = dict(verdict.headers)
    assert headers["X-RateLimit-Limit"] == "10"
    assert headers["X-RateLimit-Remaining"] == "5"
    assert headers["RateLimit"] == '"api";r=5;t=30'
    assert "Retry-After" not in headers


def test_a_denial_is_a_429_with_retry_after() -> None:
    guard = _guard()
    plan = _plan(guard, _request())
    verdict = guard.verdict(plan, _request(), _decision(plan.hit, False, 0), NOW)
    assert verdict.response is not None and verdict.response.status == 429
    assert dict(verdict.response.headers)["Retry-After"] == "30"
    assert verdict.headers == []


def test_with_two_buckets_the_one_closest_to_refusing_decides_and_both_are_listed() -> None:
    guard = _guard()
    request = _request(**{"x-api-key": "k-1"})
    plan = _plan(guard, request)
    caller, ceiling = plan.hit, plan.extra[0]
    buckets = [
        (caller, _decision(caller, remaining=40)),
        (ceiling, _decision(ceiling, remaining=7)),
    ]
    verdict = guard.verdict(plan, request, buckets[0][1], NOW, buckets)
    headers = verdict.headers
    assert dict(headers)["X-RateLimit-Remaining"] == "7"
    assert dict(headers)["X-RateLimit-Scope"] == "ip"
    assert dict(headers)["RateLimit"] == '"api-ip";r=7;t=30, "api";r=40;t=30'
    assert dict(headers)["RateLimit-Policy"].startswith('"api-ip";q=')
    assert [name for name, _ in headers][-1] == "X-RateLimit-Scope"


def test_a_refusing_shared_bucket_decides_and_retry_after_stays_last() -> None:
    guard = _guard()
    request = _request(**{"x-api-key": "k-1"})
    plan = _plan(guard, request)
    caller, ceiling = plan.hit, plan.extra[0]
    allowed, refused = _decision(caller, remaining=40), _decision(ceiling, False, 0)
    verdict = guard.verdict(plan, request, allowed, NOW, [(caller, allowed), (ceiling, refused)])
    assert verdict.response is not None and verdict.response.status == 429
    names = [name for name, _ in verdict.response.headers]
    assert names.index("X-RateLimit-Scope") < names.index("Retry-After")
    assert dict(verdict.response.headers)["X-RateLimit-Scope"] == "ip"


@pytest.mark.parametrize("style", ["legacy", "ietf", "none"])
def test_each_header_style_folds_the_shared_bucket_its_own_way(style: str) -> None:
    guard = _guard(headers=style)
    request = _request(**{"x-api-key": "k-1"})
    plan = _plan(guard, request)
    caller, ceiling = plan.hit, plan.extra[0]
    buckets = [(caller, _decision(caller, remaining=4)), (ceiling, _decision(ceiling, remaining=9))]
    names = [n for n, _ in guard.verdict(plan, request, buckets[0][1], NOW, buckets).headers]
    expected = {
        "legacy": ["X-RateLimit-Limit", "X-RateLimit-Remaining", "X-RateLimit-Reset",
                   "X-RateLimit-Lane", "X-RateLimit-Scope"],
        "ietf": ["RateLimit-Policy", "RateLimit"],
        "none": [],
    }  # fmt: skip
    assert names == expected[style]
