"""What a third-party API's response says about slowing down: `provider_pause`.

An outbound HTTP client that shares one provider (a paid API, a partner's
service) among many processes can learn from each response how long to hold
off, and pause that provider's key in a shared store so that no process sends
a request that is bound to be refused. `provider_pause` reads the response's
status and headers and answers that number of seconds, or None when the
response says nothing usable. It does no I/O and imports no HTTP library: any
headers object with a case-insensitive ``get`` (``httpx.Headers``,
``requests``' ``CaseInsensitiveDict``, ``aiohttp``'s ``CIMultiDictProxy``) will do.

What it reads:

* ``Retry-After`` on a 429 or 503: delta-seconds (``"120"``, ``"1.5"``) or an
  HTTP date. A valid one decides alone, even when it says to retry now (zero,
  or a date already past: None). One that does not parse, or is negative, is
  logged as a warning on the ``quota`` logger and ignored.
* On any status, 200 included, a provider saying that nothing is left until a
  reset:

  - ``RateLimit: "default";r=0;t=30`` (the IETF draft's structured field; with
    several items, the longest ``t`` among those with ``r=0``), and the older
    draft's ``RateLimit: limit=100, remaining=0, reset=30``;
  - ``RateLimit-Remaining: 0`` with ``RateLimit-Reset`` (seconds);
  - ``X-RateLimit-Remaining: 0`` with ``X-RateLimit-Reset`` (epoch seconds
    when above 10**9, seconds from now otherwise) or ``X-RateLimit-Reset-After``
    (seconds);
  - OpenAI's ``x-ratelimit-remaining-requests``/``-tokens`` at 0 with
    ``x-ratelimit-reset-requests``/``-tokens`` (Go durations: ``"1s"``,
    ``"6m0s"``, ``"20ms"``).

  The longest pause any of them asks for wins. Values that do not parse are
  ignored quietly (providers send all sorts), and none raises.

A pause is never longer than `max_pause`: a longer one is cut to it, with a
warning, so that a wrong header cannot stop traffic for a day.
"""

from __future__ import annotations

import logging
import math
import re
import time
from datetime import timezone
from email.utils import parsedate_to_datetime
from typing import Protocol

from quota._core.errors import ConfigurationError

__all__ = ["IDEMPOTENT", "Headers", "provider_pause"]

#: Methods that are safe to send again: a retry after a pause repeats no side effect.
IDEMPOTENT = frozenset({"GET", "HEAD", "OPTIONS", "PUT", "DELETE"})

log = logging.getLogger("quota")

#: Header values longer than this are not read (a provider's are a few dozen bytes).
_MAX_LEN = 4096
_NUMBER = re.compile(r"[0-9]+(?:\.[0-9]+)?")
#: Go's duration units (``µs`` in both spellings); two letters before one, for the regex.
_UNITS = {
    "ns": 1e-9,
    "us": 1e-6,
    "\u00b5s": 1e-6,
    "\u03bcs": 1e-6,
    "ms": 1e-3,
    "h": 3600.0,
    "m": 60.0,
    "s": 1.0,
}
_DURATION_PART = f"([0-9]+(?:\\.[0-9]+)?)({'|'.join(_UNITS)})"
_DURATION = re.compile(f"(?:{_DURATION_PART})+")
#: Above this, an ``X-RateLimit-Reset`` is a Unix time (10**9 seconds is 2001).
_EPOCH = 1e9
_OPENAI = ("requests", "tokens")


class Headers(Protocol):
    """Response headers: ``get`` finds a header whatever the case of its name."""

    def get(self, name: str, /) -> str | None: ...


def provider_pause(
    status: int, headers: Headers, *, max_pause: float, now: float | None = None
) -> float | None:
    """Seconds to hold off sending to this provider, per this response; None when it says nothing usable.

    `status` and `headers` are the response's; `now` is the current Unix time
    (`time.time()` when None), against which HTTP dates and Unix-time resets
    are read. The answer is None or a float in ``(0, max_pause]``.

    Raises `ConfigurationError` when `max_pause` is not a finite number of
    seconds above 0.
    """
    if (
        isinstance(max_pause, bool)
        or not isinstance(max_pause, (int, float))
        or not 0 < max_pause < math.inf
    ):
        raise ConfigurationError(
            f"max_pause must be a positive number of seconds, got {max_pause!r}"
        )
    if now is None:
        now = time.time()
    if status in (429, 503):
        value = headers.get("Retry-After")
        if isinstance(value, str):
            seconds = _retry_after(value, now)
            if seconds is not None:
                return _capped(seconds, max_pause, "Retry-After", value)
            log.warning(
                "ignoring the provider's Retry-After %s: not a number of seconds or an HTTP date",
                _shown(value),
            )
    found = [pause for pause in _reset_pauses(headers, now) if pause[0] > 0]
    if not found:
        return None
    seconds, name, value = max(found, key=lambda pause: pause[0])
    return _capped(seconds, max_pause, name, value)


