"""Route classes: `RoutePolicy`, which requests it covers and the limits that apply to them.

Everything here is pure: a validated dataclass and the path patterns it
compiles (`compile_paths`). `quota.http._config.HttpConfig` lists the route
classes of an application; how a class's rates scale per caller is in
`quota.http._capacity`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from quota._core.algorithms import Rate, check_algorithm
from quota._core.errors import ConfigurationError
from quota._core.rates import parse_rates
from quota.http._fields import check_name

Rates = tuple[Rate, ...]


def check_rates(name: str, value: object, algorithm: str | None) -> Rates:
    """`value` (a rate string, a `Rate` or several) as `Rate` objects; messages name `name`."""
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
        check_name("route class name", self.name)
        where = f"route class {self.name!r}"
        if self.algorithm is not None:
            check_algorithm(self.algorithm)
        base = check_rates(f"{where} rates", self.rates, self.algorithm)
        tiers = {
            str(tier): check_rates(f"{where} tier_rates[{tier!r}]", value, self.algorithm)
            for tier, value in dict(self.tier_rates).items()
        }
        tenant = (
            None
            if self.tenant_rates is None
            else check_rates(f"{where} tenant_rates", self.tenant_rates, self.algorithm)
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
