"""The tables behind `HttpConfig`: a check for every field, a row for every variable.

`HttpConfig` checks each field through one row of ``_CHECKS``; `apply_env`
reads each ``QUOTA_*`` variable that sets a field through one row of
``FIELD_VARS``, and `ENV_VARS` is made from the same rows. Numbers and
switches read as `quota._core.parsing` reads them, wherever they come from.
"""

from __future__ import annotations

import dataclasses

import pytest

import quota
from quota._sql.policies import parse_setting, setting_text
from quota.http import ENV_VARS, HttpConfig, RoutePolicy
from quota.http._config import _CHECKS
from quota.http._env import FIELD_VARS, ROUTE_VARS

FIELDS = {f.name for f in dataclasses.fields(HttpConfig)}


def test_every_field_has_a_check() -> None:
    assert {name for name, _, _ in _CHECKS} == FIELDS


def test_every_variable_sets_a_field_and_is_listed() -> None:
    assert {var.field for var in FIELD_VARS} <= FIELDS
    names = [name for var in FIELD_VARS for name in var.names]
    assert len(names) == len(set(names))
    assert set(ENV_VARS) == {var.names[0] for var in FIELD_VARS} | set(ROUTE_VARS)
    assert all(ENV_VARS[var.names[0]] == var.help for var in FIELD_VARS)


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"shadow": "yes"}, "shadow must be a bool, got 'yes'"),
        ({"ipv6_prefix": 129}, "ipv6_prefix must be 1..128, got 129"),
        ({"headers": "all"}, "headers must be one of both, legacy, ietf, none, got 'all'"),
        ({"pressure_threshold": 0}, "pressure_threshold must be in (0, 1], got 0"),
        ({"velocity_half_life": 0.0}, "velocity_half_life must be above 0 and at most 86400"),
        ({"key_prefix": "a b"}, "key_prefix must be 1-40 of [A-Za-z0-9_.-], got 'a b'"),
        ({"pressure_factors": {"auth": 2}}, "pressure_factors must be at most 1"),
        ({"unvalidated_token_ceiling": True}, "unvalidated_token_ceiling must be None or a number"),
        ({"policies": ["api"]}, "policies must be RoutePolicy objects, got 'api'"),
        ({"hash_secret": "short"}, "hash_secret must be at least 16 bytes"),
    ],
)  # fmt: skip
def test_a_bad_field_is_named_with_its_value(settings: dict[str, object], message: str) -> None:
    with pytest.raises(quota.ConfigurationError) as info:
        HttpConfig(**settings)  # type: ignore[arg-type]
    assert message in str(info.value)


def test_checked_values_are_kept_normalised() -> None:
    config = HttpConfig(
        policies=[RoutePolicy(name="api", rates="1/s")],
        exclude=["/health"],
        api_key_headers=["X-Key"],
        pressure_exempt=["admin"],
        hash_secret="s" * 16,
    )
    assert isinstance(config.policies, tuple)
    assert config.exclude == ("/health",)
    assert config.excluded("/health/live") and not config.excluded("/api")
    assert config.api_key_headers == ("x-key",)
    assert config.pressure_exempt == frozenset({"admin"})
    assert config.secret == b"s" * 16
    assert config.hash_secret == "s" * 16  # the field stays as given


@pytest.mark.parametrize(
    "word, expected", [("YES", True), (" on ", True), ("Off", False), ("0", False)]
)
def test_switch_words(word: str, expected: bool) -> None:
    assert HttpConfig.from_env({"QUOTA_SHADOW": word}).shadow is expected


def test_a_bad_switch_names_the_variable() -> None:
    with pytest.raises(quota.ConfigurationError, match=r"\$QUOTA_SHADOW must be true or false"):
        HttpConfig.from_env({"QUOTA_SHADOW": "maybe"})


def test_decimal_digits_edge_in_a_variable() -> None:
    twenty = "0." + "0" * 19 + "1"
    assert HttpConfig.from_env({"QUOTA_POLICY_CACHE_SECONDS": twenty}).policy_cache_seconds == 1e-20
    with pytest.raises(quota.ConfigurationError, match=r"\$QUOTA_POLICY_CACHE_SECONDS"):
        HttpConfig.from_env({"QUOTA_POLICY_CACHE_SECONDS": twenty + "0"})


def test_a_setting_written_back_reads_again() -> None:
    """The settings table stores every digit of a factor; that text parses again."""
    factor = 0.0012345678901234567
    text = setting_text(parse_setting("tier_multiplier.auth", factor))
    assert text == "0.0012345678901234567"
    assert parse_setting("tier_multiplier.auth", text) == factor


def test_agent_hmac_secret_adds_the_default_key() -> None:
    config = HttpConfig.from_env(
        {"QUOTA_HMAC_KEYS": "k1:" + "a" * 16, "AGENT_HMAC_SECRET": "b" * 16}
    )
    assert config.hmac_secrets == {"k1": b"a" * 16, "default": b"b" * 16}
