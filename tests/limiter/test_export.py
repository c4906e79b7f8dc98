"""`limiter.export`: usage per period and ledger entries of a time range, read in batches.

Run on every SQL row of the backend table (SQLite and PostgreSQL, sync and
async) with the injected clock; what the export yields is compared with the
tables read directly. The command line (``quota export``) is tested in
tests/cli/test_export_cli.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import math
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import quota
from quota._limiter import export as _export
from tests._support import Backend, Clock
from tests.limiter.test_quotas import _truncate, db_rows

UTC = dt.timezone.utc
DAY = 86400
#: Midnight UTC, 2025-06-16.
MIDNIGHT = 1_750_032_000
SUBJECTS = ("alice", "bob", "carol")


@pytest.fixture
def b(backend: Backend) -> Backend:
    if backend.dialect == "postgresql":
        _truncate(backend.url)
    return backend


def call(b: Backend, method: str, *args: Any, **kwargs: Any) -> Any:
    result = getattr(b.limiter, method)(*args, **kwargs)
    return b.run(result) if b.is_async else result


def export(b: Backend, *args: Any, **kwargs: Any) -> list[Any]:
    """Every record of ``export(*args, **kwargs)`` on `b`'s face."""
    records = b.limiter.export(*args, **kwargs)
    if not b.is_async:
        assert isinstance(records, Iterator)
        return list(records)

    async def collect() -> list[Any]:
        return [record async for record in records]

    return b.run(collect())


def fill(b: Backend, clock: Clock) -> None:
    """Three days of charges, denials, refunds and grants for three subjects."""
    for day in range(3):
        clock.now = MIDNIGHT + day * DAY + 0.5
        for i in range(7):
            for subject in SUBJECTS:
                key = f"{day}-{i}"
                call(b, "consume_quota", subject, "llm", 12, "day", cost=1 + i % 3,
                     idempotency_key=key)  # fmt: skip
                call(b, "consume_quota", subject, "search", 1000, 3600, cost=2)
            clock.advance(1800)
        call(b, "refund_quota", "alice", "llm", f"{day}-1")
        call(b, "grant_quota", "bob", "llm", 5, "day")


def test_the_export_totals_equal_the_ledger_sums_and_the_usage_rows(
    b: Backend, clock: Clock
) -> None:
    fill(b, clock)
    records = export(b, MIDNIGHT, MIDNIGHT + 3 * DAY, ledger=True, batch_size=4)
    usage = [r for r in records if r.type == "usage"]
    ledger = [r for r in records if r.type == "ledger"]
    assert records == usage + ledger  # usage first, then the ledger
    assert all(isinstance(r, quota.UsageRecord) for r in usage)
    assert all(isinstance(r, quota.LedgerRecord) for r in ledger)

    # The usage records are the rows of quota_usage, in primary-key order.
    rows = db_rows(
        b.url,
        "SELECT subject, name, period, tz, period_start, period_end, quota_limit, used,"
        " granted, updated_at FROM quota_usage ORDER BY subject, name, period_start",
    )
    assert [
        (r.subject, r.name, str(r.period), r.tz, r.period_start, r.resets_at, r.limit, r.used,
         r.granted, r.updated_at)
        for r in usage
    ] == [
        (s, n, str(p), tz, int(ps), int(pe), None if lim is None else int(lim), int(u), int(g),
         float(at))
        for s, n, p, tz, ps, pe, lim, u, g, at in rows
    ]  # fmt: skip
    assert len(usage) == 3 * 3 + 3 * 3 * 4  # llm: a day each; search: 4 hours a day each

    # Every ledger entry, once, by id.
    ids = [int(i) for (i,) in db_rows(b.url, "SELECT id FROM quota_ledger ORDER BY id")]
    assert [r.id for r in ledger] == ids
    # What was used and granted in each period is what its ledger entries add up to.
    used: Counter[tuple[str, str, int]] = Counter()
    granted: Counter[tuple[str, str, int]] = Counter()
    for entry in ledger:
        assert entry.period_start is not None
        period = (entry.subject, entry.name, entry.period_start)
        if entry.kind == "consume":
            used[period] += entry.cost
        elif entry.kind == "refund":
            used[period] -= entry.cost
        elif entry.kind == "grant":
            granted[period] += entry.cost
    assert {(r.subject, r.name, r.period_start): r.used for r in usage} == dict(used)
    assert {(r.subject, r.name, r.period_start): r.granted for r in usage if r.granted} == dict(
        granted
    )
    kinds = Counter(e.kind for e in ledger)
    # llm costs 1, 2, 3, 1, 2, 3, 1 a day against 12: the last is denied, each day, each subject.
    assert kinds == {"consume": 63 - 9 + 63, "deny": 9, "refund": 3, "grant": 3}
    refunded = [e for e in ledger if e.kind == "consume" and e.refunded_at is not None]
    assert [(e.subject, e.idempotency_key) for e in refunded] == [
        ("alice", f"{day}-1") for day in range(3)
    ]


