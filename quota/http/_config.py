"""The configuration of the HTTP layer: route classes (`RoutePolicy`) and `HttpConfig`.

Everything here is pure: validated dataclasses and the path patterns they
compile. `HttpConfig` is the one configuration object of the HTTP layer;
`HttpConfig.from_env` builds it from ``QUOTA_*`` variables (and the
``RATE_LIMIT_*`` names other rate limiters use) through
`quota.http._env.apply_env`, failing at start-up with a message naming any
malformed variable. How a route class's rates scale per caller is in
`quota.http._capacity`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from quota._core.algorithms import Rate, check_algorithm
from quota._core.decision import MAX_WINDOW
from quota._core.errors import ConfigurationError
from quota._core.factors import MAX_FACTOR, MIN_FACTOR
from quota._core.factors import check_factors as _check_factors
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
#: Plan scales by default; an unknown plan or a cache miss is 1x.
DEFAULT_PLAN_SCALES: Mapping[str, float] = {"enterprise": 3.0, "pro": 1.5, "free": 1.0}
#: Under pressure (at or above the threshold) these tiers keep this share of capacity.
DEFAULT_PRESSURE_FACTORS: Mapping[str, float] = {"staff": 0.85, AUTH: 0.7, ANON: 0.55}
#: Tiers pressure never lowers.
DEFAULT_PRESSURE_EXEMPT = frozenset({"admin", TRUSTED})

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
    (``{"auth": "60/minute"}``, as ``RATE_LIMIT_<NAME>_AUTHED_PER_MIN`` sets)."""
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
        variable. A malformed variable raises `ConfigurationError` naming it;
        a ``QUOTA_*`` variable nothing reads (a misspelt name) is logged once,
        as a warning on the ``quota`` logger naming the closest known one.
        """
        from quota.http._env import apply_env, warn_unread

        env = os.environ if environ is None else environ
        config = cls(**apply_env(env, settings))
        routes = [p.name for p in (*config.policies, config.default) if p is not None]
        warn_unread(env, routes)
        return config


#: The class a middleware built without a config limits every path with.
DEFAULT_POLICY = RoutePolicy(name="default", rates="60/minute")
