"""The rate-limit behaviour every backend must show, run on each row of the backend table."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest

import quota
from tests._support import Backend, expected_retry_after, window_start


def test_allows_up_to_the_limit_counting_remaining_down(backend: Backend) -> None:
    limit, window = 4, 60
    decisions = [backend.rate_limit("ip:203.0.113.7", limit, window) for _ in range(limit)]

    assert [d.allowed for d in decisions] == [True] * limit
    assert [d.count for d in decisions] == list(range(1, limit + 1))
    assert [d.remaining for d in decisions] == list(range(limit - 1, -1, -1))
    for d in decisions:
        assert (d.key, d.limit, d.window, d.retry_after) == ("ip:203.0.113.7", limit, window, 0)


@pytest.mark.parametrize(
    "offset",
    [0.0, 0.25, 29.5, 59.999],
    ids=["at-window-start", "just-after-start", "mid-window", "last-instant"],
)
def test_denies_over_the_limit_with_retry_after_and_reset_at(
    backend: Backend, offset: float
) -> None:
    limit, window = 3, 60
    backend.clock.now = window_start(backend.clock.now, window) + offset
    now = backend.clock.now
    start = window_start(now, window)
    for _ in range(limit):
        assert backend.rate_limit("k", limit, window).allowed

    denied = backend.rate_limit("k", limit, window)

    assert not denied.allowed
    assert denied.remaining == 0
    assert denied.count == limit + 1
    assert denied.reset_at == start + window
    assert isinstance(denied.retry_after, int)
    assert denied.retry_after >= 1
    assert denied.retry_after == expected_retry_after(denied.reset_at, now)


@pytest.mark.parametrize("window", [1, 7, 60, 3600, 86400, 366 * 86400])
def test_windows_are_aligned_to_the_epoch(backend: Backend, window: int) -> None:
    now = backend.clock.now
    decision = backend.rate_limit("k", 10, window)

    assert decision.reset_at == window_start(now, window) + window
    assert decision.reset_at % window == 0
    assert decision.reset_at - window <= now < decision.reset_at


def test_keys_are_isolated(backend: Backend) -> None:
    for _ in range(2):
        backend.rate_limit("a", 2, 60)
    assert not backend.rate_limit("a", 2, 60).allowed

    b = backend.rate_limit("b", 2, 60)
    assert b.allowed
    assert b.count == 1


def test_window_lengths_are_isolated(backend: Backend) -> None:
    backend.rate_limit("k", 1, 60)
    assert not backend.rate_limit("k", 1, 60).allowed

    other = backend.rate_limit("k", 1, 3600)
    assert other.allowed
    assert other.count == 1


def test_two_tiers_stay_apart(backend: Backend) -> None:
    anon, auth = "anon:1.2.3.4", "auth:tok"
    anon_allowed = auth_allowed = 0
    for _ in range(7):
        anon_allowed += backend.rate_limit(anon, 2, 60).allowed
        auth_allowed += backend.rate_limit(auth, 5, 60).allowed

    assert (anon_allowed, auth_allowed) == (2, 5)
    assert backend.peek(anon, 2, 60).count == 7
    assert backend.peek(auth, 5, 60).count == 7


def test_the_window_resets_when_the_clock_passes_reset_at(backend: Backend) -> None:
    limit, window = 2, 60
    for _ in range(limit):
        backend.rate_limit("k", limit, window)
    denied = backend.rate_limit("k", limit, window)
    assert not denied.allowed

    backend.clock.now = denied.reset_at - 0.001
    assert not backend.rate_limit("k", limit, window).allowed

    backend.clock.now = denied.reset_at
    fresh = backend.rate_limit("k", limit, window)
    assert fresh.allowed
    assert fresh.count == 1
    assert fresh.remaining == limit - 1
    assert fresh.reset_at == denied.reset_at + window


def test_denied_hits_are_counted_by_default(backend: Backend) -> None:
    counts = [backend.rate_limit("k", 2, 60).count for _ in range(5)]

    assert counts == [1, 2, 3, 4, 5]
    assert backend.peek("k", 2, 60).count == 5


def test_count_denied_false_stops_counting_at_the_limit(backend: Backend) -> None:
    capped = backend.connect(count_denied=False)
    decisions = [capped.rate_limit("k", 2, 60) for _ in range(5)]

    assert [d.allowed for d in decisions] == [True, True, False, False, False]
    assert [d.count for d in decisions] == [1, 2, 2, 2, 2]
    assert all(d.retry_after >= 1 for d in decisions[2:])
    assert capped.peek("k", 2, 60).count == 2

    backend.clock.now = decisions[-1].reset_at
    fresh = capped.rate_limit("k", 2, 60)
    assert fresh.allowed
    assert fresh.count == 1


def test_a_client_that_keeps_hammering_stays_blocked_only_when_denied_hits_count(
    backend: Backend,
) -> None:
    """The two settings differ in what a denied burst leaves behind for a bigger limit."""
    capped = backend.connect(count_denied=False)
    for _ in range(6):
        backend.rate_limit("counted", 2, 60)
        capped.rate_limit("capped", 2, 60)

    assert not backend.peek("counted", 5, 60).allowed
    assert backend.peek("capped", 5, 60).allowed


def test_count_denied_false_reports_the_real_count_when_a_costly_hit_is_denied(
    backend: Backend,
) -> None:
    capped = backend.connect(count_denied=False)
    assert capped.rate_limit("k", 5, 60, cost=4).count == 4

    denied = capped.rate_limit("k", 5, 60, cost=2)

    assert not denied.allowed
    stored = capped.peek("k", 5, 60)
    assert stored.count == 4
    assert (denied.count, denied.remaining) == (stored.count, stored.remaining)


def test_peek_does_not_count_and_tells_whether_one_more_hit_would_pass(backend: Backend) -> None:
    limit, window = 3, 60
    empty = backend.peek("k", limit, window)
    assert (empty.allowed, empty.count, empty.remaining, empty.retry_after) == (True, 0, limit, 0)
    assert empty.reset_at == window_start(backend.clock.now, window) + window

    for expected_count in range(1, limit + 1):
        backend.rate_limit("k", limit, window)
        for _ in range(3):
            seen = backend.peek("k", limit, window)
            assert seen.count == expected_count
        assert seen.remaining == limit - expected_count
        assert seen.allowed == (expected_count < limit)

    full = backend.peek("k", limit, window)
    assert not full.allowed
    assert full.retry_after == expected_retry_after(full.reset_at, backend.clock.now)
    # The peeks above counted nothing: the next hit is the limit + 1st.
    assert backend.rate_limit("k", limit, window).count == limit + 1


def test_peek_of_one_key_leaves_the_others_alone(backend: Backend) -> None:
    backend.rate_limit("a", 5, 60)
    assert backend.peek("b", 5, 60).count == 0
    assert backend.peek("a", 5, 60).count == 1


def test_reset_forgets_every_window_of_a_key_and_returns_rows_deleted(backend: Backend) -> None:
    backend.rate_limit("k", 1, 60)
    backend.rate_limit("k", 1, 3600)
    backend.rate_limit("other", 1, 60)

    assert backend.reset("k") == 2

    assert backend.rate_limit("k", 1, 60).allowed
    assert backend.rate_limit("k", 1, 3600).allowed
    assert not backend.rate_limit("other", 1, 60).allowed
    assert backend.reset("never-seen") == 0


def test_reset_with_a_window_forgets_only_windows_of_that_length(backend: Backend) -> None:
    backend.rate_limit("k", 1, 60)
    backend.clock.advance(60)  # a second 60 s window: a second row
    backend.rate_limit("k", 1, 60)
    backend.rate_limit("k", 1, 3600)

    assert backend.reset("k", window=60) == 2

    assert backend.peek("k", 1, 60).count == 0
    assert backend.peek("k", 1, 3600).count == 1
    assert backend.reset("k", window=60) == 0
    assert backend.reset("k", window=3600) == 1


def test_headers_when_allowed(backend: Backend) -> None:
    decision = backend.rate_limit("k", 5, 60)

    assert decision.headers() == {
        "X-RateLimit-Limit": "5",
        "X-RateLimit-Remaining": str(5 - 1),
        "X-RateLimit-Reset": str(window_start(backend.clock.now, 60) + 60),
    }


def test_headers_when_denied_add_retry_after(backend: Backend) -> None:
    backend.rate_limit("k", 1, 60)
    decision = backend.rate_limit("k", 1, 60)
    reset_at = window_start(backend.clock.now, 60) + 60

    assert decision.headers() == {
        "X-RateLimit-Limit": "1",
        "X-RateLimit-Remaining": "0",
        "X-RateLimit-Reset": str(reset_at),
        "Retry-After": str(expected_retry_after(reset_at, backend.clock.now)),
    }


def test_cost_counts_several_hits(backend: Backend) -> None:
    first = backend.rate_limit("k", 5, 60, cost=2)
    assert (first.allowed, first.count, first.remaining) == (True, 2, 3)

    second = backend.rate_limit("k", 5, 60, cost=2)
    assert (second.allowed, second.count, second.remaining) == (True, 4, 1)

    third = backend.rate_limit("k", 5, 60, cost=2)
    assert not third.allowed
    assert third.count == 6

    assert backend.peek("k", 5, 60).count == 6


def test_a_cost_that_exactly_fills_the_window_is_allowed(backend: Backend) -> None:
    decision = backend.rate_limit("k", 5, 60, cost=5)
    assert (decision.allowed, decision.count, decision.remaining) == (True, 5, 0)
    assert not backend.rate_limit("k", 5, 60).allowed


@pytest.mark.parametrize("cost", [6, 0, -1])
def test_a_cost_outside_one_to_limit_is_a_configuration_error(backend: Backend, cost: int) -> None:
    with pytest.raises(quota.ConfigurationError) as info:
        backend.rate_limit("k", 5, 60, cost=cost)

    assert "cost" in str(info.value)
    assert repr(cost) in str(info.value)
    assert backend.peek("k", 5, 60).count == 0


@pytest.mark.parametrize("cost", [True, 1.0], ids=["bool", "float"])
def test_a_cost_that_is_not_an_int_is_a_configuration_error(backend: Backend, cost: object) -> None:
    with pytest.raises(quota.ConfigurationError, match="cost"):
        backend.rate_limit("k", 5, 60, cost=cost)


def test_top_lists_the_busiest_keys_of_live_windows_only(backend: Backend) -> None:
    for _ in range(9):
        backend.rate_limit("old", 100, 60)
    backend.clock.advance(60)  # "old" now sits in an ended window

    hits = {"a": 4, "b": 1, "c": 2}
    for key, n in hits.items():
        for _ in range(n):
            backend.rate_limit(key, 100, 60)
    for _ in range(3):
        long_window = backend.rate_limit("d", 100, 3600)

    usage = backend.top()

    assert [(u.key, u.count) for u in usage] == [("a", 4), ("d", 3), ("c", 2), ("b", 1)]
    reset_60 = window_start(backend.clock.now, 60) + 60
    assert {u.key: (u.window, u.reset_at) for u in usage} == {
        "a": (60, reset_60),
        "b": (60, reset_60),
        "c": (60, reset_60),
        "d": (3600, long_window.reset_at),
    }
    assert [u.key for u in backend.top(2)] == ["a", "d"]


def test_top_is_empty_once_every_window_has_ended(backend: Backend) -> None:
    decision = backend.rate_limit("k", 5, 60)
    assert [u.key for u in backend.top()] == ["k"]

    backend.clock.now = decision.reset_at
    assert backend.top() == []


def test_limiters_on_one_database_share_counters(backend: Backend) -> None:
    """Two limiters (two app instances) on the same database see one count."""
    other = backend.connect()
    backend.rate_limit("k", 2, 60)
    other.rate_limit("k", 2, 60)

    assert not backend.rate_limit("k", 2, 60).allowed
    assert other.peek("k", 2, 60).count == 3


def test_a_closed_limiter_reconnects_when_used_again(backend: Backend) -> None:
    backend.rate_limit("k", 5, 60)
    backend.close_connections()

    again = backend.rate_limit("k", 5, 60)

    assert again.count == 2
    backend.close_connections()
    backend.close_connections()  # closing twice is harmless
    assert backend.peek("k", 5, 60).count == 2


def test_one_shared_limiter_is_exact_across_threads_or_tasks(backend: Backend) -> None:
    """The sync faces are thread-safe, the async ones task-safe: one limiter, many callers."""
    limit, callers, hits_each = 23, 8, 10
    total = callers * hits_each
    capped = backend.connect(count_denied=False)

    if backend.is_async:

        async def caller() -> tuple[int, int]:
            counted = capped_allowed = 0
            for _ in range(hits_each):
                counted += (await backend.limiter.rate_limit("k", limit, 60)).allowed
                capped_allowed += (await capped.limiter.rate_limit("c", limit, 60)).allowed
            return counted, capped_allowed

        async def everyone() -> list[tuple[int, int]]:
            return await asyncio.gather(*(caller() for _ in range(callers)))

        results = backend.run(everyone())
    else:

        def sync_caller(_: int) -> tuple[int, int]:
            counted = capped_allowed = 0
            for _ in range(hits_each):
                counted += backend.rate_limit("k", limit, 60).allowed
                capped_allowed += capped.rate_limit("c", limit, 60).allowed
            return counted, capped_allowed

        with ThreadPoolExecutor(max_workers=callers) as pool:
            results = list(pool.map(sync_caller, range(callers), timeout=60))

    assert sum(counted for counted, _ in results) == limit
    assert sum(allowed for _, allowed in results) == limit
    assert backend.peek("k", limit, 60).count == total
    assert backend.peek("c", limit, 60).count == limit
