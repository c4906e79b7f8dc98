"""The HTTP decision core: one sans-I/O flow that the ASGI and WSGI drivers both run.

`Guard.flow(request)` is a generator (the shape of httpx's ``auth_flow``). It
decides everything that is not I/O (exclusions, route class, identity and
tier, overrides, scaling, headers, the 429/503 answer) and *yields* the two
things it needs from outside:

* `LOAD_POLICIES`: read the ``quota_policies`` and ``quota_settings`` tables
  (the driver sends back `quota._sql.policies.read_op`'s snapshot, or throws
  the exception in);
* a `Hit`: count a hit with the limiter (the driver sends back the
  `quota.Decision`, or throws the exception in).

It returns a `Verdict`: a response to send instead of calling the app, or
headers to add to the app's response. `drive_sync` and `drive_async` are the
two drivers; the middlewares are thin adapters around them. Nothing in the
flow raises into a request: a failing limiter becomes the route class's
fail-open pass or fail-closed 503, a failing hook falls back to the default.
A missing schema (`quota.SchemaError`: ``quota migrate`` was never run) is a
deployment error, not an outage: every class fails closed with a 503 and an
ERROR log line naming the command, at most once per `ERROR_LOG_SECONDS`.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Awaitable, Callable, Generator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Generic, TypedDict, TypeVar, cast

from quota._core.algorithms import Rate
from quota._core.decision import Decision
from quota._core.errors import ConfigurationError, SchemaError
from quota._core.factors import check_factors
from quota._core.url import DIALECTS
from quota._sql.policies import read_op
from quota._wrappers.abuse import AbuseDetector, AlertCallback
from quota._wrappers.fallback import Fallback, StoreDown
from quota._wrappers.metrics import Metrics as QuotaMetrics
from quota.http._capacity import Plans, SystemPressure
from quota.http._config import DEFAULT_POLICY, HttpConfig
from quota.http._fields import SAFE_METHODS
from quota.http._identity import (
    ANON,
    Callers,
    IdentifyHook,
    Identity,
    RequestInfo,
    TokenValidator,
)
from quota.http._planning import Hit, Plan, Planner
from quota.http._responses import (
    RATE_LIMITED,
    UNAVAILABLE,
    CorsOrigins,
    Denial,
    Headers,
    HttpResponse,
    PolicyShape,
    ResponseFactory,
    expose,
    ietf_items,
    partition_key,
    rate_limit_headers,
    too_many_requests,
    unavailable,
    with_cors,
)
from quota.http._routes import RoutePolicy
from quota.http._runtime import runtime_policies
from quota.http._signals import LANE_STYLES, PredictivePressure, Velocity, lane_header, velocity_le

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from quota._limiter.async_face import AsyncLimiter
    from quota._limiter.sync_face import Limiter

log = logging.getLogger("quota.http")

#: The abuse detector's threshold standing for "no alerts" (its own floor is 1).
NO_ALERTS = 2**62
#: A failing limiter is logged at most once per this many seconds, not once per request.
ERROR_LOG_SECONDS = 10.0

#: Stores a middleware's own limiter reaches over the network, and the fallback it gets
#: there: a database that stops answering (at any step, the connect included) costs one
#: request at most twice the budget, and later requests nothing while it is down.
OWN_FALLBACK_DIALECTS = frozenset({"postgresql"})
OWN_FALLBACK = Fallback(timeout=0.25, probe_interval=1.0)
#: Observer of metric events: ``observer(name, labels)``; see `HttpMetrics`.
Observer = Callable[[str, Mapping[str, str]], None]
#: What a middleware's ``observer=`` takes: a callable as above, or a
#: `quota.Metrics`, which then counts every decision with its route and tier
#: (``quota_decisions_total{route,tier,outcome,source}``).
ObserverLike = Observer | QuotaMetrics


class _LoadPolicies:
    __slots__ = ()

    def __repr__(self) -> str:
        return "LOAD_POLICIES"


#: Effect: read ``quota_policies`` and ``quota_settings`` (`quota._sql.policies.read_op`, run as a store operation).
LOAD_POLICIES = _LoadPolicies()
Effect = Hit | _LoadPolicies


@dataclass(slots=True)
class Verdict:
    """What a driver does with a request."""

    response: HttpResponse | None
    """Send this instead of calling the app; None: call the app."""
    headers: Headers
    """Add these to the app's response."""
    expose: bool = False
    """Also add their names to ``Access-Control-Expose-Headers`` (merging the app's)."""


