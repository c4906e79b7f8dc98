"""`quota.contrib.limits`: quota as a storage for `limits`, flask-limiter and slowapi.

The behaviour `limits` promises for a storage, through `limits`' own strategy
classes, on every row of the backend table (SQLite and PostgreSQL, sync and
async storage). Time is injected: `limits` reads ``time.time()`` from the
`time` module each of its modules imported, so a fixture hands those modules
(and the adapter) a fake one; nothing sleeps. Besides the explicit cases, a
seeded random trace is run against our storage and `limits`' own
`MemoryStorage` side by side, and every answer must agree.
"""

from __future__ import annotations

import asyncio
import math
import multiprocessing
import random
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import flask
import limits.aio.strategies
import limits.errors
import limits.strategies
import pytest
from fastapi import FastAPI, Request, Response
from fastapi.testclient import TestClient
from flask_limiter import Limiter as FlaskLimiter
from limits import RateLimitItemPerHour, RateLimitItemPerMinute, parse
from limits.storage import MemoryStorage, storage_from_string
from limits.storage.base import TimestampedSlidingWindow
from slowapi import Limiter as SlowLimiter
from slowapi import _rate_limit_exceeded_handler
from slowapi.errors import RateLimitExceeded

import quota
import quota.contrib.limits as adapter
from quota._core.url import parse_url
from quota.contrib.limits import AsyncQuotaStorage, QuotaStorage
from tests import _limits_support, _workers
from tests._limits_support import Blocking, FakeTime
from tests._support import POSTGRES_FACES, SQLITE_FACES, Clock
from tests.conftest import backend_params, store_url

FIXED = "fixed-window"
SLIDING = "sliding-window-counter"


# -- fixtures -----------------------------------------------------------------------


@pytest.fixture
def limits_clock(monkeypatch: pytest.MonkeyPatch, clock: Clock) -> Clock:
    """`clock`, read by the adapter and by every `limits` module that reads the time."""
    fake = FakeTime(clock)
    for module in _limits_support.TIME_READERS:
        monkeypatch.setattr(module, "time", fake)
    return clock


def _table(url: str) -> list[tuple[Any, ...]]:
    """Every row of quota_counters: (bucket_key, client_key, window_start, window_seconds, count)."""
    sql = (
        "SELECT bucket_key, client_key, window_start, window_seconds, count"
        " FROM quota_counters ORDER BY bucket_key"
    )
    if url.startswith("sqlite"):
        with sqlite3.connect(parse_url(url).target) as conn:
            return [tuple(row) for row in conn.execute(sql)]
    import psycopg

    with psycopg.connect(url) as conn:
        return [tuple(row) for row in conn.execute(sql)]


@dataclass
class LimitsBackend:
    """One row of the backend table, seen through `limits`: a storage and its strategies."""

    name: str
    url: str
    """The quota URL (for quota's own limiter and for inspecting the table)."""
    uri: str
    """The `limits` storage URI."""
    storage: Any
    """The storage, with blocking methods whatever the face."""
    loop: asyncio.AbstractEventLoop | None

    def strategy(self, name: str) -> Any:
        module = limits.aio.strategies if self.loop else limits.strategies
        return Blocking(module.STRATEGIES[name](self.storage.target), self.loop)  # type: ignore[attr-defined]

    def rows(self) -> list[tuple[Any, ...]]:
        return _table(self.url)


@pytest.fixture(params=backend_params(*SQLITE_FACES, *POSTGRES_FACES))
def lb(request: pytest.FixtureRequest) -> Iterator[LimitsBackend]:
    """The adapter on every store and face: SQLite and PostgreSQL, sync and async."""
    name: str = request.param
    dialect, face = name.split("-")
    url = store_url(request, dialect)
    uri = ("async+quota+" if face == "async" else "quota+") + url
    loop = asyncio.new_event_loop() if face == "async" else None
    storage = storage_from_string(uri)
    try:
        yield LimitsBackend(name, url, uri, Blocking(storage, loop), loop)
    finally:
        if loop is None:
            storage.close()  # type: ignore[union-attr]
        else:
            try:
                loop.run_until_complete(storage.aclose())  # type: ignore[union-attr]
            finally:
                loop.close()


# -- registration, options, errors ----------------------------------------------------


