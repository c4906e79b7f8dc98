"""The HTTP layer's pure parts, without a database or a framework.

Identity (client IP behind proxies, credentials, HMAC), path patterns,
configuration and its environment variables, scaling, headers, the runtime
policy cache, and the decision flow driven by hand.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import types
from typing import Any

import pytest

import quota
import quota.http
from quota._core.algorithms import Rate
from quota._core.decision import Decision
from quota.admin import PolicyRow
from quota.http import (
    HttpConfig,
    Identity,
    Plans,
    RequestInfo,
    RoutePolicy,
    SystemPressure,
    sign,
)
from quota.http._capacity import ScaledRates, scale_rate
from quota.http._core import LOAD_POLICIES, PASS, Guard, drive_sync
from quota.http._identity import (
    client_ip,
    credential,
    hashed_subject,
    ip_subject_value,
    keyed_hash,
    parse_networks,
    verify_signature,
)
from quota.http._planning import Hit
from quota.http._responses import PolicyShape, expose, rate_limit_headers
from quota.http._routes import compile_paths
from quota.http._runtime import RuntimePolicies

SECRET = "core-test-secret-0123456789"
NOW = 1_750_000_000.5

# -- client IP -----------------------------------------------------------------------

PROXIES = parse_networks("trusted_proxies", ["10.0.0.0/8", "fd00::/8"])


@pytest.mark.parametrize(
    ("peer", "headers", "expected"),
    [
        ("198.51.100.1", {}, "198.51.100.1"),
        # An untrusted peer's headers are ignored, whatever they say.
        ("198.51.100.1", {"x-forwarded-for": "1.2.3.4"}, "198.51.100.1"),
        ("198.51.100.1", {"cf-connecting-ip": "1.2.3.4"}, "198.51.100.1"),
        # A trusted proxy: x-forwarded-for from the right; no client-IP header
        # (cf-connecting-ip) is read unless `client_ip_header` names it.
        ("10.0.0.1", {"cf-connecting-ip": "1.2.3.4", "x-forwarded-for": "5.6.7.8"}, "5.6.7.8"),
        ("10.0.0.1", {"x-forwarded-for": "9.9.9.9, 1.2.3.4"}, "1.2.3.4"),
        ("10.0.0.1", {"x-forwarded-for": "9.9.9.9, 1.2.3.4, 10.1.1.1"}, "1.2.3.4"),
        ("10.0.0.1", {"x-forwarded-for": "10.2.2.2, 10.1.1.1"}, "10.2.2.2"),
        ("10.0.0.1", {"x-forwarded-for": "1.2.3.4, garbage, 10.1.1.1"}, "10.1.1.1"),
        ("10.0.0.1", {"x-forwarded-for": "garbage"}, "10.0.0.1"),
        ("10.0.0.1", {"cf-connecting-ip": "nonsense", "x-forwarded-for": "1.2.3.4"}, "1.2.3.4"),
        ("10.0.0.1", {}, "10.0.0.1"),
        ("::ffff:198.51.100.1", {}, "198.51.100.1"),
        ("fd00::1", {"x-forwarded-for": "2001:db8::5"}, "2001:db8::5"),
        ("testclient", {"x-forwarded-for": "1.2.3.4"}, "testclient"),
        (None, {"x-forwarded-for": "1.2.3.4"}, None),
    ],
)
def test_the_client_ip_believes_headers_only_from_trusted_proxies(
    peer: str | None, headers: dict[str, str], expected: str | None
) -> None:
    assert client_ip(peer, headers, PROXIES) == expected


def test_without_trusted_proxies_the_peer_is_the_client() -> None:
    assert client_ip("10.0.0.1", {"x-forwarded-for": "1.2.3.4"}, ()) == "10.0.0.1"


def test_ipv6_clients_are_keyed_by_their_64_prefix() -> None:
    assert ip_subject_value("2001:db8:1:2:aaaa::1", 64) == "2001:db8:1:2::/64"
    assert ip_subject_value("2001:db8:1:2:bbbb::9", 64) == "2001:db8:1:2::/64"
    assert ip_subject_value("2001:db8::1", 128) == "2001:db8::1"
    assert ip_subject_value("198.51.100.1", 64) == "198.51.100.1"


def test_bad_trusted_proxies_name_the_setting() -> None:
    with pytest.raises(quota.ConfigurationError, match="trusted_proxies: 'ten/8'"):
        parse_networks("trusted_proxies", ["ten/8"])


# -- hashes and credentials -------------------------------------------------------------


def test_keyed_hashes_depend_on_the_secret_and_the_kind() -> None:
    a = keyed_hash(b"a" * 16, "ip", "198.51.100.1")
    assert len(a) == 32
    assert a == keyed_hash(b"a" * 16, "ip", "198.51.100.1")
    assert a != keyed_hash(b"b" * 16, "ip", "198.51.100.1")
    assert a != keyed_hash(b"a" * 16, "tok", "198.51.100.1")
    assert "198.51.100.1" not in hashed_subject("ip", "198.51.100.1", b"a" * 16)


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({"authorization": "Bearer abc"}, "abc"),
        ({"authorization": "bearer   abc "}, "abc"),
        ({"authorization": "Basic dXNlcjpwYXNz"}, "Basic dXNlcjpwYXNz"),
        ({"authorization": "Bearer "}, None),
        ({"x-api-key": "k1"}, "k1"),
        ({"x-api-key": "  "}, None),
        ({}, None),
    ],
)
def test_the_credential_is_a_bearer_token_or_an_api_key(
    headers: dict[str, str], expected: str | None
) -> None:
    assert credential(headers, ("x-api-key",)) == expected


# -- HMAC ------------------------------------------------------------------------------

KEYS = {"k1": b"k1-secret-0123456789", "k2": b"k2-secret-0123456789"}


def _verify(
    headers: dict[str, str], method: str = "GET", path: str = "/p", now: float = NOW
) -> Any:
    return verify_signature(headers, method, path, now, KEYS, 300)


def test_a_valid_signature_names_its_key() -> None:
    assert _verify(sign("k1", KEYS["k1"], "get", "/p", NOW)) == ("k1", None)
    assert _verify(sign("k2", KEYS["k2"], "GET", "/p", NOW - 300)) == ("k2", None)


def test_no_signature_headers_is_no_verdict() -> None:
    assert _verify({}) == (None, None)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"x-quota-signature": "zz"}, "malformed"),
        ({"x-quota-timestamp": "soon"}, "malformed"),
        ({"x-quota-key-id": ""}, "malformed"),
        ({"x-quota-timestamp": "9" * 5000}, "malformed"),
        ({"x-quota-timestamp": ""}, "malformed"),
        ({"x-quota-key-id": "k3"}, "unknown_key"),
        ({"x-quota-timestamp": str(int(NOW) - 301)}, "expired"),
        ({"x-quota-timestamp": str(int(NOW) + 301)}, "expired"),
        ({"x-quota-signature": "00" * 32}, "bad_signature"),
        ({"x-quota-key-id": "k2"}, "bad_signature"),
    ],
)
def test_a_bad_signature_names_why(change: dict[str, str], reason: str) -> None:
    headers = {**sign("k1", KEYS["k1"], "GET", "/p", NOW), **change}
    assert _verify(headers) == (None, reason)


def test_a_signature_covers_method_and_path() -> None:
    headers = sign("k1", KEYS["k1"], "GET", "/p", NOW)
    assert _verify(headers, path="/q") == (None, "bad_signature")
    assert _verify(headers, method="POST") == (None, "bad_signature")


def test_only_some_signature_headers_is_malformed() -> None:
    assert _verify({"x-quota-key-id": "k1"}) == (None, "malformed")


# -- path patterns ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pattern", "matching", "not_matching"),
    [
        ("/api", ["/api", "/api/", "/api/x/y"], ["/apix", "/", "/v1/api"]),
        ("/api/", ["/api", "/api/x"], ["/apix"]),
        ("/users/{id}/posts", ["/users/7/posts", "/users/7/posts/1"], ["/users/posts", "/users/7"]),
        ("/files/*", ["/files/a", "/files/a/b"], ["/files", "/filesx"]),
        ("/", ["/", "/anything/at/all"], []),
        ("re:^/v[0-9]+/chat$", ["/v1/chat", "/v22/chat"], ["/v1/chat/x", "/vx/chat"]),
    ],
)
def test_path_patterns_match_on_segment_boundaries(
    pattern: str, matching: list[str], not_matching: list[str]
) -> None:
    compiled = compile_paths("paths", [pattern])
    assert all(compiled.fullmatch(p) for p in matching)
    assert not any(compiled.fullmatch(p) for p in not_matching)


def test_a_newline_in_a_path_changes_neither_its_class_nor_its_exclusion() -> None:
    config = HttpConfig(
        policies=[
            RoutePolicy(name="search", paths=["/api/items/{id}"], rates="3/minute"),
            RoutePolicy(name="regex", paths=["re:/v1/.*"], rates="3/minute"),
        ],
        exclude=["/health"], hash_secret="h" * 16, runtime_policies=False,
    )  # fmt: skip

    assert config.route_for("GET", "/api/items/a\nb").name == "search"
    assert config.route_for("GET", "/api/items/a\nb/c").name == "search"
    assert config.route_for("GET", "/v1/a\nb").name == "regex"
    assert config.route_for("GET", "/api/items\n") is None
    assert not config.excluded("/health\n")
    assert config.excluded("/health/x\ny")


@pytest.mark.parametrize("pattern", ["api", "re:(", 7])
def test_a_bad_path_pattern_names_the_setting(pattern: Any) -> None:
    with pytest.raises(quota.ConfigurationError, match="exclude"):
        HttpConfig(exclude=[pattern])


# -- route classes and configuration -------------------------------------------------------


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"name": "has space", "rates": "1/s"}, "route class name"),
        ({"name": "a", "rates": "10/lightyear"}, "route class 'a' rates: unknown unit"),
        ({"name": "a", "rates": "2/minute", "cost": 3}, "route class 'a': cost 3 can never pass"),
        ({"name": "a", "rates": "2/minute", "cost": 0}, "cost must be a positive integer"),
        ({"name": "a", "rates": "2/minute", "methods": "GET"}, "methods must be a list"),
        ({"name": "a", "rates": "2/minute", "tier_rates": {"auth": "x"}}, r"tier_rates\['auth'\]"),
        ({"name": "a", "rates": "2/minute", "algorithm": "leaky"}, "algorithm must be one of"),
        ({"name": "a", "rates": "2/minute", "fail_open": "no"}, "fail_open must be a bool"),
    ],
)
def test_a_bad_route_class_fails_when_built(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(quota.ConfigurationError, match=message):
        RoutePolicy(**settings)


def test_a_route_class_matches_methods_and_paths() -> None:
    route = RoutePolicy(name="w", paths=["/api"], methods=["post", "PUT"], rates="1/s")
    assert route.matches("POST", "/api/x")
    assert not route.matches("GET", "/api/x")
    assert not route.matches("POST", "/other")
    assert route.base_rates == (Rate(limit=1, window=1),)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"hash_secret": "short"}, "hash_secret must be at least 16 bytes"),
        ({"headers": "fancy"}, "headers must be one of"),
        ({"enabled": "yes"}, "enabled must be a bool"),
        ({"hmac_keys": {"k": "short"}}, r"hmac_keys\['k'\]"),
        ({"hmac_window": 0}, "hmac_window"),
        ({"tier_multipliers": {"auth": -1}}, r"tier_multipliers\['auth'\]"),
        ({"pressure_factors": {"anon": 2}}, "pressure_factors must be at most 1"),
        ({"pressure_threshold": 0}, "pressure_threshold"),
        ({"policy_cache_seconds": -1}, "policy_cache_seconds"),
        ({"key_prefix": "a b"}, "key_prefix"),
        ({"ipv6_prefix": 0}, "ipv6_prefix"),
        ({"policies": ["100/minute"]}, "policies must be RoutePolicy objects"),
        (
            {"policies": [RoutePolicy(name="a", rates="1/s"), RoutePolicy(name="a", rates="2/s")]},
            "route class names must be unique",
        ),
    ],
)
def test_a_bad_config_fails_when_built(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(quota.ConfigurationError, match=message):
        HttpConfig(**settings)


def test_config_is_frozen_and_keyword_only() -> None:
    config = HttpConfig()
    with pytest.raises(AttributeError):
        config.enabled = False  # type: ignore[misc]
    with pytest.raises(TypeError):
        HttpConfig(True)  # type: ignore[misc]


# -- the environment ------------------------------------------------------------------------

CHAT = RoutePolicy(name="chat", paths=["/api/chat"], rates="10/minute")


def test_the_environment_tunes_the_classes_code_defines() -> None:
    env = {
        "QUOTA_ENABLED": "true",
        "QUOTA_SHADOW": "1",
        "QUOTA_EXCLUDE": "/health,/static/",
        "QUOTA_MUTATIONS_ONLY": "no",
        "QUOTA_TRUSTED_PROXIES": "10.0.0.0/8, 192.168.0.0/16",
        "QUOTA_HASH_SECRET": SECRET,
        "QUOTA_HMAC_KEYS": "k1:" + "a" * 16 + ",k2:" + "b" * 16,
        "AGENT_HMAC_SECRET": "c" * 16,
        "QUOTA_HMAC_WINDOW": "120",
        "QUOTA_TIER_MULTIPLIERS": "auth=4,bot=0.5",
        "QUOTA_PLAN_SCALES": "pro=2",
        "QUOTA_HEADERS": "ietf",
        "QUOTA_POLICY_CACHE_SECONDS": "2.5",
        "QUOTA_KEY_PREFIX": "web",
        "RATE_LIMIT_WINDOW_SEC": "30",
        "RATE_LIMIT_CHAT_PER_MIN": "7",
        "RATE_LIMIT_CHAT_AUTHED_PER_MIN": "70",
        "QUOTA_RATES": "100/minute;1000/day",
        "QUOTA_FAIL_OPEN": "false",
    }
    config = HttpConfig.from_env(env, policies=[CHAT])

    assert config.shadow and config.enabled and not config.mutations_only
    assert config.exclude == ("/health", "/static/")
    assert config.excluded("/static/app.js") and not config.excluded("/api")
    assert [str(n) for n in config.proxies] == ["10.0.0.0/8", "192.168.0.0/16"]
    assert config.secret == SECRET.encode()
    assert set(config.hmac_secrets) == {"k1", "k2", "default"}
    assert config.hmac_window == 120
    assert config.tier_multipliers["auth"] == 4 and config.tier_multipliers["bot"] == 0.5
    assert config.tier_multipliers["trusted"] == 10  # the defaults stay for tiers not named
    assert config.plan_scales["pro"] == 2 and config.plan_scales["enterprise"] == 3
    assert config.headers == "ietf"
    assert config.policy_cache_seconds == 2.5
    assert config.key_prefix == "web"
    (chat,) = config.policies
    assert chat.base_rates == (Rate(limit=7, window=30),)
    assert chat.rates_for_tier("auth") == (Rate(limit=70, window=30),)
    assert config.default is not None
    assert [str(r) for r in config.default.base_rates] == ["100/60s", "1000/86400s"]
    assert config.default.fail_open is False


def test_rate_limit_capacity_makes_the_default_a_token_bucket() -> None:
    env = {
        "RATE_LIMIT_CAPACITY": "100",
        "RATE_LIMIT_WINDOW_MS": "30000",
        "RATE_LIMIT_REFILL_PER_SEC": "5",
    }
    config = HttpConfig.from_env(env)

    assert config.default is not None
    (rate,) = config.default.base_rates
    assert (rate.algorithm, rate.limit, rate.window, rate.refill_per_second) == (
        "token_bucket",
        100,
        30,
        5.0,
    )


def test_rate_limit_enabled_false_turns_it_off() -> None:
    assert HttpConfig.from_env({"RATE_LIMIT_ENABLED": "false"}).enabled is False


def test_per_class_variables_by_the_generic_names() -> None:
    env = {"QUOTA_POLICY_CHAT_RATES": "5/s burst 10", "QUOTA_POLICY_CHAT_COST": "2",
           "QUOTA_POLICY_CHAT_FAIL_OPEN": "off", "QUOTA_POLICY_CHAT_AUTHED_RATES": "50/s"}  # fmt: skip
    (chat,) = HttpConfig.from_env(env, policies=[CHAT]).policies

    assert chat.base_rates == (Rate(limit=5, window=1, algorithm="token_bucket", burst=10),)
    assert chat.cost == 2 and chat.fail_open is False
    assert chat.rates_for_tier("auth") == (Rate(limit=50, window=1),)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("QUOTA_ENABLED", "maybe"),
        ("RATE_LIMIT_ENABLED", "2"),
        ("QUOTA_SHADOW", "yes please"),
        ("QUOTA_RATES", "100/fortnight"),
        ("QUOTA_ALGORITHM", "leaky"),
        ("QUOTA_TRUSTED_PROXIES", "10.0.0.0/33"),
        ("QUOTA_HASH_SECRET", "short"),
        ("RATE_LIMIT_SECRET", "short"),
        ("QUOTA_HMAC_KEYS", "k1"),
        ("QUOTA_HMAC_KEYS", "k1:short"),
        ("AGENT_HMAC_SECRET", "short"),
        ("QUOTA_HMAC_WINDOW", "five"),
        ("QUOTA_TIER_MULTIPLIERS", "auth=lots"),
        ("QUOTA_PLAN_SCALES", "pro"),
        ("QUOTA_HEADERS", "all"),
        ("QUOTA_POLICY_CACHE_SECONDS", "-1"),
        ("QUOTA_EXCLUDE", "health"),
        ("RATE_LIMIT_CHAT_PER_MIN", "ten"),
        ("RATE_LIMIT_CHAT_AUTHED_PER_MIN", "0"),
        ("RATE_LIMIT_WINDOW_SEC", "0"),
        ("QUOTA_POLICY_CHAT_RATES", "x"),
        ("QUOTA_POLICY_CHAT_COST", "-3"),
        ("RATE_LIMIT_CAPACITY", "many"),
        ("QUOTA_AUTHED_RATES", "5/minute"),
    ],
)
def test_a_malformed_variable_fails_at_startup_naming_it(name: str, value: str) -> None:
    with pytest.raises(quota.ConfigurationError, match=rf"\${name}"):
        HttpConfig.from_env({name: value}, policies=[CHAT])


def test_a_cost_the_environment_makes_impossible_names_the_class() -> None:
    with pytest.raises(quota.ConfigurationError, match="route class 'chat'"):
        HttpConfig.from_env({"QUOTA_POLICY_CHAT_COST": "50"}, policies=[CHAT])


# -- scaling ---------------------------------------------------------------------------------


def test_scaling_multiplies_limit_burst_and_refill_and_keeps_a_floor() -> None:
    bucket = Rate(limit=10, window=1, algorithm="token_bucket", burst=20, refill_per_second=10.0)
    assert scale_rate(bucket, 1.5, 1) == Rate(
        limit=15, window=1, algorithm="token_bucket", burst=30, refill_per_second=15.0
    )
    assert scale_rate(Rate(limit=3, window=60), 0.1, 1).limit == 1
    assert scale_rate(Rate(limit=3, window=60), 0.1, 2).limit == 2  # never below the cost


def test_scaled_rates_are_memoised_and_unscaled_ones_returned_as_they_are() -> None:
    scaled = ScaledRates()
    rates = (Rate(limit=10, window=60),)
    assert scaled(rates, 1.0, 1) is rates
    assert scaled(rates, 2.0, 1) is scaled(rates, 2.0, 1)
    assert scaled(rates, 2.0, 1)[0].limit == 20
    assert scaled((Rate(limit=1, window=60),), 1.0, 3)[0].limit == 3


def test_a_plan_is_scaled_until_it_expires() -> None:
    now = [0.0]
    plans = Plans(ttl=10, clock=lambda: now[0], max_entries=2)
    plans.seed("acme", "enterprise")
    plans.seed("b", "pro", ttl=1)
    assert plans.plan("acme") == "enterprise"
    now[0] = 5
    assert plans.plan("b") is None  # its own, shorter ttl
    assert plans.plan("acme") == "enterprise"
    plans.seed("c", "pro")  # bounded: the oldest goes
    assert plans.plan("acme") is None
    assert plans.plan(None) is None


def test_a_plan_ttl_is_taken_as_a_duration_or_a_timedelta_too() -> None:
    import datetime as dt

    now = [0.0]
    plans = Plans(ttl="1m", clock=lambda: now[0])
    plans.seed("a", "pro")
    plans.seed("b", "pro", ttl=dt.timedelta(seconds=30))
    plans.seed("c", "pro", ttl="2m")
    now[0] = 45
    assert [plans.plan(t) for t in "abc"] == ["pro", None, "pro"]
    now[0] = 90
    assert [plans.plan(t) for t in "abc"] == [None, None, "pro"]
    for bad in (0, -1, "soon", "0", dt.timedelta(0), float("nan"), True, None):
        with pytest.raises(quota.ConfigurationError) as info:
            Plans(ttl=bad)  # type: ignore[arg-type]
        assert "ttl" in str(info.value) and repr(bad) in str(info.value)
        if bad is not None:
            with pytest.raises(quota.ConfigurationError, match="ttl"):
                plans.seed("d", "pro", ttl=bad)  # type: ignore[arg-type]


def test_pressure_is_an_ewma_sampled_at_most_once_per_interval() -> None:
    now = [0.0]
    readings = iter([1.0, 0.0, 0.0])
    pressure = SystemPressure(
        alpha=0.5, interval=1.0, clock=lambda: now[0], sample=lambda: next(readings)
    )
    assert pressure() == 1.0
    assert pressure() == 1.0  # same interval: no new sample
    now[0] = 1.0
    assert pressure() == 0.5
    now[0] = 2.0
    assert pressure() == 0.25


def test_the_system_pressure_sample_is_a_fraction() -> None:
    assert 0.0 <= SystemPressure()() <= 1.0


# -- headers -----------------------------------------------------------------------------------

DECISION = Decision(True, "k", 100, 40, 60, 60, 1_750_000_020, 0)


def test_headers_in_each_style() -> None:
    shape = PolicyShape("api", [(100, 60), (1000, 86400)])
    both = dict(rate_limit_headers(DECISION, shape, NOW, "both", retry_after=False))
    assert both == {
        "X-RateLimit-Limit": "100",
        "X-RateLimit-Remaining": "40",
        "X-RateLimit-Reset": "1750000020",
        "RateLimit-Policy": '"api-0";q=100;w=60, "api-1";q=1000;w=86400',
        "RateLimit": '"api-0";r=40;t=20',
    }
    assert [n for n, _ in rate_limit_headers(DECISION, shape, NOW, "legacy", retry_after=False)] == [
        "X-RateLimit-Limit", "X-RateLimit-Remaining", "X-RateLimit-Reset",
    ]  # fmt: skip
    assert rate_limit_headers(DECISION, shape, NOW, "none", retry_after=True) == [
        ("Retry-After", "0")
    ]


def test_the_ietf_fields_name_the_rate_that_decided() -> None:
    shape = PolicyShape("api", [(100, 60), (1000, 86400)])
    daily = Decision(True, "k", 1000, 9, 991, 86400, 1_750_000_020, 0)

    ietf = dict(rate_limit_headers(daily, shape, NOW, "ietf", retry_after=False))

    assert ietf == {
        "RateLimit-Policy": '"api-0";q=100;w=60, "api-1";q=1000;w=86400',
        "RateLimit": '"api-1";r=9;t=20',
    }
    assert PolicyShape('a"b', [(5, 1)]).policy == '"a\\"b";q=5;w=1'


def test_exposure_merges_with_the_apps_list() -> None:
    ours = [("X-RateLimit-Limit", "1")]
    assert expose(ours, None) == "X-RateLimit-Limit, Retry-After"
    assert expose(ours, "X-Custom, retry-after") == "X-Custom, retry-after, X-RateLimit-Limit"
    assert expose(ours, "*") == "*"


# -- runtime policies ------------------------------------------------------------------------


def _row(route: str, subject: str, rates: str | None = "1/minute", **extra: Any) -> tuple[Any, ...]:
    return (route, subject, rates, extra.get("algorithm"), extra.get("cost"),
            extra.get("fail_open"), extra.get("exempt", 0), None, 0.0)  # fmt: skip


def test_the_cache_is_read_once_per_period() -> None:
    cache = RuntimePolicies(5)
    assert cache.claim(100.0)
    assert not cache.claim(104.9)
    assert cache.claim(105.0)


def test_the_most_specific_override_wins() -> None:
    cache = RuntimePolicies(5)
    cache.load([
        _row("*", "*", "1/minute"), _row("api", "*", "2/minute"), _row("api", "tier:auth", "3/minute"),
        _row("*", "tenant:acme", "4/minute"), _row("*", "tok:abc", "5/minute"),
    ], NOW)  # fmt: skip

    def rates(route: str, identity: Identity) -> str | None:
        found = cache.lookup(route, identity)
        return found.row.rates if found else None

    assert rates("api", Identity("auth", "tok:abc", tenant="acme")) == "5/minute"
    assert rates("api", Identity("auth", "tok:zzz", tenant="acme")) == "4/minute"
    assert rates("api", Identity("auth", "tok:zzz")) == "3/minute"
    assert rates("api", Identity("anon", "ip:1")) == "2/minute"
    assert rates("web", Identity("anon", "ip:1")) == "1/minute"


def test_a_malformed_row_is_skipped_and_a_failed_read_keeps_the_last_good(caplog: Any) -> None:
    counted: list[str] = []
    cache = RuntimePolicies(5, metrics=counted.append)
    cache.load([_row("api", "*", "10/lightyear"), _row("api", "tier:auth", "3/minute")], NOW)
    assert len(cache) == 1
    with caplog.at_level(logging.WARNING, logger="quota.http"):
        cache.failed(quota.StorageError("down"))
        cache.failed(quota.StorageError("down"))
    assert len(cache) == 1
    assert counted == ["policy_invalid", "policy_refresh_failed", "policy_refresh_failed"]
    assert sum("cannot read quota_policies" in r.message for r in caplog.records) == 1


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"route": ""}, "route must be a non-empty string"),
        ({"route": "a", "rates": "x"}, "rate 'x'"),
        ({"route": "a", "algorithm": "leaky"}, "algorithm must be one of"),
        ({"route": "a", "cost": 0}, "cost must be a positive integer"),
    ],
)
def test_a_bad_policy_row_fails_when_built(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(quota.ConfigurationError, match=message):
        PolicyRow(**settings)


# -- the flow, driven by hand ------------------------------------------------------------------


def _request(path: str = "/api", method: str = "GET", **headers: str) -> RequestInfo:
    return RequestInfo(method, path, path, headers, "198.51.100.1")


def _guard(**settings: Any) -> Guard:
    config = HttpConfig(
        policies=[RoutePolicy(name="api", paths=["/api"], rates="2/minute", fail_open=settings.pop("fail_open", True))],
        hash_secret=SECRET, **settings,
    )  # fmt: skip
    return Guard(config, dialect="sqlite", clock=lambda: NOW)


def test_the_flow_reads_policies_then_counts_one_hit() -> None:
    flow = _guard().flow(_request())
    assert flow.send(None) is LOAD_POLICIES
    hit = flow.send([])
    assert isinstance(hit, Hit)
    assert hit.key.startswith("http:api:anon:ip:") and hit.cost == 1
    with pytest.raises(StopIteration) as stop:
        flow.send(Decision(True, hit.key, 2, 1, 1, 60, int(NOW) + 40, 0))
    assert stop.value.value.response is None
    assert ("X-RateLimit-Remaining", "1") in stop.value.value.headers


def test_a_failing_limiter_fails_open_or_closed_as_the_class_says() -> None:
    def hit(_effect: Hit) -> Decision:
        raise quota.StorageError("down")

    def load() -> Any:
        raise quota.StorageError("down")

    assert drive_sync(_guard().flow(_request()), hit, load) is PASS
    closed = drive_sync(_guard(fail_open=False).flow(_request()), hit, load)
    assert closed.response is not None and closed.response.status == 503
    shadow = drive_sync(_guard(fail_open=False, shadow=True).flow(_request()), hit, load)
    assert shadow is PASS


def test_requests_outside_every_class_never_reach_the_limiter() -> None:
    def never(*_args: Any) -> Any:
        raise AssertionError("the limiter was called")

    assert drive_sync(_guard().flow(_request("/other")), never, never) is PASS
    assert (
        drive_sync(_guard(exclude=["/api/health"]).flow(_request("/api/health")), never, never)
        is PASS
    )
    assert drive_sync(_guard(enabled=False).flow(_request()), never, never) is PASS


def test_postgres_without_a_hash_secret_is_refused_and_sqlite_warns(caplog: Any) -> None:
    config = HttpConfig(policies=[RoutePolicy(name="api", rates="1/s")])
    with pytest.raises(quota.ConfigurationError, match="QUOTA_HASH_SECRET"):
        Guard(config, dialect="postgresql")
    with caplog.at_level(logging.WARNING, logger="quota.http"):
        one = Guard(config, dialect="sqlite")
        two = Guard(config, dialect="sqlite")
    assert one.secret != two.secret, "random per process"
    assert "QUOTA_HASH_SECRET is not set" in caplog.text


# -- the public surface ------------------------------------------------------------------------


def test_the_http_all_is_exactly_the_public_names() -> None:
    names = {
        n for n in dir(quota.http)
        if not n.startswith("_") and not isinstance(getattr(quota.http, n), types.ModuleType)
        and n != "annotations"
    }  # fmt: skip
    # (ruff's RUF022 keeps the order.)
    assert len(set(quota.http.__all__)) == len(quota.http.__all__)
    assert set(quota.http.__all__) == names


def test_every_entry_point_takes_every_guard_hook_as_a_keyword() -> None:
    """Each public constructor takes the hooks `GuardOptions` declares, and refuses other names."""
    import inspect

    from quota.http._core import HOOKS, GuardOptions
    from quota.http.asgi import QuotaMiddleware
    from quota.http.wsgi import QuotaWSGIMiddleware

    fastapi = pytest.importorskip("quota.http.fastapi")
    assert set(HOOKS) == set(GuardOptions.__optional_keys__)
    config = HttpConfig(default=RoutePolicy(name="api", rates="10/minute"))
    given = dict.fromkeys(HOOKS)
    given["clock"] = lambda: NOW
    made = [
        QuotaMiddleware(_app, limiter=quota.connect_async("memory://"), config=config, **given),
        QuotaWSGIMiddleware(_wsgi_app, limiter=quota.connect("memory://"), config=config, **given),
        fastapi.RateLimit(
            "10/minute", name="api", limiter=quota.connect_async("memory://"), **given
        ),
        Guard(config, dialect="sqlite", **given),
    ]
    for entry in made:
        guard = entry if isinstance(entry, Guard) else entry.guard
        assert guard.clock() == NOW
    for cls in (QuotaMiddleware, QuotaWSGIMiddleware, fastapi.RateLimit, Guard):
        hooks = inspect.signature(cls).parameters["hooks"]
        assert hooks.kind is inspect.Parameter.VAR_KEYWORD, cls.__name__
    with pytest.raises(TypeError, match=r"QuotaMiddleware.*'identifier'"):
        QuotaMiddleware(_app, limiter=quota.connect_async("memory://"), identifier=None)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=r"Guard.*'on_abused'"):
        Guard(config, dialect="sqlite", on_abused=None)  # type: ignore[call-arg]


async def _app(scope: dict[str, object], receive: object, send: object) -> None:
    raise AssertionError("not called")


def _wsgi_app(environ: dict[str, object], start_response: object) -> list[bytes]:
    raise AssertionError("not called")


def test_http_metrics_is_apart_from_the_prometheus_metrics() -> None:
    assert quota.http.HttpMetrics is not quota.Metrics
    assert not hasattr(quota.http, "Metrics")


def test_importing_quota_and_the_middlewares_imports_no_web_framework() -> None:
    code = (
        "import sys, quota, quota.http, quota.http.asgi, quota.http.wsgi\n"
        "loaded = sorted(m for m in ('starlette', 'fastapi', 'flask', 'werkzeug') if m in sys.modules)\n"
        "assert not loaded, loaded"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_a_failing_pressure_source_counts_as_no_pressure() -> None:
    def broken() -> float:
        raise OSError("no /proc")

    config = HttpConfig(policies=[RoutePolicy(name="api", rates="10/minute")], hash_secret=SECRET,
                        adaptive=True)  # fmt: skip
    guard = Guard(config, dialect="sqlite", pressure=broken, clock=lambda: NOW)
    flow = guard.flow(_request())
    flow.send(None)  # the policies read
    hit = flow.send([])

    assert isinstance(hit, Hit) and hit.rates[0].limit == 10
    assert guard.metrics.get("hook_failed", hook="pressure") == 1


def test_a_malformed_row_is_reported_once_while_it_stays(caplog: Any) -> None:
    # main: one warning and one count at every read of the table (every 5 s per worker).
    counted: list[str] = []
    cache = RuntimePolicies(5, metrics=counted.append)
    bad = _row("api", "*", "10/lightyear")
    with caplog.at_level(logging.WARNING, logger="quota.http"):
        for read in range(3):
            cache.load([bad, _row("api", "tier:auth", "3/minute")], NOW + 5 * read)
        cache.load([_row("api", "*", "11/lightyear")], NOW + 15)  # another malformed row

    assert counted == ["policy_invalid", "policy_invalid"]
    assert sum("skipping malformed row" in r.message for r in caplog.records) == 2
