"""Reserve, then settle: holds against durable quotas, settles, releases and expiry.

Behaviour tests run on every row of the backend table (SQLite and PostgreSQL, sync
and async) with the injected clock: expiry is tested by moving the clock, never by
sleeping. Processes (``spawn``) reserve and settle against one limit while some of
them are SIGKILLed; the ledger, replayed in id order, shows the limit held at every
moment.
"""

from __future__ import annotations

import datetime as dt
import multiprocessing
import random
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import quota
from tests import _reservation_workers
from tests._support import Backend, Clock
from tests.conftest import SQL_DIALECTS, backend_params, dialect_of, new_sql_database

NAME = "tokens"
DAY = 86400


class Q:
    """The quota methods of a backend's limiter as plain sync calls."""

    def __init__(self, backend: Backend, limiter: Any = None) -> None:
        self.backend = backend
        self.limiter = limiter if limiter is not None else backend.limiter
        self.clock: Clock = backend.clock

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self.limiter, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            result = method(*args, **kwargs)
            return self.backend.run(result) if self.backend.is_async else result

        return call

    def reserve(self, amount: int, limit: int = 100, subject: str = "s", **kw: Any) -> Any:
        return self.reserve_quota(subject, NAME, amount, limit, "day", **kw)

    def consume(self, cost: int, limit: int = 100, subject: str = "s", **kw: Any) -> Any:
        return self.consume_quota(subject, NAME, limit, "day", cost, **kw)

    def usage(self, subject: str = "s") -> tuple[int, int]:
        """(used, reserved) of `subject`'s quota in the running period."""
        rows = [u for u in self.quota_usage(subject) if u.name == NAME]
        return (rows[0].used, rows[0].reserved) if rows else (0, 0)

    def kinds(self, subject: str = "s") -> list[str]:
        return [e.kind for e in self.ledger(subject)]

    def charged(self, subject: str = "s") -> int:
        """What the ledger charged: consumes not refunded, and settles."""
        return sum(
            e.cost
            for e in self.ledger(subject)
            if (e.kind == "consume" and e.refunded_at is None) or e.kind == "settle"
        )


@pytest.fixture
def q(backend: Backend) -> Q:
    return Q(backend)


# -- holding -----------------------------------------------------------------------------


def test_a_reservation_holds_its_amount_and_others_count_it(q: Q) -> None:
    held = q.reserve(60)
    assert held.allowed and isinstance(held.id, str) and held.id
    assert held.expires_at == q.clock.now + 300
    assert (held.decision.reserved, held.decision.used, held.decision.cost) == (60, 0, 60)
    assert q.usage() == (0, 60)

    # 60 held of 100: a hold of 50 does not fit, one of 40 does; then nothing fits.
    denied = q.reserve(50)
    assert (denied.allowed, denied.id, denied.expires_at) == (False, None, None)
    assert denied.decision.reserved == 60
    assert q.reserve(40).allowed
    assert not q.consume(1).allowed
    assert q.usage() == (0, 100)
    assert q.kinds() == ["reserve", "deny", "reserve", "deny"]


def test_a_consume_leaves_room_for_the_holds(q: Q) -> None:
    q.consume(30)
    assert not q.reserve(71).allowed
    assert q.reserve(70).allowed
    assert not q.consume(1).allowed
    q.grant_quota("s", NAME, 5, "day")
    assert q.reserve(5).allowed  # granted units count as for a consume
    assert q.usage() == (30, 75)


def test_a_denied_reservation_holds_nothing_and_says_when_the_period_resets(q: Q) -> None:
    q.consume(90)
    denied = q.reserve(11)
    assert not denied.allowed
    assert denied.decision.retry_after == DAY - int(q.clock.now) % DAY
    assert q.usage() == (90, 0)
    [deny] = [e for e in q.ledger("s") if e.kind == "deny"]
    assert (deny.cost, deny.reservation_id) == (11, None)


