"""What limit applies to a request: route classes, tiers, plans, pressure, configuration.

Everything here is pure or an in-memory cache the app seeds: no database,
no network. `HttpConfig` is the one configuration object of the HTTP layer;
`HttpConfig.from_env` builds it from ``QUOTA_*`` variables (and the
``RATE_LIMIT_*`` names the design inputs used), failing at start-up with a
message naming any malformed variable.

Capacity a caller gets on a route class::

    rates of the route class (or of the caller's tier, if the class names one)
      x tier multiplier x plan scale x pressure factor, at least the request's cost

Every limit, burst and refill rate is scaled alike, so the time to refill a
bucket stays constant. Fixed windows and token buckets keep their state when
their capacity changes (neither puts it in the state key), so scaling a limit
never hands a caller a fresh bucket.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from quota._core.algorithms import ALGORITHMS, Rate, check_algorithm
from quota._core.decision import MAX_LIMIT, MAX_WINDOW
from quota._core.errors import ConfigurationError
from quota._core.rates import parse_rates
from quota.http._identity import (
    ANON,
    AUTH,
    TRUSTED,
    Network,
    ProxyRules,
    check_client_ip_header,
    check_forwarded_header,
    parse_networks,
)
from quota.http._identity import proxy_rules as build_proxy_rules

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
HEADER_STYLES = ("both", "legacy", "ietf", "none")
PROBLEM_TYPES = ("quota-exceeded", "about:blank")

#: Tier multipliers when none are configured (``anon`` is the floor).
DEFAULT_TIER_MULTIPLIERS: Mapping[str, float] = {
    ANON: 1.0, AUTH: 5.0, TRUSTED: 10.0, "staff": 2.0, "admin": 10.0,
}  # fmt: skip
#: Plan scales of the token-bucket design input; an unknown plan or a cache miss is 1x.
DEFAULT_PLAN_SCALES: Mapping[str, float] = {"enterprise": 3.0, "pro": 1.5, "free": 1.0}
#: Under pressure (at or above the threshold) these tiers keep this share of capacity.
DEFAULT_PRESSURE_FACTORS: Mapping[str, float] = {"staff": 0.85, AUTH: 0.7, ANON: 0.55}
#: Tiers pressure never lowers.
DEFAULT_PRESSURE_EXEMPT = frozenset({"admin", TRUSTED})
#: Bounds of every tier multiplier, plan scale and pressure factor (pressure
#: factors are at most 1). Within them a request's combined factor stays in
#: 1e-9..1e6, so a scaled limit is a finite number `scale_rate` can clamp.
MIN_FACTOR = 0.001
MAX_FACTOR = 1000.0

Rates = tuple[Rate, ...]


def _rates(name: str, value: object, algorithm: str | None) -> Rates:
    if isinstance(value, Rate):
        return (value,)
    if isinstance(value, str):
        try:
            return tuple(parse_rates(value, algorithm=algorithm))
        except ConfigurationError as exc:
            raise ConfigurationError(f"{name}: {exc}") from exc
    if isinstance(value, (list, tuple)) and value and all(isinstance(r, Rate) for r in value):
        return tuple(value)
    raise ConfigurationError(
        f"{name} must be a rate string like '100/minute;1000/day', a Rate or Rates; got {value!r}"
    )


def _segment_pattern(pattern: str) -> str:
    if not pattern.startswith("/"):
        raise ConfigurationError(f"path pattern {pattern!r} must start with '/'")
    if pattern == "/":
        return r"/.*"
    out = []
    for segment in pattern.rstrip("/").split("/")[1:]:
        if (segment.startswith("{") and segment.endswith("}")) or segment == "*":
            out.append("/[^/]+")
        else:
            out.append("/" + re.escape(segment))
    return "".join(out) + r"(?:/.*)?"


def compile_paths(name: str, patterns: Sequence[str]) -> re.Pattern[str]:
    """One regular expression matching any of `patterns`.

    A pattern matches its path and everything under it, on segment
    boundaries (``/api`` matches ``/api`` and ``/api/x`` but not
    ``/apix``); ``{name}`` or ``*`` stands for one segment
    (``/users/{id}/posts``); ``re:…`` is a regular expression matched
    against the whole path. Paths are decoded, so they may hold any
    character: ``.`` matches every one, a newline too (``re.DOTALL``), and
    the match is always of the whole path (``re.fullmatch``).
    """
    if isinstance(patterns, str):
        patterns = [patterns]
    if not patterns:
        raise ConfigurationError(f"{name} must list at least one path pattern")
    parts = []
    for pattern in patterns:
        if not isinstance(pattern, str):
            raise ConfigurationError(f"{name}: path pattern {pattern!r} is not a string")
        if pattern.startswith("re:"):
            try:
                re.compile(pattern[3:])
            except (re.error, OverflowError, RecursionError) as exc:
                raise ConfigurationError(
                    f"{name}: bad regular expression {pattern!r}: {exc}"
                ) from exc
            parts.append(f"(?:{pattern[3:]})")
        else:
            try:
                parts.append(_segment_pattern(pattern))
            except ConfigurationError as exc:
                raise ConfigurationError(f"{name}: {exc}") from exc
    try:
        return re.compile("(?:" + "|".join(parts) + ")", re.DOTALL)
    except (re.error, OverflowError, RecursionError) as exc:
        # Each compiles alone, but not together: a group name used twice, or
        # inline flags such as (?i) that must open the whole expression.
        raise ConfigurationError(
            f"{name}: the patterns {list(patterns)!r} do not combine into one regular"
            f" expression: {exc}"
        ) from exc


_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,40}$")


@dataclass(frozen=True, kw_only=True)
class RoutePolicy:
    """A route class: which requests it covers and the limits that apply to them."""

    name: str
    """Names the class in keys, metrics, headers and runtime overrides (``[A-Za-z0-9_.-]``)."""
    rates: str | Rate | Sequence[Rate]
    """Limits for the ``anon`` tier, scaled by the tier multipliers for the others:
    ``"100/minute;1000/day"``, ``"20/s burst 40"`` (a token bucket), or `Rate` objects."""
    paths: Sequence[str] = ("/",)
    """Path patterns (see `compile_paths`); the default covers every path."""
    methods: Sequence[str] | None = None
    """Methods this class covers (others fall to the next class); None means all."""
    tier_rates: Mapping[str, str | Rate | Sequence[Rate]] = field(default_factory=dict)
    """Exact limits for named tiers, used instead of ``rates x multiplier``
    (``{"auth": "60/minute"}``, as the d1 design's ``*_AUTHED_PER_MIN``)."""
    algorithm: str | None = None
    """Algorithm for rate strings without a burst (``fixed_window`` when None)."""
    cost: int = 1
    """Hits one request counts for (an expensive endpoint costs more)."""
    fail_open: bool = True
    """When the limiter fails: True lets requests through, False answers 503."""
    mutations_only: bool = False
    """GET, HEAD and OPTIONS on this class pass free; only mutations count."""
    shadow: bool = False
    """Decide and report, never block, for this class only (see `HttpConfig.shadow`)."""
    tenant_rates: str | Rate | Sequence[Rate] | None = None
    """Limits for a whole tenant on this class: every caller the identify hook
    puts in one tenant shares this bucket, beside each caller's own. Scaled by
    the tenant's plan (see `Plans`); None: no tenant bucket."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ConfigurationError(
                f"route class name must be 1-40 of [A-Za-z0-9_.-], got {self.name!r}"
            )
        where = f"route class {self.name!r}"
        if self.algorithm is not None:
            check_algorithm(self.algorithm)
        base = _rates(f"{where} rates", self.rates, self.algorithm)
        tiers = {
            str(tier): _rates(f"{where} tier_rates[{tier!r}]", value, self.algorithm)
            for tier, value in dict(self.tier_rates).items()
        }
        tenant = (
            None
            if self.tenant_rates is None
            else _rates(f"{where} tenant_rates", self.tenant_rates, self.algorithm)
        )
        if type(self.cost) is not int or self.cost < 1:
            raise ConfigurationError(f"{where}: cost must be a positive integer, got {self.cost!r}")
        for rate in (*base, *(r for rates in tiers.values() for r in rates), *(tenant or ())):
            try:
                rate.check_cost(self.cost)
            except ConfigurationError as exc:
                raise ConfigurationError(f"{where}: {exc}") from exc
        methods = None
        if self.methods is not None:
            if isinstance(self.methods, str):
                raise ConfigurationError(f"{where}: methods must be a list, got {self.methods!r}")
            methods = frozenset(m.upper() for m in self.methods)
        for flag in ("fail_open", "mutations_only", "shadow"):
            if not isinstance(getattr(self, flag), bool):
                raise ConfigurationError(
                    f"{where}: {flag} must be a bool, got {getattr(self, flag)!r}"
                )
        object.__setattr__(
            self, "paths", tuple([self.paths] if isinstance(self.paths, str) else self.paths)
        )
        object.__setattr__(self, "_base", base)
        object.__setattr__(self, "_tiers", tiers)
        object.__setattr__(self, "_tenant", tenant)
        object.__setattr__(self, "_methods", methods)
        object.__setattr__(self, "_pattern", compile_paths(f"{where} paths", self.paths))

    @property
    def base_rates(self) -> Rates:
        """The class's rates as `Rate` objects."""
        rates: Rates = self.__dict__["_base"]
        return rates

    def rates_for_tier(self, tier: str) -> Rates | None:
        """The exact rates this class names for `tier`, or None."""
        tiers: dict[str, Rates] = self.__dict__["_tiers"]
        return tiers.get(tier)

    @property
    def tenant_bucket(self) -> Rates | None:
        """The class's `tenant_rates` as `Rate` objects, or None."""
        rates: Rates | None = self.__dict__["_tenant"]
        return rates

    def matches(self, method: str, path: str) -> bool:
        """Whether this class covers a request with `method` on `path`."""
        methods: frozenset[str] | None = self.__dict__["_methods"]
        if methods is not None and method not in methods:
            return False
        pattern: re.Pattern[str] = self.__dict__["_pattern"]
        return pattern.fullmatch(path) is not None


def _utf8(name: str, text: str) -> bytes:
    """`text` (a secret) as UTF-8; `ConfigurationError` naming `name` for lone surrogates."""
    try:
        return text.encode()
    except UnicodeEncodeError:
        raise ConfigurationError(
            f"{name} must be text that encodes as UTF-8 (it holds a lone surrogate,"
            " as os.environ makes of bytes that are not UTF-8)"
        ) from None


def _check_factors(name: str, value: object, *, maximum: float = MAX_FACTOR) -> dict[str, float]:
    if not isinstance(value, Mapping):
        raise ConfigurationError(f"{name} must be a mapping of name to number, got {value!r}")
    out = {}
    for key, factor in value.items():
        if (
            isinstance(factor, bool)
            or not isinstance(factor, (int, float))
            or not MIN_FACTOR <= factor <= maximum  # NaN fails this too
        ):
            raise ConfigurationError(
                f"{name}[{key!r}] must be a number between {MIN_FACTOR:g} and {maximum:g},"
                f" got {factor!r}"
            )
        out[str(key)] = float(factor)
    return out


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
        for flag in ("enabled", "shadow", "mutations_only", "adaptive", "expose_headers",
                     "runtime_policies"):  # fmt: skip
            if not isinstance(getattr(self, flag), bool):
                raise ConfigurationError(f"{flag} must be a bool, got {getattr(self, flag)!r}")
        policies = tuple(self.policies)
        for policy in (*policies, self.default):
            if policy is not None and not isinstance(policy, RoutePolicy):
                raise ConfigurationError(f"policies must be RoutePolicy objects, got {policy!r}")
        names = [p.name for p in policies]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ConfigurationError(f"route class names must be unique, repeated: {duplicates}")
        object.__setattr__(self, "policies", policies)
        object.__setattr__(self, "exclude", tuple(self.exclude))
        object.__setattr__(
            self, "_exclude", compile_paths("exclude", self.exclude) if self.exclude else None
        )
        object.__setattr__(
            self, "_proxies", parse_networks("trusted_proxies", list(self.trusted_proxies))
        )
        client_ip_header = check_client_ip_header("client_ip_header", self.client_ip_header)
        forwarded_header = check_forwarded_header("forwarded_header", self.forwarded_header)
        object.__setattr__(self, "client_ip_header", client_ip_header)
        object.__setattr__(self, "forwarded_header", forwarded_header)
        object.__setattr__(self, "_proxy_rules", build_proxy_rules(
            "client_ip_header", self.__dict__["_proxies"], client_ip_header, forwarded_header
        ))  # fmt: skip
        if type(self.ipv6_prefix) is not int or not 1 <= self.ipv6_prefix <= 128:
            raise ConfigurationError(f"ipv6_prefix must be 1..128, got {self.ipv6_prefix!r}")
        secret = self.hash_secret
        if secret is not None:
            if isinstance(secret, str):
                secret = _utf8("hash_secret", secret)
            if not isinstance(secret, bytes) or len(secret) < 16:
                raise ConfigurationError(
                    "hash_secret must be at least 16 bytes (e.g. `python -c 'import secrets;"
                    " print(secrets.token_urlsafe(32))'`), got one of"
                    f" {len(secret) if isinstance(secret, bytes) else type(secret).__name__} bytes"
                )
        object.__setattr__(self, "_secret", secret)
        keys = {}
        for key_id, key in dict(self.hmac_keys).items():
            raw = _utf8(f"hmac_keys[{key_id!r}]", key) if isinstance(key, str) else key
            if (
                not isinstance(key_id, str)
                or not key_id
                or not isinstance(raw, bytes)
                or len(raw) < 16
            ):
                raise ConfigurationError(
                    f"hmac_keys[{key_id!r}] must be a non-empty key id with a secret of at least 16 bytes"
                )
            keys[key_id] = raw
        object.__setattr__(self, "_hmac_keys", keys)
        if type(self.hmac_window) is not int or not 1 <= self.hmac_window <= 3600:
            raise ConfigurationError(
                f"hmac_window must be 1..3600 seconds, got {self.hmac_window!r}"
            )
        object.__setattr__(self, "api_key_headers", tuple(h.lower() for h in self.api_key_headers))
        object.__setattr__(
            self, "tier_multipliers", _check_factors("tier_multipliers", self.tier_multipliers)
        )
        object.__setattr__(self, "plan_scales", _check_factors("plan_scales", self.plan_scales))
        factors = _check_factors("pressure_factors", self.pressure_factors)
        if any(f > 1 for f in factors.values()):
            raise ConfigurationError(f"pressure_factors must be at most 1, got {factors}")
        object.__setattr__(self, "pressure_factors", factors)
        object.__setattr__(self, "pressure_exempt", frozenset(self.pressure_exempt))
        if (
            isinstance(self.pressure_threshold, bool)
            or not isinstance(self.pressure_threshold, (int, float))
            or not 0 < self.pressure_threshold <= 1
        ):
            raise ConfigurationError(
                f"pressure_threshold must be in (0, 1], got {self.pressure_threshold!r}"
            )
        if self.headers not in HEADER_STYLES:
            raise ConfigurationError(
                f"headers must be one of {', '.join(HEADER_STYLES)}, got {self.headers!r}"
            )
        if self.problem_type not in PROBLEM_TYPES:
            raise ConfigurationError(
                f"problem_type must be one of {', '.join(PROBLEM_TYPES)}, got {self.problem_type!r}"
            )
        if not isinstance(self.partition_key, bool):
            raise ConfigurationError(f"partition_key must be a bool, got {self.partition_key!r}")
        if (
            isinstance(self.policy_cache_seconds, bool)
            or not isinstance(self.policy_cache_seconds, (int, float))
            or not 0 <= self.policy_cache_seconds <= 3600
        ):
            raise ConfigurationError(
                f"policy_cache_seconds must be 0..3600, got {self.policy_cache_seconds!r}"
            )
        if (
            type(self.unavailable_retry_after) is not int
            or not 1 <= self.unavailable_retry_after <= 3600
        ):
            raise ConfigurationError(
                f"unavailable_retry_after must be 1..3600 seconds, got {self.unavailable_retry_after!r}"
            )
        ceiling = self.unvalidated_token_ceiling
        if ceiling is not None and (
            isinstance(ceiling, bool)
            or not isinstance(ceiling, (int, float))
            or not MIN_FACTOR <= ceiling <= MAX_FACTOR
        ):
            raise ConfigurationError(
                f"unvalidated_token_ceiling must be None or a number between {MIN_FACTOR:g}"
                f" and {MAX_FACTOR:g}, got {ceiling!r}"
            )
        if not isinstance(self.key_prefix, str) or not _NAME.match(self.key_prefix):
            raise ConfigurationError(
                f"key_prefix must be 1-40 of [A-Za-z0-9_.-], got {self.key_prefix!r}"
            )
        horizon = self.pressure_horizon
        if (
            isinstance(horizon, bool)
            or not isinstance(horizon, (int, float))
            or not 0 <= horizon <= 3600
        ):
            raise ConfigurationError(f"pressure_horizon must be 0..3600 seconds, got {horizon!r}")
        if not isinstance(self.velocity, bool):
            raise ConfigurationError(f"velocity must be a bool, got {self.velocity!r}")
        half_life = self.velocity_half_life
        if (
            isinstance(half_life, bool)
            or not isinstance(half_life, (int, float))
            or not 0 < half_life <= 86400
        ):
            raise ConfigurationError(
                f"velocity_half_life must be above 0 and at most 86400 seconds, got {half_life!r}"
            )
        if type(self.velocity_max_keys) is not int or not 1 <= self.velocity_max_keys <= 10_000_000:
            raise ConfigurationError(
                f"velocity_max_keys must be 1..10000000, got {self.velocity_max_keys!r}"
            )
        if type(self.abuse_threshold) is not int or not 0 <= self.abuse_threshold <= 2**62:
            raise ConfigurationError(
                f"abuse_threshold must be a whole number 0..2**62 (0: off), got {self.abuse_threshold!r}"
            )
        for name in ("abuse_window", "abuse_interval"):
            value = getattr(self, name)
            if type(value) is not int or not 1 <= value <= MAX_WINDOW:
                raise ConfigurationError(f"{name} must be 1..{MAX_WINDOW} seconds, got {value!r}")

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
        variable. A malformed variable raises `ConfigurationError` naming it.
        """
        env = os.environ if environ is None else environ
        return cls(**apply_env(env, settings))


# -- environment --------------------------------------------------------------------

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


# -- scaling ------------------------------------------------------------------------


def _scaled(value: int, factor: float, floor: int) -> int:
    """`value` x `factor`, rounded down, kept within ``floor..MAX_LIMIT``."""
    product = value * factor + 1e-9
    if not product < MAX_LIMIT:  # also NaN: never an exception per request
        return MAX_LIMIT
    return min(MAX_LIMIT, max(floor, math.floor(product)))


def scale_rate(rate: Rate, factor: float, floor: int) -> Rate:
    """`rate` with its limit, burst and refill multiplied by `factor`, limits at least `floor`.

    Limits stay within ``floor..MAX_LIMIT`` and a refill that would leave the
    positive finite numbers stays as it was: a configuration that validated
    never makes a request fail here.
    """
    limit = _scaled(rate.limit, factor, floor)
    burst = None if rate.burst is None else _scaled(rate.burst, factor, floor)
    refill = rate.refill_per_second
    if refill is not None and 0 < refill * factor < math.inf:
        refill *= factor
    return replace(rate, limit=limit, burst=burst, refill_per_second=refill)


class ScaledRates:
    """`scale_rate` over a tuple of rates, memoised (a handful of factors recur)."""

    def __init__(self, size: int = 4096) -> None:
        self._cache: dict[tuple[int, float, int], tuple[Rates, Rates]] = {}
        self._size = size

    def __call__(self, rates: Rates, factor: float, floor: int) -> Rates:
        if factor == 1.0 and (floor == 1 or all(r.capacity >= floor for r in rates)):
            return rates
        key = (id(rates), factor, floor)
        hit = self._cache.get(key)
        if hit is not None and hit[0] is rates:
            return hit[1]
        scaled = tuple(scale_rate(r, factor, floor) for r in rates)
        if len(self._cache) >= self._size:
            self._cache.clear()
        self._cache[key] = (rates, scaled)
        return scaled


class Plans:
    """Tenant → plan, seeded by the app (from its tenant service); entries expire.

    The limiter never asks a database for a plan: a miss or an expired
    entry is simply 1x. Thread-safe; bounded (the oldest entries go first).
    """

    def __init__(
        self, *, ttl: float = 300.0, max_entries: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:  # fmt: skip
        if not ttl > 0:
            raise ConfigurationError(f"ttl must be positive seconds, got {ttl!r}")
        self._ttl = ttl
        self._max = max_entries
        self._clock = clock
        self._entries: dict[str, tuple[str, float]] = {}
        self._lock = threading.Lock()

    def seed(self, tenant: str, plan: str, *, ttl: float | None = None) -> None:
        """Remember that `tenant` is on `plan` for `ttl` seconds (default: the cache's)."""
        expires = self._clock() + (self._ttl if ttl is None else ttl)
        with self._lock:
            self._entries.pop(tenant, None)
            if len(self._entries) >= self._max:
                del self._entries[next(iter(self._entries))]
            self._entries[tenant] = (plan, expires)

    def forget(self, tenant: str) -> None:
        with self._lock:
            self._entries.pop(tenant, None)

    def plan(self, tenant: str | None) -> str | None:
        """`tenant`'s plan, or None when unknown or expired."""
        if tenant is None:
            return None
        entry = self._entries.get(tenant)
        if entry is None or entry[1] <= self._clock():
            return None
        return entry[0]


class SystemPressure:
    """System pressure in 0..1: an EWMA of max(CPU load per core, memory in use).

    Sampled at most once per `interval` seconds from ``os.getloadavg`` and
    ``/proc/meminfo`` (memory counts as 0 where that file is missing).
    Inject `sample` (returning a raw 0..1 reading) to drive it in tests.
    """

    def __init__(
        self, *, alpha: float = 0.3, interval: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        sample: Callable[[], float] | None = None,
    ) -> None:  # fmt: skip
        if not 0 < alpha <= 1:
            raise ConfigurationError(f"alpha must be in (0, 1], got {alpha!r}")
        self._alpha = alpha
        self._interval = interval
        self._clock = clock
        self._sample = sample or _system_sample
        self._value: float | None = None
        self._at = -math.inf

    def __call__(self) -> float:
        now = self._clock()
        if now - self._at >= self._interval:
            self._at = now
            reading = min(1.0, max(0.0, self._sample()))
            self._value = (
                reading
                if self._value is None
                else self._alpha * reading + (1 - self._alpha) * self._value
            )
        return self._value or 0.0


def _system_sample() -> float:
    cpu = 0.0
    with contextlib.suppress(OSError):
        cpu = os.getloadavg()[0] / (os.cpu_count() or 1)
    memory = 0.0
    try:
        with open("/proc/meminfo") as meminfo:
            values = {
                line.split(":")[0]: int(line.split()[1]) for line in meminfo if line.count(":") == 1
            }
        memory = 1 - values["MemAvailable"] / values["MemTotal"]
    except (OSError, KeyError, ValueError, IndexError, ZeroDivisionError):
        pass
    return min(1.0, max(cpu, memory))


#: The class a middleware built without a config limits every path with.
DEFAULT_POLICY = RoutePolicy(name="default", rates="60/minute")
