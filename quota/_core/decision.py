"""The decision core: pure functions, no I/O.

Everything a limiter decides that is not a database round trip lives here:
argument validation, window arithmetic, the stored key, the allow/deny rule
and the HTTP header values. Stores only run SQL and hand numbers back; the
sync and async limiters are thin drivers around these functions.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import math
import re
from dataclasses import dataclass

from quota._core.errors import ConfigurationError

#: The longest window accepted, in seconds (366 days). Longer periods are
#: durable quotas, not rate windows.
MAX_WINDOW = 366 * 24 * 3600
#: The largest limit accepted; counters are 64-bit integers in every store.
MAX_LIMIT = 2**62
#: Caller keys longer than this (in UTF-8 bytes) are stored as a digest.
MAX_RAW_KEY_BYTES = 200
#: The latest time a clock may report, in epoch seconds (the year 5138): every
#: window start, period bound and expiry computed from it fits a 64-bit column
#: and Python's calendar.
MAX_NOW = 10**11
#: The longest duration `parse_duration` accepts: 100 years of 366 days.
MAX_DURATION = 100 * 366 * 86400


def check_int(name: str, value: object, *, maximum: int) -> int:
    """Return `value` if it is an int in ``1..maximum``; raise `ConfigurationError` naming `name`."""
    # bool is an int subclass; True as a limit is always a mistake.
    if type(value) is not int:
        raise ConfigurationError(
            f"{name} must be a positive integer, got {value!r} ({type(value).__name__})"
        )
    if not 1 <= value <= maximum:
        raise ConfigurationError(f"{name} must be between 1 and {maximum}, got {value!r}")
    return value


#: A length of time as the public API takes it: whole seconds, a duration string the
#: command line takes (``"30m"``), or a `datetime.timedelta` (see `check_seconds`).
Duration = int | str | dt.timedelta


def check_seconds(name: str, value: object, *, maximum: int) -> int:
    """`value` as whole seconds in ``1..maximum``; raise `ConfigurationError` naming `name`.

    The public API takes a window, period or interval in any of the forms the
    command line takes: an int of seconds, a duration string (``"90"``,
    ``"45s"``, ``"30m"``, ``"12h"``, ``"400d"``, ``"2w"``: `parse_duration`) or a
    `datetime.timedelta` of whole seconds.
    """
    if type(value) is int:
        seconds = value
    elif isinstance(value, str):
        seconds = parse_duration(name, value)
    elif isinstance(value, dt.timedelta):
        whole, rest = divmod(value, dt.timedelta(seconds=1))
        if rest:
            raise ConfigurationError(f"{name} must be whole seconds, got {value!r}")
        seconds = whole
    else:
        raise ConfigurationError(
            f"{name} must be whole seconds (an int), a duration like '30m' or a"
            f" datetime.timedelta, got {value!r} ({type(value).__name__})"
        )
    if not 1 <= seconds <= maximum:
        raise ConfigurationError(f"{name} must be between 1 and {maximum} seconds, got {value!r}")
    return seconds


def check_span(name: str, value: object, *, maximum: float = MAX_DURATION) -> float:
    """`value` as seconds in ``(0, maximum]``, fractions allowed (a time to live, say).

    Takes what `check_seconds` takes, and a finite float. Raises
    `ConfigurationError` naming `name` and the value.
    """
    if isinstance(value, str):
        seconds: float = parse_duration(name, value)
    elif isinstance(value, dt.timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = value
    else:
        raise ConfigurationError(
            f"{name} must be seconds (a number), a duration like '5m' or a datetime.timedelta,"
            f" got {value!r} ({type(value).__name__})"
        )
    if not 0 < seconds <= maximum:  # NaN fails too
        raise ConfigurationError(
            f"{name} must be above 0 and at most {maximum:g} seconds, got {value!r}"
        )
    return float(seconds)


def check_now(now: object) -> float:
    """`now`, the time a clock reported, if it is finite epoch seconds in ``0..MAX_NOW``.

    Raises `ConfigurationError` naming the clock and what it returned: NaN,
    an infinity, a string or None from a clock would otherwise fail deep in
    the window arithmetic, or be written into a row.
    """
    if isinstance(now, bool) or not isinstance(now, (int, float)) or not 0 <= now <= MAX_NOW:
        raise ConfigurationError(
            f"clock must return epoch seconds, a finite number between 0 and {MAX_NOW};"
            f" it returned {now!r} ({type(now).__name__})"
        )
    return now


def stored_key(key: object) -> str:
    """The form of a caller's key kept in the database.

    Short, plain keys are kept readable (``k:`` + key). Keys that are long,
    hold a NUL byte (PostgreSQL text cannot) or are not valid UTF-8 (lone
    surrogates) are kept as ``h:`` + SHA-256 hex, so nothing a caller passes
    can break the table or its index. The two prefixes keep the mapping
    one-to-one.

    Raises `ConfigurationError` for a non-string or empty key.
    """
    if type(key) is not str:
        if isinstance(key, str):
            key = str(key)
        else:
            raise ConfigurationError(f"key must be a str, got {key!r} ({type(key).__name__})")
    if not key:
        raise ConfigurationError("key must be a non-empty string, got ''")
    if len(key) <= MAX_RAW_KEY_BYTES // 4 and "\x00" not in key and key.isascii():
        return "k:" + key  # the common case, decided without encoding
    raw = key.encode("utf-8", "surrogatepass")
    if len(raw) <= MAX_RAW_KEY_BYTES and "\x00" not in key:
        try:
            key.encode("utf-8")
        except UnicodeEncodeError:
            pass
        else:
            return "k:" + key
    return "h:" + hashlib.sha256(raw).hexdigest()


def display_key(stored: str) -> str:
    """The caller's key as stored, for listings (digests stay digests)."""
    return stored[2:] if stored.startswith("k:") else stored


