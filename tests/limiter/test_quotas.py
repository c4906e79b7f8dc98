"""Durable quotas: periods, consumption, idempotency, refunds, grants, the ledger, `check`.

Behaviour tests run on every row of the backend table (SQLite and PostgreSQL,
sync and async) with the injected clock; the calendar arithmetic is also
tested on its own, without a database. Processes (``spawn``) test exactness,
idempotent retries and a SIGKILL in the middle of a consume.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import inspect
import multiprocessing
import random
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import quota
from quota._core import periods as _periods
from tests import _quota_workers, _workers
from tests._support import Backend, Clock

UTC = dt.timezone.utc
BERLIN = ZoneInfo("Europe/Berlin")


def at(*fields: int, tz: dt.tzinfo = UTC) -> float:
    """Epoch seconds of a wall-clock time in `tz`."""
    return dt.datetime(*fields, tzinfo=tz).timestamp()  # type: ignore[misc]


def ts(*fields: int, tz: dt.tzinfo = UTC) -> int:
    return int(at(*fields, tz=tz))


# -- a face over the quota methods, and raw access to the tables ---------------------------


class Quotas:
    """The quota methods of a backend's limiter as plain sync calls."""

    def __init__(self, backend: Backend, limiter: Any = None) -> None:
        self.backend = backend
        self.limiter = limiter if limiter is not None else backend.limiter
        self.clock = backend.clock

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self.limiter, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            result = method(*args, **kwargs)
            return self.backend.run(result) if self.backend.is_async else result

        return call

    def connect(self, **options: Any) -> Quotas:
        """The quota methods of another limiter on the same database (other options)."""
        return Quotas(self.backend, self.backend.connect(**options).limiter)

    def rows(self, query: str) -> list[tuple[Any, ...]]:
        return db_rows(self.backend.url, query)

    def usage_row(self, subject: str, name: str) -> list[tuple[int, int]]:
        return [
            (int(u), int(g))
            for u, g in self.rows(
                f"SELECT used, granted FROM quota_usage WHERE subject = '{subject}'"
                f" AND name = '{name}' ORDER BY period_start"
            )
        ]

    def kinds(self, subject: str) -> list[str]:
        return [e.kind for e in self.ledger(subject)]


def db_rows(url: str, query: str) -> list[tuple[Any, ...]]:
    """Rows of `query`, read straight from the database behind `url`."""
    if url.startswith("sqlite"):
        conn = sqlite3.connect(url.split(":///", 1)[1], isolation_level=None)
        try:
            return list(conn.execute(query).fetchall())
        finally:
            conn.close()
    import psycopg

    with psycopg.connect(url, autocommit=True) as pg:
        cursor = pg.execute(query)
        return list(cursor.fetchall()) if cursor.description else []


def _truncate(url: str) -> None:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("TRUNCATE quota_usage, quota_ledger, quota_counters")


@pytest.fixture
def q(backend: Backend) -> Quotas:
    """Every store and face, with empty quota tables."""
    if backend.dialect == "postgresql":
        _truncate(backend.url)
    return Quotas(backend)


@pytest.fixture
def pg_quota_url(pg_url: str) -> str:
    _truncate(pg_url)
    return pg_url


# -- periods: pure calendar arithmetic -------------------------------------------------------


def bounds(period: str | int, now: float, tz: str | None = None) -> tuple[int, int]:
    checked = _periods.check_period(period)
    zone, _ = _periods.load_zone(tz, checked)
    return _periods.bounds(checked, now, zone)


@pytest.mark.parametrize(
    ("now", "start", "end"),
    [
        (at(2026, 3, 14, 0, 0, 0), ts(2026, 3, 14), ts(2026, 3, 15)),
        (at(2026, 3, 14, 23, 59, 59) + 0.999, ts(2026, 3, 14), ts(2026, 3, 15)),
        (at(2026, 3, 15, 0, 0, 0), ts(2026, 3, 15), ts(2026, 3, 16)),
        (at(2026, 12, 31, 12, 0, 0), ts(2026, 12, 31), ts(2027, 1, 1)),
    ],
)
def test_a_day_runs_from_midnight_to_midnight(now: float, start: int, end: int) -> None:
    assert bounds("day", now) == (start, end)


@pytest.mark.parametrize(
    ("now", "monday"),
    [
        (at(2026, 6, 15, 0, 0, 0), (2026, 6, 15)),  # a Monday, at its first second
        (at(2026, 6, 21, 23, 59, 59), (2026, 6, 15)),  # the Sunday after, its last second
        (at(2026, 6, 22, 0, 0, 0), (2026, 6, 22)),
        (at(2026, 12, 31, 8, 0, 0), (2026, 12, 28)),  # a week across the new year
        (at(2027, 1, 3, 8, 0, 0), (2026, 12, 28)),
    ],
)
def test_a_week_is_an_iso_week_from_monday(now: float, monday: tuple[int, int, int]) -> None:
    start, end = bounds("week", now)
    assert start == ts(*monday)
    assert end - start == 7 * 86400
    assert dt.datetime.fromtimestamp(start, UTC).isoweekday() == 1


@pytest.mark.parametrize(
    ("year", "month", "days"),
    [(2026, 2, 28), (2028, 2, 29), (2026, 4, 30), (2026, 1, 31), (2026, 12, 31), (2100, 2, 28)],
    ids=["28-days", "29-days-leap", "30-days", "31-days", "december", "2100-not-leap"],
)
def test_a_month_has_its_real_length(year: int, month: int, days: int) -> None:
    first = ts(year, month, 1)
    for now in (first, first + 86400 * (days - 1) + 86399, first + 12345.5):
        start, end = bounds("month", now)
        assert start == first
        assert end - start == days * 86400
    assert bounds("month", first + days * 86400)[0] == first + days * 86400


def test_a_berlin_day_is_23_hours_when_clocks_go_forward_and_25_when_they_go_back() -> None:
    spring = bounds("day", at(2026, 3, 29, 12, 0, 0, tz=BERLIN), "Europe/Berlin")
    assert spring == (ts(2026, 3, 29, tz=BERLIN), ts(2026, 3, 30, tz=BERLIN))
    assert spring[1] - spring[0] == 23 * 3600
    assert spring[0] == ts(2026, 3, 28, 23)  # midnight CET is 23:00 UTC

    autumn = bounds("day", at(2026, 10, 25, 12, 0, 0, tz=BERLIN), "Europe/Berlin")
    assert autumn[1] - autumn[0] == 25 * 3600
    assert autumn[1] == ts(2026, 10, 25, 23)  # midnight CET again

    # Either side of the jumps the same day holds.
    assert bounds("day", ts(2026, 3, 29, 0, 59, 59), "Europe/Berlin") == spring  # 01:59:59 CET
    assert bounds("day", ts(2026, 3, 29, 1), "Europe/Berlin") == spring  # 03:00 CEST
    first_0230 = ts(2026, 10, 25, 0, 30)  # 02:30 CEST
    assert bounds("day", first_0230, "Europe/Berlin") == autumn
    assert bounds("day", first_0230 + 3600, "Europe/Berlin") == autumn  # 02:30 CET


