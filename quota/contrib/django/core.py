"""`is_ratelimited` and `get_usage`, as django-ratelimit has them, counting in quota.

The arguments and results are django-ratelimit's (``django_ratelimit.core``);
the counters live in quota's tables (`quota.contrib.django.conf.get_limiter`).
The settings read: ``RATELIMIT_ENABLE``, ``RATELIMIT_IP_META_KEY``,
``RATELIMIT_IPV4_MASK``, ``RATELIMIT_IPV6_MASK`` and ``RATELIMIT_FAIL_OPEN``.
"""

from __future__ import annotations

import functools
import hashlib
import ipaddress
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.utils.module_loading import import_string

from quota._core.algorithms import FIXED_WINDOW
from quota._core.decision import Decision
from quota._core.errors import SchemaError, StorageError
from quota.contrib.django.conf import get_async_limiter, get_limiter

__all__ = ["ALL", "UNSAFE", "get_usage", "is_ratelimited"]

#: Every HTTP method (``method=ALL``, the default).
ALL = (None,)
#: The methods that change something.
UNSAFE = ["DELETE", "PATCH", "POST", "PUT"]

_PERIODS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_UNIT_WORDS = {
    "s": "s", "sec": "s", "second": "s", "m": "m", "min": "m", "minute": "m",
    "h": "h", "hr": "h", "hour": "h", "d": "d", "day": "d",
}  # fmt: skip
_RATE = re.compile(r"\s*(\d+)\s*/\s*(\d*)\s*([a-zA-Z]*?)s?\s*")

Rate = str | tuple[int, int]
KeyFunction = Callable[[str, Any], str]


def split_rate(rate: Rate) -> tuple[int, int]:
    """``"5/m"`` → ``(5, 60)``; ``"100/5m"`` → ``(100, 300)``; a ``(count, seconds)`` tuple as is.

    The units are ``s``, ``m``, ``h`` and ``d`` (``second``, ``minute``, ``hour``
    and ``day`` too); a rate without a unit counts per second, as in
    django-ratelimit. Anything else is `ImproperlyConfigured`.
    """
    if isinstance(rate, tuple):
        count, seconds = rate
    else:
        match = _RATE.fullmatch(rate) if isinstance(rate, str) else None
        unit = _UNIT_WORDS.get(match[3].lower() or "s") if match else None
        if match is None or unit is None:
            raise ImproperlyConfigured(
                f"ratelimit rate {rate!r} is not of the form 'X/u' or 'X/Nu' with u one of"
                " s, m, h, d (e.g. '5/m', '100/5m'), a (count, seconds) tuple, a callable"
                " or a dotted path to one"
            )
        count, seconds = int(match[1]), _PERIODS[unit] * int(match[2] or 1)
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ImproperlyConfigured(f"ratelimit rate {rate!r}: the count must be a whole number")
    if isinstance(seconds, bool) or not isinstance(seconds, int) or seconds <= 0:
        raise ImproperlyConfigured("Ratelimit period must be greater than 0")
    return count, seconds


def _get_ip(request: Any) -> str:
    ip_meta = getattr(settings, "RATELIMIT_IP_META_KEY", None)
    if not ip_meta:
        ip = request.META.get("REMOTE_ADDR")
        if not ip:
            raise ImproperlyConfigured(
                "IP address in REMOTE_ADDR is empty. This can happen when using a reverse proxy"
                " and connecting to the app server with Unix sockets: set RATELIMIT_IP_META_KEY"
            )
    elif callable(ip_meta):
        ip = ip_meta(request)
    elif isinstance(ip_meta, str) and "." in ip_meta:
        ip = import_string(ip_meta)(request)
    elif ip_meta in request.META:
        ip = request.META[ip_meta]
    else:
        raise ImproperlyConfigured(f'Could not get IP address from "{ip_meta}"')
    if ":" in ip:
        mask = getattr(settings, "RATELIMIT_IPV6_MASK", 64)
    else:
        mask = getattr(settings, "RATELIMIT_IPV4_MASK", 32)
    try:
        network = ipaddress.ip_network(f"{ip.strip()}/{mask}", strict=False)
    except ValueError as exc:
        raise ImproperlyConfigured(
            f"ratelimit: {ip!r} is not an IP address (several addresses from a proxy header?"
            " give RATELIMIT_IP_META_KEY a callable that picks the client's)"
        ) from exc
    return str(network.network_address)