def test_importing_quota_does_not_import_limits() -> None:
    code = "import sys, quota; assert 'limits' not in sys.modules, sorted(sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(
    ("scheme", "cls"),
    [
        ("quota+sqlite", QuotaStorage),
        ("quota+sqlite+pysqlite", QuotaStorage),
        ("async+quota+sqlite", AsyncQuotaStorage),
        ("async+quota+sqlite+aiosqlite", AsyncQuotaStorage),
    ],
)
def test_sqlite_schemes_build_the_storage(sqlite_url: str, scheme: str, cls: type) -> None:
    uri = scheme + "://" + sqlite_url.split("://", 1)[1]
    storage = storage_from_string(uri)
    assert type(storage) is cls


def test_postgres_schemes_are_registered_per_face() -> None:
    # Building a storage opens no connection, so no server is needed here.
    sync = ("quota+postgresql", "quota+postgres", "quota+postgresql+psycopg")
    for scheme in sync:
        assert type(storage_from_string(f"{scheme}://app@db.invalid/app")) is QuotaStorage
    for scheme in ("async+" + s for s in (*sync[:2], "quota+postgresql+asyncpg")):
        assert type(storage_from_string(f"{scheme}://app@db.invalid/app")) is AsyncQuotaStorage
    # A driver of the other face is not a scheme of this one.
    for uri in ("quota+postgresql+asyncpg://h/db", "async+quota+postgresql+psycopg://h/db"):
        with pytest.raises(limits.errors.ConfigurationError, match="unknown storage scheme"):
            storage_from_string(uri)


def test_storage_options_reach_quota_connect(sqlite_url: str) -> None:
    uri = "quota+" + sqlite_url
    storage = storage_from_string(uri, timeout="2.5", pool_size=3)  # config files give strings
    assert isinstance(storage, QuotaStorage)
    assert storage.limiter.options.timeout == 2.5
    assert storage.limiter.options.pool_size == 3
    with pytest.raises(quota.ConfigurationError, match=r"unknown storage option.*key_prefix"):
        storage_from_string(uri, key_prefix="x")
    with pytest.raises(quota.ConfigurationError, match="timeout"):
        storage_from_string(uri, timeout="soon")
    with pytest.raises(quota.ConfigurationError, match="in-memory SQLite"):
        storage_from_string("quota+sqlite:///:memory:")
    storage = storage_from_string(uri, idle_timeout="30", prepared_statements="false")
    assert storage.limiter.options.idle_timeout == 30.0
    assert storage.limiter.options.prepared_statements is False
    with pytest.raises(quota.ConfigurationError, match="prepared_statements='maybe'"):
        storage_from_string(uri, prepared_statements="maybe")


