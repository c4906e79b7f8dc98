"""The rate-limit headers and 429 bodies tell the truth, for every algorithm and cost.

Requests go through the WSGI middleware (sync limiter, SQLite) with an
injected clock; ``RateLimit-Policy`` and ``RateLimit`` are parsed with a real
Structured Field Values parser (``http_sfv``). What is held
(draft-ietf-httpapi-ratelimit-headers-10):

- the policy states the real policy: ``q`` per ``w`` is the limit per window
  of a window algorithm and the refill rate of a token bucket or GCRA, whose
  burst is stated apart (``quota-burst``, a vendor-prefixed parameter);
- on a 429, ``t`` equals ``Retry-After`` (the draft: the reset "SHOULD
  reference the same point in time as the Retry-After field value"), and
  ``X-RateLimit-Reset`` names that moment too; waiting ``Retry-After`` makes
  the same request pass, waiting a second less does not;
- when allowed, ``t`` is the wait until the policy's quota is back in full
  (all of it that was used, at most ``q`` units), never past ``w`` except for
  the sliding window, whose count of the current window fades out only over
  the next one (up to ``2w``);
- the 429 detail describes the policy ("1 per second, bursts of 5").
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from http_sfv.list import List as SfList  # the `test` extra

import quota
from quota.http import HttpConfig, RoutePolicy
from tests._http_support import HttpClient, Reply, make_client
from tests._support import Clock

SECRET = "test-hash-secret-0123456789"


@dataclass(frozen=True)
class Case:
    id: str
    rates: str
    algorithm: str | None
    q: int
    w: int
    burst: int | None  # the burst stated apart, when it differs from q
    capacity: int
    detail: str  # how the 429 detail states the policy
    t_max: int  # the longest `t` an allowed response may carry


CASES = [
    Case("fixed", "5/minute", None, 5, 60, None, 5, "5 per minute", 60),
    Case("sliding", "5/minute", "sliding_window", 5, 60, None, 5, "5 per minute", 120),
    Case("bucket", "1/s burst 5", None, 1, 1, 5, 5, "1 per second, bursts of 5", 1),
    Case("bucket-slow", "2/minute burst 6", "token_bucket", 2, 60, 6, 6,
         "2 per minute, bursts of 6", 60),
    Case("gcra", "5/minute", "gcra", 5, 60, None, 5, "5 per minute", 60),
    Case("gcra-burst", "1/s burst 5", "gcra", 1, 1, 5, 5, "1 per second, bursts of 5", 1),
]  # fmt: skip
COSTS = [1, 2, 5]
STEP = 0.3  # seconds between requests: off the whole second, as real clocks are


def params() -> list[Any]:
    return [
        pytest.param(case, cost, id=f"{case.id}-cost{cost}")
        for case in CASES
        for cost in COSTS
        if cost <= case.capacity
    ]


@dataclass
class Parsed:
    status: int
    q: int
    w: int
    burst: int | None
    r: int
    t: int
    retry_after: int | None
    x_limit: int
    x_remaining: int
    x_reset: int
    body: Any


def parse(reply: Reply) -> Parsed:
    policy = SfList()
    policy.parse((reply.header("RateLimit-Policy") or "").encode())
    assert len(policy) == 1, reply.header("RateLimit-Policy")
    (item,) = policy
    assert item.value == "api"
    limit = SfList()
    limit.parse((reply.header("RateLimit") or "").encode())
    (state,) = limit
    assert state.value == "api"
    for value in (item.params["q"], item.params["w"], state.params["r"], state.params["t"]):
        assert type(value) is int and value >= 0
    retry = reply.header("Retry-After")
    return Parsed(
        reply.status, item.params["q"], item.params["w"], item.params.get("quota-burst"),
        state.params["r"], state.params["t"], None if retry is None else int(retry),
        int(reply.header("X-RateLimit-Limit") or -1),
        int(reply.header("X-RateLimit-Remaining") or -1),
        int(reply.header("X-RateLimit-Reset") or -1),
        reply.json() if reply.status == 429 else None,
    )  # fmt: skip


@pytest.fixture
def build(tmp_path: Path, clock: Clock) -> Iterator[Any]:
    clients: list[HttpClient] = []

    def make(case: Case, cost: int, name: str = "quota") -> HttpClient:
        url = f"sqlite:///{tmp_path / (name + '.db')}"
        quota.migrate(url)
        route = RoutePolicy(
            name="api", paths=["/api"], rates=case.rates, algorithm=case.algorithm, cost=cost
        )
        config = HttpConfig(policies=[route], hash_secret=SECRET, runtime_policies=False)
        client = make_client("flask", url, clock, config)
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()


def drain(client: HttpClient, clock: Clock) -> tuple[list[tuple[float, Parsed]], float, Parsed]:
    """Requests every STEP seconds until one is denied: the allowed ones, and the denial."""
    allowed: list[tuple[float, Parsed]] = []
    for _ in range(200):
        now = clock.now
        got = parse(client.get("/api/items"))
        if got.status == 429:
            return allowed, now, got
        assert got.status == 200
        allowed.append((now, got))
        clock.advance(STEP)
    raise AssertionError("never denied")


def check_policy(case: Case, got: Parsed) -> None:
    assert (got.q, got.w) == (case.q, case.w), "q per w must be the sustained rate"
    assert got.burst == case.burst
    assert got.x_limit == case.capacity
    assert got.r == got.x_remaining <= case.capacity


@pytest.mark.parametrize(("case", "cost"), params())
def test_the_policy_states_the_real_rate_and_the_burst_apart(
    build: Any, clock: Clock, case: Case, cost: int
) -> None:
    client = build(case, cost)
    allowed, _, denied = drain(client, clock)

    for _, got in [*allowed, (0.0, denied)]:
        check_policy(case, got)


@pytest.mark.parametrize(("case", "cost"), params())
def test_an_allowed_response_resets_when_the_quota_is_back(
    build: Any, clock: Clock, case: Case, cost: int
) -> None:
    client = build(case, cost)
    allowed, _, _ = drain(client, clock)
    assert allowed

    for now, got in allowed:
        assert got.retry_after is None
        assert 0 <= got.t <= case.t_max, f"t={got.t} for w={got.w}"
        if case.algorithm != "sliding_window":
            assert got.t <= got.w, f"t={got.t} > w={got.w}"
        assert now + got.t - 1 < got.x_reset <= now + got.t + 1, "X-RateLimit-Reset is t from now"


@pytest.mark.parametrize(("case", "cost"), params())
def test_waiting_t_after_an_allowed_response_brings_the_quota_back(
    build: Any, clock: Clock, case: Case, cost: int
) -> None:
    client = build(case, cost)
    first = parse(client.get("/api/items"))
    assert first.status == 200
    clock.advance(first.t)

    after = parse(client.get("/api/items"))

    # The quota used (at most q units) has come back: the bucket holds
    # min(capacity, left + q) again (less the cost of this request when it
    # passed; a cost above q may still have to wait, as its 429 says).
    spent = cost if after.status == 200 else 0
    assert after.r + spent >= min(case.capacity, first.r + case.q)
    if cost <= case.q:
        assert after.status == 200


@pytest.mark.parametrize(("case", "cost"), params())
def test_a_429_says_when_the_same_request_passes(
    build: Any, clock: Clock, case: Case, cost: int
) -> None:
    client = build(case, cost)
    _, now, denied = drain(client, clock)

    check_policy(case, denied)
    assert denied.retry_after is not None and denied.retry_after >= 1
    assert denied.t == denied.retry_after, "t and Retry-After must name the same moment"
    assert denied.body["retry_after"] == denied.retry_after
    assert now + denied.retry_after - 1 < denied.x_reset <= now + denied.retry_after + 1

    clock.advance(denied.retry_after - 1)
    assert client.get("/api/items").status == 429, "Retry-After overstates the wait"
    clock.advance(1)
    assert client.get("/api/items").status == 200, "Retry-After understates the wait"


@pytest.mark.parametrize(("case", "cost"), params())
def test_waiting_until_x_ratelimit_reset_lets_the_same_request_pass(
    build: Any, clock: Clock, case: Case, cost: int
) -> None:
    client = build(case, cost)
    _, now, denied = drain(client, clock)
    assert denied.retry_after is not None

    clock.now = float(denied.x_reset)
    assert client.get("/api/items").status == 200
    # and not a full refill later: the reset is at most a second past Retry-After
    assert denied.x_reset - now <= denied.retry_after + 1


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_the_429_body_describes_the_policy(build: Any, clock: Clock, case: Case) -> None:
    client = build(case, 1)
    _, _, denied = drain(client, clock)

    body = denied.body
    assert body["detail"] == (
        f"Rate limit of {case.detail} exceeded; retry after {denied.retry_after}s."
    )
    assert (body["limit"], body["window"]) == (case.q, case.w)
    assert body.get("burst") == case.burst


def test_several_rates_report_the_one_that_decided(build: Any, clock: Clock) -> None:
    case = Case("multi", "10/s;3/minute", None, 0, 0, None, 0, "", 0)
    client = build(case, 1)
    replies = []
    for _ in range(4):
        replies.append(client.get("/api/items"))
        clock.advance(STEP)

    assert [r.status for r in replies] == [200, 200, 200, 429]
    state = SfList()
    state.parse((replies[-1].header("RateLimit") or "").encode())
    (item,) = state
    assert item.value == "api-1"
    retry = int(replies[-1].header("Retry-After") or 0)
    assert item.params["t"] == retry
    denied_at = clock.now - STEP
    assert retry == math.ceil((denied_at // 60 + 1) * 60 - denied_at)
