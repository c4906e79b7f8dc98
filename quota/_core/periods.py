"""Quota periods: which period an instant falls in. Pure functions, no I/O.

A period is ``"day"``, ``"week"`` (ISO: Monday to Monday), ``"month"``, or a
positive whole number of seconds. Calendar periods follow the wall clock of
an IANA time zone (UTC unless given), so they have their real length: a
month of February is 28 or 29 days, and a "day" in Europe/Berlin is 23 hours
on the day clocks go forward and 25 on the day they go back. A period of
seconds is aligned to the epoch, like a rate window, and takes no time zone.

Bounds are whole epoch seconds, start inclusive and end exclusive; the end of
one period is the start of the next.
"""

from __future__ import annotations

import datetime as dt
import math
import zoneinfo

from quota._core.decision import check_seconds
from quota._core.errors import ConfigurationError

DAY = "day"
WEEK = "week"
MONTH = "month"
#: The calendar periods, in the order error messages list them.
CALENDAR = (DAY, WEEK, MONTH)
#: The longest period of seconds accepted: ten years of 366 days.
MAX_PERIOD_SECONDS = 10 * 366 * 86400

Period = str | int
Zone = zoneinfo.ZoneInfo | dt.timezone


def check_period(period: object) -> Period:
    """`period` as a calendar period name or whole seconds; raise `ConfigurationError` naming it.

    Seconds may be given as a duration the command line takes (``"30d"``,
    ``"12h"``) or a `datetime.timedelta`; they come back as an int.
    """
    if type(period) is str and period in CALENDAR:
        return period
    if isinstance(period, (str, dt.timedelta)):
        try:
            return check_seconds("period", period, maximum=MAX_PERIOD_SECONDS)
        except ConfigurationError:
            raise ConfigurationError(
                f"period must be one of {', '.join(repr(p) for p in CALENDAR)} or whole seconds"
                f" between 1 and {MAX_PERIOD_SECONDS} (an int, a duration like '30d' or a"
                f" datetime.timedelta), got {period!r}"
            ) from None
    # bool is an int subclass; True as a period is always a mistake.
    if type(period) is not int or not 1 <= period <= MAX_PERIOD_SECONDS:
        raise ConfigurationError(
            f"period must be one of {', '.join(repr(p) for p in CALENDAR)} or a whole number of"
            f" seconds between 1 and {MAX_PERIOD_SECONDS}, got {period!r}"
        )
    return period


def load_zone(tz: object, period: Period) -> tuple[Zone, str | None]:
    """The time zone `tz` names, for `period`, and its name as stored (None for periods of seconds).

    `tz` None means UTC. Raises `ConfigurationError` naming ``tz`` and its
    value for a name that is not a known IANA zone, and for a zone given with
    a period of seconds (which is aligned to the epoch, so a zone would be
    silently ignored).
    """
    if tz is None:
        return dt.timezone.utc, None if type(period) is int else "UTC"
    if type(tz) is not str:
        raise ConfigurationError(
            f"tz must be an IANA time zone name such as 'Europe/Berlin', got {tz!r}"
            f" ({type(tz).__name__})"
        )
    if type(period) is int:
        raise ConfigurationError(
            f"tz applies to the calendar periods ({', '.join(CALENDAR)}) only; a period of"
            f" {period} seconds is aligned to the epoch, so tz={tz!r} would be ignored"
        )
    try:
        zone = zoneinfo.ZoneInfo(tz)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError, OSError) as exc:
        raise ConfigurationError(
            f"tz must be an IANA time zone name such as 'Europe/Berlin', got {tz!r}"
            " (no such zone in this system's time zone database)"
        ) from exc
    return zone, tz


def _wall(instant: int, zone: Zone) -> dt.datetime:
    return dt.datetime.fromtimestamp(instant, zone).replace(tzinfo=None)


def first_instant(wall: dt.datetime, zone: Zone) -> int:
    """The first epoch second at which the wall clock in `zone` reads `wall` or later.

    Usually the one instant the wall clock reads `wall`. When `wall` happens
    twice (clocks went back), the first of the two. When the clocks skip it
    (clocks went forward across it, as on days whose midnight does not exist
    in America/Asuncion), the instant of the jump.
    """
    early = int(wall.replace(tzinfo=zone, fold=0).timestamp())
    late = int(wall.replace(tzinfo=zone, fold=1).timestamp())
    low, high = min(early, late), max(early, late)
    if low == high or _wall(low, zone) == wall:
        return low
    # A gap: the wall clock reads less than `wall` at `low` and more at `high`,
    # and only the one transition lies between them.
    while low < high:
        middle = (low + high) // 2
        if _wall(middle, zone) >= wall:
            high = middle
        else:
            low = middle + 1
    return low


def _next_month(day: dt.date) -> dt.date:
    return dt.date(day.year + day.month // 12, day.month % 12 + 1, 1)


#: The last calendar period computed per (period, zone): most calls fall in it.
_last: dict[tuple[str, Zone], tuple[int, int]] = {}


def bounds(period: Period, now: float, zone: Zone) -> tuple[int, int]:
    """``(start, end)`` of the period holding the instant `now`, in epoch seconds.

    `period` and `zone` must have been checked (`check_period`, `load_zone`).
    """
    if type(period) is int:
        second = math.floor(now)
        start = second - second % period
        return start, start + period
    assert isinstance(period, str)
    # Periods tile time, so the one that held the previous call holds this
    # one too unless `now` left it: the calendar is consulted once a period.
    last = _last.get((period, zone))
    if last is not None and last[0] <= now < last[1]:
        return last
    found = _calendar_bounds(period, now, zone)
    _last[(period, zone)] = found
    return found


def _after(period: str, first: dt.date) -> dt.date:
    """The first day of the period after the one starting on `first`."""
    if period == DAY:
        return first + dt.timedelta(days=1)
    if period == WEEK:
        return first + dt.timedelta(days=7)
    return _next_month(first)


def _calendar_bounds(period: str, now: float, zone: Zone) -> tuple[int, int]:
    today = dt.datetime.fromtimestamp(math.floor(now), zone).date()
    if period == DAY:
        first = today
    elif period == WEEK:
        first = today - dt.timedelta(days=today.weekday())
    else:
        first = today.replace(day=1)
    midnight = dt.time()
    start = first_instant(dt.datetime.combine(first, midnight), zone)
    while True:
        following = _after(period, first)
        end = first_instant(dt.datetime.combine(following, midnight), zone)
        if now < end:
            return start, end
        # The clocks went back across the period's first midnight (America/St_Johns
        # did at 00:01): the wall clock reads the old date again, but the next
        # period began at that midnight's first instant.
        first, start = following, end