@pytest.mark.postgres
def test_many_threads_share_the_storages_bounded_pool(pg_clean_url: str) -> None:
    """flask-limiter under a thread-per-request server: at most pool_size connections."""
    import threading

    storage = storage_from_string("quota+" + pg_clean_url, pool_size="2")
    assert isinstance(storage, QuotaStorage)
    limit = limits.parse("1000/hour")
    strategy = limits.strategies.FixedWindowRateLimiter(storage)
    threads = [threading.Thread(target=strategy.hit, args=(limit, "pooled")) for _ in range(60)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    try:
        assert storage.get(limit.key_for("pooled")) == 60
        assert storage.limiter.store.pool.opened <= 2  # type: ignore[attr-defined]
    finally:
        storage.limiter.close()


def test_missing_tables_raise_schema_error_and_check_says_unhealthy(tmp_path: Path) -> None:
    uri = f"quota+sqlite:///{tmp_path / 'empty.db'}"
    storage = storage_from_string(uri)
    assert storage.check() is False
    with pytest.raises(quota.SchemaError, match="quota migrate"):
        storage.incr("k", 60)
    wrapped = storage_from_string(uri, wrap_exceptions=True)
    with pytest.raises(limits.errors.StorageError) as caught:
        wrapped.get("k")
    assert isinstance(caught.value.storage_error, quota.SchemaError)
    assert list(tmp_path.iterdir()) == []  # a mistyped path leaves no empty database behind


def test_flask_limiter_on_a_missing_sqlite_file_creates_none(tmp_path: Path) -> None:
    app = flask.Flask("limited")
    path = tmp_path / "does-not-exist.db"
    limiter = FlaskLimiter(
        lambda: "203.0.113.7", app=app, storage_uri=f"quota+sqlite:///{path}",
        default_limits=["3 per minute"],
    )  # fmt: skip

    @app.route("/ping")
    def ping() -> str:
        return "pong"

    try:
        assert app.test_client().get("/ping").status_code == 500
    finally:
        limiter.storage.close()  # type: ignore[attr-defined]
    assert list(tmp_path.iterdir()) == []


def test_check_is_false_when_the_server_is_unreachable() -> None:
    # Port 1 refuses at once; nothing needs to run there.
    uri = "quota+postgresql://root@127.0.0.1:1/test"
    assert storage_from_string(uri, timeout=1).check() is False

    async def check() -> bool:
        storage = storage_from_string("async+" + uri, timeout=1)
        try:
            return await storage.check()  # type: ignore[no-any-return, misc]
        finally:
            await storage.aclose()  # type: ignore[union-attr]

    assert asyncio.run(check()) is False


def test_storages_declare_limits_timestamped_sliding_window() -> None:
    # limits' own sliding-window expectations (reset times periodic on the
    # epoch) are keyed on this class.
    assert issubclass(QuotaStorage, TimestampedSlidingWindow)
    assert issubclass(AsyncQuotaStorage, TimestampedSlidingWindow)


def test_sliding_window_keys_are_the_ones_limits_computes() -> None:
    for now in (1_750_004_434.25, 1_750_003_200.0, 59.999, 60.0, 1e9 + 0.5):
        for expiry in (1, 7, 60, 3600, 86400):
            previous, current = adapter.sliding_indexes(expiry, now)
            assert TimestampedSlidingWindow.sliding_window_keys("k", expiry, now) == (
                f"k/{previous}",
                f"k/{current}",
            )


def test_moving_window_is_not_supported() -> None:
    # limits' own refusal for storages without it (as for memcached).
    with pytest.raises(NotImplementedError, match="MovingWindow"):
        limits.strategies.MovingWindowRateLimiter(object.__new__(QuotaStorage))
    with pytest.raises(NotImplementedError, match="MovingWindow"):
        limits.aio.strategies.MovingWindowRateLimiter(object.__new__(AsyncQuotaStorage))


# -- the storage contract, on every backend --------------------------------------------


def test_check_and_an_empty_window(lb: LimitsBackend, limits_clock: Clock) -> None:
    assert lb.storage.check() is True
    fixed = lb.strategy(FIXED)
    item = RateLimitItemPerMinute(10)
    # limits' storages: no window yet means full, "resetting" now.
    assert fixed.get_window_stats(item, "alice") == (limits_clock.now, 10)
    assert fixed.test(item, "alice")
    assert lb.storage.get(item.key_for("alice")) == 0
    assert lb.storage.get_expiry(item.key_for("alice")) == limits_clock.now


def test_fixed_window_allows_the_limit_then_denies(lb: LimitsBackend, limits_clock: Clock) -> None:
    fixed = lb.strategy(FIXED)
    item = RateLimitItemPerMinute(10)
    assert [fixed.hit(item, "alice") for _ in range(10)] == [True] * 10
    assert not fixed.test(item, "alice")
    assert not fixed.hit(item, "alice")
    stats = fixed.get_window_stats(item, "alice")
    assert stats.remaining == 0
    # The window began at the first hit (to the fraction of a second) and lasts 60 s.
    assert stats.reset_time == limits_clock.now + 60
    # Denied hits count too, as in every limits storage (incr always increments).
    assert lb.storage.get(item.key_for("alice")) == 11
    # Other identifiers and other limits have windows of their own.
    assert fixed.get_window_stats(item, "bob") == (limits_clock.now, 10)
    assert fixed.get_window_stats(RateLimitItemPerMinute(10, 2), "alice").remaining == 10


def test_window_stats_count_down(lb: LimitsBackend, limits_clock: Clock) -> None:
    fixed = lb.strategy(FIXED)
    item = RateLimitItemPerHour(3)
    remaining = []
    for _ in range(4):
        fixed.hit(item, "alice")
        limits_clock.advance(1.5)
        remaining.append(fixed.get_window_stats(item, "alice").remaining)
    assert remaining == [2, 1, 0, 0]


def test_cost_above_one(lb: LimitsBackend, limits_clock: Clock) -> None:
    fixed = lb.strategy(FIXED)
    item = RateLimitItemPerMinute(10)
    assert fixed.hit(item, "alice", cost=4)
    assert fixed.test(item, "alice", cost=6)
    assert not fixed.test(item, "alice", cost=7)
    assert fixed.hit(item, "alice", cost=4)
    assert fixed.get_window_stats(item, "alice").remaining == 2
    assert not fixed.hit(item, "alice", cost=4)  # 12 > 10: denied, and counted
    assert fixed.get_window_stats(item, "alice").remaining == 0
    assert lb.storage.get(item.key_for("alice")) == 12
    assert fixed.hit(item, "bob", cost=10)
    assert not fixed.hit(item, "carol", cost=11)
    assert lb.storage.incr(item.key_for("dave"), 60, amount=5) == 5


def test_clear_forgets_one_key(lb: LimitsBackend, limits_clock: Clock) -> None:
    fixed = lb.strategy(FIXED)
    item = RateLimitItemPerMinute(2)
    for who in ("alice", "bob"):
        fixed.hit(item, who)
        fixed.hit(item, who)
    assert not fixed.test(item, "alice")
    fixed.clear(item, "alice")
    assert fixed.get_window_stats(item, "alice") == (limits_clock.now, 2)
    assert fixed.hit(item, "alice")
    assert not fixed.test(item, "bob")


def test_window_expires_after_expiry_seconds(lb: LimitsBackend, limits_clock: Clock) -> None:
    fixed = lb.strategy(FIXED)
    item = RateLimitItemPerMinute(2)
    first = limits_clock.now  # ends in .25: not a whole second
    assert fixed.hit(item, "alice") and fixed.hit(item, "alice")
    assert not fixed.hit(item, "alice")
    # As in limits' storages: the window ends exactly `expiry` seconds after its first hit.
    end = first + 60
    limits_clock.now = end - 0.001
    assert not fixed.hit(item, "alice")
    assert fixed.get_window_stats(item, "alice") == (end, 0)
    limits_clock.now = end
    assert fixed.get_window_stats(item, "alice") == (end, 2)
    limits_clock.now = end + 0.5
    assert fixed.hit(item, "alice")  # a new window, starting at this hit
    assert lb.storage.get(item.key_for("alice")) == 1
    assert fixed.get_window_stats(item, "alice") == (end + 60.5, 1)


def test_fixed_window_under_steady_traffic_admits_what_limits_memory_storage_admits(
    lb: LimitsBackend, limits_clock: Clock
) -> None:
    """2/second, one hit every 0.1 s for 6 s: the same 12 hits admitted as by limits' MemoryStorage.

    Whole-second window starts (the first hit rounded up) admitted 8: each
    window lasted until a second after the next whole second.
    """
    item = parse("2/second")
    reference_storage = MemoryStorage()
    reference = limits.strategies.FixedWindowRateLimiter(reference_storage)
    ours = lb.strategy(FIXED)
    start = limits_clock.now  # ends in .25: windows start off the whole second
    got: list[tuple[bool, Any]] = []
    want: list[tuple[bool, Any]] = []
    try:
        for step in range(60):
            limits_clock.now = start + step / 10
            got.append((ours.hit(item, "alice"), ours.get_window_stats(item, "alice")))
            want.append((reference.hit(item, "alice"), reference.get_window_stats(item, "alice")))
    finally:
        reference_storage.timer.cancel()
    admitted, reference_admitted = [hit for hit, _ in got], [hit for hit, _ in want]
    assert (admitted.count(True), reference_admitted.count(True)) == (12, 12)
    assert admitted == reference_admitted
    assert got == want  # and every reset time, to the last bit


def test_a_count_of_zero_restarts_the_window_as_in_limits(
    lb: LimitsBackend, limits_clock: Clock
) -> None:
    # limits' storages (memory INCRBY-then-set, redis' incr_expire.lua) start
    # the window whenever the increment finds a count of 0, e.g. after a hit of cost 0.
    key = RateLimitItemPerMinute(5).key_for("alice")
    first = limits_clock.now
    assert lb.storage.incr(key, 60, amount=0) == 0
    assert lb.storage.get_expiry(key) == first + 60
    limits_clock.advance(10)
    assert lb.storage.incr(key, 60) == 1
    assert lb.storage.get_expiry(key) == first + 70
    limits_clock.advance(10)
    assert lb.storage.incr(key, 60) == 2
    assert lb.storage.get_expiry(key) == first + 70


def test_reset_deletes_only_the_adapters_rows(lb: LimitsBackend, limits_clock: Clock) -> None:
    with quota.connect(lb.url, clock=limits_clock) as own:
        own.rate_limit("alice", 10, 60)  # quota's own counter, not limits'
        item = RateLimitItemPerMinute(5)
        lb.strategy(FIXED).hit(item, "alice")
        lb.strategy(FIXED).hit(item, "bob")
        lb.strategy(SLIDING).hit(item, "alice")
        rows = lb.rows()
        assert len(rows) == 4
        ours = [row for row in rows if row[0].startswith("limits:")]
        assert len(ours) == 3
        assert all(bucket == client for bucket, client, *_ in ours)
        assert lb.storage.reset() == 3
        assert own.peek("alice", 10, 60).count == 1
        assert [row[0] for row in lb.rows()] == [row[0] for row in rows if row not in ours]


def test_cleanup_sweeps_ended_windows(lb: LimitsBackend, limits_clock: Clock) -> None:
    item = RateLimitItemPerMinute(5)
    first = limits_clock.now
    fixed_end = math.ceil(limits_clock.now) + 60  # window_start + window_seconds
    sliding_end = (math.floor(limits_clock.now / 60) + 2) * 60  # while it weighs as "previous"
    lb.strategy(FIXED).hit(item, "alice")
    lb.strategy(SLIDING).hit(item, "alice")
    fixed_key = adapter.row_key(item.key_for("alice"))

    def swept_at(now: float) -> set[str]:
        """Our rows left after a cleanup at `now` (its count may include other tables' rows)."""
        limits_clock.now = now
        own.cleanup(grace=0)
        return {row[0] for row in lb.rows()}

    with quota.connect(lb.url, clock=limits_clock) as own:
        both = swept_at(fixed_end - 1)
        assert len(both) == 2 and fixed_key in both
        assert swept_at(first + 60 - 0.001) == both  # kept until its exact end at least
        assert swept_at(fixed_end + 1) == both - {fixed_key}
        assert swept_at(sliding_end - 1) == both - {fixed_key}
        assert swept_at(sliding_end + 1) == set()


def test_keys_of_any_shape(lb: LimitsBackend, limits_clock: Clock) -> None:
    fixed = lb.strategy(FIXED)
    item = RateLimitItemPerMinute(1)
    odd = ["nul\x00byte", "emoji 🚦", "quote ' \" ;--", "x" * 5000, "%s ? $1"]
    for who in odd:
        assert fixed.hit(item, who)
        assert not fixed.hit(item, who)
    assert len(lb.rows()) == len(odd)
    for who in odd:
        fixed.clear(item, who)
    assert lb.rows() == []


def test_sliding_window_counter_weighs_the_previous_window(
    lb: LimitsBackend, limits_clock: Clock
) -> None:
    sliding = lb.strategy(SLIDING)
    item = RateLimitItemPerMinute(10)
    limits_clock.now = 1_750_003_200.0  # a whole minute: the start of a window
    assert [sliding.hit(item, "alice") for _ in range(10)] == [True] * 10
    assert not sliding.hit(item, "alice")  # refused, and not counted
    assert sliding.get_window_stats(item, "alice").remaining == 0
    key = item.key_for("alice")
    assert lb.storage.get_sliding_window(key, 60) == (0, 0.0, 10, 120.0)
    limits_clock.advance(60)  # the next window: the previous one weighs fully
    assert not sliding.test(item, "alice")
    limits_clock.advance(30)  # half of it still weighs: 5
    assert lb.storage.get_sliding_window(key, 60) == (10, 30.0, 0, 90.0)
    assert sliding.get_window_stats(item, "alice").remaining == 5
    assert [sliding.hit(item, "alice") for _ in range(6)] == [True] * 5 + [False]
    assert not sliding.hit(item, "bob", cost=11)  # above the limit: never
    assert sliding.hit(item, "bob", cost=10)
    # The rows are the storage's `sliding_window_keys` (TimestampedSlidingWindow's).
    keys = lb.storage.sliding_window_keys(key, 60, limits_clock.now)
    assert {row[0] for row in lb.rows()} >= {adapter.row_key(k) for k in keys}
    # limits 5.2+ routes SlidingWindowCounterRateLimiter.clear here (5.0 and 5.1 clear
    # the bare key only), so the storage method is called directly.
    lb.storage.clear_sliding_window(key, 60)
    assert lb.storage.get_sliding_window(key, 60) == (0, 0.0, 0, 90.0)
    assert sliding.get_window_stats(item, "alice") == (limits_clock.now, 10)


@pytest.mark.parametrize("strategy", [FIXED, SLIDING])
def test_answers_like_limits_memory_storage(
    lb: LimitsBackend, limits_clock: Clock, strategy: str
) -> None:
    """A seeded random trace at fractional instants, replayed on limits' MemoryStorage.

    Every answer agrees, reset times to the last bit.
    """
    rng = random.Random(f"{strategy}-8")
    reference_storage = MemoryStorage()
    ours = lb.strategy(strategy)
    reference = limits.strategies.STRATEGIES[strategy](reference_storage)
    items = [parse("7/minute"), parse("3 per 10 seconds")]
    steps = [0.0, 0.3, 1, 1.7, 5.0, 9.99, 10, 13.25, 29.9, 59.75, 60.0, 61.5, 90.0, 150.0]
    hits: list[bool] = []
    try:
        for step in range(400):
            item = rng.choice(items)
            who = rng.choice(["alice", "bob"])
            action = rng.choices(["hit", "test", "stats", "advance", "clear"], [8, 2, 2, 3, 0.3])[0]
            cost = rng.choice([1, 1, 1, 2, 3, 8])
            got: Any
            want: Any
            if action == "hit":
                got, want = ours.hit(item, who, cost=cost), reference.hit(item, who, cost=cost)
                hits.append(want)
            elif action == "test":
                got, want = ours.test(item, who, cost=cost), reference.test(item, who, cost=cost)
            elif action == "stats":
                got, want = ours.get_window_stats(item, who), reference.get_window_stats(item, who)
                assert got.reset_time == want.reset_time, (step, item, who, limits_clock.now)
                got, want = got.remaining, want.remaining
            elif action == "advance":
                limits_clock.advance(rng.choice(steps))
                continue
            else:
                ours.clear(item, who)
                reference.clear(item, who)
                continue
            assert got == want, (step, action, item, who, cost, limits_clock.now)
        # The trace is not vacuous: plenty of hits went each way.
        assert hits.count(True) > 25 and hits.count(False) > 25, hits
    finally:
        reference_storage.timer.cancel()


@pytest.mark.postgres
def test_a_partitioned_counters_table_is_refused_for_the_fixed_window(
    pg_make_database: Any, limits_clock: Clock
) -> None:
    url = pg_make_database()
    quota.migrate(url, counters_partitioned=True)
    item = RateLimitItemPerMinute(2)
    storage = storage_from_string("quota+" + url)
    try:
        with pytest.raises(quota.ConfigurationError, match="partitioned"):
            limits.strategies.FixedWindowRateLimiter(storage).hit(item, "alice")
        # The sliding window counter's rows are unique by key and window start: fine.
        sliding = limits.strategies.SlidingWindowCounterRateLimiter(storage)
        assert [sliding.hit(item, "alice") for _ in range(3)] == [True, True, False]
    finally:
        storage.close()  # type: ignore[union-attr]

    async def async_hit() -> None:
        storage = storage_from_string("async+quota+" + url)
        try:
            await limits.aio.strategies.FixedWindowRateLimiter(storage).hit(item, "bob")
        finally:
            await storage.aclose()  # type: ignore[union-attr]

    with pytest.raises(quota.ConfigurationError, match="partitioned"):
        asyncio.run(async_hit())


# -- exactness under real concurrency --------------------------------------------------

HITS_PER_PROCESS = 50
LIMIT = 37


def _lanes() -> list[_limits_support.Lane]:
    return [(FIXED, f"{LIMIT}/hour", "fixed"), (SLIDING, f"{LIMIT}/hour", "sliding")]


def _hammer(url: str, uris: list[str]) -> None:
    results = _workers.run_processes(
        multiprocessing.get_context("spawn"),
        _limits_support.hit_worker,
        [(uri, _lanes(), HITS_PER_PROCESS, 5, _workers.FIXED_NOW) for uri in uris],
    )
    for _strategy, _limit, identifier in _lanes():
        allowed = [result[identifier] for result in results]
        assert sum(allowed) == LIMIT, f"{identifier}: allowed per process {allowed}"
    counts = {row[0]: row[4] for row in _table(url)}
    fixed_key = adapter.row_key(parse(f"{LIMIT}/hour").key_for("fixed"))
    assert counts[fixed_key] == HITS_PER_PROCESS * len(uris)  # no lost update
    assert sorted(counts.values()) == [
        LIMIT,
        HITS_PER_PROCESS * len(uris),
    ]  # sliding: refusals not counted


@pytest.mark.slow
def test_processes_on_one_sqlite_file_allow_exactly_the_limit(sqlite_url: str) -> None:
    _hammer(sqlite_url, ["quota+" + sqlite_url] * 4)


@pytest.mark.slow
@pytest.mark.postgres
def test_processes_on_postgresql_allow_exactly_the_limit(pg_clean_url: str) -> None:
    sync, asynchronous = "quota+" + pg_clean_url, "async+quota+" + pg_clean_url
    _hammer(pg_clean_url, [sync, asynchronous, sync, asynchronous])


# -- the frameworks -------------------------------------------------------------------


def _check_limited(responses: list[Any], url: str) -> None:
    assert [r.status_code for r in responses] == [200, 200, 200, 429]
    assert [r.headers["X-RateLimit-Limit"] for r in responses] == ["3"] * 4
    assert [r.headers["X-RateLimit-Remaining"] for r in responses] == ["2", "1", "0", "0"]
    denied = responses[-1]
    assert 0 < int(denied.headers["Retry-After"]) <= 61
    # slowapi writes the reset time as the storage's float; flask-limiter as an int.
    resets = [float(r.headers["X-RateLimit-Reset"]) for r in responses]
    assert resets == [resets[0]] * 4
    (row,) = _table(url)
    assert row[0].startswith("limits:") and row[3] == 60 and row[4] == 4


def test_flask_limiter_on_quota(sql_url: str) -> None:
    app = flask.Flask("limited")
    limiter = FlaskLimiter(
        lambda: "203.0.113.7", app=app, storage_uri="quota+" + sql_url, headers_enabled=True
    )

    @app.route("/ping")
    @limiter.limit("3 per minute")
    def ping() -> str:
        return "pong"

    try:
        assert isinstance(limiter.storage, QuotaStorage)
        client = app.test_client()
        _check_limited([client.get("/ping") for _ in range(4)], sql_url)
        limiter.reset()
        assert _table(sql_url) == []
        assert client.get("/ping").status_code == 200
    finally:
        limiter.storage.close()  # type: ignore[attr-defined]


def test_slowapi_on_quota(sql_url: str) -> None:
    limiter = SlowLimiter(
        key_func=lambda request: "203.0.113.7",
        storage_uri="quota+" + sql_url,
        headers_enabled=True,
    )
    app = FastAPI()
    app.state.limiter = limiter
    app.add_exception_handler(RateLimitExceeded, _rate_limit_exceeded_handler)  # type: ignore[arg-type]

    @app.get("/ping")
    @limiter.limit("3/minute")
    def ping(request: Request, response: Response) -> dict[str, str]:
        return {"ping": "pong"}

    storage = limiter._storage
    assert isinstance(storage, QuotaStorage)
    try:
        with TestClient(app) as client:
            _check_limited([client.get("/ping") for _ in range(4)], sql_url)
            limiter.reset()
            assert client.get("/ping").status_code == 200
    finally:
        storage.close()


def test_flask_limiter_config_command_shows_the_storage(sql_url: str) -> None:
    """``flask limiter config`` prints the storage's backend (``storage.storage``) in its table."""
    from flask_limiter.commands import cli as limiter_cli

    app = flask.Flask("limited")
    limiter = FlaskLimiter(lambda: "203.0.113.7", app=app, storage_uri="quota+" + sql_url)
    storage = limiter.storage
    assert isinstance(storage, QuotaStorage)
    try:
        result = app.test_cli_runner().invoke(limiter_cli, ["config"])
        assert result.exit_code == 0, result.output
        backend = str(storage.storage)
        # The table is 80 columns wide: the backend fits in its cell, on one line.
        assert any(backend in line for line in result.output.splitlines()), result.output
        assert "OK" in result.output
    finally:
        storage.close()


def test_both_storages_name_their_backend_briefly(sql_url: str) -> None:
    """``storage.storage``, which every storage of limits has: the quota store, printed short."""
    sync = QuotaStorage("quota+" + sql_url)
    aio = AsyncQuotaStorage("async+quota+" + sql_url)
    try:
        assert sync.storage is sync.limiter.store
        assert aio.storage is aio.limiter.store
        for store in (sync.storage, aio.storage):
            assert str(store) == f"<{type(store).__name__}>"
    finally:
        sync.close()
        asyncio.run(aio.aclose())
