"""Each algorithm's edges, on every store and face (SQLite, PostgreSQL, memory, Redis).

Hand-picked instants on an injected clock: a window's boundary, an empty
bucket, a refill exactly to capacity, a cost equal to the capacity, a burst,
and retry_after checked to the second (one second earlier the hit is still
denied, at retry_after it passes).
"""

from __future__ import annotations

import math

import pytest

import quota
from quota._core.algorithms import EXPIRY_GRANULARITY
from quota._core.url import DIALECTS
from tests._support import Backend, window_start

OTHERS = ("sliding_window", "token_bucket", "gcra")
EVERY = ("fixed_window", *OTHERS)


def _at(backend: Backend, window: int, offset: float) -> float:
    """Move the clock to `offset` seconds into its current window of `window` seconds."""
    backend.clock.now = window_start(backend.clock.now, window) + offset
    return backend.clock.now


def _retry_after_is_exact(
    backend: Backend, key: str, limit: int, window: int, *, algorithm: str, cost: int = 1,
    burst: int | None = None,
) -> quota.Decision:  # fmt: skip
    """The hit is denied; one second before its retry_after it still is; at retry_after it passes."""
    kwargs = {"algorithm": algorithm, "cost": cost, "burst": burst}
    denied = backend.rate_limit(key, limit, window, **kwargs)
    assert not denied.allowed
    assert isinstance(denied.retry_after, int) and denied.retry_after >= 1
    start = backend.clock.now
    if denied.retry_after > 1:
        backend.clock.now = start + denied.retry_after - 1
        assert not backend.rate_limit(key, limit, window, **kwargs).allowed, (
            f"allowed at {denied.retry_after - 1}s, before retry_after={denied.retry_after}"
        )
    backend.clock.now = start + denied.retry_after
    assert backend.rate_limit(key, limit, window, **kwargs).allowed, (
        f"still denied at retry_after={denied.retry_after}"
    )
    return denied


@pytest.mark.parametrize("algorithm", EVERY)
def test_under_the_limit_then_over_it_with_retry_after_exact_to_the_second(
    every_backend: Backend, algorithm: str
) -> None:
    _at(every_backend, 60, 12.25)
    allowed = [every_backend.rate_limit("k", 3, 60, algorithm=algorithm) for _ in range(3)]

    assert [d.allowed for d in allowed] == [True] * 3
    assert [d.remaining for d in allowed] == [2, 1, 0]
    assert all(d.retry_after == 0 and d.limit == 3 and d.window == 60 for d in allowed)
    denied = _retry_after_is_exact(every_backend, "k", 3, 60, algorithm=algorithm)
    assert denied.remaining == 0
    assert denied.reset_at > every_backend.clock.now - denied.retry_after


@pytest.mark.parametrize("algorithm", OTHERS)
def test_keys_windows_and_algorithms_are_isolated(every_backend: Backend, algorithm: str) -> None:
    for _ in range(2):
        every_backend.rate_limit("a", 2, 60, algorithm=algorithm)
    assert not every_backend.rate_limit("a", 2, 60, algorithm=algorithm).allowed

    assert every_backend.rate_limit("b", 2, 60, algorithm=algorithm).remaining == 1
    assert every_backend.rate_limit("a", 2, 3600, algorithm=algorithm).remaining == 1
    other = next(a for a in EVERY if a != algorithm)
    assert every_backend.rate_limit("a", 2, 60, algorithm=other).remaining == 1


@pytest.mark.parametrize("algorithm", OTHERS)
def test_peek_counts_nothing_and_predicts_the_next_hit(
    every_backend: Backend, algorithm: str
) -> None:
    _at(every_backend, 60, 30.5)
    every_backend.rate_limit("k", 2, 60, algorithm=algorithm)
    peeks = [every_backend.peek("k", 2, 60, algorithm=algorithm) for _ in range(3)]

    assert [(p.allowed, p.remaining) for p in peeks] == [(True, 1)] * 3
    assert every_backend.rate_limit("k", 2, 60, algorithm=algorithm).allowed
    assert not every_backend.peek("k", 2, 60, algorithm=algorithm).allowed
    assert not every_backend.rate_limit("k", 2, 60, algorithm=algorithm).allowed