@pytest.mark.parametrize("batch_size", [1, 2, 3, 1000])
def test_every_batch_size_gives_the_same_records(b: Backend, clock: Clock, batch_size: int) -> None:
    for i in range(5):
        clock.now = MIDNIGHT + i * 3600
        for subject in ("a", "b", "c"):
            for name in ("x", "y"):
                call(b, "consume_quota", subject, name, 10, 3600)
    whole = export(b, MIDNIGHT, MIDNIGHT + DAY, ledger=True, batch_size=100_000)
    assert len(whole) == 30 + 30
    assert export(b, MIDNIGHT, MIDNIGHT + DAY, ledger=True, batch_size=batch_size) == whole
    one = export(b, MIDNIGHT, MIDNIGHT + DAY, subject="b", ledger=True, batch_size=batch_size)
    assert one == [r for r in whole if r.subject == "b"]


def test_the_range_includes_its_start_and_excludes_its_end(b: Backend, clock: Clock) -> None:
    """Usage by period start, the ledger by the entry's time: since <= t < until."""
    for hour in range(4):  # periods of an hour starting at MIDNIGHT + 0h, 1h, 2h, 3h
        clock.now = MIDNIGHT + hour * 3600
        call(b, "consume_quota", "alice", "calls", 10, 3600)
    since, until = MIDNIGHT + 3600, MIDNIGHT + 3 * 3600
    records = export(b, since, until, ledger=True)
    assert [r.period_start for r in records if r.type == "usage"] == [since, since + 3600]
    assert [r.at for r in records if r.type == "ledger"] == [since, since + 3600]
    # The same range as datetimes, with an offset, and the whole day as dates.
    berlin = dt.timezone(dt.timedelta(hours=2))
    assert (
        export(
            b,
            dt.datetime.fromtimestamp(since, berlin),
            dt.datetime.fromtimestamp(until, UTC),
            ledger=True,
        )
        == records
    )
    day = dt.datetime.fromtimestamp(MIDNIGHT, UTC).date()
    assert len(export(b, day, day + dt.timedelta(days=1))) == 4
    assert export(b, day + dt.timedelta(days=1), day + dt.timedelta(days=2), ledger=True) == []
    # A fraction of a second past a period's start leaves it out; just before takes it in.
    assert [r.period_start for r in export(b, since + 0.25, until)] == [since + 3600]
    assert [r.period_start for r in export(b, since, until + 0.25)] == [
        since,
        since + 3600,
        until,
    ]


def test_ledger_entries_out_of_time_order_are_kept_by_their_time(b: Backend, clock: Clock) -> None:
    """Servers whose clocks disagree write entries whose ids and times are in different orders:
    an entry just outside the range, between two inside it, is left out."""
    since, until = MIDNIGHT + 3600, MIDNIGHT + 2 * 3600
    for moment in (since + 1, until, since - 0.001, since, until - 0.001, since + 2):
        clock.now = moment
        call(b, "consume_quota", "alice", "calls", 100, "day")
    for size in (1, 2, 1000):
        entries = export(b, since, until, ledger=True, batch_size=size)
        assert [e.at for e in entries if e.type == "ledger"] == [
            since + 1,
            since,
            until - 0.001,
            since + 2,
        ]
        assert [e.at for e in export(b, since, until, subject="alice", ledger=True)] == [
            since + 1,
            since,
            until - 0.001,
            since + 2,
        ]


def test_a_subject_keeps_its_own_records(b: Backend, clock: Clock) -> None:
    fill(b, clock)
    everything = export(b, MIDNIGHT, MIDNIGHT + 3 * DAY, ledger=True)
    for subject in SUBJECTS:
        mine = export(b, MIDNIGHT, MIDNIGHT + 3 * DAY, subject=subject, ledger=True, batch_size=5)
        assert mine == [r for r in everything if r.subject == subject]
        assert mine
    assert export(b, MIDNIGHT, MIDNIGHT + 3 * DAY, subject="nobody", ledger=True) == []
    # Without ledger=True, only usage.
    assert {r.type for r in export(b, MIDNIGHT, MIDNIGHT + 3 * DAY)} == {"usage"}