def test_calendar_periods_follow_the_zone_not_utc() -> None:
    late_evening_utc = at(2026, 3, 31, 22, 30, 0)  # already April 1st in Berlin
    assert bounds("day", late_evening_utc) == (ts(2026, 3, 31), ts(2026, 4, 1))
    assert bounds("day", late_evening_utc, "Europe/Berlin") == (
        ts(2026, 4, 1, tz=BERLIN),
        ts(2026, 4, 2, tz=BERLIN),
    )
    month = bounds("month", late_evening_utc, "Europe/Berlin")
    assert month == (ts(2026, 4, 1, tz=BERLIN), ts(2026, 5, 1, tz=BERLIN))
    march = bounds("month", at(2026, 3, 15), "Europe/Berlin")
    assert march[1] - march[0] == 31 * 86400 - 3600  # the spring-forward hour is missing


def test_a_day_whose_midnight_does_not_exist_starts_at_the_jump() -> None:
    # America/Asuncion jumped from 00:00 to 01:00 on 2023-10-01.
    tz = "America/Asuncion"
    start, end = bounds("day", at(2023, 10, 1, 12, 0, 0), tz)
    assert start == ts(2023, 10, 1, 4)  # 00:00 -04 == 01:00 -03, the first instant of the day
    assert end == ts(2023, 10, 2, 3)  # 00:00 -03
    assert bounds("day", start - 1, tz)[1] == start
    assert bounds("day", start, tz)[0] == start


ZONES = [
    "UTC",
    "Europe/Berlin",
    "America/Asuncion",
    "America/St_Johns",
    "Australia/Lord_Howe",
    "Pacific/Chatham",
    "Asia/Kolkata",
]


@settings(max_examples=300, deadline=None)
@given(
    now=st.integers(min_value=ts(1990, 1, 1), max_value=ts(2040, 1, 1)),
    period=st.sampled_from(["day", "week", "month"]),
    tz=st.sampled_from(ZONES),
)
# St. John's set its clocks back at 00:01 in 1994: the last minutes of 29 October
# came again after 30 October had begun (found by this test in a CI run).
@example(now=783484260, period="day", tz="America/St_Johns")
def test_calendar_periods_hold_now_tile_time_and_start_on_the_local_calendar(
    now: int, period: str, tz: str
) -> None:
    start, end = bounds(period, now, tz)
    assert start <= now < end
    assert bounds(period, end, tz)[0] == end  # the next period starts where this one ends
    assert bounds(period, start - 1, tz)[1] == start
    local = dt.datetime.fromtimestamp(start, ZoneInfo(tz))
    first = dt.datetime.fromtimestamp(now, ZoneInfo(tz)).date()
    if period == "week":
        first -= dt.timedelta(days=first.weekday())
    elif period == "month":
        first = first.replace(day=1)
    following = {
        "day": first + dt.timedelta(days=1),
        "week": first + dt.timedelta(days=7),
        "month": (first.replace(day=28) + dt.timedelta(days=4)).replace(day=1),
    }[period]
    if now >= _periods.first_instant(dt.datetime.combine(following, dt.time()), ZoneInfo(tz)):
        first = following  # the clocks went back across that midnight: the next period holds now
    # The wall clock at the start reads midnight of the first day (or, when
    # midnight was skipped, the time it jumped to, within the first hours).
    assert local.date() == first
    assert local.time() < dt.time(3)


@pytest.mark.parametrize("seconds", [1, 60, 3600, 86400, 7 * 86400])
def test_a_period_of_seconds_is_aligned_to_the_epoch(seconds: int) -> None:
    now = at(2026, 5, 5, 13, 14, 15) + 0.5
    start, end = bounds(seconds, now)
    assert start % seconds == 0
    assert end == start + seconds
    assert start <= now < end


# -- bad input -----------------------------------------------------------------------------
#
# Bad arguments must fail before anything touches the database, so these run
# on limiters (sync and async) whose SQLite file cannot even be created: a
# call that reached the store would fail with StorageError instead.


class Offline:
    """The quota methods of a limiter on a database that cannot be opened, as sync calls."""

    def __init__(self, face: str, path: Path) -> None:
        url = f"sqlite:///{path / 'missing-dir' / 'q.db'}"
        self.limiter = quota.connect_async(url) if face == "async" else quota.connect(url)

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self.limiter, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            result = method(*args, **kwargs)
            return asyncio.run(result) if inspect.iscoroutine(result) else result

        return call


@pytest.fixture(params=["sync", "async"])
def offline(request: pytest.FixtureRequest, tmp_path: Path) -> Offline:
    return Offline(request.param, tmp_path)


def test_the_offline_limiter_would_fail_on_the_database(tmp_path: Path) -> None:
    # Sync face only: a failed aiosqlite open leaves its worker thread to
    # report into the closed event loop (a warning, an error under pytest).
    with pytest.raises(quota.StorageError):
        Offline("sync", tmp_path).consume_quota("s", "n", 5, "day")


def _names(exc: BaseException, argument: str, value: object) -> None:
    message = str(exc)
    assert argument in message, message
    assert repr(value) in message, message


@pytest.mark.parametrize(
    "period",
    # ("1d" is a duration, as `quota usage --period 1d` takes it: 86400 seconds.)
    [
        "daily",
        "Day",
        "",
        "1x",
        "0d",
        0,
        -60,
        1.5,
        86400.0,
        True,
        None,
        _periods.MAX_PERIOD_SECONDS + 1,
    ],
)
def test_an_unknown_period_is_rejected_naming_it(offline: Offline, period: object) -> None:
    for call in (
        lambda: offline.consume_quota("s", "n", 5, period),
        lambda: offline.grant_quota("s", "n", 5, period),
        lambda: quota.QuotaLimit("s", "n", 5, period),  # type: ignore[arg-type]
    ):
        with pytest.raises(quota.ConfigurationError) as info:
            call()
        _names(info.value, "period", period)


@pytest.mark.parametrize("tz", ["Mars/Olympus_Mons", "europe/berlin", "", "../etc/passwd", 5])
def test_an_unknown_time_zone_is_rejected_naming_tz(offline: Offline, tz: object) -> None:
    for call in (
        lambda: offline.consume_quota("s", "n", 5, "day", tz=tz),
        lambda: offline.grant_quota("s", "n", 5, "day", tz=tz),
        lambda: quota.QuotaLimit("s", "n", 5, "day", tz),  # type: ignore[arg-type]
    ):
        with pytest.raises(quota.ConfigurationError) as info:
            call()
        _names(info.value, "tz", tz)


def test_a_time_zone_with_a_period_of_seconds_is_rejected(offline: Offline) -> None:
    with pytest.raises(quota.ConfigurationError, match="tz") as info:
        offline.consume_quota("s", "n", 5, 3600, tz="Europe/Berlin")
    assert "'Europe/Berlin'" in str(info.value)


