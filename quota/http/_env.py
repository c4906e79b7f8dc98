"""Environment variables of the HTTP layer: `ENV_VARS` and `apply_env`.

`HttpConfig.from_env` lays the ``QUOTA_*`` variables (and the
``RATE_LIMIT_*`` names other rate limiters use) over the settings given in
code. Every variable set is checked, used or not: a malformed one raises
`ConfigurationError` naming it and its value.

A variable that sets one field is one row of `FIELD_VARS` (its names, the
field, its parser, what it sets); the variables of the route classes
(`ROUTE_VARS`) are read per class, their parsing depending on its
algorithm. `ENV_VARS` is made from both.
"""

from __future__ import annotations

import difflib
import logging
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from quota._core.algorithms import ALGORITHMS, Rate
from quota._core.decision import MAX_LIMIT, MAX_WINDOW
from quota._core.errors import ConfigurationError
from quota._core.factors import MAX_FACTOR, MIN_FACTOR
from quota._core.parsing import parse_decimal, parse_flag, parse_whole
from quota._core.rates import parse_rates
from quota.http._fields import (
    DEFAULT_PLAN_SCALES,
    DEFAULT_TIER_MULTIPLIERS,
    HEADER_STYLES,
    NAME,
    PROBLEM_TYPES,
    utf8,
)
from quota.http._identity import (
    AUTH,
    check_client_ip_header,
    check_forwarded_header,
    parse_networks,
)
from quota.http._identity import proxy_rules as build_proxy_rules
from quota.http._routes import Rates, RoutePolicy, compile_paths

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


def _bool(name: str, text: str) -> bool:
    flag = parse_flag(text)
    if flag is None:
        raise ConfigurationError(f"${name} must be true or false, got {text!r}")
    return flag


def _int(name: str, text: str, minimum: int = 1, maximum: int = MAX_LIMIT) -> int:
    """``$name``'s whole number in ``minimum..maximum``; `ConfigurationError` naming it otherwise."""
    number = parse_whole(text)
    if number is None or not minimum <= number <= maximum:
        raise ConfigurationError(
            f"${name} must be a whole number between {minimum} and {maximum}, got {text!r}"
        )
    return number


def _float(name: str, text: str, *, minimum: float = 0.0, maximum: float = float(MAX_LIMIT),
           exclusive: bool = False) -> float:  # fmt: skip
    """``$name``'s decimal number in ``minimum..maximum`` (above `minimum` when `exclusive`)."""
    parsed = parse_decimal(text)
    number = math.nan if parsed is None else parsed
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


# -- the variables that set one field each -------------------------------------------

Settings = Mapping[str, Any]
#: Reads one variable: ``parse(name, text, settings)`` gives the field's new value
#: (`settings` are those built so far, for a value laid over them) or raises
#: `ConfigurationError` naming ``$name`` and the text.
Parser = Callable[[str, str, Settings], Any]


@dataclass(frozen=True)
class EnvVar:
    """One environment variable that sets one field of `HttpConfig`."""

    names: tuple[str, ...]
    """The variable, then its aliases (the first one set is read)."""
    field: str
    """The `HttpConfig` field it sets."""
    parse: Parser
    help: str
    """What it sets, for `ENV_VARS`."""


def _flag(name: str, text: str, settings: Settings) -> bool:
    return _bool(name, text)


def _whole(minimum: int = 1, maximum: int = MAX_LIMIT) -> Parser:
    return lambda name, text, settings: _int(name, text, minimum, maximum)


def _decimal(minimum: float = 0.0, maximum: float = float(MAX_LIMIT), *,
             exclusive: bool = False) -> Parser:  # fmt: skip
    return lambda name, text, settings: _float(
        name, text, minimum=minimum, maximum=maximum, exclusive=exclusive
    )


def _choice(options: Sequence[str]) -> Parser:
    def parse(name: str, text: str, settings: Settings) -> str:
        if text.strip() not in options:
            raise ConfigurationError(f"${name} must be one of {', '.join(options)}, got {text!r}")
        return text.strip()

    return parse


def _exclude(name: str, text: str, settings: Settings) -> tuple[str, ...]:
    patterns = tuple(p.strip() for p in text.split(",") if p.strip())
    try:
        compile_paths("exclude", patterns)
    except ConfigurationError as exc:
        raise ConfigurationError(f"${name}: {exc}") from exc
    return patterns


def _proxies(name: str, text: str, settings: Settings) -> tuple[str, ...]:
    parse_networks(f"${name}", text)
    return tuple(p.strip() for p in text.split(",") if p.strip())