def _capped(seconds: float, max_pause: float, name: str, value: str) -> float | None:
    if not seconds > 0:  # also NaN
        log.debug("the provider's %s %s asks for no pause", name, _shown(value))
        return None
    if seconds > max_pause:
        log.warning(
            "the provider's %s %s asks for a pause of %.0f s; pausing max_pause=%s s instead",
            name, _shown(value), seconds, max_pause,
        )  # fmt: skip
        return float(max_pause)
    return float(seconds)


def _shown(value: str) -> str:
    """`value` as a log shows it: repr'd, and cut after 100 characters."""
    return repr(value[:100] + "…") if len(value) > 100 else repr(value)


def _get(headers: Headers, name: str) -> str | None:
    value = headers.get(name)
    return value if isinstance(value, str) and len(value) <= _MAX_LEN else None


def _number(value: str | None) -> float | None:
    """A non-negative decimal number (``"30"``, ``"1.5"``); None for anything else."""
    if value is None or len(value) > _MAX_LEN:
        return None
    value = value.strip()
    return float(value) if _NUMBER.fullmatch(value) else None


def _retry_after(value: str, now: float) -> float | None:
    """Seconds `value` asks to wait (0 or less for now, or a date past); None when it does not parse."""
    seconds = _number(value)
    if seconds is not None or len(value) > _MAX_LEN:
        return seconds
    try:
        when = parsedate_to_datetime(value.strip())
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when.tzinfo is None:  # "-0000": UTC, says RFC 5322
        when = when.replace(tzinfo=timezone.utc)
    return when.timestamp() - now


def _duration(value: str | None) -> float | None:
    """A Go duration (``"1h2m3.5s"``, ``"20ms"``) in seconds; None when it is not one."""
    if value is None:
        return None
    value = value.strip()
    if value == "0":
        return 0.0
    if not _DURATION.fullmatch(value):
        return None
    return sum(float(n) * _UNITS[unit] for n, unit in re.findall(_DURATION_PART, value))


def _reset_pauses(headers: Headers, now: float) -> list[tuple[float, str, str]]:
    """(seconds, header, its value) for each source saying nothing is left until a reset."""
    pauses: list[tuple[float | None, str, str | None]] = []
    value = _get(headers, "RateLimit")
    if value is not None:
        pauses.append((_ratelimit_field(value), "RateLimit", value))
    if _number(_get(headers, "RateLimit-Remaining")) == 0:
        value = _get(headers, "RateLimit-Reset")
        pauses.append((_number(value), "RateLimit-Reset", value))
    if _number(_get(headers, "X-RateLimit-Remaining")) == 0:
        value = _get(headers, "X-RateLimit-Reset")
        reset = _number(value)
        if reset is not None and reset > _EPOCH:
            reset -= now
        pauses.append((reset, "X-RateLimit-Reset", value))
        value = _get(headers, "X-RateLimit-Reset-After")
        pauses.append((_number(value), "X-RateLimit-Reset-After", value))
    for kind in _OPENAI:
        if _number(_get(headers, f"x-ratelimit-remaining-{kind}")) == 0:
            value = _get(headers, f"x-ratelimit-reset-{kind}")
            pauses.append((_duration(value), f"x-ratelimit-reset-{kind}", value))
    return [(s, name, v) for s, name, v in pauses if s is not None and v is not None]


def _ratelimit_field(value: str) -> float | None:
    """The longest reset among the items of a ``RateLimit`` field with nothing remaining.

    Reads the structured list (``"day";r=0;t=3600, "min";r=5;t=10``) and the
    older dictionary (``limit=100, remaining=0, reset=30``).
    """
    longest: float | None = None
    older: dict[str, str] = {}
    for member in _members(value):
        params = {}
        for part in member:
            key, eq, val = part.partition("=")
            if eq:
                params[key.strip().lower()] = val.strip()
        if "r" in params or "t" in params:
            reset = _number(params.get("t"))
            if _number(params.get("r")) == 0 and reset is not None:
                longest = reset if longest is None else max(longest, reset)
        else:
            older.update(params)
    if _number(older.get("remaining")) == 0:
        reset = _number(older.get("reset"))
        if reset is not None and (longest is None or reset > longest):
            longest = reset
    return longest


def _members(value: str) -> list[list[str]]:
    """`value` split on commas into members, each split on semicolons; quoted strings kept whole."""
    members: list[list[str]] = []
    parts: list[str] = []
    start = 0
    quoted = escaped = False
    for i, ch in enumerate(value):
        if quoted:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                quoted = False
        elif ch == '"':
            quoted = True
        elif ch in ",;":
            parts.append(value[start:i].strip())
            start = i + 1
            if ch == ",":
                members.append(parts)
                parts = []
    parts.append(value[start:].strip())
    members.append(parts)
    return members