def test_a_record_reads_as_a_dict_with_its_type_first(b: Backend, clock: Clock) -> None:
    clock.now = MIDNIGHT + 10.5
    call(b, "consume_quota", "alice", "llm", 10, "day", cost=3, idempotency_key="job-1")
    usage, entry = export(b, MIDNIGHT, MIDNIGHT + DAY, ledger=True)
    assert usage.as_dict() == {
        "type": "usage", "subject": "alice", "name": "llm", "period": "day", "tz": "UTC",
        "period_start": MIDNIGHT, "resets_at": MIDNIGHT + DAY, "limit": 10, "used": 3,
        "granted": 0, "reserved": 0, "updated_at": MIDNIGHT + 10.5,
    }  # fmt: skip
    assert entry.as_dict() == {
        "type": "ledger", "id": entry.id, "at": MIDNIGHT + 10.5, "subject": "alice",
        "name": "llm", "kind": "consume", "cost": 3, "idempotency_key": "job-1",
        "period_start": MIDNIGHT, "resets_at": MIDNIGHT + DAY, "limit": 10, "used": 3,
        "remaining": 7, "refunded_at": None, "reservation_id": None, "reserved": None,
    }  # fmt: skip
    assert list(usage.as_dict()) == [f.name for f in dataclasses.fields(usage)]
    with pytest.raises(dataclasses.FrozenInstanceError):
        entry.cost = 1


def test_a_running_period_is_exported_as_it_stands_between_batches(
    b: Backend, clock: Clock
) -> None:
    """No transaction is held: a row changed between two batches is read as it is then."""
    clock.now = MIDNIGHT
    for subject in ("a", "b", "c"):
        call(b, "consume_quota", subject, "llm", 10, "day")
    records = b.limiter.export(MIDNIGHT, MIDNIGHT + DAY, batch_size=1)
    seen = []
    if b.is_async:
        iterator = records.__aiter__()
        seen.append(b.run(iterator.__anext__()))
        call(b, "consume_quota", "c", "llm", 10, "day", cost=4)
        seen += b.run(_rest(iterator))
    else:
        seen.append(next(records))
        call(b, "consume_quota", "c", "llm", 10, "day", cost=4)
        seen += list(records)
    assert [(r.subject, r.used) for r in seen] == [("a", 1), ("b", 1), ("c", 5)]


async def _rest(iterator: Any) -> list[Any]:
    return [record async for record in iterator]


# -- bad arguments: a ConfigurationError naming the argument, when called ----------------------


