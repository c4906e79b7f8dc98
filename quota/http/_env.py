"""Environment variables of the HTTP layer: `ENV_VARS` and `apply_env`.

`HttpConfig.from_env` lays the ``QUOTA_*`` variables (and the
``RATE_LIMIT_*`` names other rate limiters use) over the settings given in
code. Every variable set is checked, used or not: a malformed one raises
`ConfigurationError` naming it and its value.
"""

from __future__ import annotations

import difflib
import logging
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from quota._core.algorithms import ALGORITHMS, Rate
from quota._core.decision import MAX_LIMIT, MAX_WINDOW
from quota._core.errors import ConfigurationError
from quota._core.factors import MAX_FACTOR, MIN_FACTOR
from quota._core.rates import parse_rates
from quota.http._config import (
    _NAME,
    DEFAULT_PLAN_SCALES,
    DEFAULT_TIER_MULTIPLIERS,
    HEADER_STYLES,
    PROBLEM_TYPES,
    Rates,
    RoutePolicy,
    _utf8,
    compile_paths,
)
from quota.http._identity import (
    AUTH,
    check_client_ip_header,
    check_forwarded_header,
    parse_networks,
)
from quota.http._identity import proxy_rules as build_proxy_rules

ENV_VARS: Mapping[str, str] = {
    "QUOTA_ENABLED": "master switch (true/false); alias RATE_LIMIT_ENABLED",
    "QUOTA_SHADOW": "shadow mode: decide and report, never block",
    "QUOTA_RATES": "rates of the default route class, e.g. '100/minute;1000/day'",
    "QUOTA_AUTHED_RATES": "rates of the default class for the auth tier",
    "QUOTA_ALGORITHM": "algorithm of the default class",
    "QUOTA_FAIL_OPEN": "default class: let requests through when the limiter fails",
    "QUOTA_POLICY_<NAME>_RATES": "rates of route class NAME (also _AUTHED_RATES, _COST, _FAIL_OPEN)",
    "RATE_LIMIT_<NAME>_PER_MIN": "anon limit of class NAME per RATE_LIMIT_WINDOW_SEC (default 60)",
    "RATE_LIMIT_<NAME>_AUTHED_PER_MIN": "auth-tier limit of class NAME per window",
    "RATE_LIMIT_WINDOW_SEC": "window of the RATE_LIMIT_*_PER_MIN limits",
    "RATE_LIMIT_CAPACITY": "default class as a token bucket of this capacity (alias RATE_LIMIT_MAX_REQUESTS)",
    "RATE_LIMIT_WINDOW_MS": "window of RATE_LIMIT_CAPACITY in ms (default 60000)",
    "RATE_LIMIT_REFILL_PER_SEC": "refill of RATE_LIMIT_CAPACITY (default capacity per window)",
    "QUOTA_EXCLUDE": "comma-separated path patterns never limited",
    "QUOTA_MUTATIONS_ONLY": "only POST/PUT/PATCH/DELETE count",
    "QUOTA_TRUSTED_PROXIES": "comma-separated CIDRs whose forwarding headers are believed",
    "QUOTA_CLIENT_IP_HEADER": "client-IP header: a name from every trusted proxy, or 'cidr=name,…'",
    "QUOTA_FORWARDED_HEADER": "chain header of the trusted proxies: x-forwarded-for or forwarded",
    "QUOTA_HASH_SECRET": "key of the IP/token hashes (>= 16 bytes); alias RATE_LIMIT_SECRET",
    "QUOTA_HMAC_KEYS": "signed callers: 'keyid:secret,keyid2:secret2'; AGENT_HMAC_SECRET adds key id 'default'",
    "QUOTA_HMAC_WINDOW": "seconds a signature is valid either side of its timestamp",
    "QUOTA_TIER_MULTIPLIERS": "e.g. 'auth=5,trusted=10'",
    "QUOTA_PLAN_SCALES": "e.g. 'enterprise=3,pro=1.5'",
    "QUOTA_ADAPTIVE": "lower capacity under system pressure",
    "QUOTA_HEADERS": "both, legacy, ietf or none",
    "QUOTA_PROBLEM_TYPE": "body of the 429: quota-exceeded (default) or about:blank",
    "QUOTA_PARTITION_KEY": "add pk (a keyed digest of the caller's bucket) to the IETF fields",
    "QUOTA_RUNTIME_POLICIES": "read overrides from the quota_policies table",
    "QUOTA_POLICY_CACHE_SECONDS": "period of the overrides' refresh; changes apply on every worker at its boundaries",
    "QUOTA_KEY_PREFIX": "first part of every key",
    "QUOTA_UNVALIDATED_TOKEN_CEILING": "per-IP ceiling of unvalidated tokens, x the auth tier's limits ('off': none)",
    "QUOTA_PRESSURE_HORIZON": "seconds ahead adaptive capacity predicts pressure (0: the moving average alone)",
    "QUOTA_VELOCITY": "track each key's request rate (default true)",
    "QUOTA_VELOCITY_HALF_LIFE": "seconds in which a key's tracked rate halves (default 10)",
    "QUOTA_VELOCITY_MAX_KEYS": "keys whose request rate is tracked (default 10000)",
    "QUOTA_ABUSE_THRESHOLD": "429s to one key within QUOTA_ABUSE_WINDOW that raise an abuse alert (0: off; default 100)",
    "QUOTA_ABUSE_WINDOW": "seconds over which QUOTA_ABUSE_THRESHOLD counts (default 60)",
    "QUOTA_ABUSE_INTERVAL": "seconds a key stays quiet after an abuse alert (default 900)",
}
"""Every variable `HttpConfig.from_env` reads, with what it sets."""