def _user_key(user: Any) -> str:
    return str(user.pk)


def _header(request: Any, name: str) -> str:
    return str(request.META.get("HTTP_" + name.replace("-", "_").upper(), ""))


_ACCESSORS: dict[str, Callable[[Any, str], str]] = {
    "get": lambda request, name: str(request.GET.get(name, "")),
    "post": lambda request, name: str(request.POST.get(name, "")),
    "header": _header,
}


def _key_value(request: Any, group: str, key: object, user: Any = None) -> tuple[str, bool]:
    """The counted value for `key`, and whether it is kept hashed (values clients send)."""
    if not key:
        raise ImproperlyConfigured("Ratelimit key must be specified")
    if callable(key):
        return str(key(group, request)), False
    if not isinstance(key, str):
        raise ImproperlyConfigured(f"Could not understand ratelimit key: {key!r}")
    if key == "ip":
        return _get_ip(request), False
    if key in ("user", "user_or_ip"):
        who = user if user is not None else request.user
        if key == "user" or who.is_authenticated:
            return _user_key(who), False
        return _get_ip(request), False
    if ":" in key:
        accessor, name = key.split(":", 1)
        if accessor not in _ACCESSORS:
            raise ImproperlyConfigured(f"Unknown ratelimit key: {key}")
        return _ACCESSORS[accessor](request, name), True
    if "." in key:
        return str(import_string(key)(group, request)), False
    raise ImproperlyConfigured(f"Could not understand ratelimit key: {key}")


def _method_match(request: Any, method: object) -> bool:
    if method == ALL or method is ALL:
        return True
    methods = method if isinstance(method, (list, tuple)) else [method]
    return request.method in [str(m).upper() for m in methods]


def _methods_part(method: object) -> str:
    if method == ALL:
        return ""
    if isinstance(method, (list, tuple)):
        return "".join(sorted(str(m).upper() for m in method))
    return str(method).upper()


def group_of(fn: Any) -> str:
    """The default group of a view: its module and qualified name, as django-ratelimit names it."""
    if isinstance(fn, functools.partial):
        fn = fn.func
    parts = []
    if hasattr(fn, "__module__"):
        parts.append(fn.__module__)
    if hasattr(fn, "__self__"):
        parts.append(fn.__self__.__class__.__name__)
    parts.append(fn.__qualname__)
    return ".".join(parts)


@dataclass(frozen=True, slots=True)
class Plan:
    """One limit to check for one request: the counter's key and its rate."""

    group: str
    key: str
    limit: int
    window: int


def plan(
    request: Any, group: str | None, fn: Any, key: object, rate: object, method: object,
    user: Any = None,
) -> Plan | None:  # fmt: skip
    """What to count for `request`, or None when nothing limits it (disabled, another
    method, or a rate callable returning None)."""
    if group is None and fn is None:
        raise ImproperlyConfigured("get_usage must be called with either `group` or `fn` arguments")
    if not getattr(settings, "RATELIMIT_ENABLE", True):
        return None
    if not _method_match(request, method):
        return None
    if group is None:
        group = group_of(fn)
    if callable(rate):
        rate = rate(group, request)
    elif isinstance(rate, str) and "." in rate:
        rate = import_string(rate)(group, request)
    if rate is None:
        return None
    limit, window = split_rate(rate)  # type: ignore[arg-type]
    value, hashed = _key_value(request, group, key, user)
    if hashed:
        value = "#" + hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()[:32]
    methods = _methods_part(method)
    counter = f"django:{group}:{limit}/{window}s{':' + methods if methods else ''}:{value}"
    return Plan(group, counter, limit, window)