@pytest.mark.parametrize(
    ("argument", "kwargs"),
    [
        ("limit", {"limit": 0}),
        ("limit", {"limit": -3}),
        ("limit", {"limit": True}),
        ("limit", {"limit": 2.0}),
        ("cost", {"cost": 0}),
        ("cost", {"cost": -1}),
        ("cost", {"cost": 6}),  # above the limit: it could never pass
        ("cost", {"cost": True}),
        ("cost", {"cost": 1.0}),
        ("subject", {"subject": ""}),
        ("subject", {"subject": 42}),
        ("subject", {"subject": "a\x00b"}),
        ("subject", {"subject": "x" * 201}),
        ("name", {"name": ""}),
        ("name", {"name": "\ud800"}),
        ("idempotency_key", {"idempotency_key": ""}),
        ("idempotency_key", {"idempotency_key": 7}),
    ],
)
def test_bad_consume_arguments_are_rejected_before_the_database(
    offline: Offline, argument: str, kwargs: dict[str, Any]
) -> None:
    call = {"subject": "s", "name": "n", "limit": 5, "period": "day", **kwargs}
    with pytest.raises(quota.ConfigurationError) as info:
        offline.consume_quota(**call)
    assert argument in str(info.value)
    value = kwargs[argument]
    if not (isinstance(value, str) and len(value) > 40):
        assert repr(value) in str(info.value)


@pytest.mark.parametrize(
    ("method", "args", "argument"),
    [
        ("refund_quota", ("s", "n", ""), "idempotency_key"),
        ("refund_quota", ("", "n", "k"), "subject"),
        ("quota_usage", (None,), "subject"),
        ("ledger", ("s", "last week"), "since"),
        ("ledger", ("s", float("nan")), "since"),
    ],
)
def test_other_bad_arguments_are_rejected_before_the_database(
    offline: Offline, method: str, args: tuple[Any, ...], argument: str
) -> None:
    with pytest.raises(quota.ConfigurationError, match=argument):
        getattr(offline, method)(*args)


@pytest.mark.parametrize("amount", [0, -5, True, 1.5])
def test_a_bad_grant_amount_is_rejected(offline: Offline, amount: object) -> None:
    with pytest.raises(quota.ConfigurationError) as info:
        offline.grant_quota("s", "n", amount, "day")
    _names(info.value, "amount", amount)


# -- consuming -------------------------------------------------------------------------------


def test_consume_allows_up_to_the_limit_and_a_denial_charges_nothing(q: Quotas) -> None:
    q.clock.now = at(2026, 5, 5, 13, 0, 0) + 0.25
    start, end = ts(2026, 5, 5), ts(2026, 5, 6)
    decisions = [q.consume_quota("ip:1", "demo", 3, "day") for _ in range(3)]

    assert [(d.allowed, d.used, d.remaining) for d in decisions] == [
        (True, 1, 2),
        (True, 2, 1),
        (True, 3, 0),
    ]
    for d in decisions:
        assert (d.limit, d.period_start, d.resets_at, d.retry_after) == (3, start, end, 0)
        assert (d.subject, d.name, d.cost, d.granted, d.replayed) == ("ip:1", "demo", 1, 0, False)

    for _ in range(4):
        denied = q.consume_quota("ip:1", "demo", 3, "day")
        assert (denied.allowed, denied.used, denied.remaining) == (False, 3, 0)
        assert denied.retry_after == 11 * 3600  # 13:00:00.25 -> midnight, rounded up
        assert denied.resets_at == end

    assert q.usage_row("ip:1", "demo") == [(3, 0)]
    assert q.kinds("ip:1") == ["consume"] * 3 + ["deny"] * 4


def test_a_costly_call_is_denied_when_it_does_not_fit_and_charges_nothing(q: Quotas) -> None:
    assert q.consume_quota("s", "tokens", 10, "day", cost=8).used == 8

    too_big = q.consume_quota("s", "tokens", 10, "day", cost=3)
    assert (too_big.allowed, too_big.used, too_big.remaining, too_big.cost) == (False, 8, 2, 3)

    fits = q.consume_quota("s", "tokens", 10, "day", cost=2)
    assert (fits.allowed, fits.used, fits.remaining) == (True, 10, 0)
    assert q.usage_row("s", "tokens") == [(10, 0)]
    assert [(e.kind, e.cost) for e in q.ledger("s")] == [
        ("consume", 8),
        ("deny", 3),
        ("consume", 2),
    ]


def test_quotas_are_per_subject_and_name(q: Quotas) -> None:
    q.consume_quota("alice", "llm", 1, "day")
    assert not q.consume_quota("alice", "llm", 1, "day").allowed
    assert q.consume_quota("bob", "llm", 1, "day").allowed
    assert q.consume_quota("alice", "search", 1, "day").allowed


def test_a_new_day_starts_from_zero_at_midnight(q: Quotas) -> None:
    q.clock.now = at(2026, 7, 1, 23, 59, 59) + 0.5
    assert q.consume_quota("s", "n", 1, "day").allowed
    denied = q.consume_quota("s", "n", 1, "day")
    assert (denied.allowed, denied.retry_after) == (False, 1)

    q.clock.now = at(2026, 7, 2)
    fresh = q.consume_quota("s", "n", 1, "day")
    assert (fresh.allowed, fresh.used, fresh.period_start) == (True, 1, ts(2026, 7, 2))
    assert q.usage_row("s", "n") == [(1, 0), (1, 0)]


def test_a_month_quota_resets_on_the_first_and_february_is_short(q: Quotas) -> None:
    q.clock.now = at(2028, 2, 29, 23, 0, 0)  # a leap day
    decision = q.consume_quota("s", "n", 1, "month")
    assert (decision.period_start, decision.resets_at) == (ts(2028, 2, 1), ts(2028, 3, 1))
    assert decision.resets_at - decision.period_start == 29 * 86400
    assert not q.consume_quota("s", "n", 1, "month").allowed

    q.clock.now = at(2028, 3, 1)
    assert q.consume_quota("s", "n", 1, "month").allowed


def test_a_week_quota_resets_on_monday(q: Quotas) -> None:
    q.clock.now = at(2026, 6, 21, 23, 59, 59)  # a Sunday
    first = q.consume_quota("s", "n", 1, "week")
    assert first.period_start == ts(2026, 6, 15)
    assert not q.consume_quota("s", "n", 1, "week").allowed
    q.clock.now = at(2026, 6, 22)
    assert q.consume_quota("s", "n", 1, "week").period_start == ts(2026, 6, 22)


def test_a_berlin_day_quota_across_the_spring_change_lasts_23_hours(q: Quotas) -> None:
    q.clock.now = at(2026, 3, 29, 1, 30, 0, tz=BERLIN)  # just before the jump
    before = q.consume_quota("s", "n", 2, "day", tz="Europe/Berlin")
    q.clock.now = at(2026, 3, 29, 3, 30, 0, tz=BERLIN)  # just after it: the same day
    after = q.consume_quota("s", "n", 2, "day", tz="Europe/Berlin")

    assert (before.used, after.used) == (1, 2)
    assert after.period_start == before.period_start == ts(2026, 3, 29, tz=BERLIN)
    assert after.resets_at - after.period_start == 23 * 3600
    assert not q.consume_quota("s", "n", 2, "day", tz="Europe/Berlin").allowed

    q.clock.now = at(2026, 3, 30, tz=BERLIN)
    assert q.consume_quota("s", "n", 2, "day", tz="Europe/Berlin").used == 1
    [usage] = q.quota_usage("s")
    assert (usage.period, usage.tz) == ("day", "Europe/Berlin")


def test_a_period_of_seconds_resets_on_the_epoch_grid(q: Quotas) -> None:
    q.clock.now = at(2026, 5, 5, 13, 59, 59)
    d = q.consume_quota("s", "n", 1, 3600)
    assert (d.period_start, d.resets_at) == (ts(2026, 5, 5, 13), ts(2026, 5, 5, 14))
    q.clock.now = at(2026, 5, 5, 14)
    assert q.consume_quota("s", "n", 1, 3600).allowed
    assert [u.period for u in q.quota_usage("s")] == [3600]


