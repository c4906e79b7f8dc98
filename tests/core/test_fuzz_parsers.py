"""Fuzzing every parser of outside input: a valid result or a `ConfigurationError`, nothing else.

Rate strings, CLI durations and dates, the HTTP layer's environment variables,
store URLs and `redact`: random text (Unicode digits, NUL, lone surrogates,
huge numbers, whitespace, URL punctuation) gives a value or a
`ConfigurationError` (a click usage error at the CLI). The HTTP header parsers
(the HMAC signature headers, forwarding headers, credentials) never raise at
all: an exception there is a limiter failure, and fail-open would let the
request through uncounted. Examples are bounded; the whole module runs in
seconds.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import click
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import quota
from quota._core.decision import parse_duration
from quota._core.redaction import redact
from quota._core.url import KNOWN_SCHEMES, parse_url
from quota.http import HttpConfig, RoutePolicy, sign
from quota.http._core import Guard
from quota.http._env import ENV_VARS
from quota.http._identity import (
    RequestInfo,
    client_ip,
    credential,
    hashed_subject,
    ip_subject_value,
    parse_networks,
    verify_signature,
)

FUZZ = settings(
    max_examples=150,
    deadline=None,
    database=None,
    derandomize=True,  # the same examples on every run: a failure here is a real one
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

#: Fragments that broke (or nearly broke) a parser once; random text rarely finds them.
PIECES = [
    "0", "1", "5", "9", "10", "60", "²", "\u0661\u0660", "\u0665", "߃", "\U0001d7d7", "¹", "\x00", " ", "\t", "\n",
    "\u3000", "-", "--", "+", ".", "e", "E", "_", "x", "/", "s", "m", "h", "d", "w", "ms",
    "second", "minutes", " per ", " burst ", ";", ",", "=", ":", "@", "?", "#", "%", "%40",
    "[", "]", "::1", "10.0.0.1", "fe80::1%eth0", "::ffff:1.2.3.4", "9" * 30, "9" * 5000,
    "nan", "inf", "-inf", "1e308", "1e-308", "0x10", "\udcff", "\ud800", "ñ", "ß", "K",
    "password=", "auth", "anon", "re:", "(", "(?i)", "*", "{id}",
]  # fmt: skip
TEXT = st.one_of(
    st.text(max_size=40),
    st.lists(st.sampled_from(PIECES), max_size=10).map("".join),
    st.lists(st.one_of(st.sampled_from(PIECES), st.text(max_size=3)), max_size=8).map("".join),
)
#: Things that look like numbers to `str.isdigit()`, `int()` or `float()`, and some that do not.
NUMBERISH = st.lists(
    st.sampled_from(
        ["0", "1", "5", "9", "²", "\u0661\u0660", "\u0665", "\U0001d7d7", "¹", "-", "+", ".", "e", " ", "_", "\x00",
         "9" * 30, "9" * 5000, "nan", "inf"]
    ),
    min_size=1,
    max_size=4,
).map("".join)  # fmt: skip
UNIT = st.sampled_from(["", "s", "m", "h", "d", "w", "second", "minutes", "ms", "ñ", "\x00"])
RATE = st.tuples(
    NUMBERISH, st.sampled_from(["/", " per ", "/ "]), st.one_of(st.just(""), NUMBERISH), UNIT,
    st.one_of(st.just(""), NUMBERISH.map(" burst ".__add__)),
).map("".join)  # fmt: skip
RATES = st.one_of(TEXT, RATE, st.lists(RATE, min_size=1, max_size=3).map(";".join))
DURATION = st.one_of(TEXT, st.tuples(NUMBERISH, UNIT).map("".join))
VALUE = st.one_of(
    TEXT, NUMBERISH, RATES,
    st.tuples(st.sampled_from(["auth=", "pro=", "k:"]), NUMBERISH).map("".join),
)  # fmt: skip


# -- library parsers --------------------------------------------------------------------


@FUZZ
@given(RATES)
def test_parse_rates_gives_rates_or_a_configuration_error(text: str) -> None:
    try:
        rates = quota.parse_rates(text)
    except quota.ConfigurationError:
        return
    assert rates and all(isinstance(rate, quota.Rate) for rate in rates)
    assert "".join(c for c in text if c.isdigit()).isascii()


@FUZZ
@given(DURATION)
def test_parse_duration_gives_bounded_seconds_or_a_configuration_error(text: str) -> None:
    try:
        seconds = parse_duration("window", text)
    except quota.ConfigurationError as exc:
        assert "window" in str(exc)
        return
    assert type(seconds) is int and 0 <= seconds <= 100 * 366 * 86400


def _callback(callback: Any, text: str) -> Any:
    return callback(click.Context(click.Command("x")), click.Option(["--x"]), text)


@FUZZ
@given(DURATION)
def test_the_cli_parsers_give_a_value_or_a_usage_error(text: str) -> None:
    from quota._cli.main import _duration
    from quota._cli.quotas import _period, _since

    for callback in (_duration("window"), _period, _since):
        # BadParameter is a UsageError: the CLI exits 2 with the message.
        with contextlib.suppress(click.UsageError):
            _callback(callback, text)


#: Every variable `HttpConfig.from_env` reads, route-class names filled in.
VARIABLES = [
    *sorted(name.replace("<NAME>", "API") for name in ENV_VARS if "*" not in name),
    "RATE_LIMIT_MAX_REQUESTS", "QUOTA_POLICY_API_AUTHED_RATES", "QUOTA_POLICY_API_COST",
    "QUOTA_POLICY_API_FAIL_OPEN", "RATE_LIMIT_SECRET", "AGENT_HMAC_SECRET",
]  # fmt: skip


@FUZZ
@given(st.dictionaries(st.sampled_from(VARIABLES), VALUE, min_size=1, max_size=4))
def test_the_environment_gives_a_config_or_a_configuration_error(env: dict[str, str]) -> None:
    try:
        config = HttpConfig.from_env(
            env, policies=[RoutePolicy(name="api", paths=["/api"], rates="10/minute")]
        )
    except quota.ConfigurationError as exc:
        # The message names the variable (or the setting it feeds).
        assert any(name in str(exc) for name in env) or "$" not in str(exc), str(exc)
        return
    for factors in (config.tier_multipliers, config.plan_scales):
        assert all(math.isfinite(f) and 0 < f <= 1000 for f in factors.values())


@FUZZ
@given(st.sampled_from(VARIABLES), VALUE)
def test_each_variable_alone_gives_a_config_or_names_itself(name: str, value: str) -> None:
    try:
        HttpConfig.from_env({name: value}, policies=[RoutePolicy(name="api", rates="10/minute")])
    except quota.ConfigurationError as exc:
        if name not in ("QUOTA_AUTHED_RATES", "QUOTA_FAIL_OPEN"):
            assert name in str(exc), str(exc)


@FUZZ
@given(TEXT)
def test_parse_networks_gives_networks_or_a_configuration_error(text: str) -> None:
    with contextlib.suppress(quota.ConfigurationError):
        parse_networks("trusted_proxies", text)


# -- URLs ------------------------------------------------------------------------------

URL_TEXT = st.one_of(
    TEXT,
    st.tuples(st.sampled_from([*KNOWN_SCHEMES, "nosuch", "http"]), TEXT).map("://".join),
)


@FUZZ
@given(URL_TEXT)
def test_parse_url_gives_a_store_url_or_a_configuration_error(url: str) -> None:
    try:
        parsed = parse_url(url)
    except quota.ConfigurationError:
        return
    assert parsed.dialect in ("sqlite", "postgresql", "memory", "redis", "redis-cluster")


@FUZZ
@given(URL_TEXT)
def test_redact_never_raises(url: str) -> None:
    assert isinstance(redact(url), str)


HOST = st.from_regex(r"[a-p0-9.-]{1,12}(:[0-9]{1,5})?", fullmatch=True)
PATH = st.from_regex(r"(/[a-p0-9_]{0,8})?(\?[a-p=&@]{0,12})?", fullmatch=True)


@FUZZ
@given(
    st.sampled_from([*KNOWN_SCHEMES, "nosuch"]),
    st.from_regex(r"[a-p0-9_]{0,8}", fullmatch=True),
    st.text(min_size=1, max_size=12).filter(lambda p: "/" not in p),
    HOST,
    PATH,
)
def test_no_message_about_a_url_shows_its_password(
    scheme: str, user: str, password: str, host: str, path: str
) -> None:
    secret = "ZQ" + password  # nothing else in the URL holds a Z or a Q
    url = f"{scheme}://{user}:{secret}@{host}{path}"
    assert secret not in redact(url)
    try:
        parse_url(url).sqlalchemy_url()
    except quota.ConfigurationError as exc:
        assert secret not in str(exc), str(exc)


@FUZZ
@given(st.from_regex(r"[a-p0-9=&_]{0,20}", fullmatch=True), st.text(min_size=1, max_size=12))
def test_a_password_in_the_query_string_is_redacted(before: str, password: str) -> None:
    secret = "ZQ" + password.replace("&", "").replace("#", "")
    url = f"postgresql://host/db?{before}&password={secret}"
    assert secret not in redact(url)


# -- HTTP headers: never an exception ---------------------------------------------------

KEYS = {"k1": b"signing-secret-0123456789"}
NOW = 1_750_000_000.0


HEX64 = st.from_regex(r"[0-9a-f]{64}", fullmatch=True)
KEY_ID = st.one_of(st.just("k1"), st.just("k1"), st.sampled_from(["k2", ""]), TEXT)
STAMP = st.one_of(st.just(str(int(NOW))), NUMBERISH, NUMBERISH, TEXT)
SIGNATURE = st.one_of(HEX64, TEXT)


@FUZZ
@given(
    st.one_of(st.none(), KEY_ID),
    st.one_of(st.none(), STAMP),
    st.one_of(st.none(), SIGNATURE),
    TEXT,
    TEXT,
)
def test_verify_signature_rejects_or_accepts_never_raises(
    key_id: str | None, stamp: str | None, signature: str | None, method: str, path: str
) -> None:
    headers = {
        name: value
        for name, value in (
            ("x-quota-key-id", key_id),
            ("x-quota-timestamp", stamp),
            ("x-quota-signature", signature),
        )
        if value is not None
    }
    found, reason = verify_signature(headers, method, path, NOW, KEYS, 300)
    assert found is None or (found == "k1" and reason is None)
    if stamp is not None and found is not None:
        assert stamp.isascii() and stamp.isdigit()


@FUZZ
@given(STAMP)
def test_any_timestamp_of_a_signed_request_verifies_or_is_rejected(stamp: str) -> None:
    headers = {**sign("k1", KEYS["k1"], "GET", "/api", NOW), "x-quota-timestamp": stamp}
    found, reason = verify_signature(headers, "GET", "/api", NOW, KEYS, 300)
    if found is not None:
        assert stamp == str(int(NOW))
    elif stamp.isascii() and stamp.isdigit() and len(stamp) <= 15:
        assert reason in ("expired", "bad_signature")
    else:
        assert reason == "malformed"


@FUZZ
@given(TEXT, TEXT)
def test_a_signed_request_with_a_fuzzed_path_or_method_still_verifies(
    method: str, path: str
) -> None:
    try:
        headers = sign("k1", KEYS["k1"], method, path, NOW)
    except UnicodeEncodeError:  # a path no HTTP server hands over (lone surrogates)
        return
    assert verify_signature(headers, method, path, NOW, KEYS, 300) == ("k1", None)


TRUSTED = parse_networks("trusted_proxies", "10.0.0.0/8,::1/128,fe80::/10")


@FUZZ
@given(
    st.one_of(st.none(), st.sampled_from(["10.0.0.1", "::1", "203.0.113.9", "testclient"]), TEXT),
    st.one_of(st.none(), TEXT),
    st.one_of(st.none(), TEXT, st.lists(TEXT, max_size=5).map(",".join)),
    st.integers(1, 128),
)
def test_forwarding_headers_give_an_address_never_raise(
    peer: str | None, cf: str | None, forwarded: str | None, prefix: int
) -> None:
    headers = {
        name: value
        for name, value in (("cf-connecting-ip", cf), ("x-forwarded-for", forwarded))
        if value is not None
    }
    for trusted in (TRUSTED, ()):
        ip = client_ip(peer, headers, trusted)
        assert ip is None or isinstance(ip, str)
        if ip is not None:
            assert isinstance(ip_subject_value(ip, prefix), str)
            assert hashed_subject("ip", ip, b"x" * 16, ipv6_prefix=prefix).startswith("ip:")


@FUZZ
@given(st.dictionaries(st.sampled_from(["authorization", "x-api-key", "x-other"]), TEXT))
def test_credentials_are_read_never_raise(headers: dict[str, str]) -> None:
    token = credential(headers, ("x-api-key",))
    if token is not None:
        assert hashed_subject("tok", token, b"x" * 16).startswith("tok:")


GUARD = Guard(
    HttpConfig(
        hash_secret="test-hash-secret-0123456789",
        hmac_keys={"k1": KEYS["k1"]},
        trusted_proxies=["10.0.0.0/8", "::1"],
        runtime_policies=False,
    ),
    dialect="sqlite",
)


IP_TEXT = st.one_of(
    TEXT, st.sampled_from(["10.0.0.1", "::1", "203.0.113.9", "fe80::1%eth0", "::ffff:10.0.0.2"])
)
HEADERS = st.fixed_dictionaries(
    {"x-quota-key-id": KEY_ID, "x-quota-timestamp": STAMP},
    optional={
        "x-quota-signature": SIGNATURE, "authorization": TEXT, "x-api-key": TEXT, "cf-connecting-ip": IP_TEXT,
        "x-forwarded-for": st.lists(IP_TEXT, max_size=4).map(",".join),
    },
)  # fmt: skip


@FUZZ
@given(
    HEADERS,
    st.one_of(st.none(), st.sampled_from(["10.0.0.1", "::1", "203.0.113.9"]), TEXT),
    TEXT,
)
def test_a_requests_identity_is_always_decided(
    headers: dict[str, str], peer: str | None, path: str
) -> None:
    request = RequestInfo("GET", path, path, headers, peer)
    identity = GUARD.identity(request, NOW)
    assert identity.tier in ("anon", "auth", "trusted")
    assert isinstance(identity.subject, str) and identity.subject


@FUZZ
@given(STAMP, st.one_of(st.none(), IP_TEXT))
def test_a_fuzzed_timestamp_never_breaks_identity(stamp: str, forwarded: str | None) -> None:
    headers = {**sign("k1", KEYS["k1"], "GET", "/api", NOW), "x-quota-timestamp": stamp}
    if forwarded is not None:
        headers["x-forwarded-for"] = forwarded
    identity = GUARD.identity(RequestInfo("GET", "/api", "/api", headers, "10.0.0.1"), NOW)
    assert identity.tier == ("trusted" if stamp == str(int(NOW)) else "anon")


@pytest.mark.parametrize("stamp", ["--1", "²", "+5", " 5", "5.0", "9" * 30])
def test_the_reported_timestamps_are_malformed(stamp: str) -> None:
    headers = {**sign("k1", KEYS["k1"], "GET", "/", NOW), "x-quota-timestamp": stamp}
    assert verify_signature(headers, "GET", "/", NOW, KEYS, 300) == (None, "malformed")