PASS = Verdict(None, [])
Flow = Generator[Effect, Any, Verdict]
R = TypeVar("R")


class HttpMetrics:
    """Counters of what the middleware did, by name and labels; thread-safe.

    A middleware's ``.metrics``. Not `quota.Metrics` (the Prometheus-backed
    counters an ``observer=`` may be).

    Names: ``ratelimit.hits``, ``ratelimit.blocked``, ``ratelimit.shadow_blocked``
    (route, tier); ``ratelimit.errors`` (route, mode: open/closed);
    ``ratelimit.hmac_rejected`` (reason); ``ratelimit.exempt`` (route);
    ``ratelimit.policy_refresh_failed``, ``ratelimit.policy_invalid``,
    ``ratelimit.settings_refresh_failed``, ``ratelimit.setting_invalid``,
    ``ratelimit.abuse_alerts``; ``ratelimit.velocity`` (route, tier, le: the
    bucket of the caller's request rate); ``ratelimit.hook_failed`` (hook:
    identify, token_validator, pressure, response_factory, on_abuse). An
    `Observer` sees each event as it happens (to feed Prometheus or StatsD);
    its exceptions are swallowed.
    """

    def __init__(self, observer: ObserverLike | None = None) -> None:
        self._counts: dict[str, int] = {}
        self._keys: dict[tuple[str, str, str], str] = {}
        self._lock = threading.Lock()
        self.sink: QuotaMetrics | None = None
        if isinstance(observer, QuotaMetrics):
            self.sink, observer = observer, None
        self._observer: Observer | None = observer

    @property
    def observed(self) -> bool:
        """Whether a callable observer sees each event (one worth computing labels for)."""
        return self._observer is not None

    def inc(self, name: str, **labels: str) -> None:
        key = "ratelimit." + name
        if labels:
            key += "{" + ",".join(f"{k}={v}" for k, v in labels.items()) + "}"
        self._add(key, name, labels)

    def count(self, name: str, route: str, tier: str) -> None:
        """`inc` with route and tier labels, the per-request case (its key is cached)."""
        key = self._keys.get((name, route, tier))
        if key is None:
            key = self._keys[(name, route, tier)] = f"ratelimit.{name}{{route={route},tier={tier}}}"
        self._add(key, name, {"route": route, "tier": tier} if self._observer else None)

    def _add(self, key: str, name: str, labels: Mapping[str, str] | None) -> None:
        with self._lock:
            self._counts[key] = self._counts.get(key, 0) + 1
        if self._observer is not None:
            try:
                self._observer("ratelimit." + name, labels or {})
            except Exception:
                log.exception("quota: metrics observer failed")

    def snapshot(self) -> dict[str, int]:
        """Every counter so far, e.g. ``{"ratelimit.blocked{route=api,tier=anon}": 3}``."""
        with self._lock:
            return dict(self._counts)

    def get(self, name: str, **labels: str) -> int:
        key = "ratelimit." + name
        if labels:
            key += "{" + ",".join(f"{k}={v}" for k, v in labels.items()) + "}"
        return self._counts.get(key, 0)


def resolve_secret(config: HttpConfig, dialect: str) -> bytes:
    """The hash secret to use; see `HttpConfig.hash_secret` for the rule without one."""
    if config.secret is not None:
        return config.secret
    if dialect == "postgresql":
        raise ConfigurationError(
            "QUOTA_HASH_SECRET (HttpConfig.hash_secret) is required with PostgreSQL: every app"
            " instance must hash IPs and tokens to the same keys, or each would keep limits of"
            " its own. Set the same random value (>= 16 bytes) on every instance."
        )
    log.warning(
        "quota: QUOTA_HASH_SECRET is not set; using a random per-process secret. Limits keyed"
        " by IP or token are then per process and start afresh on restart; set it when"
        " several processes share the database."
    )
    return secrets.token_bytes(32)


