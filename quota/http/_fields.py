"""What the HTTP configuration's fields may hold: their choices, bounds, defaults and checks.

Shared by `HttpConfig` (`quota.http._config`), the route classes
(`quota.http._routes`) and the environment reader (`quota.http._env`), so
that a value is refused with the same words wherever it comes from. A check
takes the name to show (a field, or ``$VARIABLE``) and the value, and returns
the value to keep or raises `ConfigurationError` naming both.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Mapping
from typing import Any, cast

from quota._core.errors import ConfigurationError
from quota.http._identity import ANON, AUTH, TRUSTED

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
HEADER_STYLES = ("both", "legacy", "ietf", "none")
PROBLEM_TYPES = ("quota-exceeded", "about:blank")

#: Tier multipliers when none are configured (``anon`` is the floor).
DEFAULT_TIER_MULTIPLIERS: Mapping[str, float] = {
    ANON: 1.0, AUTH: 5.0, TRUSTED: 10.0, "staff": 2.0, "admin": 10.0,
}  # fmt: skip
#: Plan scales by default; an unknown plan or a cache miss is 1x.
DEFAULT_PLAN_SCALES: Mapping[str, float] = {"enterprise": 3.0, "pro": 1.5, "free": 1.0}
#: Under pressure (at or above the threshold) these tiers keep this share of capacity.
DEFAULT_PRESSURE_FACTORS: Mapping[str, float] = {"staff": 0.85, AUTH: 0.7, ANON: 0.55}
#: Tiers pressure never lowers.
DEFAULT_PRESSURE_EXEMPT = frozenset({"admin", TRUSTED})

#: A route class's name or the key prefix: they appear in keys, metrics and headers.
NAME = re.compile(r"^[A-Za-z0-9_.-]{1,40}$")

Check = Callable[[str, Any], Any]
"""A check of one value: ``check(name, value)`` returns the value to keep."""


def check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ConfigurationError(f"{name} must be a bool, got {value!r}")
    return value


def whole(low: int, high: int, bounds: str) -> Check:
    """A check of an `int` (not a bool) in ``low..high``; `bounds` is how the message says it."""

    def check(name: str, value: object) -> int:
        if type(value) is not int or not low <= value <= high:
            raise ConfigurationError(f"{name} must be {bounds}, got {value!r}")
        return value

    return check


def number(
    low: float, high: float, bounds: str, *, above: bool = False, optional: bool = False
) -> Check:
    """A check of an `int` or `float` (not a bool) in ``low..high`` (above `low` when `above`).

    `optional` lets None through. NaN is refused: it fails every comparison.
    """

    def check(name: str, value: object) -> float | None:
        if value is None and optional:
            return None
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not (low < value if above else low <= value)
            or not value <= high
        ):
            raise ConfigurationError(f"{name} must be {bounds}, got {value!r}")
        return value

    return check


def choice(options: Collection[str]) -> Check:
    """A check that the value is one of `options`."""

    def check(name: str, value: object) -> str:
        if value not in options:
            raise ConfigurationError(f"{name} must be one of {', '.join(options)}, got {value!r}")
        return cast(str, value)

    return check


def check_name(name: str, value: object) -> str:
    """`value` if it is 1-40 of ``[A-Za-z0-9_.-]``."""
    if not isinstance(value, str) or not NAME.match(value):
        raise ConfigurationError(f"{name} must be 1-40 of [A-Za-z0-9_.-], got {value!r}")
    return value


def utf8(name: str, text: str) -> bytes:
    """`text` (a secret) as UTF-8; `ConfigurationError` naming `name` for lone surrogates."""
    try:
        return text.encode()
    except UnicodeEncodeError:
        raise ConfigurationError(
            f"{name} must be text that encodes as UTF-8 (it holds a lone surrogate,"
            " as os.environ makes of bytes that are not UTF-8)"
        ) from None