def test_a_retry_with_the_idempotency_key_returns_the_same_reservation(q: Q) -> None:
    first = q.reserve(30, idempotency_key="req-1")
    again = q.reserve(30, idempotency_key="req-1")
    assert (again.id, again.expires_at, again.allowed) == (first.id, first.expires_at, True)
    assert again.decision.replayed and not first.decision.replayed
    assert q.usage() == (0, 30)
    assert q.kinds() == ["reserve"]
    other = q.reserve(30, idempotency_key="req-2")
    assert other.id != first.id


# -- settling ----------------------------------------------------------------------------


def test_a_settle_below_the_amount_charges_the_actual_and_releases_the_rest(q: Q) -> None:
    held = q.reserve(60, idempotency_key="r")
    d = q.settle_quota(held.id, 25)
    assert (d.allowed, d.used, d.reserved, d.cost, d.overage, d.expired) == (
        True, 25, 0, 25, 0, False,
    )  # fmt: skip
    assert d.idempotency_key == "r" and not d.replayed
    assert q.usage() == (25, 0)
    settle = q.ledger("s")[-1]
    assert (settle.kind, settle.cost, settle.reservation_id, settle.reserved) == (
        "settle", 25, held.id, 60,
    )  # fmt: skip
    assert q.charged() == 25


def test_a_settle_above_the_amount_charges_the_excess_as_far_as_the_limit_allows(q: Q) -> None:
    mine = q.reserve(30)
    q.reserve(50)  # someone else's hold
    q.consume(10)
    # 10 used + 50 held by the other: room for 40 in all, 30 of it reserved.
    d = q.settle_quota(mine.id, 55)
    assert (d.allowed, d.used, d.reserved, d.overage) == (True, 50, 50, 15)
    assert q.usage() == (50, 50)
    assert q.ledger("s")[-1].cost == 40  # the ledger holds what was charged, not asked
    assert q.charged() == 50


def test_a_settle_above_the_amount_that_fits_is_charged_whole(q: Q) -> None:
    held = q.reserve(10)
    d = q.settle_quota(held.id, 35)
    assert (d.used, d.overage) == (35, 0)


def test_a_second_settle_returns_the_first_and_charges_nothing(q: Q) -> None:
    held = q.reserve(40)
    first = q.settle_quota(held.id, 30)
    for actual in (30, 5, 90, 0):
        again = q.settle_quota(held.id, actual)
        assert again.replayed
        assert dict_of(again, replayed=False) == dict_of(first)
    assert q.release_quota(held.id).replayed
    assert q.usage() == (30, 0)
    assert q.kinds().count("settle") == 1


def dict_of(decision: quota.QuotaDecision, **changes: Any) -> dict[str, Any]:
    import dataclasses

    return dataclasses.asdict(dataclasses.replace(decision, **changes))


def test_release_charges_nothing(q: Q) -> None:
    held = q.reserve(70)
    d = q.release_quota(held.id)
    assert (d.allowed, d.used, d.reserved, d.cost, d.overage) == (True, 0, 0, 0, 0)
    assert q.usage() == (0, 0)
    assert q.reserve(100).allowed
    assert q.kinds() == ["reserve", "settle", "reserve"]
    assert q.ledger("s")[1].cost == 0