class GuardOptions(TypedDict, total=False):
    """The hooks of a `Guard`, declared once: every HTTP entry point takes them as keywords.

    `quota.http.asgi.QuotaMiddleware`, `quota.http.wsgi.QuotaWSGIMiddleware`,
    `quota.http.fastapi.RateLimit` and `Guard` take each as a keyword of the
    same name (``**hooks``; each defaults to None) and pass them on together;
    Django's middleware reads them from ``QUOTA["HTTP"]["hooks"]``. See
    `QuotaMiddleware` for what each does.
    """

    identify: IdentifyHook | None
    token_validator: TokenValidator | None
    response_factory: ResponseFactory | None
    plans: Plans | None
    pressure: Callable[[], float] | None
    clock: Callable[[], float] | None
    observer: ObserverLike | None
    on_abuse: AlertCallback | None


#: The names of the hooks, as `GuardOptions` declares them.
HOOKS: tuple[str, ...] = tuple(GuardOptions.__annotations__)


def guard_options(where: str, hooks: Mapping[str, Any]) -> GuardOptions:
    """Every hook of `hooks` (None for those not given); `TypeError` for a name not a hook.

    `where` names the callable the keywords were passed to, as Python's own
    message for an unexpected keyword argument does.
    """
    for name in hooks:
        if name not in HOOKS:
            raise TypeError(f"{where}() got an unexpected keyword argument {name!r}")
    found: dict[str, Any] = dict.fromkeys(HOOKS)
    found.update(hooks)
    return cast(GuardOptions, found)


