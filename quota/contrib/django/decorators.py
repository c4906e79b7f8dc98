"""`ratelimit`: django-ratelimit's decorator, counting in the project's database.

    from quota.contrib.django import ratelimit

    @ratelimit(key="ip", rate="5/m", block=True)
    def login(request): ...

Function views, async views (counted with the running loop's async limiter)
and class-based views through ``method_decorator``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from functools import wraps
from typing import Any, TypeVar, cast

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.conf import settings
from django.utils.module_loading import import_string

from quota._core.algorithms import FIXED_WINDOW
from quota._core.decision import Decision
from quota.contrib.django.conf import get_async_limiter, get_limiter
from quota.contrib.django.core import ALL, UNSAFE, Plan, Planner, count_async, count_with
from quota.contrib.django.exceptions import Ratelimited

__all__ = ["ALL", "UNSAFE", "ratelimit"]

F = TypeVar("F", bound=Callable[..., Any])
#: Where a request keeps the decisions of the decorators it passed (for the response headers).
DECISIONS_ATTRIBUTE = "_quota_decisions"


def ratelimit(
    group: str | None = None,
    key: object = None,
    rate: object = None,
    method: object = ALL,
    block: bool = True,
    *,
    algorithm: str = FIXED_WINDOW,
) -> Callable[[F], F]:
    """Limit a view to `rate` requests per `key`, as django-ratelimit's decorator does.

    `key`: ``"ip"``, ``"user"``, ``"user_or_ip"``, ``"header:<name>"``,
    ``"get:<name>"``, ``"post:<name>"``, a callable ``(group, request) -> str``
    or a dotted path to one. `rate`: ``"X/u"`` or ``"X/Nu"`` (u one of s, m,
    h, d), a ``(count, seconds)`` tuple, a callable ``(group, request)``
    returning one or None (no limit), or a dotted path to one. `method`:
    `ALL` (default), `UNSAFE`, a method name or a list of them; other methods
    pass uncounted. `group` (default: the view's dotted name) names the
    counter that views sharing it share. `algorithm`: quota's
    ``fixed_window`` (default), ``sliding_window``, ``token_bucket`` or ``gcra``.

    Every request the limit applies to is counted. Over the limit,
    ``request.limited`` is True (and stays True when an earlier decorator set
    it); with `block` (default) `Ratelimited` is raised (or the
    ``RATELIMIT_EXCEPTION_CLASS`` setting's class), a 429 with
    `quota.contrib.django.ratelimiting.RatelimitMiddleware`, else Django's 403.
    """

    def decorator(fn: F) -> F:
        planner = Planner(group, fn, key, rate, method)
        if iscoroutinefunction(fn):

            @wraps(fn)
            async def _async_wrapped(request: Any, *args: Any, **kwargs: Any) -> Any:
                user = None
                if key in ("user", "user_or_ip") and hasattr(request, "auser"):
                    user = await request.auser()
                planned = planner(request, user)
                if planned is not None:
                    decision = await count_async(planned, increment=True, algorithm=algorithm)
                    now = get_async_limiter().options.app_clock()
                    _settle(request, planned, decision, now, block)
                else:
                    request.limited = getattr(request, "limited", False)
                return await fn(request, *args, **kwargs)

            return cast(F, markcoroutinefunction(_async_wrapped))

        @wraps(fn)
        def _wrapped(request: Any, *args: Any, **kwargs: Any) -> Any:
            planned = planner(request)
            if planned is not None:
                limiter = get_limiter()
                decision = count_with(limiter, planned, increment=True, algorithm=algorithm)
                _settle(request, planned, decision, limiter.options.app_clock(), block)
            else:
                request.limited = getattr(request, "limited", False)
            return fn(request, *args, **kwargs)

        return _wrapped  # type: ignore[return-value]

    return decorator


def _settle(
    request: Any, planned: Plan, decision: Decision | None, now: float, block: bool
) -> None:
    if decision is None:  # the store failed: limited unless RATELIMIT_FAIL_OPEN
        limited = not getattr(settings, "RATELIMIT_FAIL_OPEN", False)
    else:
        limited = not decision.allowed
    request.limited = limited or getattr(request, "limited", False)
    if decision is not None:
        decisions = getattr(request, DECISIONS_ATTRIBUTE, None)
        if decisions is None:
            decisions = []
            setattr(request, DECISIONS_ATTRIBUTE, decisions)
        decisions.append((planned, decision))
    if limited and block:
        cls = getattr(settings, "RATELIMIT_EXCEPTION_CLASS", Ratelimited)
        if isinstance(cls, str):
            cls = import_string(cls)
        if isinstance(cls, type) and issubclass(cls, Ratelimited):
            raise cls(decision=decision, group=planned.group)
        error = cls()
        with contextlib.suppress(AttributeError):  # a class with __slots__ goes without
            error.decision, error.group = decision, planned.group
        raise error


ratelimit.ALL = ALL  # type: ignore[attr-defined]
ratelimit.UNSAFE = UNSAFE  # type: ignore[attr-defined]