#: The other ``QUOTA_*`` variables quota reads: the store's URL, the load shedder's.
OTHER_VARS = ("QUOTA_DATABASE_URL", "QUOTA_SHED_CEILING", "QUOTA_SHED_RETRY_AFTER")
#: What follows ``QUOTA_POLICY_<NAME>_`` in the variables of one route class.
POLICY_FIELDS = ("RATES", "AUTHED_RATES", "COST", "FAIL_OPEN")
#: Prefixes of the variables of the repository's own tests, benchmarks and examples.
_TOOLING = ("QUOTA_TEST_", "QUOTA_BENCH_", "QUOTA_EXAMPLE_", "QUOTA_LIMITS_", "QUOTA_HTTP_FUZZ_")

log = logging.getLogger("quota")
_warned: set[str] = set()


def known_names(routes: Iterable[str]) -> set[str]:
    """Every ``QUOTA_*`` variable quota reads for a config whose route classes are `routes`."""
    names = {name for name in ENV_VARS if name.startswith("QUOTA_") and "<" not in name}
    names.update(OTHER_VARS)
    for route in {*routes, "default"}:
        names.update(f"QUOTA_POLICY_{_env_key(route)}_{field}" for field in POLICY_FIELDS)
    return names


def unread_names(env: Mapping[str, str], routes: Iterable[str]) -> dict[str, str | None]:
    """The ``QUOTA_*`` variables set in `env` that nothing reads, each with the closest known name."""
    known = known_names(routes)
    unread = sorted(
        name for name in env
        if name.startswith("QUOTA_") and name not in known and not name.startswith(_TOOLING)
    )  # fmt: skip
    return {
        name: next(iter(difflib.get_close_matches(name, known, n=1, cutoff=0.6)), None)
        for name in unread
    }


def warn_unread(env: Mapping[str, str], routes: Sequence[str]) -> None:
    """Log one warning (once per process and name) for each ``QUOTA_*`` variable nothing reads.

    A misspelt variable (``QUOTA_POLICY_APII_RATES``) would otherwise change
    nothing without a word.
    """
    for name, closest in unread_names(env, routes).items():
        if name in _warned:
            continue
        _warned.add(name)
        hint = f"; did you mean {closest}?" if closest else ""
        log.warning(
            "quota: the environment variable %s is set but no setting reads it (route"
            " classes: %s)%s",
            name, ", ".join(sorted({*routes, "default"})), hint,
        )  # fmt: skip


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _bool(name: str, text: str) -> bool:
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigurationError(f"${name} must be true or false, got {text!r}")


#: Only ASCII digits: ``str.isdigit`` also takes ``'²'`` (which `int` refuses) and
#: ``'\u0661\u0660'`` (which `int` and `float` read as 10). Digits are few enough for `int`.
_WHOLE = re.compile(r"[0-9]{1,19}")
_DECIMAL = re.compile(r"(?:[0-9]{1,19}(?:\.[0-9]{0,19})?|\.[0-9]{1,19})(?:[eE][+-]?[0-9]{1,3})?")