# -- idempotency -------------------------------------------------------------------------------


def test_the_same_key_returns_the_original_decision_and_charges_once(q: Quotas) -> None:
    first = q.consume_quota("s", "llm", 5, "day", cost=2, idempotency_key="req-1")
    q.clock.advance(30)
    retries = [
        q.consume_quota("s", "llm", 5, "day", cost=2, idempotency_key="req-1") for _ in range(3)
    ]

    assert not first.replayed
    for retry in retries:
        assert retry.replayed
        assert retry.allowed
        assert (retry.used, retry.remaining, retry.cost, retry.period_start, retry.resets_at) == (
            first.used,
            first.remaining,
            first.cost,
            first.period_start,
            first.resets_at,
        )
    assert q.usage_row("s", "llm") == [(2, 0)]
    assert [(e.kind, e.idempotency_key) for e in q.ledger("s")] == [("consume", "req-1")]


def test_a_retry_after_the_period_filled_up_still_gets_its_original_allowance(q: Quotas) -> None:
    assert q.consume_quota("s", "n", 2, "day", idempotency_key="a").allowed
    assert q.consume_quota("s", "n", 2, "day", idempotency_key="b").allowed
    assert not q.consume_quota("s", "n", 2, "day", idempotency_key="c").allowed

    retry = q.consume_quota("s", "n", 2, "day", idempotency_key="a")
    assert (retry.allowed, retry.replayed, retry.used) == (True, True, 1)
    assert q.usage_row("s", "n") == [(2, 0)]


def test_keys_are_scoped_to_subject_and_quota(q: Quotas) -> None:
    q.consume_quota("alice", "llm", 5, "day", idempotency_key="k")
    other_subject = q.consume_quota("bob", "llm", 5, "day", idempotency_key="k")
    other_quota = q.consume_quota("alice", "search", 5, "day", idempotency_key="k")
    assert not other_subject.replayed
    assert not other_quota.replayed
    assert q.usage_row("alice", "llm") == [(1, 0)]


def test_a_denial_does_not_bind_its_key(q: Quotas) -> None:
    q.consume_quota("s", "n", 1, "day")
    denied = q.consume_quota("s", "n", 1, "day", idempotency_key="retry-me")
    assert not denied.allowed

    q.grant_quota("s", "n", 1, "day")
    passed = q.consume_quota("s", "n", 1, "day", idempotency_key="retry-me")
    again = q.consume_quota("s", "n", 1, "day", idempotency_key="retry-me")
    assert (passed.allowed, passed.replayed) == (True, False)
    assert (again.allowed, again.replayed) == (True, True)
    assert q.usage_row("s", "n") == [(2, 1)]


# -- refunds ------------------------------------------------------------------------------------


def test_refund_gives_the_charge_back_once(q: Quotas) -> None:
    q.consume_quota("s", "llm", 3, "day", cost=2, idempotency_key="job-1")
    q.consume_quota("s", "llm", 3, "day", idempotency_key="job-2")
    assert not q.consume_quota("s", "llm", 3, "day").allowed

    refund = q.refund_quota("s", "llm", "job-1")
    assert (refund.refunded, refund.status, refund.amount, refund.used) == (
        True,
        "refunded",
        2,
        1,
    )
    assert q.consume_quota("s", "llm", 3, "day", cost=2).allowed

    twice = q.refund_quota("s", "llm", "job-1")
    assert (twice.refunded, twice.status, twice.amount) == (False, "already_refunded", 0)
    unknown = q.refund_quota("s", "llm", "never-seen")
    assert (unknown.refunded, unknown.status) == (False, "unknown_key")
    other_quota = q.refund_quota("s", "search", "job-2")
    assert other_quota.status == "unknown_key"

    assert q.usage_row("s", "llm") == [(3, 0)]
    assert [(e.kind, e.cost) for e in q.ledger("s")] == [
        ("consume", 2),
        ("consume", 1),
        ("deny", 1),
        ("refund", 2),
        ("consume", 2),
    ]
    refunded = next(e for e in q.ledger("s") if e.idempotency_key == "job-1")
    assert refunded.refunded_at == q.clock.now


def test_after_a_refund_the_key_charges_again_once(q: Quotas) -> None:
    """A refunded key is free: the retry of the failed work is a new charge, made once."""
    q.consume_quota("s", "llm", 5, "day", idempotency_key="job")
    q.refund_quota("s", "llm", "job")

    retry = q.consume_quota("s", "llm", 5, "day", idempotency_key="job")
    again = q.consume_quota("s", "llm", 5, "day", idempotency_key="job")
    assert (retry.allowed, retry.replayed, retry.used) == (True, False, 1)
    assert (again.replayed, again.used) == (True, 1)
    assert q.usage_row("s", "llm") == [(1, 0)]
    assert q.refund_quota("s", "llm", "job").refunded
    assert q.refund_quota("s", "llm", "job").status == "already_refunded"
    assert q.usage_row("s", "llm") == [(0, 0)]


def test_a_refund_goes_back_to_the_period_it_was_charged_in(q: Quotas) -> None:
    q.clock.now = at(2026, 7, 1, 23, 59)
    q.consume_quota("s", "n", 5, "day", cost=3, idempotency_key="late")
    q.clock.now = at(2026, 7, 2, 0, 1)
    q.consume_quota("s", "n", 5, "day")

    result = q.refund_quota("s", "n", "late")
    assert (result.period_start, result.used) == (ts(2026, 7, 1), 0)
    assert q.usage_row("s", "n") == [(0, 0), (1, 0)]


# -- grants -------------------------------------------------------------------------------------


def test_a_grant_tops_up_the_current_period_only(q: Quotas) -> None:
    q.clock.now = at(2026, 7, 1, 12)
    q.consume_quota("s", "n", 2, "day")
    q.consume_quota("s", "n", 2, "day")
    assert not q.consume_quota("s", "n", 2, "day").allowed

    usage = q.grant_quota("s", "n", 3, "day")
    assert (usage.used, usage.granted, usage.limit, usage.remaining) == (2, 3, 2, 3)

    allowed = [q.consume_quota("s", "n", 2, "day") for _ in range(4)]
    assert [d.allowed for d in allowed] == [True, True, True, False]
    assert (allowed[0].granted, allowed[0].remaining) == (3, 2)

    q.clock.now = at(2026, 7, 2, 12)
    assert [q.consume_quota("s", "n", 2, "day").allowed for _ in range(3)] == [True, True, False]
    assert [(e.kind, e.cost) for e in q.ledger("s") if e.kind == "grant"] == [("grant", 3)]


def test_a_grant_before_any_use_creates_the_period(q: Quotas) -> None:
    usage = q.grant_quota("promo", "llm", 10, "month", tz="Europe/Berlin")
    assert (usage.used, usage.granted, usage.limit, usage.remaining) == (0, 10, None, None)
    decisions = [q.consume_quota("promo", "llm", 1, "month", tz="Europe/Berlin") for _ in range(12)]
    assert [d.allowed for d in decisions] == [True] * 11 + [False]


# -- usage and the ledger --------------------------------------------------------------------------


