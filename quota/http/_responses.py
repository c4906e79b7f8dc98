"""What the middleware says back: rate-limit headers, the 429 and 503 bodies, CORS exposure.

Pure functions from a decision to header pairs and bytes; no framework
types. An app reshapes a denial with a response factory (`ResponseFactory`),
for instance into a JSON-RPC error object for an MCP endpoint.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from quota._core import Decision
from quota.http._identity import RequestInfo

Headers = list[tuple[str, str]]

PROBLEM_JSON = "application/problem+json"
RATE_LIMITED = "RATE_LIMITED"
UNAVAILABLE = "RATE_LIMIT_UNAVAILABLE"

LEGACY_HEADERS = ("X-RateLimit-Limit", "X-RateLimit-Remaining", "X-RateLimit-Reset")
IETF_HEADERS = ("RateLimit", "RateLimit-Policy")
#: Every header a browser client may want to read; list them in your CORS
#: middleware's ``expose_headers`` if it overwrites ours.
EXPOSE_HEADERS = (*LEGACY_HEADERS, *IETF_HEADERS, "Retry-After")


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


class PolicyShape:
    """The parts of the IETF fields fixed by a route class and its rates, built once per pair."""

    __slots__ = ("by_window", "first", "policy")

    def __init__(self, route: str, limits: Sequence[tuple[int, int]]) -> None:
        names = [route] if len(limits) == 1 else [f"{route}-{i}" for i in range(len(limits))]
        quoted = [_sf_string(name) for name in names]
        #: The ``RateLimit-Policy`` value: every rate, ``"name";q=<limit>;w=<window>``.
        self.policy = ", ".join(
            f"{name};q={limit};w={window}"
            for name, (limit, window) in zip(quoted, limits, strict=True)
        )
        self.first = quoted[0]
        self.by_window: dict[int, str] = {}
        for name, (_, window) in zip(quoted, limits, strict=True):
            self.by_window.setdefault(window, name)

    def current(self, window: int) -> str:
        """The quoted name of the rate with this window (the one that decided)."""
        return self.by_window.get(window, self.first)


def rate_limit_headers(
    decision: Decision, shape: PolicyShape, now: float, style: str, *, retry_after: bool
) -> Headers:
    """The rate-limit headers for `decision` under a class whose rates `shape` describes.

    ``legacy``: ``X-RateLimit-Limit``, ``-Remaining``, ``-Reset`` (epoch
    seconds). ``ietf``: ``RateLimit-Policy`` listing every rate as
    ``"name";q=<limit>;w=<window>`` and ``RateLimit`` naming the one that
    decided with ``r=<remaining>;t=<seconds to reset>``
    (draft-ietf-httpapi-ratelimit-headers). ``Retry-After`` when asked.
    """
    remaining = str(decision.remaining)
    if style == "both":
        out: Headers = [
            ("X-RateLimit-Limit", str(decision.limit)),
            ("X-RateLimit-Remaining", remaining),
            ("X-RateLimit-Reset", str(decision.reset_at)),
            ("RateLimit-Policy", shape.policy),
            (
                "RateLimit",
                f"{shape.current(decision.window)};r={remaining};t={_reset_in(decision, now)}",
            ),
        ]
    elif style == "legacy":
        out = [
            ("X-RateLimit-Limit", str(decision.limit)),
            ("X-RateLimit-Remaining", remaining),
            ("X-RateLimit-Reset", str(decision.reset_at)),
        ]
    elif style == "ietf":
        out = [
            ("RateLimit-Policy", shape.policy),
            (
                "RateLimit",
                f"{shape.current(decision.window)};r={remaining};t={_reset_in(decision, now)}",
            ),
        ]
    else:
        out = []
    if retry_after:
        out.append(("Retry-After", str(decision.retry_after)))
    return out


def _reset_in(decision: Decision, now: float) -> int:
    return max(0, math.ceil(decision.reset_at - now))


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


def too_many_requests(decision: Decision, headers: Headers) -> HttpResponse:
    """The default 429: ``application/problem+json`` with ``code: RATE_LIMITED`` and ``retry_after``."""
    detail = (
        f"Rate limit of {decision.limit} per {decision.window}s exceeded;"
        f" retry after {decision.retry_after}s."
    )
    body = problem(429, "Too Many Requests", detail, RATE_LIMITED, decision.retry_after,
                   limit=decision.limit, window=decision.window)  # fmt: skip
    return HttpResponse(429, _with_body_headers(headers, len(body)), body)


def unavailable(retry_after: int) -> HttpResponse:
    """The 503 of a fail-closed class whose limiter failed."""
    body = problem(503, "Service Unavailable",
                   f"The rate limiter is unavailable; retry after {retry_after}s.",
                   UNAVAILABLE, retry_after)  # fmt: skip
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