#: The longest key `hit_params` keeps as it is without encoding it (4 bytes a character at most).
_MAX_PLAIN_KEY = MAX_RAW_KEY_BYTES // 4
#: Plain keys seen lately and their stored form: a lookup costs less than checking a key again.
_plain_keys: dict[str, str] = {}
#: Entries `_plain_keys` holds at most (about a megabyte); then it starts afresh.
_PLAIN_KEYS_KEPT = 10_000


def _plain_key(key: object) -> str:
    """`stored_key(key)`, remembered in `_plain_keys` when the key is kept as it is."""
    if type(key) is str and key.isascii() and 0 < len(key) <= _MAX_PLAIN_KEY and "\x00" not in key:
        if len(_plain_keys) >= _PLAIN_KEYS_KEPT:
            _plain_keys.clear()
        skey = _plain_keys[key] = "k:" + key
        return skey
    return stored_key(key)


def hit_params(
    key: object, limit: object, window: object, now: float, cost: int = 1
) -> tuple[str, str, int, int, int, float]:
    """Validate a call and place it in its epoch-aligned window.

    Returns the parameters of the hit statement: ``(bucket_key, stored_key,
    window_start, window, cost, now)``. The bucket key is built from window
    length, window start and stored key, so every window of every key is
    its own row. Raises `ConfigurationError` naming the bad argument and value.

    This runs on every decision, so the common case is checked inline.
    """
    try:
        skey = _plain_keys[key]  # type: ignore[index]
    except (KeyError, TypeError):  # not seen lately, or no str at all
        skey = _plain_key(key)
    if limit.__class__ is not int or not 0 < limit <= MAX_LIMIT:
        check_int("limit", limit, maximum=MAX_LIMIT)
    if window.__class__ is not int or not 0 < window <= MAX_WINDOW:
        window = check_int("window", window, maximum=MAX_WINDOW)
    if now.__class__ is not float or not 0.0 <= now <= MAX_NOW:  # NaN fails the range test
        check_now(now)
    start = int(now)
    start -= start % window
    return f"{window}:{start}:{skey}", skey, start, window, cost, now


@dataclass(frozen=True)
class Decision:
    """The outcome of one rate-limit check."""

    allowed: bool
    """True when the request may proceed."""
    key: str
    """The caller's key, as passed in."""
    limit: int
    """Requests allowed per window."""
    remaining: int
    """Requests left in this window after this one; never negative."""
    count: int
    """Hits counted in this window so far, this one included when it was counted."""
    window: int
    """Window length in seconds."""
    reset_at: int
    """Epoch second at which the current window ends and the count starts again."""
    retry_after: int
    """Whole seconds to wait before retrying: at least 1 when denied, 0 when allowed."""
    retry_after_exact: float = 0.0
    """Seconds until the same hit could pass, not rounded: the moment the window
    resets, or the bucket has refilled enough, less the time of the decision.
    0.0 when allowed. `Limiter.acquire` sleeps this long (``retry_after`` is it
    rounded up to a whole second, at least 1)."""

    def headers(self) -> dict[str, str]:
        """The response headers an HTTP app sends with this decision.

        ``X-RateLimit-Limit``, ``X-RateLimit-Remaining``, ``X-RateLimit-Reset``
        (epoch seconds), and ``Retry-After`` on a denial.
        """
        headers = {
            "X-RateLimit-Limit": str(self.limit),
            "X-RateLimit-Remaining": str(self.remaining),
            "X-RateLimit-Reset": str(self.reset_at),
        }
        if not self.allowed:
            headers["Retry-After"] = str(self.retry_after)
        return headers


