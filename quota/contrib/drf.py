"""Exact Django REST framework throttles: DRF's classes, counted by quota.

    # settings.py
    INSTALLED_APPS = [..., "rest_framework", "quota.contrib.django"]
    REST_FRAMEWORK = {
        "DEFAULT_THROTTLE_CLASSES": [
            "quota.contrib.drf.AnonRateThrottle",
            "quota.contrib.drf.UserRateThrottle",
        ],
        "DEFAULT_THROTTLE_RATES": {"anon": "100/day", "user": "1000/day"},
    }

`AnonRateThrottle`, `UserRateThrottle` and `ScopedRateThrottle` are DRF's
classes (they subclass them: ``get_cache_key``, ``get_rate``,
``parse_rate``, ``get_ident``, ``scope``, ``THROTTLE_RATES``, ``timer`` and
``cache_format`` are DRF's own) whose decision is one atomic counter per
key, kept by quota's limiter in the app's database (`quota.contrib.django`'s
``get_limiter``): the read-decide-write of DRF's cache history, which
admits more than the rate under concurrency, becomes one statement. Derive
from `QuotaThrottle` as from DRF's ``SimpleRateThrottle``.

The differences from DRF's classes are listed in the documentation (the
Django REST framework page); in short: fixed windows aligned to the epoch
instead of a sliding log of timestamps, `QuotaThrottle.history` a stand-in
of the window's count, `QuotaThrottle.wait` the time until the next request
passes, and ``cache`` unused.

`RateLimitHeadersMiddleware` adds ``X-RateLimit-*`` and the IETF
``RateLimit`` fields to the responses of throttled views when the
``QUOTA_DRF_HEADERS`` setting names a style (``legacy``, ``ietf`` or
``both``; ``none`` by default).
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from typing import Any

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.core.exceptions import ImproperlyConfigured
from rest_framework import throttling as _drf

from quota._core.algorithms import FIXED_WINDOW
from quota._core.decision import Decision
from quota._limiter import Limiter
from quota.contrib.django import conf
from quota.http import PolicyShape, rate_limit_headers

__all__ = [
    "AnonRateThrottle",
    "QuotaThrottle",
    "RateLimitHeadersMiddleware",
    "ScopedRateThrottle",
    "UserRateThrottle",
]

#: The setting that turns the rate-limit headers on, and the styles it takes.
HEADERS_SETTING = "QUOTA_DRF_HEADERS"
HEADER_STYLES = ("none", "legacy", "ietf", "both")
#: Where a request keeps the decisions its throttles made (on Django's ``HttpRequest``).
_DECISIONS = "_quota_drf_decisions"

#: The throttle's ``timer()`` while quota's limiter decides (None: the limiter's own clock).
_decision_time: ContextVar[float | None] = ContextVar("quota_drf_decision_time", default=None)


def _with_timer(limiter: Limiter) -> Limiter:
    """`limiter`, its clock made to read the deciding throttle's ``timer()`` when one is set.

    quota's limiter takes the time from its clock, not from the call: the
    throttle sets `_decision_time` around its call and the wrapped clock
    returns it. Other callers of the same limiter leave it unset and get the
    limiter's clock unchanged. Per context (thread or task), so concurrent
    requests never see each other's time.
    """
    clock = limiter._clock
    if getattr(clock, "_quota_drf", False):
        return limiter

    def clock_or_timer() -> float:
        now = _decision_time.get()
        return clock() if now is None else now

    clock_or_timer._quota_drf = True  # type: ignore[attr-defined]
    limiter._clock = clock_or_timer
    return limiter


class _ThrottleRates:
    """``THROTTLE_RATES``: DRF's ``DEFAULT_THROTTLE_RATES`` as it is when read.

    DRF's class attribute is the setting when ``rest_framework.throttling`` was
    first imported; this one follows ``override_settings`` too. A subclass's
    ``THROTTLE_RATES = {...}`` or an instance's assignment replaces it, as in DRF.
    """

    def __get__(self, instance: object, owner: type | None = None) -> Any:
        from rest_framework.settings import api_settings

        return api_settings.DEFAULT_THROTTLE_RATES


def _closed(key: str, window: int, now: float) -> Decision:
    """The decision of a ``0/…`` rate: every request is over it, nothing counted."""
    reset_at = (int(now) // window + 1) * window
    return Decision(
        False, key, 0, 0, 0, window, reset_at, max(1, math.ceil(reset_at - now)), reset_at - now
    )


class QuotaThrottle(_drf.SimpleRateThrottle):
    """DRF's ``SimpleRateThrottle`` counted by quota: override ``get_cache_key`` as in DRF.

    `allow_request` counts the request on the counter of
    ``"drf:" + get_cache_key(...)`` for a window of ``duration`` seconds at the
    time ``timer()`` returns, and allows it when the window holds at most
    ``num_requests`` requests. The counter is one row of quota's tables in the
    database of ``QUOTA["DATABASE"]`` (or ``QUOTA["URL"]``), updated in one
    statement: exact across threads, processes and servers. Raises what quota's
    limiter raises (`quota.StorageError` when the database fails, unless
    ``QUOTA["OPTIONS"]["fallback"]`` is set; `quota.SchemaError` before
    ``manage.py migrate``).
    """

    THROTTLE_RATES = _ThrottleRates()
    #: quota's algorithm for the counter: ``fixed_window`` (the default),
    #: ``sliding_window``, ``token_bucket`` or ``gcra``.
    algorithm: str = FIXED_WINDOW
    #: Put before the cache key to make quota's key.
    key_prefix: str = "drf:"
    #: The last decision (None before `allow_request` counted anything).
    decision: Decision | None = None

    def allow_request(self, request: Any, view: Any) -> bool:
        """Count this request and say whether it passes (True without a rate or a key)."""
        self.decision = None
        self.history = []
        if self.rate is None:
            return True
        self.key = self.get_cache_key(request, view)
        if self.key is None:
            return True
        self.now = self.timer()
        decision = self.decide(self.key_prefix + self.key, self.num_requests, self.duration)
        self.decision = decision
        # DRF's history held the window's requests, the allowed one included.
        self.history = [self.now] * min(decision.count, self.num_requests)
        _remember(request, self, decision)
        if decision.allowed:
            return self.throttle_success()
        return self.throttle_failure()

    def decide(self, key: str, limit: int, window: int) -> Decision:
        """Count one request on `key` (at most `limit` per `window` seconds) at ``self.now``."""
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
            raise ImproperlyConfigured(
                f"{type(self).__name__}: the number of requests must be a whole number,"
                f" got {limit!r} from rate {self.rate!r}"
            )
        if limit == 0:
            return _closed(key, int(window), float(self.now))
        limiter = _with_timer(conf.get_limiter())
        token = _decision_time.set(self.now)
        try:
            return limiter.rate_limit(key, limit, window, algorithm=self.algorithm)
        finally:
            _decision_time.reset(token)

    def throttle_success(self) -> bool:
        """True: the request was counted (nothing is written to DRF's cache)."""
        return True

    def throttle_failure(self) -> bool:
        """False: the request is over the rate."""
        return False

    def wait(self) -> float | None:
        """Seconds until the next request passes (DRF sends it as ``Retry-After``).

        0.0 when the window has room left; None before `allow_request` counted
        anything (no rate, no key, or not called yet).
        """
        decision = self.decision
        if decision is None:
            return None
        if decision.allowed and decision.remaining > 0:
            return 0.0
        if decision.retry_after_exact > 0:
            return float(decision.retry_after_exact)
        return max(0.0, float(decision.reset_at) - float(self.now))


class AnonRateThrottle(_drf.AnonRateThrottle, QuotaThrottle):
    """DRF's ``AnonRateThrottle`` counted by quota: anonymous requests, by client address.

    Scope ``anon`` (``DEFAULT_THROTTLE_RATES["anon"]``); signed-in users pass.
    """


class UserRateThrottle(_drf.UserRateThrottle, QuotaThrottle):
    """DRF's ``UserRateThrottle`` counted by quota: by user, anonymous requests by address.

    Scope ``user`` (``DEFAULT_THROTTLE_RATES["user"]``).
    """


class ScopedRateThrottle(_drf.ScopedRateThrottle, QuotaThrottle):
    """DRF's ``ScopedRateThrottle`` counted by quota: the view's ``throttle_scope`` names the rate.

    A view without ``throttle_scope`` is not throttled.
    """


# --- headers -------------------------------------------------------------------------


def _remember(request: Any, throttle: QuotaThrottle, decision: Decision) -> None:
    """Keep the decision on Django's request, where `RateLimitHeadersMiddleware` finds it."""
    target = getattr(request, "_request", request)
    try:
        found = target.__dict__.setdefault(_DECISIONS, [])
    except AttributeError:  # not a request (DRF's own tests pass a dict)
        return
    name = str(throttle.scope or type(throttle).__name__)
    found.append((name, decision, float(throttle.now)))


def headers_style() -> str:
    """The ``QUOTA_DRF_HEADERS`` setting, checked: ``none`` (default), ``legacy``, ``ietf``, ``both``."""
    from django.conf import settings

    style = getattr(settings, HEADERS_SETTING, "none")
    if style is None:
        return "none"
    if style not in HEADER_STYLES:
        raise ImproperlyConfigured(
            f"{HEADERS_SETTING} must be one of {', '.join(HEADER_STYLES)}, got {style!r}"
        )
    return str(style)


def _deciding(found: list[tuple[str, Decision, float]]) -> tuple[str, Decision, float]:
    """The decision the headers show: the denial waiting longest, else the least room left."""
    denied = [entry for entry in found if not entry[1].allowed]
    if denied:
        return max(denied, key=lambda entry: entry[1].retry_after_exact)
    return min(found, key=lambda entry: entry[1].remaining)


def response_headers(request: Any, style: str) -> list[tuple[str, str]]:
    """The rate-limit headers for the decisions `request`'s throttles made, in `style`."""
    found = getattr(request, _DECISIONS, None)
    if not found or style == "none":
        return []
    name, decision, now = _deciding(found)
    shape = PolicyShape(name, [(decision.limit, decision.window)])
    return list(rate_limit_headers(decision, shape, now, style, retry_after=False))


class RateLimitHeadersMiddleware:
    """Adds the rate-limit headers of DRF throttles to responses, sync and async.

    ``MIDDLEWARE += ["quota.contrib.drf.RateLimitHeadersMiddleware"]`` and
    ``QUOTA_DRF_HEADERS = "both"`` (or ``legacy``: ``X-RateLimit-Limit``,
    ``-Remaining``, ``-Reset``; ``ietf``: ``RateLimit-Policy`` and
    ``RateLimit``). On allowed and throttled responses alike; the throttle
    that decided is the one whose denial waits longest, else the one with
    the least room left. DRF itself sends ``Retry-After`` on a 429.
    """

    sync_capable = True
    async_capable = True

    def __init__(self, get_response: Callable[[Any], Any]) -> None:
        self.get_response = get_response
        self._async = iscoroutinefunction(get_response)
        if self._async:
            markcoroutinefunction(self)

    def __call__(self, request: Any) -> Any:
        if self._async:
            return self._acall(request)
        response = self.get_response(request)
        return self._add(request, response)

    async def _acall(self, request: Any) -> Any:
        get_response: Callable[[Any], Awaitable[Any]] = self.get_response
        response = await get_response(request)
        return self._add(request, response)

    def _add(self, request: Any, response: Any) -> Any:
        for name, value in response_headers(request, headers_style()):
            response[name] = value
        return response