def _int(name: str, text: str, minimum: int = 1, maximum: int = MAX_LIMIT) -> int:
    """``$name``'s whole number in ``minimum..maximum``; `ConfigurationError` naming it otherwise."""
    value = text.strip()
    if not _WHOLE.fullmatch(value) or not minimum <= int(value) <= maximum:
        raise ConfigurationError(
            f"${name} must be a whole number between {minimum} and {maximum}, got {text!r}"
        )
    return int(value)


def _float(name: str, text: str, *, minimum: float = 0.0, maximum: float = float(MAX_LIMIT),
           exclusive: bool = False) -> float:  # fmt: skip
    """``$name``'s decimal number in ``minimum..maximum`` (above `minimum` when `exclusive`)."""
    value = text.strip()
    number = float(value) if _DECIMAL.fullmatch(value) else math.nan
    low_ok = number > minimum if exclusive else number >= minimum
    if not (low_ok and number <= maximum):  # NaN (not a number) fails both
        low = f"above {minimum:g}" if exclusive else f"at least {minimum:g}"
        raise ConfigurationError(
            f"${name} must be a decimal number {low} and at most {maximum:g}, got {text!r}"
        )
    return number


def _pairs(name: str, text: str, sep: str) -> dict[str, str]:
    out = {}
    for item in text.split(","):
        if not item.strip():
            continue
        key, found, value = item.partition(sep)
        if not found or not key.strip() or not value.strip():
            raise ConfigurationError(f"${name}: {item.strip()!r} is not of the form name{sep}value")
        out[key.strip()] = value.strip()
    return out


def _env_rates(name: str, text: str, algorithm: str | None = None) -> Rates:
    try:
        return tuple(parse_rates(text, algorithm=algorithm))
    except ConfigurationError as exc:
        raise ConfigurationError(f"${name}: {exc}") from exc


def _get(env: Mapping[str, str], *names: str) -> tuple[str, str] | None:
    for name in names:
        value = env.get(name)
        if value is not None and value.strip() != "":
            return name, value
    return None


def _env_key(name: str) -> str:
    return re.sub(r"[^A-Z0-9]", "_", name.upper())


def _window_sec(env: Mapping[str, str]) -> int:
    """``$RATE_LIMIT_WINDOW_SEC``: the window of every ``RATE_LIMIT_*_PER_MIN`` limit (60)."""
    found = _get(env, "RATE_LIMIT_WINDOW_SEC")
    return _int(*found, maximum=MAX_WINDOW) if found else 60


def _policy_from_env(env: Mapping[str, str], policy: RoutePolicy) -> RoutePolicy:
    key = _env_key(policy.name)
    changes: dict[str, Any] = {}
    used: list[str] = []  # the variables behind `changes`, for the message of a refusal
    window = _window_sec(env)
    algorithm = policy.algorithm or "fixed_window"
    found = _get(env, f"QUOTA_POLICY_{key}_RATES")
    if found:
        changes["rates"] = _env_rates(*found, policy.algorithm)
    elif found := _get(env, f"RATE_LIMIT_{key}_PER_MIN"):
        changes["rates"] = (Rate(limit=_int(*found), window=window, algorithm=algorithm),)
    used += [found[0]] if found else []
    tiers = dict(policy.tier_rates)
    if found := _get(env, f"QUOTA_POLICY_{key}_AUTHED_RATES"):
        tiers[AUTH] = _env_rates(*found, policy.algorithm)
    elif found := _get(env, f"RATE_LIMIT_{key}_AUTHED_PER_MIN"):
        tiers[AUTH] = (Rate(limit=_int(*found), window=window, algorithm=algorithm),)
    used += [found[0]] if found else []
    if tiers != dict(policy.tier_rates):
        changes["tier_rates"] = tiers
    if found := _get(env, f"QUOTA_POLICY_{key}_COST"):
        changes["cost"] = _int(*found)
        used.append(found[0])
    if found := _get(env, f"QUOTA_POLICY_{key}_FAIL_OPEN"):
        changes["fail_open"] = _bool(*found)
    if not changes:
        return policy
    try:
        return replace(policy, **changes)
    except ConfigurationError as exc:
        names = ", ".join(f"${name}" for name in used) or "the environment"
        raise ConfigurationError(f"{names} for route class {policy.name!r}: {exc}") from exc


