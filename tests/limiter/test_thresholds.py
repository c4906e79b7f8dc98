"""Usage thresholds: the firing rule (exact, with grants), once per period, re-arming by
refunds and grants, ``fired`` on decisions, the ``on_threshold`` callback after the
commit, validation, old schemas, and eight processes racing over one threshold.

Behaviour tests run on every row of the backend table (SQLite and PostgreSQL, sync and
async) with the injected clock.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
from collections.abc import Callable
from decimal import Decimal
from typing import Any

import pytest

import quota
from quota._limiter import quotas as _quotas
from quota._limiter import thresholds as _thresholds
from quota._limiter.quota_types import check_thresholds
from quota._sql import quotas as q
from tests import _threshold_workers, _workers
from tests._support import Backend
from tests.limiter.test_quotas import NOW, db_rows

D = Decimal


def call(backend: Backend, face: Any, method: str, *args: Any, **kwargs: Any) -> Any:
    result = getattr(face.limiter, method)(*args, **kwargs)
    return backend.run(result) if backend.is_async else result


def consume(backend: Backend, *args: Any, face: Any = None, **kwargs: Any) -> quota.QuotaDecision:
    decision: quota.QuotaDecision = call(backend, face or backend, "consume_quota", *args, **kwargs)
    return decision


def events(url: str, subject: str = "s") -> list[tuple[str, int, int, bool]]:
    """(threshold, used, limit, armed) of `subject`'s events, oldest first."""
    return [
        (str(t), int(u), int(lim), r is None)
        for t, u, lim, r in db_rows(
            url,
            "SELECT threshold, used, quota_limit, rearmed_at FROM quota_events"
            f" WHERE subject = '{subject}' ORDER BY id",
        )
    ]


# -- the rule, without a database ------------------------------------------------------------


def test_the_rule_is_exact_where_floats_are_not() -> None:
    assert 0.07 * 100 > 7  # a float comparison would miss the crossing at 7 of 100
    assert _thresholds.crossed(check_thresholds((0.07,)), 7, 100) == [D("0.07")]
    assert _thresholds.crossed([D("0.07")], 6, 100) == []
    assert _thresholds.crossed([D("0.8"), D("0.9"), D("1")], 9, 10) == [D("0.8"), D("0.9")]
    # Huge limits: exact too (a float would round 2**60 - 1 to 2**60).
    assert _thresholds.crossed([D("1")], 2**60 - 1, 2**60) == []


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ((0.8, 0.9, 1.0), (D("0.8"), D("0.9"), D("1"))),
        ([1, 0.5], (D("0.5"), D("1"))),
        ((D("0.25"),), (D("0.25"),)),
        ((), ()),
        (None, ()),
    ],
)
def test_thresholds_become_exact_decimals_smallest_first(given: Any, expected: Any) -> None:
    assert check_thresholds(given) == expected


@pytest.mark.parametrize(
    ("given", "named"),
    [
        ((0,), "0"),
        ((-0.5,), "-0.5"),
        ((1.5,), "1.5"),
        ((float("nan"),), "nan"),
        ((float("inf"),), "inf"),
        ((True,), "True"),
        (("0.8",), "'0.8'"),
        ((0.8, D("0.80")), "Decimal('0.80')"),
        ((0.5, 0.5), "0.5"),
        ("0.8", "'0.8'"),
        (0.8, "0.8"),
        (tuple(i / 100 for i in range(1, 30)), "29"),
    ],
)
def test_bad_thresholds_name_the_argument_and_value(given: Any, named: str) -> None:
    with pytest.raises(quota.ConfigurationError, match="thresholds") as info:
        check_thresholds(given)
    assert named in str(info.value)
    with pytest.raises(quota.ConfigurationError, match="thresholds"):
        quota.QuotaLimit("s", "n", 10, "day", thresholds=given)


