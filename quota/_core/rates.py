"""Policies a person writes down: rate strings, and how several rates combine.

``parse_rates("100/minute;1000/day")`` → two `Rate` objects;
``"10/second"``, ``"10 per second"``, ``"100/5 minutes"`` and
``"100/s burst 200"`` (a token bucket of capacity 200 refilling 100 per
second) all parse. Errors name the part that is wrong.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from quota._core.algorithms import (
    ALGORITHMS,
    FIXED_WINDOW,
    GCRA,
    TOKEN_BUCKET,
    Rate,
    check_algorithm,
)
from quota._core.decision import Decision
from quota._core.errors import ConfigurationError
from quota._core.parsing import parse_whole

_UNITS = {
    **dict.fromkeys(("s", "sec", "secs", "second", "seconds"), 1),
    **dict.fromkeys(("m", "min", "mins", "minute", "minutes"), 60),
    **dict.fromkeys(("h", "hr", "hrs", "hour", "hours"), 3600),
    **dict.fromkeys(("d", "day", "days"), 86400),
    **dict.fromkeys(("w", "wk", "week", "weeks"), 604800),
}
_RATE = re.compile(
    r"^\s*(?P<limit>\S+?)\s*(?:/|\s+per\s+)\s*(?P<count>[0-9]+\s*|[^\sA-Za-z]\S*?\s+)?(?P<unit>[A-Za-z]+)"
    r"(?:\s+burst\s+(?P<burst>\S+))?\s*$",
    re.ASCII,
)


def _whole(part: str, what: str, text: str) -> int:
    number = parse_whole(part)
    if number is None or number < 1:
        raise ConfigurationError(
            f"{what} {part!r} in rate {text!r} must be a positive whole number (ASCII digits)"
        )
    return number


def parse_rate(text: str, *, algorithm: str | None = None) -> Rate:
    """One rate such as ``"10/second"`` or ``"100/s burst 200"``; see `parse_rates`."""
    match = _RATE.match(text)
    if match is None:
        raise ConfigurationError(
            f"rate {text!r} is not of the form '<limit>/<unit>', '<limit> per <n> <unit>'"
            " or '<limit>/<unit> burst <n>' (e.g. '10/second', '100/5 minutes', '100/s burst 200')"
        )
    limit = _whole(match["limit"], "limit", text)
    unit = match["unit"].lower()
    if unit not in _UNITS:
        raise ConfigurationError(
            f"unknown unit {match['unit']!r} in rate {text!r}; use second, minute, hour, day or week"
        )
    count = _whole(match["count"].strip(), "window count", text) if match["count"] else 1
    burst = _whole(match["burst"], "burst", text) if match["burst"] else None
    if algorithm is None:
        algorithm = TOKEN_BUCKET if burst is not None else FIXED_WINDOW
    check_algorithm(algorithm)
    if burst is not None and algorithm not in (TOKEN_BUCKET, GCRA):
        raise ConfigurationError(
            f"rate {text!r} has a burst, which only token_bucket and gcra use, but algorithm is {algorithm!r}"
        )
    try:
        return Rate(limit=limit, window=count * _UNITS[unit], algorithm=algorithm, burst=burst)
    except ConfigurationError as exc:
        raise ConfigurationError(f"rate {text!r}: {exc}") from None


def parse_rates(text: str, *, algorithm: str | None = None) -> list[Rate]:
    """Rates separated by ``;`` (or ``,``), e.g. ``"100/minute;1000/day"``.

    `algorithm` applies to every rate; without it a rate with a burst is a
    token bucket and the others are fixed windows. Raises
    `ConfigurationError` naming the part that is wrong.
    """
    if not isinstance(text, str) or not text.strip():
        raise ConfigurationError(f"rates must be a non-empty string like '10/second', got {text!r}")
    parts = re.split(r"[;,]", text)
    rates = []
    for number, part in enumerate(parts, 1):
        if not part.strip():
            raise ConfigurationError(f"rate {number} of {text!r} is empty (a stray ';' or ',')")
        rates.append(parse_rate(part.strip(), algorithm=algorithm))
    return rates


def as_rates(rates: Rate | str | Iterable[Rate]) -> list[Rate]:
    """`rates` as a non-empty list: a `Rate`, a rate string, or several `Rate` objects.

    Raises `ConfigurationError` naming ``rates`` for anything else (None, a
    number, bytes, an empty list, a list holding something not a `Rate`).
    """
    if isinstance(rates, Rate):
        return [rates]
    if isinstance(rates, str):
        return parse_rates(rates)
    out = (
        list(rates)
        if isinstance(rates, Iterable) and not isinstance(rates, (bytes, bytearray, memoryview))
        else []
    )
    if not out or not all(isinstance(rate, Rate) for rate in out):
        raise ConfigurationError(
            f"rates must be a Rate, a rate string or Rate objects, got {rates!r}"
            f" ({type(rates).__name__}); algorithms: {', '.join(ALGORITHMS)}"
        )
    return out


def most_restrictive(decisions: Sequence[Decision]) -> Decision:
    """The decision to act on when several rates apply to one request.

    A denial wins over any allowance, the longest wait among denials; among
    allowances, the one with the fewest hits remaining.
    """
    denied = [d for d in decisions if not d.allowed]
    if denied:
        return max(denied, key=lambda d: d.retry_after)
    return min(decisions, key=lambda d: d.remaining)