@pytest.mark.parametrize("algorithm", EVERY)
def test_cost_counts_as_that_many_hits(every_backend: Backend, algorithm: str) -> None:
    _at(every_backend, 60, 1.5)
    first = every_backend.rate_limit("k", 4, 60, algorithm=algorithm, cost=3)
    assert (first.allowed, first.remaining) == (True, 1)
    _retry_after_is_exact(every_backend, "k", 4, 60, algorithm=algorithm, cost=2)


@pytest.mark.parametrize("algorithm", OTHERS)
def test_reset_forgets_every_state_of_the_key(every_backend: Backend, algorithm: str) -> None:
    for window in (60, 3600):
        for _ in range(2):
            every_backend.rate_limit("k", 2, window, algorithm=algorithm)
    every_backend.rate_limit("other", 2, 60, algorithm=algorithm)

    assert every_backend.reset("k", 60) == 1
    assert every_backend.rate_limit("k", 2, 60, algorithm=algorithm).remaining == 1
    assert not every_backend.rate_limit("k", 2, 3600, algorithm=algorithm).allowed
    assert every_backend.reset("k") == 2
    assert every_backend.rate_limit("k", 2, 3600, algorithm=algorithm).remaining == 1
    assert every_backend.rate_limit("other", 2, 60, algorithm=algorithm).remaining == 0


@pytest.mark.parametrize("algorithm", OTHERS)
def test_cleanup_drops_idle_state_and_a_key_then_starts_fresh(
    every_backend: Backend, algorithm: str
) -> None:
    for _ in range(3):
        every_backend.rate_limit("k", 3, 60, algorithm=algorithm)
    # SQL stores round a state row's expiry up to the hour (so updates stay HOT).
    every_backend.clock.advance(EXPIRY_GRANULARITY + 3 * 60 + 1)

    result = every_backend.cleanup(grace=0)

    # Redis expires rows by itself (a TTL each): its cleanup never finds any.
    assert result.deleted == (0 if DIALECTS[every_backend.dialect].speaks_redis else 1)
    assert every_backend.rate_limit("k", 3, 60, algorithm=algorithm).remaining == 2


# -- sliding window -----------------------------------------------------------------------


def test_sliding_window_weighs_the_previous_window_across_the_boundary(
    every_backend: Backend,
) -> None:
    _at(every_backend, 60, 59.5)
    assert all(
        every_backend.rate_limit("k", 4, 60, algorithm="sliding_window").allowed for _ in range(4)
    )

    # A fixed window would open 4 more here; the sliding one still counts all 4 at the boundary.
    every_backend.clock.now = window_start(every_backend.clock.now, 60) + 60
    at_boundary = every_backend.rate_limit("k", 4, 60, algorithm="sliding_window")
    assert (at_boundary.allowed, at_boundary.count, at_boundary.retry_after) == (False, 4, 15)

    # 15 s in, a quarter of the previous window has faded: 3 + 1 fits in 4.
    every_backend.clock.advance(14)
    assert not every_backend.rate_limit("k", 4, 60, algorithm="sliding_window").allowed
    every_backend.clock.advance(1)
    passed = every_backend.rate_limit("k", 4, 60, algorithm="sliding_window")
    assert (passed.allowed, passed.count, passed.remaining) == (True, 4, 0)


def test_sliding_window_forgets_a_window_two_windows_old(every_backend: Backend) -> None:
    _at(every_backend, 60, 10.0)
    for _ in range(3):
        every_backend.rate_limit("k", 3, 60, algorithm="sliding_window")
    every_backend.clock.advance(120)

    fresh = every_backend.rate_limit("k", 3, 60, algorithm="sliding_window")

    assert (fresh.allowed, fresh.count, fresh.remaining) == (True, 1, 2)


def test_sliding_window_retry_after_waits_for_the_previous_window_to_fade(
    every_backend: Backend,
) -> None:
    _at(every_backend, 60, 50.0)
    for _ in range(3):
        every_backend.rate_limit("k", 4, 60, algorithm="sliding_window")
    every_backend.clock.advance(20)  # 10 s into the next window
    assert every_backend.rate_limit("k", 4, 60, algorithm="sliding_window").allowed

    denied = _retry_after_is_exact(every_backend, "k", 4, 60, algorithm="sliding_window")
    assert denied.retry_after == 10  # 3 * (60 - 20) / 60 = 2 left of the previous window