@pytest.mark.parametrize("bad", [(0.5, 2), 0, 0.8, "", False])
def test_bad_thresholds_fail_the_call_before_any_statement(backend: Backend, bad: Any) -> None:
    with pytest.raises(quota.ConfigurationError, match="thresholds"):
        consume(backend, "s", "n", 10, "day", thresholds=bad)
    assert db_rows(backend.url, "SELECT count(*) FROM quota_usage") == [(0,)]


def test_on_threshold_must_be_callable() -> None:
    with pytest.raises(quota.ConfigurationError, match="on_threshold"):
        quota.Options(on_threshold=42)  # type: ignore[arg-type]


def _statements(op: Any, rows: list[Any]) -> list[str]:
    """The names of the statements `op` runs when each answers the next of `rows`."""
    names = []
    answer = None
    try:
        while True:
            statement, _ = op.send(answer)
            names.append(statement.name)
            answer = rows.pop(0)
    except StopIteration:
        return names


def test_no_thresholds_no_extra_statement() -> None:
    charge = [[(9, 0, 0)], [(1,)]]  # usage_charge: used, granted, reserved
    plain = _quotas.consume("s", "n", 10, "day", 1, None, None, NOW)
    assert _statements(plain, list(charge)) == ["usage_charge", "ledger_charge"]
    below = _quotas.consume("s", "n", 10, "day", 1, None, None, NOW, (0.95,))
    assert _statements(below, list(charge)) == ["usage_charge", "ledger_charge"]
    above = _quotas.consume("s", "n", 10, "day", 1, None, None, NOW, (0.5, 0.9))
    assert _statements(above, [*charge, []]) == ["usage_charge", "ledger_charge", "events_fire_2"]
    assert q.USAGE_CHARGE.name == "usage_charge"


# -- on every backend ------------------------------------------------------------------------


def test_each_threshold_fires_once_at_its_crossing(backend: Backend) -> None:
    fired_at = {}
    for _ in range(12):
        d = consume(backend, "s", "n", 10, "day", thresholds=(0.5, 0.8, 1))
        if d.fired:
            fired_at[d.used] = [str(e.threshold) for e in d.fired]
    assert fired_at == {5: ["0.5"], 8: ["0.8"], 10: ["1"]}
    assert events(backend.url) == [("0.5", 5, 10, True), ("0.8", 8, 10, True), ("1", 10, 10, True)]


def test_a_fired_event_says_what_was_crossed(backend: Backend) -> None:
    d = consume(backend, "s", "n", 10, "day", cost=9, thresholds=(0.5, 0.8))
    assert [e.threshold for e in d.fired] == [D("0.5"), D("0.8")]
    event = d.fired[1]
    assert (event.subject, event.quota, event.period_start) == ("s", "n", d.period_start)
    assert (event.used, event.limit, event.at) == (9, 10, backend.clock())
    [(stored_id,)] = db_rows(backend.url, "SELECT id FROM quota_events WHERE threshold = '0.8'")
    assert event.id == int(stored_id)


def test_grants_count_in_the_limit(backend: Backend) -> None:
    call(backend, backend, "grant_quota", "s", "n", 10, "day")
    fired = [consume(backend, "s", "n", 10, "day", thresholds=(0.5,)) for _ in range(10)]
    assert [d.used for d in fired if d.fired] == [10]  # half of 10 + 10, not of 10
    assert events(backend.url) == [("0.5", 10, 20, True)]


def test_a_denied_charge_fires_nothing(backend: Backend) -> None:
    consume(backend, "s", "n", 10, "day", cost=7)
    d = consume(backend, "s", "n", 10, "day", cost=5, thresholds=(0.5,))
    assert not d.allowed and d.fired == ()
    assert events(backend.url) == []


def test_thresholds_reached_before_they_were_asked_for_fire_at_the_next_charge(
    backend: Backend,
) -> None:
    consume(backend, "s", "n", 10, "day", cost=6)
    d = consume(backend, "s", "n", 10, "day", thresholds=(0.5,))
    assert [str(e.threshold) for e in d.fired] == ["0.5"]