def _client_ip_header(name: str, text: str, settings: Settings) -> str | dict[str, str] | None:
    shown = f"${name}"
    stripped = text.strip()
    header = check_client_ip_header(shown, _pairs(name, text, "=") if "=" in stripped else stripped)
    trusted = parse_networks("trusted_proxies", list(settings.get("trusted_proxies", ())))
    build_proxy_rules(shown, trusted, header)
    return header


def _forwarded_header(name: str, text: str, settings: Settings) -> str:
    return check_forwarded_header(f"${name}", text)


def _secret(name: str, text: str, settings: Settings) -> str:
    if len(utf8(f"${name}", text)) < 16:
        raise ConfigurationError(f"${name} must be at least 16 bytes long")
    return text


def _hmac_keys(name: str, text: str, settings: Settings) -> dict[str, str | bytes]:
    keys = dict(settings.get("hmac_keys", {}))
    for key_id, secret in _pairs(name, text, ":").items():
        if len(utf8(f"${name}", secret)) < 16:
            raise ConfigurationError(
                f"${name}: the secret of key id {key_id!r} must be at least 16 bytes"
            )
        keys[key_id] = secret
    return keys


def _default_hmac_key(name: str, text: str, settings: Settings) -> dict[str, str | bytes]:
    return {**settings.get("hmac_keys", {}), "default": _secret(name, text, settings)}


def _factors(field: str, default: Mapping[str, float]) -> Parser:
    """Factors ``name=number,…`` laid over the field's value (its default when empty)."""

    def parse(name: str, text: str, settings: Settings) -> dict[str, float]:
        factors = dict(settings.get(field) or default)
        for key, value in _pairs(name, text, "=").items():
            factors[key] = _float(f"{name} ({key})", value, minimum=MIN_FACTOR, maximum=MAX_FACTOR)
        return factors

    return parse


def _key_prefix(name: str, text: str, settings: Settings) -> str:
    if not NAME.match(text.strip()):
        raise ConfigurationError(f"${name} must be 1-40 of [A-Za-z0-9_.-], got {text!r}")
    return text.strip()


def _ceiling(name: str, text: str, settings: Settings) -> float | None:
    if parse_flag(text) is False or text.strip().lower() == "none":
        return None
    return _float(name, text, minimum=MIN_FACTOR, maximum=MAX_FACTOR)