# -- token bucket ---------------------------------------------------------------------------


def test_an_empty_bucket_waits_one_token_and_a_denial_takes_nothing(
    every_backend: Backend,
) -> None:
    for _ in range(5):
        assert every_backend.rate_limit("k", 5, 60, algorithm="token_bucket").allowed
    denials = [every_backend.rate_limit("k", 5, 60, algorithm="token_bucket") for _ in range(3)]

    # 5 per 60 s is a token every 12 s; hammering an empty bucket does not push that back.
    assert [(d.allowed, d.remaining, d.retry_after) for d in denials] == [(False, 0, 12)] * 3
    _retry_after_is_exact(every_backend, "k", 5, 60, algorithm="token_bucket")


def test_a_bucket_refills_exactly_to_its_capacity_and_no_further(every_backend: Backend) -> None:
    for _ in range(5):
        every_backend.rate_limit("k", 5, 60, algorithm="token_bucket")
    every_backend.clock.advance(60)
    full = every_backend.peek("k", 5, 60, algorithm="token_bucket")
    assert (full.allowed, full.remaining) == (True, 5)
    assert full.reset_at == math.ceil(every_backend.clock.now)  # full already

    every_backend.clock.advance(10 * 60)  # idle far longer: still only 5
    decisions = [every_backend.rate_limit("k", 5, 60, algorithm="token_bucket") for _ in range(6)]
    assert [d.allowed for d in decisions] == [True] * 5 + [False]


def test_a_cost_equal_to_the_capacity_takes_the_whole_bucket(every_backend: Backend) -> None:
    whole = every_backend.rate_limit("k", 4, 60, algorithm="token_bucket", cost=4)
    assert (whole.allowed, whole.remaining, whole.count) == (True, 0, 4)

    denied = _retry_after_is_exact(every_backend, "k", 4, 60, algorithm="token_bucket", cost=4)
    assert denied.retry_after == 60


def test_a_burst_is_the_bucket_capacity_refilled_at_the_limit_rate(
    every_backend: Backend,
) -> None:
    decisions = [
        every_backend.rate_limit("k", 5, 60, algorithm="token_bucket", burst=10) for _ in range(11)
    ]
    assert [d.allowed for d in decisions] == [True] * 10 + [False]
    assert decisions[0].limit == 10
    assert decisions[-1].retry_after == 12  # refills at 5 per 60 s, not 10
    _retry_after_is_exact(every_backend, "k", 5, 60, algorithm="token_bucket", burst=10)


def test_a_rate_string_with_a_burst_is_a_token_bucket(every_backend: Backend) -> None:
    decisions = [every_backend.hit("k", "1/second burst 3") for _ in range(4)]
    assert [d.allowed for d in decisions] == [True, True, True, False]
    every_backend.clock.advance(1)
    assert every_backend.hit("k", "1/second burst 3").allowed


# -- GCRA -------------------------------------------------------------------------------------


def test_gcra_allows_the_burst_then_one_per_emission_interval(every_backend: Backend) -> None:
    decisions = [every_backend.rate_limit("k", 5, 60, algorithm="gcra") for _ in range(6)]
    assert [d.allowed for d in decisions] == [True] * 5 + [False]
    assert [d.remaining for d in decisions] == [4, 3, 2, 1, 0, 0]
    assert decisions[-1].retry_after == 12

    _retry_after_is_exact(every_backend, "k", 5, 60, algorithm="gcra")
    assert not every_backend.rate_limit("k", 5, 60, algorithm="gcra").allowed
    every_backend.clock.advance(12)
    assert every_backend.rate_limit("k", 5, 60, algorithm="gcra").allowed