def test_a_refund_below_the_threshold_rearms_it(backend: Backend) -> None:
    first = consume(backend, "s", "n", 10, "day", cost=8, idempotency_key="a", thresholds=(0.8,))
    assert len(first.fired) == 1
    call(backend, backend, "refund_quota", "s", "n", "a")
    assert events(backend.url) == [("0.8", 8, 10, False)]
    again = consume(backend, "s", "n", 10, "day", cost=8, idempotency_key="b", thresholds=(0.8,))
    assert len(again.fired) == 1 and again.fired[0].id != first.fired[0].id
    assert events(backend.url) == [("0.8", 8, 10, False), ("0.8", 8, 10, True)]


def test_a_refund_that_stays_above_keeps_it_fired(backend: Backend) -> None:
    consume(backend, "s", "n", 10, "day", cost=8, thresholds=(0.5,))
    consume(backend, "s", "n", 10, "day", cost=1, idempotency_key="a")
    call(backend, backend, "refund_quota", "s", "n", "a")
    assert consume(backend, "s", "n", 10, "day", thresholds=(0.5,)).fired == ()
    assert events(backend.url) == [("0.5", 8, 10, True)]


def test_a_grant_that_lowers_the_share_rearms_it(backend: Backend) -> None:
    consume(backend, "s", "n", 10, "day", cost=9, thresholds=(0.9,))
    call(backend, backend, "grant_quota", "s", "n", 10, "day")  # 9 of 20: below 0.9
    assert events(backend.url) == [("0.9", 9, 10, False)]
    fired = [consume(backend, "s", "n", 10, "day", cost=1, thresholds=(0.9,)) for _ in range(11)]
    assert [d.used for d in fired if d.fired] == [18]
    assert events(backend.url)[-1] == ("0.9", 18, 20, True)


def test_check_fires_a_quota_limits_thresholds(backend: Backend) -> None:
    limit = quota.QuotaLimit("s", "n", 4, "day", thresholds=(0.5,))
    results = [call(backend, backend, "check", limit) for _ in range(3)]
    fired = [d.decisions[0].fired for d in results]
    assert [len(f) for f in fired] == [0, 1, 0]
    assert fired[1][0].used == 2


def test_a_check_denied_elsewhere_fires_nothing(backend: Backend) -> None:
    got: list[quota.ThresholdEvent] = []
    face = backend.connect(on_threshold=got.append)
    full = quota.RateWindow("k", 1, 60)
    call(backend, face, "check", full)
    limit = quota.QuotaLimit("s", "n", 2, "day", thresholds=(0.5,))
    result = call(backend, face, "check", limit, full)
    assert not result.allowed and result.decisions[0].fired == ()
    assert got == [] and events(backend.url) == []


def test_the_callback_runs_after_the_commit(backend: Backend) -> None:
    seen: list[Any] = []

    def on_threshold(event: quota.ThresholdEvent) -> None:
        # Read on a connection of its own: only a committed row is there.
        seen.append((event.threshold, db_rows(backend.url, "SELECT count(*) FROM quota_events")))

    face = backend.connect(on_threshold=on_threshold)
    consume(backend, "s", "n", 10, "day", cost=9, thresholds=(0.5, 0.9), face=face)
    assert seen == [(D("0.5"), [(2,)]), (D("0.9"), [(2,)])]