def test_a_settle_charges_the_period_of_the_reservation(q: Q) -> None:
    q.clock.now = (q.clock.now // DAY + 1) * DAY - 10  # ten seconds before midnight
    held = q.reserve(20)
    q.clock.advance(20)  # the next day
    d = q.settle_quota(held.id, 15)
    assert d.period_start == held.decision.period_start and not d.expired
    usages = q.quota_usage("s", include_ended=True)
    assert [(u.period_start, u.used, u.reserved) for u in usages] == [
        (held.decision.period_start, 15, 0)
    ]


def test_an_unknown_id_raises_reservation_not_found(q: Q) -> None:
    with pytest.raises(quota.ReservationNotFound) as info:
        q.settle_quota("no-such-id", 1)
    assert info.value.reservation_id == "no-such-id"
    assert isinstance(info.value, quota.QuotaError)
    with pytest.raises(quota.ReservationNotFound):
        q.release_quota("no-such-id")


def test_used_is_what_the_ledger_charged(q: Q) -> None:
    rng = random.Random(7)
    for i in range(40):
        if rng.random() < 0.3:
            q.consume(rng.randint(1, 5), limit=1000, idempotency_key=f"c{i}")
        held = q.reserve(rng.randint(1, 30), limit=1000)
        if held.allowed and rng.random() < 0.8:
            q.settle_quota(held.id, rng.randint(0, 40))
        if i % 7 == 6:
            q.refund_quota("s", NAME, f"c{i - 1}")
            q.clock.advance(31)
    q.clock.advance(300)
    used, reserved = q.usage()
    assert reserved == 0
    assert used == q.charged()


# -- expiry ------------------------------------------------------------------------------


def test_a_hold_expires_at_its_ttl_on_the_next_usage_read(q: Q) -> None:
    held = q.reserve(60, ttl=30)
    q.clock.advance(29.999)
    assert q.usage() == (0, 60)
    q.clock.advance(0.001)  # no grace
    assert q.usage() == (0, 0)
    release = q.ledger("s")[-1]
    assert (release.kind, release.cost, release.reservation_id, release.reserved) == (
        "release", 60, held.id, 60,
    )  # fmt: skip
    assert q.usage() == (0, 0)
    assert q.kinds().count("release") == 1


@pytest.mark.parametrize("how", ["consume", "reserve", "check"])
def test_a_hold_expires_on_the_next_charge(q: Q, how: str) -> None:
    q.reserve(60, ttl="1m")
    q.reserve(20, ttl="1h")
    q.clock.advance(60)
    if how == "consume":
        assert q.consume(80).allowed
    elif how == "reserve":
        assert q.reserve(80).allowed
    else:
        assert q.check(quota.QuotaLimit("s", NAME, 100, "day"), cost=80).allowed
    assert "release" in q.kinds()
    assert sum(q.usage()) == 100


def test_cleanup_releases_the_holds_whose_time_is_up(q: Q) -> None:
    for subject in ("a", "b", "c"):
        q.reserve(10, subject=subject, ttl=10)
    q.reserve(10, subject="d", ttl=100)
    q.clock.advance(10)
    assert q.cleanup(dry_run=True).released == 3
    assert q.cleanup(batch_size=2).released == 3
    assert q.cleanup().released == 0
    for subject in ("a", "b", "c"):
        assert q.kinds(subject) == ["reserve", "release"]
        assert q.usage(subject) == (0, 0)
    assert q.usage("d") == (0, 10)


def test_a_settle_after_expiry_is_charged_like_a_new_consume(q: Q) -> None:
    held = q.reserve(40, ttl=10, idempotency_key="late")
    q.clock.advance(11)
    d = q.settle_quota(held.id, 30)
    assert (d.allowed, d.expired, d.used, d.overage, d.cost) == (True, True, 30, 0, 30)
    assert q.kinds() == ["reserve", "release", "settle"]
    assert q.usage() == (30, 0)
    assert q.settle_quota(held.id, 99).replayed


def test_a_settle_after_expiry_that_does_not_fit_charges_nothing(q: Q) -> None:
    held = q.reserve(40, ttl=10)
    q.clock.advance(11)
    q.consume(80)  # releases the hold, and takes most of the room
    d = q.settle_quota(held.id, 30)
    assert (d.allowed, d.expired, d.used, d.overage) == (False, True, 80, 30)
    assert q.usage() == (80, 0)
    assert q.ledger("s")[-1].cost == 0
    assert q.charged() == 80


def test_a_settle_after_expiry_goes_to_the_period_running_then(q: Q) -> None:
    q.clock.now = (q.clock.now // DAY + 1) * DAY - 10
    held = q.reserve(40, ttl=5)
    q.clock.advance(20)
    d = q.settle_quota(held.id, 30)
    assert d.expired and d.period_start == held.decision.period_start + DAY
    assert [(u.used, u.reserved) for u in q.quota_usage("s", include_ended=True)] == [
        (30, 0), (0, 0),
    ]  # fmt: skip


# -- arguments ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"ttl": 0}, "ttl"),
        ({"ttl": 604801}, "ttl"),
        ({"ttl": "8d"}, "ttl"),
        ({"ttl": "soon"}, "ttl"),
        ({"ttl": 1.5}, "ttl"),
        ({"ttl": True}, "ttl"),
        ({"amount": 0}, "amount"),
        ({"amount": 101}, "amount"),
        ({"amount": "5"}, "amount"),
        ({"limit": 0}, "limit"),
        ({"period": "fortnight"}, "period"),
        ({"idempotency_key": ""}, "idempotency_key"),
        ({"subject": ""}, "subject"),
    ],
)
def test_bad_reserve_arguments_raise_configuration_error_naming_them(
    q: Q, kwargs: dict[str, Any], named: str
) -> None:
    call = {"subject": "s", "name": NAME, "amount": 5, "limit": 100, "period": "day"} | kwargs
    with pytest.raises(quota.ConfigurationError) as info:
        q.reserve_quota(**call)
    assert named in str(info.value) and repr(kwargs[named])[:6] in str(info.value)
    assert q.usage() == (0, 0)