def test_gcra_burst_and_a_cost_equal_to_it(every_backend: Backend) -> None:
    burst = [every_backend.rate_limit("k", 2, 60, algorithm="gcra", burst=4) for _ in range(5)]
    assert [d.allowed for d in burst] == [True] * 4 + [False]
    assert burst[-1].retry_after == 30  # emission interval 60 / 2

    every_backend.clock.advance(4 * 30)
    whole = every_backend.rate_limit("k", 2, 60, algorithm="gcra", burst=4, cost=4)
    assert (whole.allowed, whole.remaining) == (True, 0)
    denied = _retry_after_is_exact(every_backend, "k", 2, 60, algorithm="gcra", burst=4, cost=4)
    assert denied.retry_after == 120


def test_several_rates_count_each_and_the_strictest_decides(every_backend: Backend) -> None:
    _at(every_backend, 3600, 600.5)
    decisions = [every_backend.hit("k", "2/minute;3/hour") for _ in range(3)]
    assert [d.allowed for d in decisions] == [True, True, False]
    assert (decisions[-1].window, decisions[-1].retry_after) == (60, 60)

    # The minute starts again, but the denied hit counted in the hour too: 4 > 3.
    every_backend.clock.advance(60)
    later = every_backend.hit("k", "2/minute;3/hour")
    assert (later.allowed, later.window, later.count) == (False, 3600, 4)
    assert later.retry_after == 3600 - 660


# -- bad input: a clear ConfigurationError naming what is wrong ------------------------------


@pytest.fixture
def limiter() -> quota.Limiter:
    return quota.connect("memory://")


@pytest.mark.parametrize("algorithm", EVERY)
@pytest.mark.parametrize(
    ("args", "kwargs", "names"),
    [
        ((0, 60), {}, "limit"),
        ((-3, 60), {}, "limit"),
        ((5, 0), {}, "window"),
        ((5, -60), {}, "window"),
        ((5, 60), {"cost": 0}, "cost"),
        ((5, 60), {"cost": -2}, "cost"),
        ((5, 60), {"cost": 6}, "cost (6 can never pass|must be between 1 and 5, got 6)"),
    ],
    ids=["limit-0", "limit-negative", "window-0", "window-negative", "cost-0", "cost-negative",
         "cost-above-capacity"],
)  # fmt: skip
def test_bad_limits_windows_and_costs_name_the_argument(
    limiter: quota.Limiter, algorithm: str, args: tuple[int, int], kwargs: dict[str, int],
    names: str,
) -> None:  # fmt: skip
    with pytest.raises(quota.ConfigurationError, match=names):
        limiter.rate_limit("k", *args, algorithm=algorithm, **kwargs)
    assert len(limiter.store) == 0  # type: ignore[arg-type]  # nothing was counted


@pytest.mark.parametrize("algorithm", ["token_bucket", "gcra"])
@pytest.mark.parametrize("burst", [0, -1, 2.5, True])
def test_a_bad_burst_names_burst(limiter: quota.Limiter, algorithm: str, burst: object) -> None:
    with pytest.raises(quota.ConfigurationError, match="burst"):
        limiter.rate_limit("k", 5, 60, algorithm=algorithm, burst=burst)  # type: ignore[arg-type]


def test_a_cost_above_the_burst_can_never_pass(limiter: quota.Limiter) -> None:
    assert limiter.rate_limit("k", 2, 60, algorithm="token_bucket", burst=5, cost=5).allowed
    with pytest.raises(quota.ConfigurationError, match=r"cost 6 can never pass.*capacity of 5"):
        limiter.rate_limit("k", 2, 60, algorithm="token_bucket", burst=5, cost=6)


@pytest.mark.parametrize("refill", [0, -1.5, float("inf"), float("nan"), "1", True])
def test_a_bad_refill_rate_names_refill_per_second(refill: object) -> None:
    with pytest.raises(quota.ConfigurationError, match="refill_per_second"):
        quota.Rate(limit=5, window=60, algorithm="token_bucket", refill_per_second=refill)  # type: ignore[arg-type]