class Guard:
    """The decision core of the HTTP layer, shared by every driver; see the module docstring."""

    def __init__(self, config: HttpConfig, *, dialect: str, **hooks: Unpack[GuardOptions]) -> None:
        """A guard deciding by `config` on a store of `dialect`; see `GuardOptions` for `hooks`.

        Without a ``clock`` hook it reads `time.time`.
        """
        if not isinstance(config, HttpConfig):
            raise ConfigurationError(f"config must be an HttpConfig, got {config!r}")
        given = guard_options("Guard", hooks)
        identify, token_validator = given["identify"], given["token_validator"]
        response_factory, plans, pressure = (
            given["response_factory"],
            given["plans"],
            given["pressure"],
        )
        clock = given["clock"] or time.time
        observer, on_abuse = given["observer"], given["on_abuse"]
        self.config = config
        self.metrics = HttpMetrics(observer)
        self.plans = plans
        self.secret = resolve_secret(config, dialect)
        self.runtime = runtime_policies(config, dialect, self.metrics.inc)
        #: Who is calling (the ``identify`` and ``token_validator`` hooks, the built-in tiers).
        self.callers = Callers(self.secret, identify, token_validator, self.metrics.inc)
        self._factory = response_factory
        if config.adaptive and pressure is None:
            horizon = config.pressure_horizon
            pressure = PredictivePressure(horizon=horizon) if horizon > 0 else SystemPressure()
        self._pressure = pressure if config.adaptive else None
        self.clock = clock
        #: What a request counts as (route class, tier, overrides, plans, pressure).
        self.planner = Planner(
            self.runtime, plans, adaptive=self._pressure is not None, count=self.metrics.inc
        )
        self._shapes: dict[tuple[str, int], tuple[tuple[Rate, ...], PolicyShape]] = {}
        self._last_error_log = -1e18
        #: Each counted key's request rate (observability only); None with ``velocity=False``.
        self.velocity: Velocity | None = None
        if config.velocity:
            self.velocity = Velocity(
                half_life=config.velocity_half_life, max_keys=config.velocity_max_keys,
                clock=clock,
            )  # fmt: skip
        if on_abuse is not None and not callable(on_abuse):
            raise ConfigurationError(f"on_abuse must be callable(key, count), got {on_abuse!r}")
        if on_abuse is not None and not config.abuse_threshold:
            raise ConfigurationError("on_abuse needs abuse_threshold above 0 (0 turns alerts off)")
        self._on_abuse = on_abuse
        #: Hears every 429 answered (never shadow or fail-open passes); None when
        #: ``abuse_threshold=0``. Its ``threshold`` may be changed at run time.
        self.abuse: AbuseDetector | None = None
        if config.abuse_threshold:
            self.abuse = AbuseDetector(
                config.abuse_threshold, config.abuse_window, config.abuse_interval,
                callback=self._abuse_alert, clock=clock, metrics=self.metrics.sink,
            )  # fmt: skip
        # The X-RateLimit-Lane header of each tier seen (() for a tier no header can carry).
        self._lanes: dict[str, tuple[str, str] | tuple[()]] = {}
        self._settings = threading.Lock()

    @property
    def route_names(self) -> tuple[str, ...]:
        """The names of the route classes this guard limits with (its default class's too)."""
        config = self.config
        return tuple(p.name for p in (*config.policies, config.default) if p is not None)

    # -- the flow --------------------------------------------------------------------

    def flow(self, request: RequestInfo) -> Flow:
        """Decide `request`; see the module docstring for what it yields and returns."""
        config = self.config
        if not config.enabled:
            return PASS
        method = request.method
        if config.mutations_only and method in SAFE_METHODS:
            return PASS
        if config.excluded(request.path):
            return PASS
        route = config.route_for(method, request.path)
        if route is None or (route.mutations_only and method in SAFE_METHODS):
            return PASS
        now = self.clock()
        runtime = self.runtime
        if runtime is not None and runtime.claim(now):
            try:
                read = yield LOAD_POLICIES
            except Exception as exc:
                read = exc
            runtime.refresh(read, now, self)  # the settings too, applied to this guard
        pressure = self._pressure_now() if self._pressure is not None else 0.0
        try:
            plan = self.plan(route, request, now, pressure)
        except Exception as exc:  # a rate an override made impossible, say
            return self._failure(route, ANON, request, route.fail_open, exc)
        if plan is None:
            return PASS
        try:
            decision = yield plan.hit
        except Exception as exc:
            return self._failure(plan.route, plan.identity.tier, request, plan.fail_open, exc)
        if not plan.extra:
            return self.verdict(plan, request, decision, now)
        # Once the caller's bucket allows, the shared ones (tenant, IP ceiling)
        # are counted, each once, until one of them refuses.
        buckets = [(plan.hit, decision)]
        for hit in plan.extra if decision.allowed or plan.shadow else ():
            try:
                shared = yield hit
            except Exception as exc:
                return self._failure(plan.route, plan.identity.tier, request, plan.fail_open, exc)
            buckets.append((hit, shared))
            if not shared.allowed and not plan.shadow:
                break
        return self.verdict(plan, request, decision, now, buckets)

    # -- pure steps --------------------------------------------------------------------

    def identity(self, request: RequestInfo, now: float) -> Identity:
        """The request's tier and subject: the app's hook, else trusted, auth or anon."""
        return self.callers.resolve(request, now, self.config)[0]

    def subject(self, kind: str, value: str) -> str:
        """The subject an IP (``kind="ip"``) or token (``"tok"``) is keyed under here."""
        return self.callers.subject(kind, value, self.config.ipv6_prefix)

    def plan(
        self, route: RoutePolicy, request: RequestInfo, now: float, pressure: float = 0.0
    ) -> Plan | None:
        """What `request` counts as on `route` at `now`, or None when it is exempt.

        `pressure` is the adaptive capacity source's reading (0 to 1; see
        `HttpConfig.adaptive`), taken by the caller. Reads no clock and does no
        I/O (the app's ``identify`` and ``token_validator`` hooks aside).
        """
        identity, unchecked_from = self.callers.resolve(request, now, self.config)
        return self.planner.plan(self.config, route, identity, unchecked_from, pressure)

    def _pressure_now(self) -> float:
        assert self._pressure is not None
        try:
            return float(self._pressure())
        except Exception:
            self.metrics.inc("hook_failed", hook="pressure")
            log.exception("quota: the pressure source failed; taking no pressure")
            return 0.0

    def _shape(self, route: str, rates: tuple[Rate, ...]) -> PolicyShape:
        found = self._shapes.get((route, id(rates)))
        if found is not None and found[0] is rates:
            return found[1]
        shape = PolicyShape(route, rates)
        if len(self._shapes) > 4096:
            self._shapes.clear()
        self._shapes[(route, id(rates))] = (rates, shape)
        return shape

    def verdict(
        self, plan: Plan, request: RequestInfo, decision: Decision, now: float,
        buckets: list[tuple[Hit, Decision]] | None = None,
    ) -> Verdict:  # fmt: skip
        """Headers to add, or the 429 to send, for `decision`.

        With `buckets` (the caller's, then the shared ones counted), the bucket
        that refused (when all allowed: the one with the fewest left) decides:
        its numbers fill the legacy headers, ``X-RateLimit-Scope`` names it
        (``caller``, ``tenant`` or ``ip``), ``X-RateLimit-Tenant-Remaining``
        tells the tenant's, and the IETF fields list every bucket, the
        deciding one first.
        """
        route, tier = plan.route.name, plan.identity.tier
        metrics = self.metrics
        metrics.count("hits", route, tier)
        shapes = plan.shapes
        if shapes is None:
            shapes = plan.shapes = tuple(
                self._shape(_bucket_name(route, hit.scope), hit.rates)
                for hit in (plan.hit, *plan.extra)
            )
        at = 0
        if buckets is not None:
            at = _deciding(buckets)
            decision = buckets[at][1]
        blocked = not decision.allowed
        self._observe(plan, decision, now)
        headers = self._headers(plan, shapes, decision, now, buckets, at, blocked)
        exposing = self.config.expose_headers and "origin" in request.headers and bool(headers)
        if not blocked:
            return Verdict(None, headers, exposing)
        if plan.shadow:
            metrics.count("shadow_blocked", route, tier)
            return Verdict(None, headers, exposing)
        metrics.count("blocked", route, tier)
        if self.abuse is not None:
            self.abuse.record_denial(plan.hit.key, now)
        shown = headers
        if exposing:
            shown = [*headers, ("Access-Control-Expose-Headers", expose(headers, None))]
        default = too_many_requests(decision, shown, shapes[at], self.config.problem_type)
        denial = Denial(RATE_LIMITED, request, route, tier, decision, decision.retry_after,
                        tuple(shown), default)  # fmt: skip
        return Verdict(self._respond(denial), [])

    def _observe(self, plan: Plan, decision: Decision, now: float) -> None:
        """Tell the `quota.Metrics` sink and the velocity tracker about a deciding `decision`."""
        route, tier = plan.route.name, plan.identity.tier
        metrics = self.metrics
        if metrics.sink is not None:
            metrics.sink.record_decision(decision.allowed, route=route, tier=tier)
        velocity = self.velocity
        if velocity is not None:
            rate = velocity.hit(plan.hit.key, now)
            if metrics.sink is not None:
                metrics.sink.observe_velocity(rate, route=route, tier=tier)
            elif metrics.observed:
                metrics.inc("velocity", route=route, tier=tier, le=velocity_le(rate))

    def _headers(
        self, plan: Plan, shapes: tuple[PolicyShape, ...], decision: Decision, now: float,
        buckets: list[tuple[Hit, Decision]] | None, at: int, blocked: bool,
    ) -> Headers:  # fmt: skip
        """The rate-limit headers of the deciding bucket (`at`), the others folded in."""
        config = self.config
        deciding = plan.hit if at == 0 else plan.extra[at - 1]
        headers = rate_limit_headers(
            decision, shapes[at], now, config.headers,
            retry_after=blocked and not plan.shadow,
            partition=deciding.key if config.partition_key else None, secret=self.secret,
        )  # fmt: skip
        if buckets is not None:
            self._add_shared(headers, buckets, shapes, at, now)
        if config.headers in LANE_STYLES:
            self._add_lane(headers, plan.identity.tier)
        return headers

    def _add_lane(self, headers: Headers, tier: str) -> None:
        """``X-RateLimit-Lane`` after X-RateLimit-Limit, -Remaining and -Reset, for a
        tier that is an HTTP token (each tier's header looked up once)."""
        lane = self._lanes.get(tier)
        if lane is None:
            lane = self._lanes[tier] = lane_header(tier, self._lanes)
        if lane:
            headers.insert(3, lane)

    def _add_shared(
        self, headers: Headers, buckets: list[tuple[Hit, Decision]],
        shapes: tuple[PolicyShape, ...], at: int, now: float,
    ) -> None:  # fmt: skip
        """Fold the other buckets into `headers`, those of the deciding one (`buckets[at]`).

        ``X-RateLimit-Scope`` names the deciding bucket and
        ``X-RateLimit-Tenant-Remaining`` tells the tenant's (before a
        Retry-After, which stays last); ``RateLimit-Policy`` and ``RateLimit``
        list every bucket's item, the deciding one's first.
        """
        config = self.config
        style = config.headers
        if style in ("both", "ietf"):
            policies, items = [], []
            keyed = config.partition_key
            for i, (other, seen) in enumerate(buckets):
                if i != at:
                    pk = partition_key(other.key, self.secret) if keyed else None
                    policy, item = ietf_items(seen, shapes[i], now, pk)
                    policies.append(policy)
                    items.append(item)
            if policies:
                # Where `rate_limit_headers` puts them: after the three legacy ones, if any.
                first = 0 if style == "ietf" else 3
                name, value = headers[first]
                headers[first] = (name, ", ".join((value, *policies)))
                name, value = headers[first + 1]
                headers[first + 1] = (name, ", ".join((value, *items)))
        if style in ("both", "legacy"):
            plain = [("X-RateLimit-Scope", buckets[at][0].scope)]
            plain += [
                ("X-RateLimit-Tenant-Remaining", str(seen.remaining))
                for other, seen in buckets
                if other.scope == "tenant"
            ]
            end = len(headers)
            if end and headers[-1][0] == "Retry-After":  # keep it last
                end -= 1
            headers[end:end] = plain

    def _failure(
        self, route: RoutePolicy, tier: str, request: RequestInfo, fail_open: bool,
        exc: BaseException,
    ) -> Verdict:  # fmt: skip
        # A missing schema fails every request alike until someone migrates:
        # passing them all would be a limit that silently limits nothing.
        schema = isinstance(exc, SchemaError)
        passes = not schema and (fail_open or self.config.shadow or route.shadow)
        mode = "open" if passes else "closed"
        self.metrics.inc("errors", route=route.name, mode=mode)
        if self.metrics.sink is not None:
            self.metrics.sink.record_decision(
                mode == "open", source="fail_open", route=route.name, tier=tier
            )
        stamp = time.monotonic()
        if stamp - self._last_error_log >= ERROR_LOG_SECONDS:  # not one line per request
            self._last_error_log = stamp
            if schema:
                log.error(
                    "quota: %s; every limited request is answered 503 until it is"
                    " (route class %r)",
                    exc, route.name,
                )  # fmt: skip
            else:
                log.warning(
                    "quota: the limiter failed on route class %r (%s: %s); failing %s",
                    route.name, type(exc).__name__, exc, mode,
                )  # fmt: skip
        if mode == "open":
            return PASS
        retry = self.config.unavailable_retry_after
        default = unavailable(retry)
        denial = Denial(UNAVAILABLE, request, route.name, tier, None, retry,
                        (("Retry-After", str(retry)),), default)  # fmt: skip
        return Verdict(self._respond(denial), [])

    def answer(
        self, response: HttpResponse, request: RequestInfo, cors: CorsOrigins | None
    ) -> HttpResponse:
        """A verdict's `response` as a driver sends it: readable by browser code (`with_cors`).

        `cors` grants the request's origin (None: no grant, a CORS layer
        above does); the rate-limit headers are exposed when the config says so.
        """
        origin = request.headers.get("origin")
        return with_cors(response, origin, cors, exposing=self.config.expose_headers)

    def _respond(self, denial: Denial) -> HttpResponse:
        if self._factory is None:
            return denial.default
        try:
            shaped = self._factory(denial)
        except Exception:
            self.metrics.inc("hook_failed", hook="response_factory")
            log.exception("quota: the response factory failed; sending the default answer")
            return denial.default
        if shaped is None:
            return denial.default
        if not isinstance(shaped, HttpResponse):
            self.metrics.inc("hook_failed", hook="response_factory")
            log.error("quota: the response factory returned %r, not an HttpResponse", shaped)
            return denial.default
        return shaped

    # -- changed at run time ---------------------------------------------------------

    def set_tier_multiplier(self, tier: str, value: float) -> None:
        """Scale `tier`'s limits by `value` from the next request on, without a new config.

        Bounded like `HttpConfig.tier_multipliers` (0.001 to 1000); raises
        `ConfigurationError` otherwise, changing nothing. Only this guard's
        copy of the config changes (``guard.config``), never the `HttpConfig`
        it was built with, which other middlewares may share. As with the
        config's multipliers, exact ``tier_rates`` and exact runtime
        overrides are not scaled.
        """
        if not isinstance(tier, str) or not tier:
            raise ConfigurationError(f"tier must be a non-empty string, got {tier!r}")
        factor = check_factors("tier_multipliers", {tier: value})
        with self._settings:
            config = self.config
            multipliers = {**config.tier_multipliers, **factor}
            # Scaled rates and their header shapes were made for the old factors.
            self.planner.reset()
            self._shapes = {}
            self.config = replace(config, tier_multipliers=multipliers)

    @property
    def abuse_threshold(self) -> int:
        """The abuse alert threshold in force: 429s to one key that raise an alert (0: off)."""
        detector = self.abuse
        if detector is None or detector.threshold >= NO_ALERTS:
            return 0
        return detector.threshold

    def set_abuse_threshold(self, threshold: int) -> bool:
        """Raise abuse alerts after `threshold` 429s to one key from now on (0: no alerts).

        Like `HttpConfig.abuse_threshold` (a whole number, 0..2**62), with the
        config's window and quiet interval; `ConfigurationError` otherwise,
        changing nothing. True when the threshold in force changed.
        """
        if type(threshold) is not int or not 0 <= threshold <= NO_ALERTS:
            raise ConfigurationError(
                f"abuse_threshold must be a whole number 0..2**62 (0: off), got {threshold!r}"
            )
        with self._settings:
            detector = self.abuse
            # Never set back to None: a request may be between its check and its call.
            if detector is None:
                if threshold == 0:
                    return False
                config = self.config
                self.abuse = AbuseDetector(
                    threshold, config.abuse_window, config.abuse_interval,
                    callback=self._abuse_alert, clock=self.clock, metrics=self.metrics.sink,
                )  # fmt: skip
                return True
            if detector.threshold == (threshold or NO_ALERTS):
                return False
            detector.threshold = threshold or NO_ALERTS
            return True

    def _abuse_alert(self, key: str, count: int) -> None:
        """The abuse detector's callback: count the alert, then tell the app's ``on_abuse``."""
        self.metrics.inc("abuse_alerts")
        if self._on_abuse is None:
            return
        try:
            self._on_abuse(key, count)
        except Exception:
            self.metrics.inc("hook_failed", hook="on_abuse")
            log.exception("quota: the on_abuse callback failed for key %r", key)