def test_a_ttl_takes_seconds_durations_and_timedeltas(q: Q) -> None:
    now = q.clock.now
    assert q.reserve(1, ttl=1).expires_at == now + 1
    assert q.reserve(1, ttl=604800).expires_at == now + 604800
    assert q.reserve(1, ttl="10m").expires_at == now + 600
    assert q.reserve(1, ttl=dt.timedelta(hours=1)).expires_at == now + 3600


@pytest.mark.parametrize("actual", [-1, 1.5, "3", None, True])
def test_bad_settle_arguments_raise_configuration_error(q: Q, actual: Any) -> None:
    held = q.reserve(5)
    with pytest.raises(quota.ConfigurationError, match="actual"):
        q.settle_quota(held.id, actual)
    with pytest.raises(quota.ConfigurationError, match="reservation_id"):
        q.settle_quota(None, 1)
    assert q.usage() == (0, 5)


# -- an old schema -----------------------------------------------------------------------


@pytest.mark.parametrize("name", backend_params(*SQL_DIALECTS))
def test_before_the_migration_the_quota_calls_say_to_migrate(
    name: str, request: pytest.FixtureRequest, clock: Clock
) -> None:
    url = new_sql_database(request, dialect_of(name), revision="0006_leases")
    with quota.connect(url, clock=clock) as limiter:
        calls: list[Callable[[], Any]] = [
            lambda: limiter.reserve_quota("s", NAME, 1, 10, "day"),
            lambda: limiter.consume_quota("s", NAME, 10, "day"),
            lambda: limiter.settle_quota("x", 1),
            lambda: limiter.quota_usage("s"),
        ]
        for call in calls:
            with pytest.raises(quota.SchemaError) as info:
                call()
            assert "quota migrate" in str(info.value)
            assert "0007_reservations" in str(info.value)
        assert limiter.cleanup().released == 0  # nothing to release before the migration
        assert limiter.rate_limit("k", 1, 60).allowed  # the rest works on
    quota.migrate(url)
    with quota.connect(url, clock=clock) as limiter:
        assert limiter.reserve_quota("s", NAME, 1, 10, "day").allowed


# -- processes ---------------------------------------------------------------------------

SPAWN = multiprocessing.get_context("spawn")
NOW = dt.datetime(2026, 7, 1, 12, tzinfo=dt.timezone.utc).timestamp() + 0.5
LIMIT = 20_000
TTL = 60


