"""Planning: what one HTTP request counts as, with no I/O and no clock.

A `Planner` turns a route class and a caller's `Identity` into a `Plan`: the
`Hit` on the caller's own bucket (rates for its tier, scaled by the tier
multiplier, a tenant's plan, capacity pressure, or replaced by a runtime
override) and the shared buckets counted beside it (the tenant's, the
per-IP ceiling of unvalidated tokens). A repeat caller's plan is kept while
nothing that changes between requests applies to it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from quota._core.algorithms import Rate
from quota.http._capacity import Plans, ScaledRates
from quota.http._config import HttpConfig
from quota.http._identity import AUTH, Identity
from quota.http._responses import PolicyShape
from quota.http._routes import RoutePolicy

if TYPE_CHECKING:
    from quota.http._runtime import Override, RuntimePolicies


@dataclass(slots=True)
class Hit:
    """Effect: count one request on `key` under `rates`."""

    key: str
    rates: tuple[Rate, ...]
    cost: int
    scope: str = "caller"
    """Whose bucket: ``caller``, ``tenant`` (the caller's whole tenant) or ``ip``
    (the ceiling of unvalidated tokens sent from one client IP)."""
    fail_closed: bool = False
    """The class answers 503 when the limiter cannot decide: a limiter with a fallback
    refuses this hit while its store is down instead of deciding it from memory."""


@dataclass(slots=True)
class Plan:
    """What one request is counted as."""

    route: RoutePolicy
    identity: Identity
    hit: Hit
    fail_open: bool
    shadow: bool
    extra: tuple[Hit, ...] = ()
    """Buckets counted beside the caller's own once it allows: the tenant's,
    and the per-IP ceiling of unvalidated tokens."""
    shapes: tuple[PolicyShape, ...] | None = None
    """How the headers describe each bucket (`hit`'s, then `extra`'s), made on first use."""


class Planner:
    """Plans requests for one guard: see the module docstring.

    `runtime` is the guard's cache of runtime overrides (None: none),
    `plans` its tenant plan cache, `adaptive` whether a pressure reading
    applies; `count` (``count(name, **labels)``) counts exempt requests.
    """

    def __init__(
        self, runtime: RuntimePolicies | None, plans: Plans | None, *, adaptive: bool,
        count: Callable[..., None],
    ) -> None:  # fmt: skip
        self.runtime = runtime
        self.plans = plans
        self.adaptive = adaptive
        self._count = count
        #: Rates scaled by a factor, shared by the plans (made afresh by `reset`).
        self.scaled = ScaledRates()
        # The plans of repeat callers, valid for `_planned_for` (the config they were made under).
        self._planned: dict[tuple[int, str, str, str | None, str | None], Plan] = {}
        self._planned_for: HttpConfig | None = None

    def reset(self) -> None:
        """Forget the scaled rates and kept plans (the tier multipliers changed)."""
        self.scaled = ScaledRates()
        self._planned = {}

    def plan(
        self, config: HttpConfig, route: RoutePolicy, identity: Identity,
        unchecked_from: str | None, pressure: float = 0.0,
    ) -> Plan | None:  # fmt: skip
        """What `identity` counts as on `route` under `config`, or None when it is exempt.

        `unchecked_from` is the client IP's subject when the caller's token
        went unchecked (its ceiling is counted too); `pressure` the adaptive
        capacity source's reading.
        """
        override = self.runtime.lookup(route.name, identity) if self.runtime is not None else None
        if override is not None or self.adaptive:
            return self._plan(config, route, identity, unchecked_from, override, pressure)
        if identity.tenant is not None and self.plans is not None:
            return self._plan(config, route, identity, unchecked_from, None)
        # Nothing that changes between requests applies: the caller's last plan holds.
        if self._planned_for is not config:
            self._planned, self._planned_for = {}, config
        key = (id(route), identity.tier, identity.subject, identity.tenant, unchecked_from)
        plan = self._planned.get(key)
        if plan is None:
            plan = self._plan(config, route, identity, unchecked_from, None)
            if plan is not None:
                if len(self._planned) >= 65536:
                    self._planned.clear()
                self._planned[key] = plan
        return plan

    def _plan(
        self, config: HttpConfig, route: RoutePolicy, identity: Identity,
        unchecked_from: str | None, override: Override | None, pressure: float = 0.0,
    ) -> Plan | None:  # fmt: skip
        tier = identity.tier
        cost, fail_open = route.cost, route.fail_open
        rates: tuple[Rate, ...] | None = None
        base = route.base_rates
        scale = 1.0
        exact = False
        if override is not None:
            row = override.row
            if row.exempt:
                self._count("exempt", route=route.name)
                return None
            if row.cost is not None:
                cost = row.cost
            if row.fail_open is not None:
                fail_open = row.fail_open
            overriding = override.rates_for(route.algorithm)
            if overriding is not None:
                if row.exact:
                    rates, exact = overriding, True
                else:
                    base = overriding
        if rates is None:
            rates = route.rates_for_tier(tier)
            if rates is None:
                rates = base
                scale = config.tier_multipliers.get(tier, 1.0)
        if not exact and self.plans is not None and identity.tenant is not None:
            plan_name = self.plans.plan(identity.tenant)
            if plan_name is not None:
                scale *= config.plan_scales.get(plan_name, 1.0)
        squeeze = 1.0
        if (
            self.adaptive
            and tier not in config.pressure_exempt
            and pressure >= config.pressure_threshold
        ):
            squeeze = config.pressure_factors.get(tier, 1.0)
            scale *= squeeze
        rates = self.scaled(rates, scale, cost)
        prefix = f"{config.key_prefix}:{route.name}:"
        shadow = config.shadow or route.shadow
        closed = not (fail_open or shadow)
        hit = Hit(prefix + f"{tier}:{identity.subject}", rates, cost, fail_closed=closed)
        if unchecked_from is None and (route.tenant_bucket is None or identity.tenant is None):
            return Plan(route, identity, hit, fail_open, shadow)
        extra = self._shared(config, route, identity, unchecked_from, cost, squeeze, prefix, closed)
        return Plan(route, identity, hit, fail_open, shadow, extra)

    def _shared(
        self, config: HttpConfig, route: RoutePolicy, identity: Identity,
        unchecked_from: str | None, cost: int, squeeze: float, prefix: str, closed: bool,
    ) -> tuple[Hit, ...]:  # fmt: skip
        """The shared buckets a plan counts beside the caller's: the tenant's, the IP ceiling."""
        extra = []
        if route.tenant_bucket is not None and identity.tenant is not None:
            share = squeeze
            plan_name = self.plans.plan(identity.tenant) if self.plans is not None else None
            if plan_name is not None:
                share *= config.plan_scales.get(plan_name, 1.0)
            tenant_rates = self.scaled(route.tenant_bucket, share, cost)
            extra.append(
                Hit(prefix + "tenant:" + identity.tenant, tenant_rates, cost, "tenant", closed)
            )
        if unchecked_from is not None:
            ceiling = route.rates_for_tier(AUTH)
            share = squeeze * (config.unvalidated_token_ceiling or 1.0)
            if ceiling is None:
                ceiling = route.base_rates
                share *= config.tier_multipliers.get(AUTH, 1.0)
            ceiling = self.scaled(ceiling, share, cost)
            extra.append(
                Hit(prefix + "auth-ceiling:" + unchecked_from, ceiling, cost, "ip", closed)
            )
        return tuple(extra)