def _bucket_from_env(env: Mapping[str, str]) -> Rates | None:
    """The default class as a token bucket: ``$RATE_LIMIT_CAPACITY`` and its window and refill.

    The window and refill variables are checked whenever they are set, so a
    malformed one fails at start-up even where no capacity uses it.
    """
    window_ms = _get(env, "RATE_LIMIT_WINDOW_MS")
    window = max(1, round(_int(*window_ms, maximum=MAX_WINDOW * 1000) / 1000)) if window_ms else 60
    refill = _get(env, "RATE_LIMIT_REFILL_PER_SEC")
    refill_rate = _float(*refill, exclusive=True) if refill else None
    found = _get(env, "RATE_LIMIT_CAPACITY", "RATE_LIMIT_MAX_REQUESTS")
    if not found:
        return None
    return (Rate(limit=_int(*found), window=window, algorithm="token_bucket",
                 refill_per_second=refill_rate),)  # fmt: skip


def _default_from_env(env: Mapping[str, str], default: RoutePolicy | None) -> RoutePolicy | None:
    algorithm = None
    if found := _get(env, "QUOTA_ALGORITHM"):
        if found[1] not in ALGORITHMS:
            raise ConfigurationError(
                f"${found[0]} must be one of {', '.join(ALGORITHMS)}, got {found[1]!r}"
            )
        algorithm = found[1]
    rates: Rates | None = None
    bucket = _bucket_from_env(env)
    if found := _get(env, "QUOTA_RATES"):
        rates = _env_rates(*found, algorithm)
    elif bucket is not None:
        rates = bucket
    authed = _get(env, "QUOTA_AUTHED_RATES")
    fail_open = _get(env, "QUOTA_FAIL_OPEN")
    if rates is None and default is None:
        if authed or fail_open:
            raise ConfigurationError("$QUOTA_AUTHED_RATES and $QUOTA_FAIL_OPEN need $QUOTA_RATES")
        return None
    changes: dict[str, Any] = {}
    if rates is not None:
        changes["rates"] = rates
    if authed:
        changes["tier_rates"] = {
            **(default.tier_rates if default else {}),
            AUTH: _env_rates(*authed, algorithm),
        }
    if fail_open:
        changes["fail_open"] = _bool(*fail_open)
    if algorithm:
        changes["algorithm"] = algorithm
    if default is None:
        return RoutePolicy(name="default", **changes)
    return replace(default, **changes)


