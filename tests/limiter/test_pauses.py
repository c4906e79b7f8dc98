"""Pauses: ``limiter.pause(key, seconds)`` holds a key back for every process on the store.

Every store and face, on an injected clock: a pause ends when the clock says so. The
outbound transports (tests/contrib/test_outbound*.py) are what reads pauses across
processes.
"""

from __future__ import annotations

import math

import pytest

import quota
from tests._support import Backend


def test_a_pause_is_seen_by_every_limiter_on_the_store(every_backend: Backend) -> None:
    other = every_backend.connect()
    assert other.paused("api") == 0.0
    assert every_backend.pause("api", 2) == pytest.approx(2.0)
    assert other.paused("api") == pytest.approx(2.0)
    assert other.paused("another") == 0.0
    every_backend.clock.advance(1.5)
    assert other.paused("api") == pytest.approx(0.5)
    every_backend.clock.advance(0.6)
    assert other.paused("api") == 0.0
    assert every_backend.paused("api") == 0.0


def test_a_pause_only_grows(every_backend: Backend) -> None:
    assert every_backend.pause("api", 5) == pytest.approx(5.0)
    every_backend.clock.advance(1)
    # A shorter pause while a longer one runs leaves the longer.
    assert every_backend.pause("api", 1) == pytest.approx(4.0)
    assert every_backend.paused("api") == pytest.approx(4.0)
    assert every_backend.pause("api", 10.5) == pytest.approx(10.5)
    every_backend.clock.advance(10)
    assert every_backend.paused("api") == pytest.approx(0.5)


def test_an_ended_pause_is_replaced_by_a_new_one(every_backend: Backend) -> None:
    every_backend.pause("api", 3)
    every_backend.clock.advance(60)
    assert every_backend.paused("api") == 0.0
    assert every_backend.pause("api", 2) == pytest.approx(2.0)
    assert every_backend.paused("api") == pytest.approx(2.0)


def test_reset_lifts_a_pause_and_counts_stay_apart(every_backend: Backend) -> None:
    every_backend.pause("api", 30)
    assert every_backend.hit("api", "2/minute").allowed  # a pause is no hit
    assert every_backend.hit("api", "2/minute").remaining == 0
    every_backend.reset("api")
    assert every_backend.paused("api") == 0.0
    assert every_backend.hit("api", "2/minute").remaining == 1


@pytest.mark.parametrize("seconds", [-1, math.nan, math.inf, 86_401, "2", None, True])
def test_a_bad_pause_names_its_argument(every_backend: Backend, seconds: object) -> None:
    with pytest.raises(quota.ConfigurationError, match="seconds"):
        every_backend.pause("api", seconds)
    assert every_backend.paused("api") == 0.0


def test_cleanup_sweeps_a_pause_once_it_has_ended(backend: Backend) -> None:
    backend.pause("api", 5)
    assert backend.cleanup(grace=0).deleted == 0  # still running
    backend.clock.advance(6)
    assert backend.cleanup(grace=0).deleted == 1
    assert backend.paused("api") == 0.0