@pytest.fixture(params=["sync", "async"])
def offline(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    """A limiter on a SQLite file that cannot exist: any database access would fail."""
    url = f"sqlite:///{tmp_path / 'missing-dir' / 'q.db'}"
    limiter = quota.connect_async(url) if request.param == "async" else quota.connect(url)
    return limiter


NAIVE = dt.datetime(2026, 1, 1)


@pytest.mark.parametrize(
    ("kwargs", "argument", "value"),
    [
        ({"since": NAIVE}, "since", NAIVE),
        ({"until": NAIVE}, "until", NAIVE),
        ({"since": "2026-01-01"}, "since", "2026-01-01"),
        ({"since": True}, "since", True),
        ({"since": None}, "since", None),
        ({"until": math.nan}, "until", math.nan),
        ({"until": math.inf}, "until", math.inf),
        ({"since": -1e13}, "since", -1e13),
        ({"until": 10**20}, "until", 10**20),
        ({"since": MIDNIGHT + DAY}, "until", MIDNIGHT + DAY),  # until not after since
        ({"until": MIDNIGHT}, "until", MIDNIGHT),  # an empty range
        ({"subject": ""}, "subject", ""),
        ({"subject": 7}, "subject", 7),
        ({"ledger": "yes"}, "ledger", "yes"),
        ({"ledger": 1}, "ledger", 1),
        ({"batch_size": 0}, "batch_size", 0),
        ({"batch_size": 100_001}, "batch_size", 100_001),
        ({"batch_size": 2.0}, "batch_size", 2.0),
    ],
)
def test_a_bad_argument_is_rejected_at_the_call_naming_it(
    offline: Any, kwargs: dict[str, Any], argument: str, value: object
) -> None:
    arguments: dict[str, Any] = {"since": MIDNIGHT, "until": MIDNIGHT + DAY, **kwargs}
    with pytest.raises(quota.ConfigurationError) as caught:
        offline.export(arguments.pop("since"), arguments.pop("until"), **arguments)
    assert argument in str(caught.value)
    assert repr(value) in str(caught.value)


def _memory_errors(face: str, url: str) -> tuple[str, str]:
    """What `quota_usage` and the first record of `export` raise on a memory store."""
    if face == "sync":
        with quota.connect(url) as limiter:
            with pytest.raises(quota.ConfigurationError) as usage:
                limiter.quota_usage("alice")
            with pytest.raises(quota.ConfigurationError) as exported:
                next(limiter.export(MIDNIGHT, MIDNIGHT + DAY))
        return str(usage.value), str(exported.value)

    async def both() -> tuple[str, str]:
        async with quota.connect_async(url) as limiter:
            with pytest.raises(quota.ConfigurationError) as usage:
                await limiter.quota_usage("alice")
            with pytest.raises(quota.ConfigurationError) as exported:
                await limiter.export(MIDNIGHT, MIDNIGHT + DAY).__anext__()
        return str(usage.value), str(exported.value)

    return asyncio.run(both())


@pytest.mark.parametrize("face", ["sync", "async"])
def test_a_store_without_durable_quotas_says_so_as_the_other_quota_methods_do(
    face: str, memory_url: str
) -> None:
    usage, exported = _memory_errors(face, memory_url)
    assert "durable quotas and other SQL-only features need sqlite://" in exported
    # The same sentence, but for the statement's name.
    assert usage.split(":", 1)[1] == exported.split(":", 1)[1]


# -- the column tables -------------------------------------------------------------------------


def test_the_column_tables_name_every_field_of_the_records() -> None:
    """A column added to a table is one line in its column table and one field in its record."""
    for record, columns in (
        (quota.UsageRecord, _export.USAGE_COLUMNS),
        (quota.LedgerRecord, _export.LEDGER_COLUMNS),
    ):
        init = [f.name for f in dataclasses.fields(record) if f.init]
        assert init == [c.field for c in columns]
        assert dataclasses.fields(record)[0].name == "type"


@pytest.mark.postgres
def test_the_asyncpg_driver_exports_too(pg_url: str) -> None:
    """asyncpg types each parameter from its column: the bounds must match them."""
    pytest.importorskip("asyncpg")
    _truncate(pg_url)
    clock = Clock(MIDNIGHT + 0.5)
    with quota.connect(pg_url, clock=clock) as limiter:
        for subject in ("a", "b"):
            limiter.consume_quota(subject, "llm", 10, "day", idempotency_key="k")
            limiter.consume_quota(subject, "llm", 10, "day")
        expected = list(limiter.export(MIDNIGHT - 0.5, MIDNIGHT + DAY + 0.5, ledger=True))
    url = pg_url.replace("postgresql://", "postgresql+asyncpg://", 1)

    async def go() -> list[Any]:
        async with quota.connect_async(url, pool_size=1) as limiter:
            first = [
                r
                async for r in limiter.export(
                    MIDNIGHT - 0.5, MIDNIGHT + DAY + 0.5, ledger=True, batch_size=1
                )
            ]
            mine = [
                r
                async for r in limiter.export(
                    dt.date(2025, 6, 16), dt.date(2025, 6, 17), subject="b", ledger=True,
                    batch_size=1,
                )
            ]  # fmt: skip
            assert mine == [r for r in first if r.subject == "b"]
            return first

    assert asyncio.run(go()) == expected
    assert len(expected) == 2 + 4


def test_usage_and_ledger_periods_agree(b: Backend, clock: Clock) -> None:
    """Each ledger entry of a charge names a period the usage records hold."""
    fill(b, clock)
    records = export(b, MIDNIGHT, MIDNIGHT + 3 * DAY, ledger=True)
    periods = {(r.subject, r.name, r.period_start) for r in records if r.type == "usage"}
    by_period: defaultdict[tuple[str, str, int | None], int] = defaultdict(int)
    for r in records:
        if r.type == "ledger":
            by_period[(r.subject, r.name, r.period_start)] += 1
    assert set(by_period) == periods
