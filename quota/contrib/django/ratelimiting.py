"""`RatelimitMiddleware`: `Ratelimited` as a 429 with the rate-limit headers.

    MIDDLEWARE = [
        ...,
        "quota.contrib.django.ratelimiting.RatelimitMiddleware",
    ]

A view over a `ratelimit` limit (``block=True``) raises `Ratelimited`; this
middleware answers it with ``429 Too Many Requests`` (an RFC 9457 problem
document), ``Retry-After``, ``X-RateLimit-Limit``/``-Remaining``/``-Reset``
and the IETF ``RateLimit`` and ``RateLimit-Policy`` fields. With the
``RATELIMIT_VIEW`` setting (django-ratelimit's: a dotted path to a view taking
``(request, exception)``) that view answers instead, and the headers are
added to its response. Responses of views a `ratelimit` decorator let through
carry the same headers, for the decorator closest to its limit; headers a
response already has are left alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.conf import settings
from django.http import HttpResponse
from django.utils.module_loading import import_string

from quota._core.decision import Decision
from quota.contrib.django.conf import get_limiter
from quota.contrib.django.core import Plan
from quota.contrib.django.decorators import DECISIONS_ATTRIBUTE
from quota.contrib.django.exceptions import Ratelimited
from quota.contrib.django.middleware import to_django
from quota.http import (
    PROBLEM_JSON,
    RATE_LIMITED,
    PolicyShape,
    problem,
    rate_limit_headers,
    too_many_requests,
)

__all__ = ["RatelimitMiddleware", "rate_limit_response"]

_shapes: dict[tuple[str, int, int], PolicyShape] = {}


def _shape(group: str, limit: int, window: int) -> PolicyShape:
    shape = _shapes.get((group, limit, window))
    if shape is None:
        if len(_shapes) > 4096:
            _shapes.clear()
        shape = _shapes[(group, limit, window)] = PolicyShape(group, [(max(limit, 1), window)])
    return shape


def _headers(group: str, decision: Decision) -> list[tuple[str, str]]:
    now = get_limiter().options.app_clock()
    shape = _shape(group, decision.limit, decision.window)
    return rate_limit_headers(decision, shape, now, "both", retry_after=not decision.allowed)


def rate_limit_response(request: Any, exception: Ratelimited) -> HttpResponse:
    """The 429 for `exception`: a problem document with the rate-limit headers."""
    decision: Decision | None = getattr(exception, "decision", None)
    group: str = getattr(exception, "group", None) or "ratelimit"
    if decision is None:
        body = problem(429, "Too Many Requests", "Rate limit exceeded.", RATE_LIMITED, 0)
        return HttpResponse(body, status=429, content_type=PROBLEM_JSON)
    headers = _headers(group, decision)
    return to_django(
        too_many_requests(decision, headers, _shape(group, decision.limit, decision.window))
    )


def _add_headers(response: Any, group: str, decision: Decision) -> Any:
    for name, value in _headers(group, decision):
        if name not in response:
            response[name] = value
    return response


def _closest(request: Any) -> tuple[Plan, Decision] | None:
    decisions: list[tuple[Plan, Decision]] | None = getattr(request, DECISIONS_ATTRIBUTE, None)
    if not decisions:
        return None
    return min(decisions, key=lambda pair: (pair[1].allowed, pair[1].remaining))


class RatelimitMiddleware:
    """Answer `Ratelimited` with a 429 (or the ``RATELIMIT_VIEW``), adding the headers."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response: Callable[[Any], Any]) -> None:
        self.get_response = get_response
        self.is_async = iscoroutinefunction(get_response)
        if self.is_async:
            markcoroutinefunction(self)

    def __call__(self, request: Any) -> Any:
        if self.is_async:
            return self.__acall__(request)
        return self._finish(request, self.get_response(request))

    async def __acall__(self, request: Any) -> Any:
        return self._finish(request, await self.get_response(request))

    def _finish(self, request: Any, response: Any) -> Any:
        closest = _closest(request)
        if closest is not None:
            _add_headers(response, closest[0].group, closest[1])
        return response

    def process_exception(self, request: Any, exception: Exception) -> Any:
        if not isinstance(exception, Ratelimited):
            return None
        view = getattr(settings, "RATELIMIT_VIEW", None)
        if not view:
            return rate_limit_response(request, exception)
        response = import_string(view)(request, exception)
        decision = getattr(exception, "decision", None)
        if decision is not None:
            _add_headers(response, getattr(exception, "group", None) or "ratelimit", decision)
        return response