def test_the_callback_is_not_called_for_a_rolled_back_charge(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    got: list[quota.ThresholdEvent] = []
    face = backend.connect(on_threshold=got.append)
    real = _quotas._fire_thresholds

    def fire_then_fail(*args: Any) -> Any:
        yield from real(*args)
        raise quota.StorageError("the database failed after the events were written")

    monkeypatch.setattr(_quotas, "_fire_thresholds", fire_then_fail)
    with pytest.raises(quota.StorageError, match="after the events"):
        consume(backend, "s", "n", 10, "day", cost=9, thresholds=(0.5,), face=face)
    assert got == []
    assert events(backend.url) == []
    assert db_rows(backend.url, "SELECT count(*) FROM quota_usage") == [(0,)]


def test_a_failing_callback_is_logged_not_raised(
    backend: Backend, caplog: pytest.LogCaptureFixture
) -> None:
    calls: list[Decimal] = []

    def broken(event: quota.ThresholdEvent) -> None:
        calls.append(event.threshold)
        raise RuntimeError("the pager is down")

    face = backend.connect(on_threshold=broken)
    with caplog.at_level(logging.ERROR, logger="quota"):
        d = consume(backend, "s", "n", 10, "day", cost=9, thresholds=(0.5, 0.9), face=face)
    assert d.allowed and len(d.fired) == 2
    assert calls == [D("0.5"), D("0.9")]  # one failing does not skip the next
    assert sum("on_threshold raised" in r.getMessage() for r in caplog.records) == 2
    assert "the pager is down" in caplog.text
    assert len(events(backend.url)) == 2  # the outbox keeps them for the webhook


def test_the_async_face_awaits_a_coroutine_callback(
    open_backend: Callable[..., Backend], sqlite_url: str
) -> None:
    got: list[Decimal] = []

    async def on_threshold(event: quota.ThresholdEvent) -> None:
        await asyncio.sleep(0)
        got.append(event.threshold)

    backend = open_backend("sqlite-async", sqlite_url, on_threshold=on_threshold)
    consume(backend, "s", "n", 2, "day", thresholds=(0.5,))
    assert got == [D("0.5")]


def test_the_sync_face_refuses_a_coroutine_callback_in_the_log(
    open_backend: Callable[..., Backend], sqlite_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    async def on_threshold(event: quota.ThresholdEvent) -> None:
        raise AssertionError("never awaited")

    backend = open_backend("sqlite-sync", sqlite_url, on_threshold=on_threshold)
    with caplog.at_level(logging.ERROR, logger="quota"):
        d = consume(backend, "s", "n", 2, "day", thresholds=(0.5,))
    assert len(d.fired) == 1
    assert "returned an awaitable" in caplog.text


def test_a_replayed_charge_fires_nothing_again(backend: Backend) -> None:
    got: list[quota.ThresholdEvent] = []
    face = backend.connect(on_threshold=got.append)
    first = consume(
        backend, "s", "n", 10, "day", cost=9, idempotency_key="k", thresholds=(0.5,), face=face
    )
    again = consume(
        backend, "s", "n", 10, "day", cost=9, idempotency_key="k", thresholds=(0.5,), face=face
    )
    assert len(first.fired) == 1 and again.replayed and again.fired == ()
    assert len(got) == 1


# -- reservations: the hold fires nothing, its settle fires what its charge reaches ---------


def test_a_hold_fires_nothing_and_its_settle_fires_once(backend: Backend) -> None:
    got: list[quota.ThresholdEvent] = []
    face = backend.connect(on_threshold=got.append)
    held = call(backend, face, "reserve_quota", "s", "n", 9, 10, "day", thresholds=(0.5, 0.8))
    assert held.allowed and held.decision.fired == () and events(backend.url) == []
    settled = call(backend, face, "settle_quota", held.id, 6)
    assert [str(e.threshold) for e in settled.fired] == ["0.5"] and settled.used == 6
    assert [str(e.threshold) for e in got] == ["0.5"]
    assert events(backend.url) == [("0.5", 6, 10, True)]
    again = call(backend, face, "settle_quota", held.id, 9)
    assert again.replayed and again.fired == () and len(got) == 1
    # The next charge that reaches 0.8 fires it, once.
    d = consume(backend, "s", "n", 10, "day", cost=2, thresholds=(0.5, 0.8), face=face)
    assert [str(e.threshold) for e in d.fired] == ["0.8"]
    assert [str(e.threshold) for e in got] == ["0.5", "0.8"]


def test_a_released_hold_fires_nothing(backend: Backend) -> None:
    held = call(backend, backend, "reserve_quota", "s", "n", 10, 10, "day", thresholds=(0.5,))
    released = call(backend, backend, "release_quota", held.id)
    assert released.fired == () and released.used == 0 and events(backend.url) == []


def test_bad_thresholds_on_a_reserve_hold_nothing(backend: Backend) -> None:
    with pytest.raises(quota.ConfigurationError, match="thresholds"):
        call(backend, backend, "reserve_quota", "s", "n", 1, 10, "day", thresholds=(1.5,))
    assert call(backend, backend, "quota_usage", "s") == []


# -- a database not migrated to the outbox -----------------------------------------------------


@pytest.mark.parametrize("face", ["sync", "async"])
def test_an_old_schema_says_to_migrate_and_works_without_thresholds(
    sql_database: Callable[..., str], sql_dialect: str, face: str,
    open_backend: Callable[..., Backend],
) -> None:  # fmt: skip
    url = sql_database("0007_reservations")  # durable quotas need 0007 at least
    backend = open_backend(f"{sql_dialect}-{face}", url)
    d = consume(backend, "s", "n", 10, "day", cost=9, idempotency_key="a")
    assert d.allowed and d.fired == ()
    assert call(backend, backend, "refund_quota", "s", "n", "a").refunded
    assert call(backend, backend, "grant_quota", "s", "n", 1, "day").granted == 1
    with pytest.raises(quota.SchemaError, match="quota migrate") as info:
        consume(backend, "s", "n", 10, "day", cost=9, thresholds=(0.5,))
    assert "quota_events" in str(info.value)
    with pytest.raises(quota.SchemaError, match="quota migrate"):
        call(backend, backend, "check", quota.QuotaLimit("s", "n", 10, "day", thresholds=(0.05,)))
    # Nothing of the failed calls stayed: the charge rolled back with them.
    assert call(backend, backend, "quota_usage", "s")[0].used == 0
    quota.migrate(url)
    assert len(consume(backend, "s", "n", 10, "day", cost=9, thresholds=(0.5,)).fired) == 1


@pytest.mark.parametrize("face", ["sync", "async"])
def test_a_reserve_with_thresholds_before_the_outbox_says_to_migrate(
    sql_database: Callable[..., str], sql_dialect: str, face: str,
    open_backend: Callable[..., Backend],
) -> None:  # fmt: skip
    url = sql_database("0007_reservations")
    backend = open_backend(f"{sql_dialect}-{face}", url)
    with pytest.raises(quota.SchemaError, match="quota migrate"):
        call(backend, backend, "reserve_quota", "s", "n", 5, 10, "day", thresholds=(0.5,))
    # Held nothing; without thresholds a reservation works at 0007.
    held = call(backend, backend, "reserve_quota", "s", "n", 5, 10, "day")
    assert held.allowed and call(backend, backend, "settle_quota", held.id, 5).used == 5


# -- several processes -------------------------------------------------------------------------

SPAWN = multiprocessing.get_context("spawn")


def _one_event_per_threshold(url: str) -> None:
    limit, processes, calls = 1000, 8, 110  # 880 charges: past 800, short of the limit
    results = _workers.run_processes(
        SPAWN,
        _threshold_workers.race_worker,
        [(url, "s", "n", limit, calls, NOW)] * processes,
    )
    fired = [(used, t) for result in results for used, ts in result for t in ts]
    assert fired == [(800, "0.8")]
    assert sorted(used for result in results for used, _ in result) == list(
        range(1, processes * calls + 1)
    )
    assert events(url) == [("0.8", 800, 1000, True)]


@pytest.mark.slow
def test_processes_racing_on_sqlite_fire_once(sqlite_url: str) -> None:
    _one_event_per_threshold(sqlite_url)


@pytest.mark.slow
@pytest.mark.postgres
def test_processes_racing_on_postgresql_fire_once(pg_store_url: str) -> None:
    _one_event_per_threshold(pg_store_url)