def _bucket_name(route: str, scope: str) -> str:
    return route if scope == "caller" else f"{route}-{scope}"


def _deciding(buckets: list[tuple[Hit, Decision]]) -> int:
    """The bucket that decides: the first that refused; when all allowed, the one closest to refusing."""
    at, least = 0, -1
    for i, (_, decision) in enumerate(buckets):
        if not decision.allowed:
            return i
        if least < 0 or decision.remaining < least:
            at, least = i, decision.remaining
    return at


# -- the two drivers ---------------------------------------------------------------


def build_guard(
    config: HttpConfig | None, options: GuardOptions, *, dialect: str,
    app_clock: Callable[[], float] | None, where: str = "build_guard",
) -> Guard:  # fmt: skip
    """The `Guard` of a middleware or dependency on a store of `dialect`.

    `config` None is `HttpConfig.from_env` with `DEFAULT_POLICY` as the
    default class; without a ``clock`` hook the guard reads `app_clock` (the
    limiter's), else `time.time`. Raises `TypeError` for a key of `options`
    that is not a hook, naming `where` (the entry point they were passed to).
    """
    hooks = guard_options(where, options)
    if config is None:
        config = HttpConfig.from_env(default=DEFAULT_POLICY)
    hooks["clock"] = hooks["clock"] or app_clock
    return Guard(config, dialect=dialect, **hooks)


