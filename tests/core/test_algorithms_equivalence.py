"""Same trace, same decisions: memory, SQLite, PostgreSQL and Redis agree call for call.

Hypothesis draws traces of calls (a time step of fractional seconds, a key
from a small set, an algorithm, a limit, a window, a burst, a cost; now and
then a peek or a reset) and replays each against every store on one
injected clock. Every decision must be the same everywhere: allowed,
remaining, retry_after, reset_at and count, all of them. The stores share
no code beyond `quota._core.algorithms`: the SQL runs its own arithmetic in the
database, Redis in Lua, so this is what holds them to one semantics.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from dataclasses import astuple, dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import quota
from tests._support import T0, Clock

ALGORITHMS = ("fixed_window", "sliding_window", "token_bucket", "gcra")


@dataclass(frozen=True)
class Policy:
    algorithm: str
    limit: int
    window: int
    burst: int | None

    @property
    def capacity(self) -> int:
        return self.burst or self.limit


@dataclass(frozen=True)
class Call:
    step: float
    """Seconds the clock moves before the call (fractional; often 0)."""
    lag: float
    """Seconds this call's clock lags the others' (an app server whose clock is behind:
    it meets rows stamped in its future); negative, it runs ahead. Milliseconds either
    way put calls just across a boundary out of order."""
    action: str
    """``hit``, ``peek`` or ``reset``."""
    key: str
    policy: Policy
    cost: int

    def run(self, limiters: dict[bool, quota.Limiter], prefix: str) -> list[Any]:
        """The call on a limiter counting denied hits, and (a fixed window, where it matters)
        on keys of its own on one that does not."""
        results = [self._run(limiters[True], prefix)]
        if self.policy.algorithm == "fixed_window":
            results.append(self._run(limiters[False], prefix + "capped:"))
        return results

    def _run(self, limiter: quota.Limiter, prefix: str) -> Any:
        key, policy = prefix + self.key, self.policy
        if self.action == "reset":
            limiter.reset(key)
            return "reset"  # how many rows went differs (Redis and memory expire rows)
        kwargs: dict[str, Any] = {"algorithm": policy.algorithm, "burst": policy.burst}
        if self.action == "peek":
            return astuple(limiter.peek(key, policy.limit, policy.window, **kwargs))
        return astuple(
            limiter.rate_limit(key, policy.limit, policy.window, cost=self.cost, **kwargs)
        )


@st.composite
def policies(draw: st.DrawFn) -> Policy:
    algorithm = draw(st.sampled_from(ALGORITHMS))
    return Policy(
        algorithm=algorithm,
        limit=draw(st.integers(1, 5)),
        window=draw(st.sampled_from([1, 2, 7, 60])),
        burst=draw(st.none() | st.integers(1, 6)) if algorithm in ALGORITHMS[2:] else None,
    )


#: Steps that land on boundaries (a window's start, a whole token, an emission
#: interval) as often as steps that land anywhere.
_STEPS = st.sampled_from(
    [0.0] * 6 + [0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 7.0, 12.0, 30.0, 60.0]
) | st.floats(0, 90, allow_nan=False)


@st.composite
def traces(draw: st.DrawFn) -> list[Call]:
    """Calls under a pool of one or two policies, so state builds up on few rows."""
    pool = draw(st.lists(policies(), min_size=1, max_size=2))
    trace = []
    for _ in range(draw(st.integers(1, 24))):
        policy = draw(st.sampled_from(pool))
        trace.append(
            Call(
                step=draw(_STEPS),
                lag=draw(
                    st.sampled_from(
                        [0.0] * 10 + [0.001, 0.2, 0.25, 1.0, 7.0, 30.0, -0.001, -0.2, -1.0]
                    )
                ),
                action=draw(st.sampled_from(["hit"] * 10 + ["peek", "reset"])),
                key=draw(st.sampled_from("ab")),
                policy=policy,
                cost=draw(st.integers(1, policy.capacity)),
            )
        )
    return trace


@pytest.fixture
def stores(
    request: pytest.FixtureRequest, sqlite_url: str, pg_clean_url: str
) -> Iterator[tuple[Clock, dict[str, dict[bool, quota.Limiter]]]]:
    """One clock; per store a limiter counting denied hits and one that does not.

    Without a Redis server the other three are still compared (test_stores says
    why Redis is skipped).
    """
    urls = {"memory": "memory://equivalence", "sqlite": sqlite_url, "postgresql": pg_clean_url}
    with contextlib.suppress(pytest.skip.Exception):
        urls["redis"] = str(request.getfixturevalue("redis_url"))
    clock = Clock()
    limiters = {
        name: {denied: quota.connect(url, clock=clock, count_denied=denied) for denied in (True, False)}
        for name, url in urls.items()
    }  # fmt: skip
    yield clock, limiters
    for pair in limiters.values():
        for limiter in pair.values():
            limiter.close()


def _replay(
    stores: tuple[Clock, dict[str, dict[bool, quota.Limiter]]], start: float, trace: list[Call]
) -> None:
    clock, limiters = stores
    prefix = f"{uuid.uuid4().hex[:8]}:"  # every example on keys of its own
    results: dict[str, list[Any]] = {name: [] for name in limiters}
    now = start
    for call in trace:
        now += call.step
        clock.now = now - call.lag
        for name, pair in limiters.items():
            results[name].append(call.run(pair, prefix))
    reference = results["memory"]
    for name, got in results.items():
        for index, (expected, actual) in enumerate(zip(reference, got, strict=True)):
            assert actual == expected, (
                f"{name} differs from memory at call {index} ({trace[index]}):"
                f" {actual} != {expected}"
            )


_SETTINGS = settings(
    max_examples=50,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    database=None,
)
_TRACES = {
    "start": st.integers(0, 86400).map(lambda s: float(int(T0) + s))
    | st.floats(T0, T0 + 86400, allow_nan=False),
    "trace": traces(),
}


@pytest.mark.postgres
@_SETTINGS
@given(**_TRACES)
def test_every_store_decides_every_trace_alike(
    stores: tuple[Clock, dict[str, dict[bool, quota.Limiter]]],
    start: float,
    trace: list[Call],
) -> None:
    assert set(stores[1]) >= {"memory", "sqlite", "postgresql"}
    _replay(stores, start, trace)