def _closed(plan: Plan, now: float) -> Decision:
    """The decision of a ``0/…`` rate: every request is over it, nothing counted."""
    reset_at = (int(now) // plan.window + 1) * plan.window
    return Decision(
        False, plan.key, 0, 0, 0, plan.window, reset_at, max(1, math.ceil(reset_at - now))
    )


def count_sync(plan: Plan, *, increment: bool, algorithm: str = FIXED_WINDOW) -> Decision | None:
    """Count (or only read) `plan`'s counter with the sync limiter; None if the store failed."""
    limiter = get_limiter()
    if plan.limit == 0:
        return _closed(plan, limiter.options.app_clock())
    try:
        if increment:
            return limiter.rate_limit(plan.key, plan.limit, plan.window, algorithm=algorithm)
        return limiter.peek(plan.key, plan.limit, plan.window, algorithm=algorithm)
    except SchemaError:
        raise
    except StorageError:
        return None


async def count_async(
    plan: Plan, *, increment: bool, algorithm: str = FIXED_WINDOW
) -> Decision | None:
    """`count_sync` with the running loop's async limiter."""
    limiter = get_async_limiter()
    if plan.limit == 0:
        return _closed(plan, limiter.options.app_clock())
    try:
        if increment:
            return await limiter.rate_limit(plan.key, plan.limit, plan.window, algorithm=algorithm)
        return await limiter.peek(plan.key, plan.limit, plan.window, algorithm=algorithm)
    except SchemaError:
        raise
    except StorageError:
        return None


def usage(
    plan: Plan, decision: Decision | None, *, increment: bool, now: float
) -> dict[str, Any] | None:
    """django-ratelimit's usage dict for a decision (None: not limited, the store failed
    and ``RATELIMIT_FAIL_OPEN`` is set)."""
    if decision is None:
        if getattr(settings, "RATELIMIT_FAIL_OPEN", False):
            return None
        return {"count": 0, "limit": 0, "should_limit": True, "time_left": -1}
    limited = not decision.allowed if increment else decision.count > decision.limit
    return {
        "count": decision.count,
        "limit": plan.limit,
        "should_limit": limited,
        "time_left": decision.reset_at - int(now),
        "decision": decision,
    }


def get_usage(
    request: Any, group: str | None = None, fn: Any = None, key: object = None,
    rate: object = None, method: object = ALL, increment: bool = False,
) -> dict[str, Any] | None:  # fmt: skip
    """django-ratelimit's ``get_usage``: the count of `request`'s counter under `rate`.

    A dict with ``count``, ``limit``, ``should_limit`` and ``time_left``
    (seconds to the window's end), plus ``decision`` (quota's `Decision`);
    None when nothing limits the request. With `increment` this request is
    counted. Raises ``ImproperlyConfigured`` for a bad key, rate or neither
    `group` nor `fn`.
    """
    planned = plan(request, group, fn, key, rate, method)
    if planned is None:
        return None
    decision = count_sync(planned, increment=increment)
    return usage(planned, decision, increment=increment, now=get_limiter().options.app_clock())


def is_ratelimited(
    request: Any, group: str | None = None, fn: Any = None, key: object = None,
    rate: object = None, method: object = ALL, increment: bool = False,
) -> bool:  # fmt: skip
    """django-ratelimit's ``is_ratelimited``: True when `request` is over `rate`."""
    found = get_usage(request, group, fn, key, rate, method, increment)
    return bool(found and found["should_limit"])


is_ratelimited.ALL = ALL  # type: ignore[attr-defined]
is_ratelimited.UNSAFE = UNSAFE  # type: ignore[attr-defined]
get_usage.ALL = ALL  # type: ignore[attr-defined]
get_usage.UNSAFE = UNSAFE  # type: ignore[attr-defined]