def _replay(entries: list[quota.LedgerEntry]) -> tuple[int, int]:
    """(used, reserved) after replaying `entries` in id order; asserts the limit held at
    every entry, and that each entry recorded the usage the replay reaches."""
    used = reserved = 0
    for e in sorted(entries, key=lambda e: e.id):
        if e.kind == "reserve":
            reserved += e.cost
        elif e.kind == "settle":
            used += e.cost
            reserved -= e.reserved or 0
        elif e.kind == "release":
            reserved -= e.cost
        elif e.kind == "deny":
            continue
        else:
            raise AssertionError(f"unexpected entry {e}")
        assert reserved >= 0 and used + reserved <= LIMIT, (e, used, reserved)
        assert e.used == used, (e, used)
    return used, reserved


def _reserve_and_settle_under_kills(url: str) -> None:
    workers, victims = 8, {1, 4, 6}
    pipes, processes = [], []
    for seed in range(workers):
        parent, child = SPAWN.Pipe(duplex=False)
        process = SPAWN.Process(
            target=_reservation_workers.reserve_and_settle,
            args=(
                url,
                "shared",
                NAME,
                LIMIT,
                TTL,
                seed,
                60 if seed not in victims else 10**6,
                child,
                NOW,
            ),
            daemon=True,
        )
        process.start()
        child.close()
        pipes.append(parent)
        processes.append(process)
    rng = random.Random()
    try:
        for seed in victims:
            assert pipes[seed].poll(60), f"worker {seed} never started"
            for _ in range(rng.randint(5, 40)):
                assert pipes[seed].poll(60), f"worker {seed} stopped"
                pipes[seed].recv()
            for _ in range(rng.randrange(0, 200_000)):  # a random moment inside the loop
                pass
            processes[seed].kill()
        for seed, process in enumerate(processes):
            process.join(180)
            assert process.exitcode == (-9 if seed in victims else 0), (seed, process.exitcode)
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join(10)
        for pipe in pipes:
            pipe.close()
    with quota.connect(url, clock=lambda: NOW + TTL) as limiter:
        entries = limiter.ledger("shared")
        before = _replay(entries)
        assert before[0] + before[1] <= LIMIT
        result = limiter.cleanup()
        entries = limiter.ledger("shared")
        [usage] = limiter.quota_usage("shared")
    # Nothing expired while the workers ran (their clock stood still): cleanup released
    # every hold the killed workers left, and nothing else.
    assert result.released == sum(e.kind == "release" for e in entries)
    assert sum(e.cost for e in entries if e.kind == "release") == before[1]
    used, reserved = _replay(entries)
    assert (usage.used, usage.reserved) == (used, reserved)
    assert reserved == 0
    assert usage.used == sum(e.cost for e in entries if e.kind == "settle")
    assert usage.used == before[0]
    assert sum(e.kind == "deny" for e in entries) > 0, "the limit was never reached"


@pytest.fixture
def reservation_url(request: pytest.FixtureRequest, sql_dialect: str) -> Iterator[str]:
    yield new_sql_database(request, sql_dialect)


@pytest.mark.slow
def test_processes_reserving_and_settling_while_some_are_killed_keep_the_books(
    reservation_url: str,
) -> None:
    _reserve_and_settle_under_kills(reservation_url)


def test_the_export_carries_reservations(q: Q) -> None:
    if q.backend.is_async:
        pytest.skip(
            "the export's iteration is the same code on both faces (tests/limiter/test_export.py)"
        )
    held = q.reserve(40)
    q.reserve(10)
    q.settle_quota(held.id, 25)
    start = int(q.clock.now) - int(q.clock.now) % DAY
    records = list(q.limiter.export(start, start + DAY, ledger=True))
    usage = [r for r in records if r.type == "usage"]
    entries = [r for r in records if r.type == "ledger"]
    assert [(u.used, u.reserved) for u in usage] == [(25, 10)]
    assert [(e.kind, e.cost, e.reservation_id, e.reserved) for e in entries] == [
        ("reserve", 40, held.id, 40),
        ("reserve", 10, entries[1].reservation_id, 10),
        ("settle", 25, held.id, 40),
    ]
    assert "reserved" in quota.UsageRecord.__dataclass_fields__
