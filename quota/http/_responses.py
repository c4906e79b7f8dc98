"""What the middleware says back: rate-limit headers, the 429 and 503 bodies, CORS exposure.

Pure functions from a decision to header pairs and bytes; no framework
types. An app reshapes a denial with a response factory (`ResponseFactory`),
for instance into a JSON-RPC error object for an MCP endpoint.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from quota._core.algorithms import FIXED_WINDOW, GCRA, SLIDING_WINDOW, TOKEN_BUCKET, Rate
from quota._core.decision import Decision
from quota._core.errors import ConfigurationError
from quota.http._identity import RequestInfo

Headers = list[tuple[str, str]]

PROBLEM_JSON = "application/problem+json"
RATE_LIMITED = "RATE_LIMITED"
UNAVAILABLE = "RATE_LIMIT_UNAVAILABLE"
OVERLOADED = "OVERLOADED"
#: The draft's problem type for requests over one or more quota policies (status 429).
QUOTA_EXCEEDED = "https://iana.org/assignments/http-problem-types#quota-exceeded"

LEGACY_HEADERS = ("X-RateLimit-Limit", "X-RateLimit-Remaining", "X-RateLimit-Reset")
IETF_HEADERS = ("RateLimit", "RateLimit-Policy")
EXPOSE_HEADERS = (
    *LEGACY_HEADERS, "X-RateLimit-Lane", "X-RateLimit-Scope", "X-RateLimit-Tenant-Remaining",
    *IETF_HEADERS, "Retry-After",
)  # fmt: skip
"""Every header a browser client may want to read; list them in your CORS
middleware's ``expose_headers`` if it overwrites ours."""


@dataclass(frozen=True, slots=True)
class HttpResponse:
    """A complete response, in no framework's types."""

    status: int
    headers: tuple[tuple[str, str], ...]
    body: bytes


@dataclass(frozen=True, slots=True)
class Denial:
    """Why a request is being turned away, for a response factory to shape the answer."""

    reason: str
    """``RATE_LIMITED`` (429) or ``RATE_LIMIT_UNAVAILABLE`` (503, a fail-closed class whose limiter failed)."""
    request: RequestInfo
    route: str
    """The route class name."""
    tier: str
    decision: Decision | None
    """The limiter's decision (None when the limiter failed)."""
    retry_after: int
    headers: tuple[tuple[str, str], ...]
    """Headers the answer should carry: Retry-After and the rate-limit fields."""
    default: HttpResponse
    """The answer the middleware sends when the factory returns None."""


#: Reshapes a denial: return an `HttpResponse`, or None for the default one.
ResponseFactory = Callable[[Denial], "HttpResponse | None"]