_new = object.__new__
_set = object.__setattr__
#: The fields of an allowed decision, copied per decision (`decide`).
_allowed_fields = {
    "allowed": True, "key": "", "limit": 0, "remaining": 0, "count": 0, "window": 0,
    "reset_at": 0, "retry_after": 0, "retry_after_exact": 0.0,
}.copy  # fmt: skip


def _decision(
    allowed: bool, key: str, limit: int, remaining: int, count: int, window: int,
    reset_at: int, retry_after: int, retry_after_exact: float = 0.0,
) -> Decision:  # fmt: skip
    """`Decision(...)`, built three times faster than the frozen ``__init__``.

    A decision is made per request; the generated frozen ``__init__`` sets
    each field through ``object.__setattr__`` one by one, which costs more
    than the rest of the decision core together. Setting ``__dict__`` once
    gives an identical instance.
    """
    decision = _new(Decision)
    _set(decision, "__dict__", {
        "allowed": allowed, "key": key, "limit": limit, "remaining": remaining, "count": count,
        "window": window, "reset_at": reset_at, "retry_after": retry_after,
        "retry_after_exact": retry_after_exact,
    })  # fmt: skip
    return decision


def retry_after(reset_at: int, now: float) -> int:
    """Whole seconds from `now` until `reset_at`, at least 1."""
    return max(1, math.ceil(reset_at - now))


def decide(
    key: str, limit: int, window: int, window_start: int, now: float, count: int | None
) -> Decision:
    """The decision for a hit, given the window's count after the increment.

    `count` is None when the store declined to count a hit that would have
    gone over the limit (``count_denied=False``): the window is full, and its
    count is reported as the limit.
    """
    reset_at = window_start + window
    if count is not None and count <= limit:
        # `_decision` inline: an allowed hit is the common case of every request.
        # Copying a template and setting the six fields that vary costs less than
        # building a dict of nine.
        fields = _allowed_fields()
        fields["key"] = key
        fields["limit"] = limit
        fields["remaining"] = limit - count
        fields["count"] = count
        fields["window"] = window
        fields["reset_at"] = reset_at
        decision = _new(Decision)
        _set(decision, "__dict__", fields)
        return decision
    return _decision(
        False, key, limit, 0, limit if count is None else count, window, reset_at,
        retry_after(reset_at, now), reset_at - now,
    )  # fmt: skip


def decide_uncounted(
    key: str, limit: int, window: int, window_start: int, now: float, stored: int
) -> Decision:
    """A denial that was not counted (``count_denied=False``), with the count the window holds."""
    reset_at = window_start + window
    remaining = max(0, limit - stored)
    return _decision(
        False, key, limit, remaining, stored, window, reset_at, retry_after(reset_at, now),
        reset_at - now,
    )  # fmt: skip


def peek_decision(
    key: str, limit: int, window: int, window_start: int, now: float, count: int
) -> Decision:
    """The state of a window without a hit: `allowed` says whether one more would pass."""
    if count < limit:
        return _decision(True, key, limit, limit - count, count, window, window_start + window, 0)
    return decide_uncounted(key, limit, window, window_start, now, count)


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
#: ASCII digits only (``str.isdigit`` takes ``'²'`` and ``'\u0661\u0660'``), few enough for `int`.
_DURATION = re.compile(r"([0-9]{1,12})([smhdw]?)")


def parse_duration(name: str, text: str) -> int:
    """Whole seconds from ``"90"``, ``"45s"``, ``"30m"``, ``"12h"``, ``"400d"`` or ``"2w"``.

    The number is ASCII digits; the result is at most `MAX_DURATION`.
    Raises `ConfigurationError` naming `name` and the text.
    """
    match = _DURATION.fullmatch(text.strip().lower()) if isinstance(text, str) else None
    if match is None:
        raise ConfigurationError(
            f"{name} must be a duration like 90, 45s, 30m, 12h, 400d or 2w; got {text!r}"
        )
    seconds = int(match[1]) * _UNITS[match[2] or "s"]
    if seconds > MAX_DURATION:
        raise ConfigurationError(
            f"{name} must be at most {MAX_DURATION} seconds (100 years), got {text!r}"
        )
    return seconds
