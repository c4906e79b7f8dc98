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
from django.core.signals import setting_changed
from django.utils.module_loading import import_string

from quota._core.algorithms import FIXED_WINDOW
from quota._core.decision import Decision
from quota._core.errors import SchemaError, StorageError
from quota._limiter import Limiter
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

#: The ``RATELIMIT_*`` settings read on every request, as last read; emptied when one
#: changes (``override_settings``, pytest-django's ``settings``).
_settings_read: dict[str, object] = {}
#: Parsed text rates, and client addresses' counted values by (address, mask).
_rates: dict[str, tuple[int, int]] = {}
_networks: dict[tuple[str, object], str] = {}
_CACHED = 4096


def _setting(name: str, default: object) -> object:
    try:
        return _settings_read[name]
    except KeyError:
        value = _settings_read[name] = getattr(settings, name, default)
        return value


def _setting_changed(*, setting: str, **_kwargs: Any) -> None:
    if setting.startswith("RATELIMIT_"):
        _settings_read.clear()
        _networks.clear()


setting_changed.connect(_setting_changed, dispatch_uid="quota.contrib.django.core")


def split_rate(rate: Rate) -> tuple[int, int]:
    """``"5/m"`` → ``(5, 60)``; ``"100/5m"`` → ``(100, 300)``; a ``(count, seconds)`` tuple as is.

    The units are ``s``, ``m``, ``h`` and ``d`` (``second``, ``minute``, ``hour``
    and ``day`` too); a rate without a unit counts per second, as in
    django-ratelimit. Anything else is `ImproperlyConfigured`.
    """
    if type(rate) is str:
        found = _rates.get(rate)
        if found is not None:
            return found
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
    if type(rate) is str:
        if len(_rates) >= _CACHED:
            _rates.clear()
        _rates[rate] = (count, seconds)
    return count, seconds


def _get_ip(request: Any) -> str:
    ip_meta = _setting("RATELIMIT_IP_META_KEY", None)
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
    v6 = ":" in ip
    mask = _setting("RATELIMIT_IPV6_MASK", 64) if v6 else _setting("RATELIMIT_IPV4_MASK", 32)
    cached = type(ip) is str and type(mask) is int
    found = _networks.get((ip, mask)) if cached else None
    if found is not None:
        return found
    try:
        network = ipaddress.ip_network(f"{ip.strip()}/{mask}", strict=False)
    except ValueError as exc:
        raise ImproperlyConfigured(
            f"ratelimit: {ip!r} is not an IP address (several addresses from a proxy header?"
            " give RATELIMIT_IP_META_KEY a callable that picks the client's)"
        ) from exc
    found = str(network.network_address)
    if cached:
        if len(_networks) >= _CACHED:
            _networks.clear()
        _networks[(ip, mask)] = found
    return found


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
    return Planner(group, fn, key, rate, method)(request, user)


class Planner:
    """`plan` for one set of arguments (a decorated view's), the request-independent
    parts worked out once: the group, the method filter, a fixed rate and the counter's
    prefix. Errors (a bad key or rate) are still raised when a request is planned."""

    __slots__ = ("_fn", "_group", "_header", "_key", "_method", "_methods", "_prefix", "_rate")

    def __init__(self, group: str | None, fn: Any, key: object, rate: object, method: object):
        self._group, self._fn, self._key, self._rate, self._method = group, fn, key, rate, method
        #: None: every method; else the methods counted (upper case).
        self._methods: frozenset[str] | None = None
        if not (method == ALL or method is ALL):
            methods = method if isinstance(method, (list, tuple)) else [method]
            self._methods = frozenset(str(m).upper() for m in methods)
        #: The ``META`` name of a ``header:<name>`` key.
        self._header: str | None = None
        if isinstance(key, str) and key.startswith("header:"):
            self._header = "HTTP_" + key[7:].replace("-", "_").upper()
        #: (limit, window, counter prefix) of a fixed rate, once parsed.
        self._prefix: tuple[int, int, str] | None = None

    def __call__(self, request: Any, user: Any = None) -> Plan | None:
        if not _setting("RATELIMIT_ENABLE", True):
            return None
        if self._methods is not None and request.method not in self._methods:
            return None
        group = self._group
        if group is None:
            group = self._group = group_of(self._fn)
        fixed = self._prefix
        if fixed is None:
            rate = self._rate
            dynamic = callable(rate) or (isinstance(rate, str) and "." in rate)
            if callable(rate):
                rate = rate(group, request)
            elif isinstance(rate, str) and "." in rate:
                rate = import_string(rate)(group, request)
            if rate is None:
                return None
            limit, window = split_rate(rate)  # type: ignore[arg-type]
            methods = _methods_part(self._method)
            prefix = f"django:{group}:{limit}/{window}s{':' + methods if methods else ''}:"
            if not dynamic:
                self._prefix = (limit, window, prefix)
        else:
            limit, window, prefix = fixed
        if self._header is not None:
            value, hashed = str(request.META.get(self._header, "")), True
        else:
            value, hashed = _key_value(request, group, self._key, user)
        if hashed:
            value = "#" + hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()[:32]
        return Plan(group, prefix + value, limit, window)


def _closed(plan: Plan, now: float) -> Decision:
    """The decision of a ``0/…`` rate: every request is over it, nothing counted."""
    reset_at = (int(now) // plan.window + 1) * plan.window
    return Decision(
        False, plan.key, 0, 0, 0, plan.window, reset_at, max(1, math.ceil(reset_at - now))
    )


def count_sync(plan: Plan, *, increment: bool, algorithm: str = FIXED_WINDOW) -> Decision | None:
    """Count (or only read) `plan`'s counter with the sync limiter; None if the store failed."""
    return count_with(get_limiter(), plan, increment=increment, algorithm=algorithm)


def count_with(
    limiter: Limiter, plan: Plan, *, increment: bool, algorithm: str = FIXED_WINDOW
) -> Decision | None:
    """`count_sync` with `limiter` (the sync limiter, already at hand)."""
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
    to count and ``RATELIMIT_FAIL_OPEN`` is set).

    As in django-ratelimit, only a failed count is limited: a check that counts
    nothing (`increment` False) and cannot read the store reads a count of 0.
    """
    if decision is None and not increment:
        reset_at = (int(now) // plan.window + 1) * plan.window
        return {"count": 0, "limit": plan.limit, "should_limit": False,
                "time_left": reset_at - int(now), "decision": None}  # fmt: skip
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
    counted; without it a store that fails reads a count of 0 (``decision``
    None), not limited, as in django-ratelimit. Raises ``ImproperlyConfigured`` for a bad key, rate or neither
    `group` nor `fn`.
    """
    planned = plan(request, group, fn, key, rate, method)
    if planned is None:
        return None
    limiter = get_limiter()
    decision = count_with(limiter, planned, increment=increment)
    return usage(planned, decision, increment=increment, now=limiter.options.app_clock())


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