def drive_sync(flow: Flow, hit: Callable[[Hit], Decision], load: Callable[[], Any]) -> Verdict:
    """Run `flow`, calling `hit` and `load` for its effects (a sync limiter's calls)."""
    try:
        effect = flow.send(None)
        while True:
            try:
                result = hit(effect) if isinstance(effect, Hit) else load()
            except Exception as exc:
                effect = flow.throw(exc)
            else:
                effect = flow.send(result)
    except StopIteration as stop:
        verdict: Verdict = stop.value
        return verdict


async def drive_async(
    flow: Flow, hit: Callable[[Hit], Awaitable[Decision]], load: Callable[[], Awaitable[Any]]
) -> Verdict:
    """`drive_sync`, awaiting each effect (an async limiter's calls)."""
    try:
        effect = flow.send(None)
        while True:
            try:
                result = await (hit(effect) if isinstance(effect, Hit) else load())
            except Exception as exc:
                effect = flow.throw(exc)
            else:
                effect = flow.send(result)
    except StopIteration as stop:
        verdict: Verdict = stop.value
        return verdict


def own_limiter_settings(dialect: str) -> dict[str, Any]:
    """The settings of the limiter a middleware opens itself on a `dialect` store."""
    # Group commit where the store has something to group (`Dialect.batching`).
    settings: dict[str, Any] = {"batching": DIALECTS[dialect].batching}
    if dialect in OWN_FALLBACK_DIALECTS:
        settings["fallback"] = OWN_FALLBACK
    return settings


