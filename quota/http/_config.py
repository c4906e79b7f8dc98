"""`HttpConfig`, the one configuration object of the HTTP layer.

Everything here is pure: a validated dataclass. Each field's check is a row
of `_CHECKS`, run in order when the config is built; the values a field may
hold and the checks they share with the environment reader are in
`quota.http._fields`, the route classes in `quota.http._routes`.
`HttpConfig.from_env` builds a config from ``QUOTA_*`` variables (and the
``RATE_LIMIT_*`` names other rate limiters use) through
`quota.http._env.apply_env`, failing at start-up with a message naming any
malformed variable.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from quota._core.decision import MAX_WINDOW
from quota._core.errors import ConfigurationError
from quota._core.factors import MAX_FACTOR, MIN_FACTOR, check_factors
from quota.http._env import apply_env, warn_unread
from quota.http._fields import (
    DEFAULT_PLAN_SCALES,
    DEFAULT_PRESSURE_EXEMPT,
    DEFAULT_PRESSURE_FACTORS,
    DEFAULT_TIER_MULTIPLIERS,
    HEADER_STYLES,
    PROBLEM_TYPES,
    Check,
    check_bool,
    check_name,
    choice,
    number,
    utf8,
    whole,
)
from quota.http._identity import (
    Network,
    ProxyRules,
    check_client_ip_header,
    check_forwarded_header,
    parse_networks,
)
from quota.http._identity import proxy_rules as build_proxy_rules
from quota.http._routes import RoutePolicy, compile_paths


def _policies(name: str, value: Sequence[RoutePolicy]) -> tuple[RoutePolicy, ...]:
    policies = tuple(value)
    for policy in policies:
        _policy(name, policy)
    names = [p.name for p in policies]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ConfigurationError(f"route class names must be unique, repeated: {duplicates}")
    return policies


def _policy(name: str, value: RoutePolicy | None) -> RoutePolicy | None:
    if value is not None and not isinstance(value, RoutePolicy):
        raise ConfigurationError(f"policies must be RoutePolicy objects, got {value!r}")
    return value


def _exclude(name: str, value: Sequence[str]) -> re.Pattern[str] | None:
    return compile_paths(name, value) if value else None


def _secret(name: str, value: str | bytes | None) -> bytes | None:
    if value is None:
        return None
    secret = utf8(name, value) if isinstance(value, str) else value
    if not isinstance(secret, bytes) or len(secret) < 16:
        raise ConfigurationError(
            f"{name} must be at least 16 bytes (e.g. `python -c 'import secrets;"
            " print(secrets.token_urlsafe(32))'`), got one of"
            f" {len(secret) if isinstance(secret, bytes) else type(secret).__name__} bytes"
        )
    return secret


def _hmac_keys(name: str, value: Mapping[str, str | bytes]) -> dict[str, bytes]:
    keys = {}
    for key_id, key in dict(value).items():
        raw = utf8(f"{name}[{key_id!r}]", key) if isinstance(key, str) else key
        if not isinstance(key_id, str) or not key_id or not isinstance(raw, bytes) or len(raw) < 16:
            raise ConfigurationError(
                f"{name}[{key_id!r}] must be a non-empty key id with a secret of at least 16 bytes"
            )
        keys[key_id] = raw
    return keys


def _pressure_factors(name: str, value: object) -> dict[str, float]:
    factors = check_factors(name, value)
    if any(f > 1 for f in factors.values()):
        raise ConfigurationError(f"{name} must be at most 1, got {factors}")
    return factors


def _lowered(name: str, value: Sequence[str]) -> tuple[str, ...]:
    return tuple(h.lower() for h in value)


def _tuple(name: str, value: Sequence[Any]) -> tuple[Any, ...]:
    return tuple(value)


def _frozenset(name: str, value: Sequence[str]) -> frozenset[str]:
    return frozenset(value)


#: The checks of `HttpConfig`, run in this order when it is built: (field, the
#: attribute the checked value is kept in, check). A check gets the field's
#: name and value and raises `ConfigurationError` naming both; a value kept
#: under another attribute (``_secret``) is derived, the field stays as given.
_CHECKS: tuple[tuple[str, str, Check], ...] = (
    *((flag, flag, check_bool) for flag in (
        "enabled", "shadow", "mutations_only", "adaptive", "expose_headers", "runtime_policies",
    )),
    ("policies", "policies", _policies),
    ("default", "default", _policy),
    ("exclude", "exclude", _tuple),
    ("exclude", "_exclude", _exclude),
    ("trusted_proxies", "_proxies", lambda name, value: parse_networks(name, list(value))),
    ("client_ip_header", "client_ip_header", check_client_ip_header),
    ("forwarded_header", "forwarded_header", check_forwarded_header),
    ("ipv6_prefix", "ipv6_prefix", whole(1, 128, "1..128")),
    ("hash_secret", "_secret", _secret),
    ("hmac_keys", "_hmac_keys", _hmac_keys),
    ("hmac_window", "hmac_window", whole(1, 3600, "1..3600 seconds")),
    ("api_key_headers", "api_key_headers", _lowered),
    ("tier_multipliers", "tier_multipliers", check_factors),
    ("plan_scales", "plan_scales", check_factors),
    ("pressure_factors", "pressure_factors", _pressure_factors),
    ("pressure_exempt", "pressure_exempt", _frozenset),
    ("pressure_threshold", "pressure_threshold", number(0, 1, "in (0, 1]", above=True)),
    ("headers", "headers", choice(HEADER_STYLES)),
    ("problem_type", "problem_type", choice(PROBLEM_TYPES)),
    ("partition_key", "partition_key", check_bool),
    ("policy_cache_seconds", "policy_cache_seconds", number(0, 3600, "0..3600")),
    ("unavailable_retry_after", "unavailable_retry_after", whole(1, 3600, "1..3600 seconds")),
    ("unvalidated_token_ceiling", "unvalidated_token_ceiling", number(
        MIN_FACTOR, MAX_FACTOR, f"None or a number between {MIN_FACTOR:g} and {MAX_FACTOR:g}",
        optional=True,
    )),
    ("key_prefix", "key_prefix", check_name),
    ("pressure_horizon", "pressure_horizon", number(0, 3600, "0..3600 seconds")),
    ("velocity", "velocity", check_bool),
    ("velocity_half_life", "velocity_half_life", number(
        0, 86400, "above 0 and at most 86400 seconds", above=True
    )),
    ("velocity_max_keys", "velocity_max_keys", whole(1, 10_000_000, "1..10000000")),
    ("abuse_threshold", "abuse_threshold", whole(0, 2**62, "a whole number 0..2**62 (0: off)")),
    ("abuse_window", "abuse_window", whole(1, MAX_WINDOW, f"1..{MAX_WINDOW} seconds")),
    ("abuse_interval", "abuse_interval", whole(1, MAX_WINDOW, f"1..{MAX_WINDOW} seconds")),
)  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class HttpConfig:
    """Configuration of the HTTP middlewares; validated when built (see `from_env`)."""

    enabled: bool = True
    """Master switch: False passes every request untouched."""
    shadow: bool = False
    """Shadow mode: decide, count, send headers and metrics, but never block."""
    policies: Sequence[RoutePolicy] = ()
    """Route classes, first match wins."""
    default: RoutePolicy | None = None
    """The class for requests no route class covers; None lets them pass unlimited."""
    exclude: Sequence[str] = ()
    """Path patterns never limited (health checks, static files), as in `compile_paths`."""
    mutations_only: bool = False
    """GET, HEAD and OPTIONS pass free everywhere; only mutations count."""
    trusted_proxies: Sequence[str] = ()
    """Proxies (CIDRs) whose forwarding headers are believed (see `client_ip`)."""
    client_ip_header: str | Mapping[str, str] | None = None
    """A header naming the client in one address (``cf-connecting-ip``,
    ``true-client-ip``, ``x-real-ip``, ``fly-client-ip``), believed only from
    the trusted proxies that set it: a mapping ``{CIDR: header}`` names the
    proxies (each CIDR within `trusted_proxies`); a bare name believes it from
    every trusted proxy, so set one only when every path into the app goes
    through a proxy that sets it. None (the default) reads no such header."""
    forwarded_header: str = "x-forwarded-for"
    """The chain header the trusted proxies write: ``x-forwarded-for`` or
    ``forwarded`` (RFC 7239). Only this one is read: a proxy passes the other
    through untouched, so a client could write it."""
    ipv6_prefix: int = 64
    """IPv6 clients are keyed by this prefix of their address (one subscriber's /64)."""
    hash_secret: str | bytes | None = None
    """Key of the HMAC that turns IPs and tokens into subjects (≥ 16 bytes).
    None: a random per-process secret on SQLite (with a warning: limits are
    then per process and reset on restart); refused on PostgreSQL."""
    hmac_keys: Mapping[str, str | bytes] = field(default_factory=dict)
    """Key id → secret for signed (*trusted*) callers; several at once for rotation."""
    hmac_window: int = 300
    """Seconds a signature stays valid either side of its timestamp."""
    api_key_headers: Sequence[str] = ("x-api-key",)
    """Headers carrying an API key (``Authorization`` is always read)."""
    tier_multipliers: Mapping[str, float] = field(
        default_factory=lambda: dict(DEFAULT_TIER_MULTIPLIERS)
    )
    """Scale of each tier's limits; a tier not listed gets 1x."""
    plan_scales: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_PLAN_SCALES))
    """Scale per tenant plan (see `Plans`)."""
    adaptive: bool = False
    """Lower capacity under system pressure (see `SystemPressure`)."""
    pressure_threshold: float = 0.75
    """Pressure (0..1) at or above which `pressure_factors` apply."""
    pressure_factors: Mapping[str, float] = field(
        default_factory=lambda: dict(DEFAULT_PRESSURE_FACTORS)
    )
    """Share of capacity each tier keeps under pressure; tiers not listed keep all."""
    pressure_exempt: Sequence[str] = tuple(sorted(DEFAULT_PRESSURE_EXEMPT))
    """Tiers pressure never lowers."""
    headers: str = "both"
    """Rate-limit headers sent: ``legacy`` (X-RateLimit-*), ``ietf`` (RateLimit,
    RateLimit-Policy), ``both`` or ``none``. Retry-After is always sent on 429/503."""
    expose_headers: bool = True
    """Add the headers to ``Access-Control-Expose-Headers`` on cross-origin requests."""
    runtime_policies: bool = True
    """Read overrides from the ``quota_policies`` table (see ``quota policy``)."""
    policy_cache_seconds: float = 5.0
    """Period of the overrides' refresh: the table is read on the first request
    after each multiple of this many seconds since the epoch, and a change
    applies on every worker at the first such boundary at least 1 s after it
    was written (0: read on every request)."""
    unavailable_retry_after: int = 5
    """Retry-After of the 503 a fail-closed class answers when the limiter fails."""
    key_prefix: str = "http"
    """First part of every key the middleware counts under."""
    unvalidated_token_ceiling: float | None = 1.0
    """Without a ``token_validator``, a bearer token or API key is nobody's
    proof of anything: a client could send a fresh one per request. Such
    callers keep the ``auth`` tier and a bucket per token, and all of them
    behind one client IP also share a ceiling of the ``auth`` tier's limits
    x this factor. None turns the ceiling off (a client can then mint
    buckets); a ``token_validator`` makes it unnecessary."""
    problem_type: str = "quota-exceeded"
    """Body of the default 429: ``quota-exceeded``, the problem type of
    draft-ietf-httpapi-ratelimit-headers-10 with ``violated-policies``, or
    ``about:blank`` (title ``Too Many Requests``, the body of earlier releases)."""
    partition_key: bool = False
    """Add ``pk`` (the partition key: a keyed digest of the bucket the request
    counted on, never the IP, token or key id) to ``RateLimit-Policy`` and ``RateLimit``."""
    pressure_horizon: float = 0.0
    """Seconds ahead adaptive capacity looks. Above 0, the built-in pressure
    source is `quota.http.PredictivePressure` (the moving average plus its
    trend x this horizon), so capacity is lowered before the system saturates
    and given back as soon as the trend falls; 0 is `SystemPressure`, the
    moving average alone."""
    velocity: bool = True
    """Track each key's request rate (``guard.velocity``, the
    ``quota_request_velocity`` histogram); observability only, never a decision."""
    velocity_half_life: float = 10.0
    """Seconds in which a key's tracked request rate halves once it stops."""
    velocity_max_keys: int = 10_000
    """Keys whose request rate is tracked; the one seen least recently goes first."""
    abuse_threshold: int = 100
    """429s answered to one key within `abuse_window` seconds that raise an
    abuse alert (a WARNING, the ``on_abuse`` callback, a metric), at most one
    per key per `abuse_interval`; 0 turns alerts off."""
    abuse_window: int = 60
    """Seconds over which `abuse_threshold` counts a key's 429s."""
    abuse_interval: int = 900
    """Seconds a key stays quiet after an abuse alert."""

    def __post_init__(self) -> None:
        for name, attribute, check in _CHECKS:
            object.__setattr__(self, attribute, check(name, getattr(self, name)))
        rules = build_proxy_rules(
            "client_ip_header", self.proxies, self.client_ip_header, self.forwarded_header
        )
        object.__setattr__(self, "_proxy_rules", rules)

    # -- derived values, computed once at construction --------------------------

    @property
    def proxies(self) -> tuple[Network, ...]:
        networks: tuple[Network, ...] = self.__dict__["_proxies"]
        return networks

    @property
    def proxy_rules(self) -> ProxyRules:
        """How the client address is read behind the trusted proxies (see `client_ip`)."""
        rules: ProxyRules = self.__dict__["_proxy_rules"]
        return rules

    @property
    def secret(self) -> bytes | None:
        secret: bytes | None = self.__dict__["_secret"]
        return secret

    @property
    def hmac_secrets(self) -> Mapping[str, bytes]:
        keys: Mapping[str, bytes] = self.__dict__["_hmac_keys"]
        return keys

    def excluded(self, path: str) -> bool:
        """Whether `path` is never limited."""
        pattern: re.Pattern[str] | None = self.__dict__["_exclude"]
        return pattern is not None and pattern.fullmatch(path) is not None

    def route_for(self, method: str, path: str) -> RoutePolicy | None:
        """The first route class covering the request, else the default (maybe None)."""
        for policy in self.policies:
            if policy.matches(method, path):
                return policy
        return self.default

    def route_named(self, name: str) -> RoutePolicy | None:
        for policy in (*self.policies, self.default):
            if policy is not None and policy.name == name:
                return policy
        return None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **settings: Any) -> HttpConfig:
        """A config from environment variables, over `settings` given in code.

        Code sets the shape (route classes and their defaults); the
        environment tunes it per deployment. See `ENV_VARS` for every
        variable. A malformed variable raises `ConfigurationError` naming it;
        a ``QUOTA_*`` variable nothing reads (a misspelt name) is logged once,
        as a warning on the ``quota`` logger naming the closest known one.
        """
        env = os.environ if environ is None else environ
        config = cls(**apply_env(env, settings))
        routes = [p.name for p in (*config.policies, config.default) if p is not None]
        warn_unread(env, routes)
        return config


#: The class a middleware built without a config limits every path with.
DEFAULT_POLICY = RoutePolicy(name="default", rates="60/minute")