def test_quota_usage_lists_the_running_periods(q: Quotas) -> None:
    q.clock.now = at(2026, 7, 1, 12)
    q.consume_quota("s", "llm", 10, "day", cost=4)
    q.consume_quota("s", "search", 100, "month")
    q.consume_quota("other", "llm", 10, "day")
    q.clock.now = at(2026, 7, 2, 12)
    q.consume_quota("s", "llm", 10, "day", cost=1)

    current = q.quota_usage("s")
    assert [(u.name, u.used, u.limit, u.remaining, u.resets_at) for u in current] == [
        ("llm", 1, 10, 9, ts(2026, 7, 3)),
        ("search", 1, 100, 99, ts(2026, 8, 1)),
    ]
    every = q.quota_usage("s", include_ended=True)
    assert [(u.name, u.period_start, u.used) for u in every] == [
        ("llm", ts(2026, 7, 2), 1),
        ("llm", ts(2026, 7, 1), 4),
        ("search", ts(2026, 7, 1), 1),
    ]
    assert q.quota_usage("nobody") == []


def test_the_ledger_filters_by_time_and_matches_the_usage_totals(q: Quotas) -> None:
    rng = random.Random(7)
    q.clock.now = at(2026, 7, 1, 8)
    keys: list[str] = []
    for i in range(60):
        q.clock.advance(60)
        action = rng.random()
        if action < 0.6:
            key = f"k{i}" if rng.random() < 0.7 else rng.choice(keys or ["k0"])
            q.consume_quota("s", "n", 40, "day", cost=rng.randint(1, 4), idempotency_key=key)
            keys.append(key)
        elif action < 0.85 and keys:
            q.refund_quota("s", "n", rng.choice(keys))
        else:
            q.grant_quota("s", "n", rng.randint(1, 3), "day")

    entries = q.ledger("s")
    assert [e.id for e in entries] == sorted(e.id for e in entries)
    charged = sum(e.cost for e in entries if e.kind == "consume")
    refunded = sum(e.cost for e in entries if e.kind == "refund")
    granted = sum(e.cost for e in entries if e.kind == "grant")
    assert q.usage_row("s", "n") == [(charged - refunded, granted)]
    # Each entry's snapshot is the usage right after it, in order.
    running = 0
    for e in entries:
        running += {"consume": e.cost, "refund": -e.cost}.get(e.kind, 0)
        assert e.used == running

    midpoint = entries[len(entries) // 2].at
    assert [e.id for e in q.ledger("s", since=midpoint)] == [
        e.id for e in entries if e.at >= midpoint
    ]
    as_datetime = dt.datetime.fromtimestamp(midpoint, UTC)
    assert len(q.ledger("s", since=as_datetime)) == len(q.ledger("s", since=midpoint))
    with pytest.raises(quota.ConfigurationError, match="since"):
        q.ledger("s", since="yesterday")
    with pytest.raises(quota.ConfigurationError, match="since"):
        q.ledger("s", since=dt.datetime(2026, 1, 1))  # naive: which zone?


# -- check: all or nothing --------------------------------------------------------------------------

MINUTE = quota.RateWindow("key:1", 2, 60)
HOUR = quota.RateWindow("key:1", 5, 3600)
DAY = quota.QuotaLimit("acct:1", "llm", 3, "day")


def _state(q: Quotas) -> tuple[Any, ...]:
    peeks = tuple(
        q.backend.peek(w.key, w.limit, w.window).count for w in (MINUTE, HOUR)
    )  # fmt: skip
    return peeks, tuple(q.usage_row("acct:1", "llm"))


def test_check_charges_every_limit_when_all_allow(q: Quotas) -> None:
    result = q.check(MINUTE, DAY, HOUR)
    assert (result.allowed, result.denied_by, result.retry_after, result.replayed) == (
        True,
        None,
        0,
        False,
    )
    minute, day, hour = result.decisions
    assert isinstance(minute, quota.Decision) and isinstance(hour, quota.Decision)
    assert isinstance(day, quota.QuotaDecision)
    assert (minute.count, hour.count, day.used) == (1, 1, 1)
    assert _state(q) == ((1, 1), ((1, 0),))
    assert q.kinds("acct:1") == ["consume"]


def test_a_denied_check_charges_nothing_anywhere(q: Quotas) -> None:
    q.clock.now = at(2026, 7, 1, 12, 0, 30)
    assert q.check(MINUTE, HOUR, DAY).allowed
    assert q.check(MINUTE, HOUR, DAY).allowed
    before = _state(q)
    assert before == ((2, 2), ((2, 0),))

    denied = q.check(HOUR, DAY, MINUTE)

    assert not denied.allowed
    assert denied.denied_by == MINUTE
    assert denied.retry_after == 30
    hour, day, minute = denied.decisions
    assert isinstance(minute, quota.Decision) and isinstance(day, quota.QuotaDecision)
    assert (minute.allowed, minute.count, minute.remaining) == (False, 2, 0)
    # The limits that would have allowed say so, with their counts untouched.
    assert (hour.allowed, hour.count, day.allowed, day.used, day.remaining) == (True, 2, True, 2, 1)
    assert _state(q) == before
    assert q.kinds("acct:1") == ["consume", "consume"]  # a rate window denied: no quota entry


def test_a_check_denied_by_its_quota_leaves_the_rate_windows_alone(q: Quotas) -> None:
    q.clock.now = at(2026, 7, 1, 23, 0, 0)
    small = quota.QuotaLimit("acct:1", "llm", 1, "day")
    assert q.check(MINUTE, small).allowed
    before = _state(q)

    denied = q.check(MINUTE, HOUR, small)

    assert (denied.allowed, denied.denied_by, denied.retry_after) == (False, small, 3600)
    assert _state(q) == before
    assert q.kinds("acct:1") == ["consume", "deny"]


def test_the_longest_retry_after_wins_and_the_first_denier_is_named(q: Quotas) -> None:
    q.clock.now = at(2026, 7, 1, 12, 59, 0)
    tight_minute = quota.RateWindow("k", 1, 60)
    tight_hour = quota.RateWindow("k", 1, 3600)
    assert q.check(tight_minute, tight_hour).allowed

    denied = q.check(tight_hour, tight_minute)
    assert denied.denied_by == tight_hour
    assert denied.retry_after == 60  # both end at 13:00
    q.clock.now = at(2026, 7, 1, 13, 0, 30)
    assert q.check(tight_minute, tight_hour).allowed
    q.clock.now = at(2026, 7, 1, 13, 0, 45)
    later = q.check(tight_minute, tight_hour)
    assert (later.denied_by, later.retry_after) == (tight_minute, 3600 - 45)


def test_check_shares_counters_with_rate_limit(q: Quotas) -> None:
    q.backend.rate_limit("key:1", 2, 60)
    assert q.check(MINUTE).allowed
    assert not q.backend.rate_limit("key:1", 2, 60).allowed
    denied = q.check(MINUTE, DAY)
    assert not denied.allowed
    assert q.usage_row("acct:1", "llm") == []


def test_a_check_with_a_key_is_charged_once(q: Quotas) -> None:
    first = q.check(MINUTE, DAY, idempotency_key="req-9")
    retry = q.check(MINUTE, DAY, idempotency_key="req-9")

    assert first.allowed and not first.replayed
    assert retry.allowed and retry.replayed
    day = retry.decisions[1]
    assert isinstance(day, quota.QuotaDecision)
    assert (day.replayed, day.used) == (True, 1)
    assert _state(q) == ((1, 0), ((1, 0),))
    # The same key on consume_quota is that same charge.
    assert q.consume_quota("acct:1", "llm", 3, "day", idempotency_key="req-9").replayed


def test_a_retried_check_whose_windows_filled_up_is_still_a_replay(q: Quotas) -> None:
    assert q.check(MINUTE, DAY, idempotency_key="r").allowed
    q.backend.rate_limit("key:1", 2, 60)  # the minute window is full now
    retry = q.check(MINUTE, DAY, idempotency_key="r")
    assert (retry.allowed, retry.replayed) == (True, True)
    assert q.usage_row("acct:1", "llm") == [(1, 0)]


@pytest.mark.parametrize(
    ("limits", "kwargs", "argument"),
    [
        ((), {}, "limits"),
        (("not a limit",), {}, "limits"),
        ((MINUTE, MINUTE), {}, "limits"),
        ((DAY, quota.QuotaLimit("acct:1", "llm", 9, "week")), {}, "limits"),
        ((MINUTE, DAY), {"cost": 3}, "cost"),  # above the minute's limit of 2
        ((MINUTE, DAY), {"cost": 0}, "cost"),
        ((MINUTE,), {"idempotency_key": "k"}, "idempotency_key"),
    ],
)
def test_bad_checks_are_rejected_before_the_database(
    offline: Offline, limits: tuple[Any, ...], kwargs: dict[str, Any], argument: str
) -> None:
    with pytest.raises(quota.ConfigurationError, match=argument):
        offline.check(*limits, **kwargs)


@pytest.mark.parametrize(
    ("build", "argument"),
    [
        (lambda: quota.RateWindow("", 1, 60), "key"),
        (lambda: quota.RateWindow("k", 0, 60), "limit"),
        (lambda: quota.RateWindow("k", 1, 0), "window"),
        (lambda: quota.QuotaLimit("", "n", 1, "day"), "subject"),
        (lambda: quota.QuotaLimit("s", "n", -1, "day"), "limit"),
        (lambda: quota.QuotaLimit("s", "n", 1, "fortnight"), "period"),
        (lambda: quota.QuotaLimit("s", "n", 1, "day", "Nowhere/Land"), "tz"),
    ],
)
def test_limits_are_validated_when_built(build: Callable[[], object], argument: str) -> None:
    with pytest.raises(quota.ConfigurationError, match=argument):
        build()


# -- rate denials in the ledger ---------------------------------------------------------------------


def test_rate_denials_are_recorded_only_when_asked(q: Quotas) -> None:
    recording = q.connect(record_rate_denials=True)
    for _ in range(3):
        q.backend.rate_limit("plain", 1, 60)
    assert q.ledger("plain") == []

    face = q.backend.connect(record_rate_denials=True)
    decisions = [face.rate_limit("ip:9", 1, 60) for _ in range(3)]
    assert [d.allowed for d in decisions] == [True, False, False]
    entries = q.ledger("ip:9")
    assert [(e.kind, e.name, e.used, e.limit, e.resets_at) for e in entries] == [
        ("rate_denied", "rate:60s", 2, 1, decisions[1].reset_at),
        ("rate_denied", "rate:60s", 3, 1, decisions[2].reset_at),
    ]
    # A check denied by a rate window records it too, on such a limiter.
    recording.check(quota.RateWindow("ip:9", 1, 60))
    assert [e.kind for e in q.ledger("ip:9")] == ["rate_denied"] * 3


def test_record_rate_denials_must_be_a_bool(tmp_path: Path) -> None:
    with pytest.raises(quota.ConfigurationError, match="record_rate_denials"):
        quota.connect(f"sqlite:///{tmp_path / 'q.db'}", record_rate_denials="yes")  # type: ignore[arg-type]


# -- cleanup and retention ----------------------------------------------------------------------------


def test_cleanup_never_touches_quota_tables(q: Quotas) -> None:
    q.clock.now = at(2020, 1, 1, 12)
    q.consume_quota("s", "n", 5, 60)  # a period of seconds that ended long ago
    q.consume_quota("s", "n", 5, "day", idempotency_key="k")
    q.backend.rate_limit("k", 5, 60)
    q.clock.now = at(2026, 1, 1)

    result = q.backend.cleanup(grace=0)

    assert result.deleted == 1  # the rate window only
    assert len(q.rows("SELECT * FROM quota_usage")) == 2
    assert len(q.rows("SELECT * FROM quota_ledger")) == 2
    # The charge's ledger entry survived: a retry of it is still recognised.
    assert q.consume_quota("s", "n", 5, "day", idempotency_key="k").replayed


def test_ledger_retention_deletes_old_entries_only(q: Quotas) -> None:
    q.clock.now = at(2025, 1, 1)
    for i in range(5):
        q.consume_quota("s", "n", 100, "day", idempotency_key=f"old{i}")
    q.clock.now = at(2026, 3, 1)
    q.consume_quota("s", "n", 100, "day", idempotency_key="new")

    dry = q.cleanup_ledger(older_than=400 * 86400, dry_run=True)
    assert (dry.dry_run, dry.expired, dry.deleted) == (True, 5, 0)
    assert len(q.ledger("s")) == 6

    done = q.cleanup_ledger(older_than=400 * 86400, batch_size=2)
    assert (done.deleted, done.expired) == (5, 5)
    assert [e.idempotency_key for e in q.ledger("s")] == ["new"]
    assert len(q.rows("SELECT * FROM quota_usage")) == 2  # usage is never deleted
    with pytest.raises(quota.ConfigurationError, match="older_than"):
        q.cleanup_ledger(older_than=0)


# -- faults: nothing is half-written -------------------------------------------------------------------


@pytest.fixture
def failing_ledger(q: Quotas) -> Iterator[Quotas]:
    """`q` with a trigger that makes every ledger insert fail."""
    if q.backend.dialect == "sqlite":
        create = [
            "CREATE TRIGGER quota_test_fail BEFORE INSERT ON quota_ledger"
            " BEGIN SELECT RAISE(ABORT, 'ledger is read-only today'); END"
        ]
        drop = ["DROP TRIGGER quota_test_fail"]
    else:
        create = [
            "CREATE FUNCTION quota_test_fail() RETURNS trigger LANGUAGE plpgsql AS"
            " $$ BEGIN RAISE EXCEPTION 'ledger is read-only today'; END $$",
            "CREATE TRIGGER quota_test_fail BEFORE INSERT ON quota_ledger"
            " FOR EACH ROW EXECUTE FUNCTION quota_test_fail()",
        ]
        drop = [
            "DROP TRIGGER quota_test_fail ON quota_ledger",
            "DROP FUNCTION quota_test_fail()",
        ]
    for statement in create:
        db_rows(q.backend.url, statement)
    try:
        yield q
    finally:
        for statement in drop:
            db_rows(q.backend.url, statement)


def test_a_database_error_is_a_storage_error_and_writes_nothing(failing_ledger: Quotas) -> None:
    q = failing_ledger
    for call in (
        lambda: q.consume_quota("s", "n", 5, "day"),
        lambda: q.consume_quota("s", "n", 5, "day", idempotency_key="k"),
        lambda: q.grant_quota("s", "n", 5, "day"),
        lambda: q.check(MINUTE, DAY),
    ):
        with pytest.raises(quota.StorageError, match="read-only today"):
            call()
    assert q.rows("SELECT * FROM quota_usage") == []
    assert q.rows("SELECT * FROM quota_counters") == []
    assert q.rows("SELECT * FROM quota_ledger") == []


def test_a_schema_without_the_quota_tables_asks_for_a_migration(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'old.db'}"
    quota.migrate(url, revision="0001_counters")
    with (
        quota.connect(url) as limiter,
        pytest.raises(quota.SchemaError, match=r"0001_counters.*migrate"),
    ):
        limiter.consume_quota("s", "n", 1, "day")


# -- migrations -----------------------------------------------------------------------------------------


def _upgrade_keeps_counters(url: str) -> None:
    quota.migrate(url, revision="0001_counters")
    db_rows(
        url,
        "INSERT INTO quota_counters VALUES ('60:0:k:a', 'k:a', 0, 60, 7, 1.5),"
        " ('3600:0:k:b', 'k:b', 0, 3600, 2, 2.5)",
    )
    quota.migrate(url, revision="0002_quotas")
    assert quota.current_revision(url) == "0002_quotas"
    counters = "SELECT bucket_key, count FROM quota_counters ORDER BY bucket_key"
    assert db_rows(url, counters) == [("3600:0:k:b", 2), ("60:0:k:a", 7)]
    assert db_rows(url, "SELECT count(*) FROM quota_usage") == [(0,)]
    assert db_rows(url, "SELECT count(*) FROM quota_ledger") == [(0,)]

    quota.migrate(url)  # on to head: whatever comes next keeps them too
    with quota.connect(url) as limiter:
        assert limiter.consume_quota("s", "n", 1, "day").allowed

    quota.downgrade(url, revision="0001_counters", drop_data=True)  # it holds a charge
    assert quota.current_revision(url) == "0001_counters"
    assert db_rows(url, counters) == [("3600:0:k:b", 2), ("60:0:k:a", 7)]
    for table in ("quota_usage", "quota_ledger"):
        with pytest.raises(Exception, match=r"(?i)quota_(usage|ledger)"):
            db_rows(url, f"SELECT * FROM {table}")

    quota.migrate(url)  # and up again
    assert db_rows(url, "SELECT count(*) FROM quota_usage") == [(0,)]


def test_sqlite_upgrade_from_0001_keeps_counters_and_downgrade_drops_only_quota_tables(
    tmp_path: Path,
) -> None:
    _upgrade_keeps_counters(f"sqlite:///{tmp_path / 'm.db'}")


@pytest.mark.postgres
def test_postgresql_upgrade_from_0001_keeps_counters_and_downgrade_drops_only_quota_tables(
    pg_make_database: Callable[[], str],
) -> None:
    _upgrade_keeps_counters(pg_make_database())


@pytest.mark.postgres
def test_postgresql_quota_tables_are_logged(pg_url: str) -> None:
    rows = db_rows(
        pg_url,
        "SELECT relname, relpersistence FROM pg_class"
        " WHERE relname IN ('quota_usage', 'quota_ledger') ORDER BY relname",
    )
    assert rows == [("quota_ledger", "p"), ("quota_usage", "p")]


# -- several processes ------------------------------------------------------------------------------------

SPAWN = multiprocessing.get_context("spawn")
NOW = at(2026, 7, 1, 12, 0, 0) + 0.5


def _exactly_the_limit(url: str, faces: list[str]) -> None:
    limit, attempts = 23, 12  # 4 x 12 = 48 attempts
    results = _workers.run_processes(
        SPAWN,
        _quota_workers.consume_worker,
        [(url, face, "s", "n", limit, "day", [None] * attempts, NOW) for face in faces],
    )
    allowed = [sum(r[0] for r in result) for result in results]
    assert sum(allowed) == limit, allowed
    with quota.connect(url, clock=lambda: NOW) as limiter:
        [usage] = limiter.quota_usage("s")
        entries = limiter.ledger("s")
    assert usage.used == limit
    assert sum(e.kind == "consume" for e in entries) == limit
    assert sum(e.kind == "deny" for e in entries) == len(faces) * attempts - limit
    # Every allowed call saw a distinct count: no two were charged as one.
    used = sorted(r[1] for result in results for r in result if r[0])
    assert used == list(range(1, limit + 1))


@pytest.mark.slow
def test_processes_on_sqlite_consume_exactly_the_limit(sqlite_url: str) -> None:
    _exactly_the_limit(sqlite_url, ["sync", "sync", "async", "async"])


@pytest.mark.slow
@pytest.mark.postgres
def test_processes_on_postgresql_consume_exactly_the_limit(pg_quota_url: str) -> None:
    _exactly_the_limit(pg_quota_url, ["sync", "async", "sync", "async"])


def _retries_charge_once(url: str) -> None:
    keys = [f"req-{i}" for i in range(12)]
    plans = []
    for seed in range(4):
        shuffled = keys * 2
        random.Random(seed).shuffle(shuffled)
        plans.append(shuffled)
    faces = ["sync", "async", "sync", "async"]
    results = _workers.run_processes(
        SPAWN,
        _quota_workers.consume_worker,
        [
            (url, face, "s", "n", 100, "day", plan, NOW)
            for face, plan in zip(faces, plans, strict=True)
        ],
    )
    by_key: dict[str | None, set[int]] = {}
    for result in results:
        for allowed, used, _replayed, key in result:
            assert allowed
            by_key.setdefault(key, set()).add(used)
    # Every caller of one key saw the one original decision.
    assert all(len(seen) == 1 for seen in by_key.values()), by_key
    assert sorted(next(iter(s)) for s in by_key.values()) == list(range(1, len(keys) + 1))
    fresh = sum(not r[2] for result in results for r in result)
    assert fresh == len(keys)
    with quota.connect(url, clock=lambda: NOW) as limiter:
        assert [u.used for u in limiter.quota_usage("s")] == [len(keys)]
        assert len(limiter.ledger("s")) == len(keys)


@pytest.mark.slow
def test_idempotent_retries_from_processes_charge_once_on_sqlite(sqlite_url: str) -> None:
    _retries_charge_once(sqlite_url)


@pytest.mark.slow
@pytest.mark.postgres
def test_idempotent_retries_from_processes_charge_once_on_postgresql(pg_quota_url: str) -> None:
    _retries_charge_once(pg_quota_url)


def _checks_in_opposite_orders_do_not_deadlock(url: str) -> None:
    rounds = 40
    results = _workers.run_processes(
        SPAWN,
        _quota_workers.check_worker,
        [(url, "s", rounds, i % 2 == 1, NOW) for i in range(4)],
    )
    assert results == [rounds] * 4
    with quota.connect(url, clock=lambda: NOW) as limiter:
        assert [u.used for u in limiter.quota_usage("s")] == [4 * rounds, 4 * rounds]
        assert limiter.peek("s:a", 10**6, 3600).count == 4 * rounds


@pytest.mark.slow
def test_checks_in_opposite_orders_do_not_deadlock_on_sqlite(sqlite_url: str) -> None:
    _checks_in_opposite_orders_do_not_deadlock(sqlite_url)


@pytest.mark.slow
@pytest.mark.postgres
def test_checks_in_opposite_orders_do_not_deadlock_on_postgresql(pg_quota_url: str) -> None:
    _checks_in_opposite_orders_do_not_deadlock(pg_quota_url)


def _kill_mid_consume(url: str, rounds: int = 3) -> None:
    rng = random.Random()
    for round_ in range(rounds):
        parent, child = SPAWN.Pipe(duplex=False)
        process = SPAWN.Process(
            target=_quota_workers.consume_until_killed,
            args=(url, "victim", round_, child, NOW),
            daemon=True,
        )
        process.start()
        child.close()
        try:
            assert parent.poll(60), "the worker never started"
            for _ in range(rng.randint(5, 60)):
                parent.recv()
            # A random moment inside the loop: spin (no sleep) for up to a few operations.
            for _ in range(rng.randrange(0, 300_000)):
                pass
        finally:
            process.kill()
            process.join(30)
            parent.close()
        assert process.exitcode == -9, process.exitcode
    with quota.connect(url, clock=lambda: NOW) as limiter:
        entries = limiter.ledger("victim")
        [usage] = limiter.quota_usage("victim")
        charged = sum(e.cost for e in entries if e.kind == "consume")
        refunded = sum(e.cost for e in entries if e.kind == "refund")
        assert usage.used == charged - refunded
        marked = {e.idempotency_key for e in entries if e.kind == "consume" and e.refunded_at}
        assert marked == {e.idempotency_key for e in entries if e.kind == "refund"}
        # The database is left usable: no lock or transaction outlives the process.
        assert limiter.consume_quota("victim", "llm", 10**9, "day", 1, "after").allowed


@pytest.mark.slow
def test_a_sigkill_mid_consume_leaves_charge_and_ledger_together_on_sqlite(
    sqlite_url: str,
) -> None:
    _kill_mid_consume(sqlite_url)


@pytest.mark.slow
@pytest.mark.postgres
def test_a_sigkill_mid_consume_leaves_charge_and_ledger_together_on_postgresql(
    pg_quota_url: str,
) -> None:
    _kill_mid_consume(pg_quota_url)


def _kill_between_charge_and_ledger(url: str) -> None:
    parent, child = SPAWN.Pipe(duplex=False)
    process = SPAWN.Process(
        target=_quota_workers.consume_and_stall, args=(url, "victim", child, NOW), daemon=True
    )
    process.start()
    child.close()
    try:
        assert parent.poll(60), "the worker never reached the ledger insert"
        parent.recv()
    finally:
        process.kill()
        process.join(30)
        parent.close()
    assert process.exitcode == -9, process.exitcode
    with quota.connect(url, clock=lambda: NOW) as limiter:
        assert limiter.quota_usage("victim") == []  # the charge went with the process
        assert limiter.ledger("victim") == []
        # Nothing outlives the process: no lock, no half transaction; the key is free.
        retry = limiter.consume_quota("victim", "llm", 100, "day", 3, "stalled")
        assert (retry.allowed, retry.replayed, retry.used) == (True, False, 3)


@pytest.mark.slow
def test_a_sigkill_between_charge_and_ledger_entry_leaves_neither_on_sqlite(
    sqlite_url: str,
) -> None:
    _kill_between_charge_and_ledger(sqlite_url)


@pytest.mark.slow
@pytest.mark.postgres
def test_a_sigkill_between_charge_and_ledger_entry_leaves_neither_on_postgresql(
    pg_quota_url: str,
) -> None:
    _kill_between_charge_and_ledger(pg_quota_url)


# -- the public surface ----------------------------------------------------------------------------------


def test_results_are_frozen(tmp_path: Path, clock: Clock) -> None:
    url = f"sqlite:///{tmp_path / 'q.db'}"
    quota.migrate(url)
    with quota.connect(url, clock=clock) as limiter:
        values = [
            limiter.consume_quota("s", "n", 1, "day", idempotency_key="k"),
            limiter.refund_quota("s", "n", "k"),
            limiter.grant_quota("s", "n", 1, "day"),
            limiter.ledger("s")[0],
            limiter.check(quota.QuotaLimit("s", "n", 1, "day")),
            DAY,
            MINUTE,
        ]
    for value in values:
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(value, dataclasses.fields(value)[0].name, None)


def test_async_methods_are_coroutines(tmp_path: Path) -> None:
    limiter = quota.connect_async(f"sqlite:///{tmp_path / 'q.db'}")
    for name in ("consume_quota", "refund_quota", "grant_quota", "quota_usage", "ledger", "check"):
        assert inspect.iscoroutinefunction(getattr(limiter, name)), name


@pytest.mark.postgres
def test_refund_racing_a_consume_of_the_same_key_never_deadlocks(pg_url: str) -> None:
    """A refund and a consume (a retry of the same key) on one subject take the usage row
    and the ledger row in one order: no `deadlock detected` in a long race."""
    import threading
    import uuid

    subject = f"race-{uuid.uuid4().hex}"
    errors: list[BaseException] = []
    with quota.connect(pg_url, pool_size=4) as limiter:
        for round_ in range(150):
            key = f"k{round_}"
            limiter.consume_quota(subject, "calls", 10**6, "day", idempotency_key=key)
            barrier = threading.Barrier(2)

            def run(call: Callable[[], object], barrier: threading.Barrier = barrier) -> None:
                barrier.wait()
                try:
                    call()
                except BaseException as exc:  # reported below
                    errors.append(exc)

            threads = [
                threading.Thread(
                    target=run, args=(lambda k=key: limiter.refund_quota(subject, "calls", k),)
                ),
                threading.Thread(
                    target=run,
                    args=(
                        lambda k=key: limiter.consume_quota(
                            subject, "calls", 10**6, "day", idempotency_key=k
                        ),
                    ),
                ),
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(30)
        assert not errors, errors[:3]
        # Usage equals the ledger: charges minus refunds.
        ledger = limiter.ledger(subject)
        charged = sum(e.cost for e in ledger if e.kind == "consume")
        refunded = sum(e.cost for e in ledger if e.kind == "refund")
        assert [u.used for u in limiter.quota_usage(subject)] == [charged - refunded]


def test_a_transaction_the_database_rolled_back_for_another_is_run_again() -> None:
    """deadlock_detected / serialization_failure: nothing was written, so the operation runs
    again from scratch (made anew by `again`); any other error is raised."""
    from quota._limiter.drive_sync import run

    class Refused(Exception):
        def __init__(self, sqlstate: str) -> None:
            super().__init__(sqlstate)
            self.sqlstate = sqlstate

    class Store:
        dialect = "postgresql"

        def __init__(self, failures: list[str]) -> None:
            self.failures = failures
            self.runs = 0

        def run(self, op: Any, *, transaction: bool) -> Any:
            self.runs += 1
            if self.failures:
                state = self.failures.pop(0)
                raise quota.StorageError(state) from Refused(state)
            return next(op, None) or "done"

    def make() -> Iterator[Any]:
        return iter(())

    store = Store(["40P01", "40001"])
    assert run(store, make(), again=make) == "done"  # type: ignore[arg-type]
    assert store.runs == 3
    with pytest.raises(quota.StorageError, match="23505"):
        run(Store(["23505"]), make(), again=make)  # type: ignore[arg-type]