class _Calls(Generic[R]):
    """The limiter calls behind a `Hit` and `LOAD_POLICIES`, for either face.

    `R` is what the face's calls return: a `Decision` (sync) or an awaitable
    of one. A single rate goes through ``rate_limit`` (the limiter's hot path
    for a fixed window), several through ``hit``. On a limiter with a
    fallback, a fail-closed class's hit raises `StoreDown` while the store is
    down (the class answers 503) instead of being decided from memory.
    """

    __slots__ = ("_hit", "_limiter", "_rate_limit", "_routes", "guarded", "store")

    def __init__(self, limiter: Limiter | AsyncLimiter, routes: Sequence[str]) -> None:
        self._limiter = limiter
        self._rate_limit: Callable[..., R] = limiter.rate_limit  # type: ignore[assignment]
        self._hit: Callable[..., R] = limiter.hit  # type: ignore[assignment]
        self._routes = routes
        self.store = limiter.store
        self.guarded = limiter.options.fallback is not None

    def call(self, effect: Hit) -> R:
        """Count `effect` (refused at once when it is fail-closed and the store is down)."""
        closed = effect.fail_closed and self.guarded
        if closed and not self.store.up:
            raise _store_down()
        rates = effect.rates
        if len(rates) == 1 and rates[0].refill_per_second is None:
            rate = rates[0]
            return self._rate_limit(
                effect.key, rate.limit, rate.window, cost=effect.cost,
                algorithm=rate.algorithm, burst=rate.burst, fail_closed=closed,
            )  # fmt: skip
        return self._hit(effect.key, rates, cost=effect.cost, fail_closed=closed)

    def closed(self, effect: Hit, decision: Decision) -> Decision:
        """`decision`, unless this very call found the store down on a fail-closed `effect`."""
        if effect.fail_closed and self.guarded and not decision.allowed and not self.store.up:
            raise _store_down()
        return decision

    def load(self) -> R:
        # Under a fallback: held to its budget, refused while the store is down.
        limiter = self._limiter
        return limiter.run(read_op(self._routes, limiter.options.app_clock()), strict=True)  # type: ignore[return-value]