def _sf_string(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


#: The parameter stating a token bucket's or GCRA's burst apart from its rate.
#: The draft lets other parameters through ("regarded as comments") and asks
#: that service-specific ones carry a vendor prefix (its example: ``acme-burst``).
BURST_PARAM = "quota-burst"

_WINDOW_NAMES = {1: "second", 60: "minute", 3600: "hour", 86400: "day"}


@dataclass(frozen=True, slots=True)
class RateShape:
    """One rate as the IETF fields state it: its quota per window, and its burst apart."""

    name: str
    """The quoted policy name."""
    label: str
    """The policy name unquoted, as ``violated-policies`` lists it."""
    algorithm: str
    quota: int
    """``q``: the limit per window, or a refill algorithm's sustained rate per `window`."""
    window: int
    """``w``, in seconds."""
    burst: int | None
    """A token bucket's capacity or GCRA's burst, when it differs from `quota`."""
    refill_time: float
    """Seconds a refill algorithm takes to regain `quota` units (at most `window`)."""

    def describe(self) -> str:
        """``1 per second, bursts of 5``."""
        per = _WINDOW_NAMES.get(self.window, f"{self.window} seconds")
        text = f"{self.quota} per {per}"
        return text if self.burst is None else f"{text}, bursts of {self.burst}"


def _rate_shape(label: str, rate: Rate | tuple[int, int]) -> RateShape:
    name = _sf_string(label)
    if isinstance(rate, tuple):  # (limit, window) of a fixed window
        limit, window = rate
        return RateShape(name, label, FIXED_WINDOW, limit, window, None, float(window))
    algorithm, window = rate.algorithm, rate.window
    if algorithm not in (TOKEN_BUCKET, GCRA):
        return RateShape(name, label, algorithm, rate.limit, window, None, float(window))
    # GCRA spaces hits window / limit apart whatever the refill says; a token
    # bucket refills at `rate.rate` (limit / window unless set apart).
    per_second = rate.rate if algorithm == TOKEN_BUCKET else rate.limit / window
    quota, window = _as_quota(per_second, window)
    burst = rate.capacity if rate.capacity != quota else None
    return RateShape(name, label, algorithm, quota, window, burst, quota / per_second)


def _as_quota(per_second: float, window: int) -> tuple[int, int]:
    """A refill rate as whole units per whole seconds, exact when it can be, else never more."""
    for w in dict.fromkeys((window, 1, 60, 3600, 86400)):
        q = per_second * w
        if q >= 1 and abs(q - round(q)) <= 1e-9 * q:
            return round(q), w
    if per_second * window >= 1:
        return math.floor(per_second * window + 1e-9), window
    return 1, math.ceil(1 / per_second - 1e-9)


class PolicyShape:
    """The parts of the IETF fields fixed by a route class and its rates, built once per pair.

    `limits` holds `Rate`s (or ``(limit, window)`` pairs, fixed windows).
    """

    __slots__ = ("by_window", "first", "items", "policy", "rates")

    def __init__(self, route: str, limits: Sequence[Rate | tuple[int, int]]) -> None:
        names = [route] if len(limits) == 1 else [f"{route}-{i}" for i in range(len(limits))]
        self.rates = [_rate_shape(name, rate) for name, rate in zip(names, limits, strict=True)]
        #: Each rate as a policy item: ``"name";q=<quota>;w=<window>``, and
        #: ``;quota-burst=<burst>`` for a token bucket or GCRA whose burst is not its quota.
        self.items = [
            f"{r.name};q={r.quota};w={r.window}"
            + ("" if r.burst is None else f";{BURST_PARAM}={r.burst}")
            for r in self.rates
        ]
        #: The ``RateLimit-Policy`` value without a partition key: every item.
        self.policy = ", ".join(self.items)
        self.first = self.rates[0]
        self.by_window: dict[int, RateShape] = {}
        for shape, rate in zip(self.rates, limits, strict=True):
            self.by_window.setdefault(rate[1] if isinstance(rate, tuple) else rate.window, shape)

    def current(self, window: int) -> RateShape:
        """The rate with this window (the one that decided; a `Decision` names its window)."""
        return self.by_window.get(window, self.first)

    def policy_with(self, pk: str) -> str:
        """The ``RateLimit-Policy`` value with ``;pk=<pk>`` on every item."""
        return ", ".join(f"{item};pk={pk}" for item in self.items)


def partition_key(key: str, secret: bytes) -> str:
    """The ``pk`` parameter for the counter `key`: ``:<base64>:``, an SF Byte Sequence.

    The first 12 bytes of an HMAC-SHA256 of `key` under `secret` (the hash
    secret): the same counter always gives the same value, on every instance
    sharing the secret, and the value reveals nothing of the caller (neither
    IP, token nor key id) to whoever reads it.
    """
    digest = hmac.new(
        secret, b"quota-pk\x00" + key.encode("utf-8", "surrogatepass"), hashlib.sha256
    ).digest()
    return ":" + base64.b64encode(digest[:12]).decode("ascii") + ":"


def rate_limit_headers(
    decision: Decision, shape: PolicyShape, now: float, style: str, *, retry_after: bool,
    partition: str | None = None, secret: bytes = b"",
) -> Headers:  # fmt: skip
    """The rate-limit headers for `decision` under a class whose rates `shape` describes.

    ``legacy``: ``X-RateLimit-Limit``, ``-Remaining``, ``-Reset`` (epoch
    seconds). ``ietf`` (draft-ietf-httpapi-ratelimit-headers-10):
    ``RateLimit-Policy`` listing every rate as ``"name";q=<quota>;w=<window>``
    (a token bucket's or GCRA's sustained rate, its burst apart as
    ``quota-burst``) and ``RateLimit`` naming the one that decided with
    ``r=<remaining>;t=<seconds to reset>``. ``Retry-After`` when asked.
    With `partition` (the key the request counted on), both IETF fields
    carry ``pk``, its `partition_key` under `secret`.

    ``t`` and ``X-RateLimit-Reset`` name one moment: on a denial, when the same
    request passes (``t`` equals ``Retry-After``); when allowed, when the
    quota used (at most ``q`` units) is back: the window's end for a fixed
    window, the fading of the current window's count for a sliding one, and
    for a refill algorithm the full refill or ``w``, whichever comes first.
    """
    if style not in ("both", "legacy", "ietf"):
        return [("Retry-After", str(decision.retry_after))] if retry_after else []
    rate = shape.current(decision.window)
    reset_in, reset_at = _reset(decision, rate, now)
    remaining = str(decision.remaining)
    if style == "ietf":
        out: Headers = []
    else:
        out = [
            ("X-RateLimit-Limit", str(decision.limit)),
            ("X-RateLimit-Remaining", remaining),
            ("X-RateLimit-Reset", str(reset_at)),
        ]
    if style != "legacy":
        if partition is None:
            out.append(("RateLimit-Policy", shape.policy))
            out.append(("RateLimit", f"{rate.name};r={remaining};t={reset_in}"))
        else:
            policy, item = ietf_items(decision, shape, now, partition_key(partition, secret))
            out.append(("RateLimit-Policy", policy))
            out.append(("RateLimit", item))
    if retry_after:
        out.append(("Retry-After", str(decision.retry_after)))
    return out


def ietf_items(
    decision: Decision, shape: PolicyShape, now: float, pk: str | None = None
) -> tuple[str, str]:
    """The ``RateLimit-Policy`` and ``RateLimit`` values of one bucket (see `rate_limit_headers`).

    `pk` is the bucket's `partition_key`, or None for none. A request
    counted on several buckets lists each one's items in both fields.
    """
    rate = shape.current(decision.window)
    reset_in = _reset(decision, rate, now)[0]
    if pk is None:
        return shape.policy, f"{rate.name};r={decision.remaining};t={reset_in}"
    return shape.policy_with(pk), f"{rate.name};r={decision.remaining};t={reset_in};pk={pk}"


def _reset(decision: Decision, rate: RateShape, now: float) -> tuple[int, int]:
    """``(t, X-RateLimit-Reset)``: seconds from `now` to the reset, and its epoch second."""
    end = decision.reset_at  # the window's end; a refill algorithm's full refill
    if not decision.allowed:
        # When the same request passes: what Retry-After says. A fixed window's
        # end is that moment exactly (and says it without rounding now).
        wait = decision.retry_after
        if rate.algorithm == FIXED_WINDOW and max(1, math.ceil(end - now)) == wait:
            return wait, end
        return wait, math.ceil(now + wait)
    if rate.algorithm == SLIDING_WINDOW:
        # This hit is in the current window's count, which weighs in full until
        # the window ends and fades out over the next one.
        moment = float(end + rate.window)
    elif rate.algorithm in (TOKEN_BUCKET, GCRA):
        moment = min(float(end), now + rate.refill_time)
    else:
        moment = float(end)
    return max(0, math.ceil(moment - now - _EPS)), math.ceil(moment - _EPS)


_EPS = 1e-9


def expose(headers: Headers, existing: str | None) -> str:
    """The ``Access-Control-Expose-Headers`` value with our `headers` (and Retry-After) added to `existing`."""
    names = [n.strip() for n in (existing or "").split(",") if n.strip()]
    if "*" in names:
        return existing or "*"
    seen = {n.lower() for n in names}
    for name in [*(n for n, _ in headers), "Retry-After"]:
        if name.lower() not in seen and name.lower() != "access-control-expose-headers":
            names.append(name)
            seen.add(name.lower())
    return ", ".join(names)


def problem(
    status: int, title: str, detail: str, code: str, retry_after: int, **extra: object
) -> bytes:
    """An RFC 9457 problem document (``type`` is ``about:blank``: the status says it all)."""
    body: dict[str, object] = {
        "type": "about:blank", "title": title, "status": status, "detail": detail,
        "code": code, "retry_after": retry_after, **extra,
    }  # fmt: skip
    return json.dumps(body, separators=(",", ":")).encode()


def too_many_requests(
    decision: Decision, headers: Headers, shape: PolicyShape | None = None,
    problem_type: str = "quota-exceeded",
) -> HttpResponse:  # fmt: skip
    """The default 429: ``application/problem+json`` with ``code: RATE_LIMITED`` and ``retry_after``.

    `problem_type` ``quota-exceeded``: the draft's problem type
    (`QUOTA_EXCEEDED`, title ``Quota Exceeded``) with ``violated-policies``
    naming the policy that denied, as ``RateLimit-Policy`` names it.
    ``about:blank``: title ``Too Many Requests`` and no ``violated-policies``.
    Either way the detail, ``limit`` and ``window`` state the rate that
    decided as `shape` describes it (a token bucket's or GCRA's sustained
    rate, and its ``burst``); without `shape`, the decision's limit and window
    (and no ``violated-policies``: no policy is named).
    """
    if shape is None:
        rate = _rate_shape("", (decision.limit, decision.window))
    else:
        rate = shape.current(decision.window)
    detail = f"Rate limit of {rate.describe()} exceeded; retry after {decision.retry_after}s."
    extra: dict[str, object] = {"limit": rate.quota, "window": rate.window}
    if rate.burst is not None:
        extra["burst"] = rate.burst
    if problem_type == "about:blank":
        body = problem(
            429, "Too Many Requests", detail, RATE_LIMITED, decision.retry_after, **extra
        )
    else:
        document: dict[str, object] = {
            "type": QUOTA_EXCEEDED, "title": "Quota Exceeded", "status": 429, "detail": detail,
        }  # fmt: skip
        if shape is not None:
            document["violated-policies"] = [rate.label]
        document.update(code=RATE_LIMITED, retry_after=decision.retry_after, **extra)
        body = json.dumps(document, separators=(",", ":")).encode()
    return HttpResponse(429, _with_body_headers(headers, len(body)), body)


def unavailable(retry_after: int) -> HttpResponse:
    """The 503 of a fail-closed class whose limiter failed."""
    body = problem(503, "Service Unavailable",
                   f"The rate limiter is unavailable; retry after {retry_after}s.",
                   UNAVAILABLE, retry_after)  # fmt: skip
    return HttpResponse(
        503, _with_body_headers([("Retry-After", str(retry_after))], len(body)), body
    )


def overloaded(retry_after: int, detail: str) -> HttpResponse:
    """The 503 of load shedding (`quota.http.shedding.SheddingMiddleware`): too much work in flight.

    ``application/problem+json`` with ``code: OVERLOADED``, ``retry_after``
    and ``error: overloaded``.
    """
    body = problem(503, "Service Unavailable", detail, OVERLOADED, retry_after, error="overloaded")
    return HttpResponse(
        503, _with_body_headers([("Retry-After", str(retry_after))], len(body)), body
    )


def _with_body_headers(headers: Headers, length: int) -> tuple[tuple[str, str], ...]:
    return (
        ("Content-Type", PROBLEM_JSON),
        ("Content-Length", str(length)),
        ("Cache-Control", "no-store"),
        *headers,
    )


# -- CORS on the answers the middleware makes itself ----------------------------

#: What `CorsOrigins.of` accepts: ``"*"``, origins (``https://app.example``), or
#: an object with a CORS middleware's ``is_allowed_origin(origin)``,
#: ``allow_all_origins`` and ``allow_credentials`` (Starlette's).
CorsSetting = str | Sequence[str] | object


@dataclass(frozen=True, slots=True)
class CorsOrigins:
    """The origins whose browser code may read a 429 or 503 the middleware answers itself."""

    origins: frozenset[str]
    any_origin: bool = False
    credentials: bool = False
    allowed: Callable[[str], bool] | None = None

    @classmethod
    def of(cls, setting: CorsSetting | None) -> CorsOrigins | None:
        """``"*"``, a list of origins, or a CORS middleware to follow; None: none."""
        if setting is None:
            return None
        if isinstance(setting, str):
            setting = [setting]
        is_allowed = getattr(setting, "is_allowed_origin", None)
        if callable(is_allowed):
            return cls(
                frozenset(), bool(getattr(setting, "allow_all_origins", False)),
                bool(getattr(setting, "allow_credentials", False)), is_allowed,
            )  # fmt: skip
        if not isinstance(setting, Sequence) or not all(isinstance(o, str) for o in setting):
            raise ConfigurationError(
                f'cors_origins must be "*" or a list of origins, got {setting!r}'
            )
        origins = frozenset(o.rstrip("/") for o in setting)
        return cls(origins - {"*"}, "*" in origins)

    def grant(self, origin: str) -> Headers:
        """The ``Access-Control-Allow-*`` headers for a request from `origin` (none if not allowed)."""
        if self.allowed is not None:
            if not self.allowed(origin):
                return []
        elif not self.any_origin and origin not in self.origins:
            return []
        if self.any_origin and not self.credentials:
            return [("Access-Control-Allow-Origin", "*")]
        out = [("Access-Control-Allow-Origin", origin)]
        if self.credentials:
            out.append(("Access-Control-Allow-Credentials", "true"))
        return out


def is_preflight(method: str, headers: Mapping[str, str]) -> bool:
    """A CORS preflight: ``OPTIONS`` with ``Origin`` and ``Access-Control-Request-Method``."""
    return (
        method == "OPTIONS" and "origin" in headers and "access-control-request-method" in headers
    )


def with_cors(
    response: HttpResponse, origin: str | None, cors: CorsOrigins | None, *, exposing: bool
) -> HttpResponse:
    """A denial answered to a cross-origin request, made readable by browser code.

    A request without an ``Origin`` (`origin` None) gets `response` as it is. Adds ``Access-Control-Allow-Origin`` (and ``Vary: Origin``) when `cors`
    allows `origin`, and, when `exposing`, the rate-limit headers and
    Retry-After to ``Access-Control-Expose-Headers``. Headers the response
    (a response factory's) already carries are kept.
    """
    if origin is None:
        return response
    headers = list(response.headers)
    names = {name.lower() for name, _ in headers}
    added: Headers = []
    if cors is not None and "access-control-allow-origin" not in names:
        grant = cors.grant(origin)
        added += grant
        if grant and grant[0][1] != "*":
            vary = [v for k, v in headers if k.lower() == "vary"]
            if not any("origin" in v.lower() or "*" in v for v in vary):
                added.append(("Vary", "Origin"))
    if exposing:
        ours = [(n, v) for n, v in headers if n.lower() in _EXPOSED]
        existing = [v for k, v in headers if k.lower() == "access-control-expose-headers"]
        value = expose(ours, ", ".join(existing) or None)
        if not existing or value != ", ".join(existing):
            headers = [(k, v) for k, v in headers if k.lower() != "access-control-expose-headers"]
            added.append(("Access-Control-Expose-Headers", value))
    if not added:
        return response
    return HttpResponse(response.status, (*headers, *added), response.body)


_EXPOSED = frozenset(n.lower() for n in EXPOSE_HEADERS)