#: The variables that set one field each, read in this order.
FIELD_VARS: tuple[EnvVar, ...] = (
    EnvVar(names=("QUOTA_ENABLED", "RATE_LIMIT_ENABLED"), field="enabled", parse=_flag,
           help="master switch (true/false); alias RATE_LIMIT_ENABLED"),
    EnvVar(names=("QUOTA_SHADOW",), field="shadow", parse=_flag,
           help="shadow mode: decide and report, never block"),
    EnvVar(names=("QUOTA_MUTATIONS_ONLY",), field="mutations_only", parse=_flag,
           help="only POST/PUT/PATCH/DELETE count"),
    EnvVar(names=("QUOTA_ADAPTIVE",), field="adaptive", parse=_flag,
           help="lower capacity under system pressure"),
    EnvVar(names=("QUOTA_RUNTIME_POLICIES",), field="runtime_policies", parse=_flag,
           help="read overrides from the quota_policies table"),
    EnvVar(names=("QUOTA_PARTITION_KEY",), field="partition_key", parse=_flag,
           help="add pk (a keyed digest of the caller's bucket) to the IETF fields"),
    EnvVar(names=("QUOTA_EXCLUDE",), field="exclude", parse=_exclude,
           help="comma-separated path patterns never limited"),
    EnvVar(names=("QUOTA_TRUSTED_PROXIES",), field="trusted_proxies", parse=_proxies,
           help="comma-separated CIDRs whose forwarding headers are believed"),
    EnvVar(names=("QUOTA_CLIENT_IP_HEADER",), field="client_ip_header", parse=_client_ip_header,
           help="client-IP header: a name from every trusted proxy, or 'cidr=name,…'"),
    EnvVar(names=("QUOTA_FORWARDED_HEADER",), field="forwarded_header", parse=_forwarded_header,
           help="chain header of the trusted proxies: x-forwarded-for or forwarded"),
    EnvVar(names=("QUOTA_HASH_SECRET", "RATE_LIMIT_SECRET"), field="hash_secret", parse=_secret,
           help="key of the IP/token hashes (>= 16 bytes); alias RATE_LIMIT_SECRET"),
    EnvVar(names=("QUOTA_HMAC_KEYS",), field="hmac_keys", parse=_hmac_keys,
           help="signed callers: 'keyid:secret,keyid2:secret2'; AGENT_HMAC_SECRET adds key id 'default'"),
    EnvVar(names=("AGENT_HMAC_SECRET",), field="hmac_keys", parse=_default_hmac_key,
           help="the secret of signed callers' key id 'default' (>= 16 bytes)"),
    EnvVar(names=("QUOTA_HMAC_WINDOW",), field="hmac_window", parse=_whole(maximum=3600),
           help="seconds a signature is valid either side of its timestamp"),
    EnvVar(names=("QUOTA_TIER_MULTIPLIERS",), field="tier_multipliers",
           parse=_factors("tier_multipliers", DEFAULT_TIER_MULTIPLIERS),
           help="e.g. 'auth=5,trusted=10'"),
    EnvVar(names=("QUOTA_PLAN_SCALES",), field="plan_scales",
           parse=_factors("plan_scales", DEFAULT_PLAN_SCALES),
           help="e.g. 'enterprise=3,pro=1.5'"),
    EnvVar(names=("QUOTA_HEADERS",), field="headers", parse=_choice(HEADER_STYLES),
           help="both, legacy, ietf or none"),
    EnvVar(names=("QUOTA_PROBLEM_TYPE",), field="problem_type", parse=_choice(PROBLEM_TYPES),
           help="body of the 429: quota-exceeded (default) or about:blank"),
    EnvVar(names=("QUOTA_POLICY_CACHE_SECONDS",), field="policy_cache_seconds",
           parse=_decimal(maximum=3600),
           help="period of the overrides' refresh; changes apply on every worker at its boundaries"),
    EnvVar(names=("QUOTA_KEY_PREFIX",), field="key_prefix", parse=_key_prefix,
           help="first part of every key"),
    EnvVar(names=("QUOTA_UNVALIDATED_TOKEN_CEILING",), field="unvalidated_token_ceiling",
           parse=_ceiling,
           help="per-IP ceiling of unvalidated tokens, x the auth tier's limits ('off': none)"),
    EnvVar(names=("QUOTA_PRESSURE_HORIZON",), field="pressure_horizon",
           parse=_decimal(maximum=3600),
           help="seconds ahead adaptive capacity predicts pressure (0: the moving average alone)"),
    EnvVar(names=("QUOTA_VELOCITY",), field="velocity", parse=_flag,
           help="track each key's request rate (default true)"),
    EnvVar(names=("QUOTA_VELOCITY_HALF_LIFE",), field="velocity_half_life",
           parse=_decimal(maximum=86400, exclusive=True),
           help="seconds in which a key's tracked rate halves (default 10)"),
    EnvVar(names=("QUOTA_VELOCITY_MAX_KEYS",), field="velocity_max_keys",
           parse=_whole(maximum=10_000_000),
           help="keys whose request rate is tracked (default 10000)"),
    EnvVar(names=("QUOTA_ABUSE_THRESHOLD",), field="abuse_threshold",
           parse=_whole(minimum=0, maximum=2**62),
           help="429s to one key within QUOTA_ABUSE_WINDOW that raise an abuse alert (0: off; default 100)"),
    EnvVar(names=("QUOTA_ABUSE_WINDOW",), field="abuse_window", parse=_whole(maximum=MAX_WINDOW),
           help="seconds over which QUOTA_ABUSE_THRESHOLD counts (default 60)"),
    EnvVar(names=("QUOTA_ABUSE_INTERVAL",), field="abuse_interval",
           parse=_whole(maximum=MAX_WINDOW),
           help="seconds a key stays quiet after an abuse alert (default 900)"),
)  # fmt: skip

#: The variables of the route classes (`RoutePolicy` fields), read by the class
#: they name: their parsing depends on its algorithm and on each other.
ROUTE_VARS: Mapping[str, str] = {
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
}

ENV_VARS: Mapping[str, str] = {
    **{var.names[0]: var.help for var in FIELD_VARS},
    **ROUTE_VARS,
}
"""Every variable `HttpConfig.from_env` reads, with what it sets."""


def apply_env(env: Mapping[str, str], settings: Mapping[str, Any]) -> dict[str, Any]:
    """`settings` with the environment's values laid over them; see `ENV_VARS`.

    Every variable set is checked, used or not: a malformed one raises
    `ConfigurationError` naming it and its value.
    """
    out = dict(settings)
    for var in FIELD_VARS:
        if found := _get(env, *var.names):
            out[var.field] = var.parse(*found, out)
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