def _store_down() -> StoreDown:
    return StoreDown("the limiter's store is down (its fallback refuses fail-closed classes)")


def sync_effects(
    limiter: Limiter, routes: Sequence[str] = ()
) -> tuple[Callable[[Hit], Decision], Callable[[], Any]]:
    """`hit` and `load` for `drive_sync` on a sync `quota.Limiter`; see `_Calls`.

    `load` also records `routes`, the names of the route classes the
    middleware serves, in ``quota_settings`` when they are not there yet
    (see `read_op`).
    """
    calls: _Calls[Decision] = _Calls(limiter, routes)

    def hit(effect: Hit) -> Decision:
        return calls.closed(effect, calls.call(effect))

    return hit, calls.load


def async_effects(
    limiter: AsyncLimiter, routes: Sequence[str] = ()
) -> tuple[Callable[[Hit], Awaitable[Decision]], Callable[[], Awaitable[Any]]]:
    """`hit` and `load` for `drive_async` on a `quota.AsyncLimiter`; see `sync_effects`."""
    calls: _Calls[Awaitable[Decision]] = _Calls(limiter, routes)

    async def closed(effect: Hit) -> Decision:
        return calls.closed(effect, await calls.call(effect))

    def hit(effect: Hit) -> Awaitable[Decision]:
        # Only a fail-closed hit needs a look at the store after it (and a coroutine of its own).
        return closed(effect) if effect.fail_closed and calls.guarded else calls.call(effect)

    return hit, calls.load


__all__ = [
    "HOOKS",
    "LOAD_POLICIES",
    "PASS",
    "Guard",
    "GuardOptions",
    "HttpMetrics",
    "Verdict",
    "build_guard",
    "own_limiter_settings",
]
