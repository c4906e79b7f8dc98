"""``clock="database"``: app servers whose clocks disagree still share one window.

Two limiters on one store, their app clocks 30 s apart. With app clocks
(the default) a 30 s fixed window is a different window for each; with the
database clock both land in the one window the database's time says, and
every algorithm reads its time from the store (a year-old app clock changes
nothing). On SQLite (``julianday('now')``), PostgreSQL
(``statement_timestamp()``), Redis (``TIME``) and memory (its own clock).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from quota import Rate, RateLimitTimeout
from tests._support import POSTGRES_FACES, SQLITE_FACES, T0, Backend, Clock
from tests.conftest import REDIS_FACES, backend_params, dialect_of, store_url

ALGORITHMS = ("fixed_window", "sliding_window", "token_bucket", "gcra")
FACES = backend_params(*SQLITE_FACES, *POSTGRES_FACES, *REDIS_FACES, "memory-sync")
SKEW = 30.0


@pytest.fixture(params=FACES)
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    name: str = request.param
    made = Backend(name, store_url(request, dialect_of(name)), Clock())
    try:
        yield made
    finally:
        made.close()


def test_app_clocks_30s_apart_count_in_different_windows(backend: Backend) -> None:
    behind = backend.connect(clock=lambda: T0 - T0 % SKEW)
    ahead = backend.connect(clock=lambda: T0 - T0 % SKEW + SKEW)

    decisions = [face.rate_limit("k", 2, 30) for face in (behind, behind, ahead, ahead)]

    assert [d.allowed for d in decisions] == [True] * 4
    assert decisions[2].reset_at == decisions[0].reset_at + 30


def test_with_the_database_clock_they_share_one_window(backend: Backend) -> None:
    behind = backend.connect(clock="database")
    ahead = backend.connect(clock="database")
    # The app clock is still read (peek, fallbacks); it must not decide a hit.
    ahead.limiter._clock = lambda: time.time() + SKEW

    for attempt in range(3):  # the database's 30 s window may end mid-test: go again
        key = f"k{attempt}"
        decisions = [face.rate_limit(key, 2, 30) for face in (behind, ahead, behind, ahead)]
        if len({d.reset_at for d in decisions}) == 1:
            break
    assert [d.allowed for d in decisions] == [True, True, False, False]
    assert [d.count for d in decisions] == [1, 2, 3, 4]
    assert decisions[0].reset_at % 30 == 0
    assert 0 < decisions[0].reset_at - time.time() <= 30 + 1


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_every_algorithm_takes_its_time_from_the_store(backend: Backend, algorithm: str) -> None:
    year_old = backend.connect(clock="database")
    year_old.limiter._clock = lambda: T0  # a year and more in the past
    skewed = backend.connect(clock="database")
    skewed.limiter._clock = lambda: time.time() + SKEW

    decisions = [
        face.rate_limit("k", 3, 3600, algorithm=algorithm)
        for face in (year_old, skewed, year_old, skewed)
    ]

    assert [d.allowed for d in decisions] == [True, True, True, False]
    now = time.time()
    for decision in decisions:
        assert now - 1 <= decision.reset_at <= now + 3600 + 1
        # (a sliding window may wait into the next window for this one to fade)
        assert decision.retry_after <= 2 * 3600 + 1


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_an_acquire_a_later_rate_denies_gives_back_where_the_store_counted(
    backend: Backend, algorithm: str
) -> None:
    face = backend.connect(clock="database")
    face.limiter._clock = lambda: T0  # a year and more in the past: never where the hit is
    # Windows of days: the store's clock does not leave them during the test.
    short = Rate(limit=5, window=86_400, algorithm=algorithm)
    rates = [short, Rate(limit=2, window=7 * 86_400)]
    for _ in range(2):
        assert face.acquire("k", rates, timeout=0).allowed
    for _ in range(3):
        with pytest.raises(RateLimitTimeout):
            face.acquire("k", rates, timeout=0)
    assert sum(face.hit("k", short).allowed for _ in range(6)) == 3