@pytest.mark.parametrize("algorithm", ["leaky_bucket", "", "GCRA", None])
def test_an_unknown_algorithm_lists_the_known_ones(
    limiter: quota.Limiter, algorithm: object
) -> None:
    with pytest.raises(quota.ConfigurationError, match=r"algorithm must be one of fixed_window"):
        limiter.rate_limit("k", 5, 60, algorithm=algorithm)  # type: ignore[arg-type]
    if algorithm is not None:  # parse_rates takes None as "by the rate's shape"
        with pytest.raises(quota.ConfigurationError, match="algorithm"):
            quota.parse_rates("5/minute", algorithm=algorithm)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("10/fortnight", "unknown unit 'fortnight'"),
        ("ten/minute", "limit 'ten'"),
        ("10/minute;;", "rate 2 of '10/minute;;' is empty"),
        ("10/minute,", "rate 2 .* is empty"),
        ("", "non-empty"),
        ("10", "not of the form"),
        ("10/", "not of the form"),
        ("/minute", "not of the form"),
        ("0/minute", "limit '0'"),
        ("-5/minute", "limit '-5'"),
        ("10/0 minutes", "window count '0'"),
        ("100/s burst 0", "burst '0'"),
        ("100/s burst lots", "burst 'lots'"),
        ("100/s burst", "not of the form"),
    ],
)
def test_a_malformed_rate_string_names_the_bad_part(text: str, names: str) -> None:
    with pytest.raises(quota.ConfigurationError, match=names):
        quota.parse_rates(text)


def test_a_burst_with_a_window_algorithm_is_refused() -> None:
    with pytest.raises(quota.ConfigurationError, match=r"burst.*only token_bucket and gcra"):
        quota.parse_rates("10/minute burst 20", algorithm="sliding_window")


def test_rate_strings_a_person_writes() -> None:
    assert [(r.limit, r.window, r.algorithm, r.burst) for r in quota.parse_rates(
        "10/second; 100 per 5 minutes, 1000/day"
    )] == [(10, 1, "fixed_window", None), (100, 300, "fixed_window", None),
           (1000, 86400, "fixed_window", None)]  # fmt: skip
    (bucket,) = quota.parse_rates("100/s burst 200")
    assert (bucket.algorithm, bucket.capacity, bucket.rate) == ("token_bucket", 200, 100.0)
    (gcra,) = quota.parse_rates("6/minute burst 3", algorithm="gcra")
    assert (gcra.algorithm, gcra.capacity, gcra.window) == ("gcra", 3, 60)


def test_gcra_never_denies_an_idle_key_whose_cost_is_its_burst(every_backend: Backend) -> None:
    # One hit per 0.2 s, no burst: every hit below comes after a longer pause, so each
    # must pass, whatever rounding `now` carries (these instants once found a denial).
    every_backend.clock.now = 1_750_004_434.0
    for pause in (0.0, 0.25, 60.0, 0.5, 3600.125, 0.2):
        every_backend.clock.advance(pause)
        assert every_backend.rate_limit("k", 5, 1, algorithm="gcra", burst=1).allowed, pause


def test_a_lagging_clock_never_rolls_state_back(every_backend: Backend) -> None:
    """A server whose clock is behind meets rows stamped in its future: it takes them as
    current, and leaves their stamps where they are."""
    clock = every_backend.clock
    lead = _at(every_backend, 60, 5.0)
    for _ in range(2):
        every_backend.rate_limit("sw", 3, 60, algorithm="sliding_window")
    for _ in range(2):
        every_backend.rate_limit("tb", 2, 60, algorithm="token_bucket")

    clock.now = lead - 30  # the previous window, for the lagging server
    assert every_backend.rate_limit("sw", 3, 60, algorithm="sliding_window").count == 3
    assert not every_backend.rate_limit("tb", 2, 60, algorithm="token_bucket").allowed

    clock.now = lead + 45  # the leader again: the window still holds 3; 1.5 tokens back
    assert not every_backend.rate_limit("sw", 3, 60, algorithm="sliding_window").allowed
    refilled = every_backend.rate_limit("tb", 2, 60, algorithm="token_bucket")
    assert (refilled.allowed, refilled.remaining) == (True, 0)


def test_gcra_allows_its_whole_burst_for_every_limit() -> None:
    short = []
    for limit in range(1, 61):
        limiter = quota.connect("memory://", clock=lambda: 1_800_000_000.0)
        allowed = sum(
            limiter.rate_limit("k", limit, 60, algorithm="gcra").allowed for _ in range(limit + 1)
        )
        if allowed != limit:
            short.append((limit, allowed))
    assert short == []