def apply_env(env: Mapping[str, str], settings: Mapping[str, Any]) -> dict[str, Any]:
    """`settings` with the environment's values laid over them; see `ENV_VARS`.

    Every variable set is checked, used or not: a malformed one raises
    `ConfigurationError` naming it and its value.
    """
    out = dict(settings)
    booleans = {
        "enabled": ("QUOTA_ENABLED", "RATE_LIMIT_ENABLED"),
        "shadow": ("QUOTA_SHADOW",),
        "mutations_only": ("QUOTA_MUTATIONS_ONLY",),
        "adaptive": ("QUOTA_ADAPTIVE",),
        "runtime_policies": ("QUOTA_RUNTIME_POLICIES",),
        "partition_key": ("QUOTA_PARTITION_KEY",),
    }
    for setting, names in booleans.items():
        if found := _get(env, *names):
            out[setting] = _bool(*found)
    if found := _get(env, "QUOTA_EXCLUDE"):
        out["exclude"] = tuple(p.strip() for p in found[1].split(",") if p.strip())
        try:
            compile_paths("exclude", out["exclude"])
        except ConfigurationError as exc:
            raise ConfigurationError(f"${found[0]}: {exc}") from exc
    if found := _get(env, "QUOTA_TRUSTED_PROXIES"):
        parse_networks(f"${found[0]}", found[1])
        out["trusted_proxies"] = tuple(p.strip() for p in found[1].split(",") if p.strip())
    if found := _get(env, "QUOTA_CLIENT_IP_HEADER"):
        name = f"${found[0]}"
        text = found[1].strip()
        header = check_client_ip_header(name, _pairs(*found, "=") if "=" in text else text)
        trusted = parse_networks("trusted_proxies", list(out.get("trusted_proxies", ())))
        build_proxy_rules(name, trusted, header)
        out["client_ip_header"] = header
    if found := _get(env, "QUOTA_FORWARDED_HEADER"):
        out["forwarded_header"] = check_forwarded_header(f"${found[0]}", found[1])
    if found := _get(env, "QUOTA_HASH_SECRET", "RATE_LIMIT_SECRET"):
        if len(_utf8(f"${found[0]}", found[1])) < 16:
            raise ConfigurationError(f"${found[0]} must be at least 16 bytes long")
        out["hash_secret"] = found[1]
    keys = dict(out.get("hmac_keys", {}))
    if found := _get(env, "QUOTA_HMAC_KEYS"):
        for key_id, secret in _pairs(found[0], found[1], ":").items():
            if len(_utf8(f"${found[0]}", secret)) < 16:
                raise ConfigurationError(
                    f"${found[0]}: the secret of key id {key_id!r} must be at least 16 bytes"
                )
            keys[key_id] = secret
    if found := _get(env, "AGENT_HMAC_SECRET"):
        if len(_utf8(f"${found[0]}", found[1])) < 16:
            raise ConfigurationError(f"${found[0]} must be at least 16 bytes long")
        keys["default"] = found[1]
    if keys:
        out["hmac_keys"] = keys
    if found := _get(env, "QUOTA_HMAC_WINDOW"):
        out["hmac_window"] = _int(*found, maximum=3600)
    for setting, name in (("tier_multipliers", "QUOTA_TIER_MULTIPLIERS"),
                          ("plan_scales", "QUOTA_PLAN_SCALES")):  # fmt: skip
        if found := _get(env, name):
            base = dict(
                out.get(setting)
                or (
                    DEFAULT_TIER_MULTIPLIERS
                    if setting == "tier_multipliers"
                    else DEFAULT_PLAN_SCALES
                )
            )
            for key, value in _pairs(found[0], found[1], "=").items():
                base[key] = _float(
                    f"{found[0]} ({key})", value, minimum=MIN_FACTOR, maximum=MAX_FACTOR
                )
            out[setting] = base
    if found := _get(env, "QUOTA_HEADERS"):
        if found[1].strip() not in HEADER_STYLES:
            raise ConfigurationError(
                f"${found[0]} must be one of {', '.join(HEADER_STYLES)}, got {found[1]!r}"
            )
        out["headers"] = found[1].strip()
    if found := _get(env, "QUOTA_PROBLEM_TYPE"):
        if found[1].strip() not in PROBLEM_TYPES:
            raise ConfigurationError(
                f"${found[0]} must be one of {', '.join(PROBLEM_TYPES)}, got {found[1]!r}"
            )
        out["problem_type"] = found[1].strip()
    if found := _get(env, "QUOTA_POLICY_CACHE_SECONDS"):
        out["policy_cache_seconds"] = _float(*found, maximum=3600)
    if found := _get(env, "QUOTA_KEY_PREFIX"):
        if not _NAME.match(found[1].strip()):
            raise ConfigurationError(
                f"${found[0]} must be 1-40 of [A-Za-z0-9_.-], got {found[1]!r}"
            )
        out["key_prefix"] = found[1].strip()
    if found := _get(env, "QUOTA_UNVALIDATED_TOKEN_CEILING"):
        off = found[1].strip().lower() in _FALSE | {"none"}
        out["unvalidated_token_ceiling"] = (
            None if off else _float(*found, minimum=MIN_FACTOR, maximum=MAX_FACTOR)
        )
    if found := _get(env, "QUOTA_PRESSURE_HORIZON"):
        out["pressure_horizon"] = _float(*found, maximum=3600)
    if found := _get(env, "QUOTA_VELOCITY"):
        out["velocity"] = _bool(*found)
    if found := _get(env, "QUOTA_VELOCITY_HALF_LIFE"):
        out["velocity_half_life"] = _float(*found, maximum=86400, exclusive=True)
    if found := _get(env, "QUOTA_VELOCITY_MAX_KEYS"):
        out["velocity_max_keys"] = _int(*found, maximum=10_000_000)
    if found := _get(env, "QUOTA_ABUSE_THRESHOLD"):
        out["abuse_threshold"] = _int(*found, minimum=0, maximum=2**62)
    for setting, name in (("abuse_window", "QUOTA_ABUSE_WINDOW"),
                          ("abuse_interval", "QUOTA_ABUSE_INTERVAL")):  # fmt: skip
        if found := _get(env, name):
            out[setting] = _int(*found, maximum=MAX_WINDOW)
    policies = out.get("policies", ())
    for policy in policies:
        if not isinstance(policy, RoutePolicy):
            raise ConfigurationError(f"policies must be RoutePolicy objects, got {policy!r}")
    _window_sec(env)  # checked even when no route class reads it
    out["policies"] = tuple(_policy_from_env(env, p) for p in policies)
    out["default"] = _default_from_env(env, out.get("default"))
    if out["default"] is not None:
        out["default"] = _policy_from_env(env, out["default"])
    return out
