"""``durability="relaxed"`` on PostgreSQL, and the validation of the batching options."""

from __future__ import annotations

import asyncio
from collections.abc import Generator
from typing import Any

import pytest

import quota
from quota._sql.steps import Rows, Step


def _show() -> Generator[Step, Rows, str]:
    rows = yield "SHOW synchronous_commit", ()
    return str(rows[0][0])


@pytest.mark.postgres
@pytest.mark.parametrize("durability, session", [("full", "on"), ("relaxed", "off")])
def test_relaxed_commits_asynchronously_except_in_transactions(
    pg_clean_url: str, durability: str, session: str
) -> None:
    with quota.connect(pg_clean_url, durability=durability) as limiter:
        assert limiter.store.run(_show(), transaction=False) == session
        # Durable quotas run in transactions of `run`: always synchronous.
        assert limiter.store.run(_show(), transaction=True) == "on"
        assert limiter.rate_limit("k", 5, 60).count == 1

    async def main() -> tuple[str, str, int]:
        async with quota.connect_async(pg_clean_url, durability=durability) as limiter:
            outside = await limiter.store.run(_show(), transaction=False)
            inside = await limiter.store.run(_show(), transaction=True)
            return outside, inside, (await limiter.rate_limit("k", 5, 60)).count

    assert asyncio.run(main()) == (session, "on", 2)


@pytest.mark.parametrize(
    "option, value, message",
    [
        ("durability", "fast", "durability must be one of full, relaxed, got 'fast'"),
        ("batching", 1, "batching must be a bool, got 1"),
        ("max_batch", 0, "max_batch must be between 1 and 100000, got 0"),
    ],
)
def test_bad_batching_and_durability_options_fail_when_the_limiter_is_built(
    sqlite_url: str, option: str, value: Any, message: str
) -> None:
    for factory in (quota.connect, quota.connect_async):
        with pytest.raises(quota.ConfigurationError) as caught:
            factory(sqlite_url, **{option: value})
        assert str(caught.value) == message


def test_relaxed_is_accepted_on_sqlite_which_already_commits_without_fsync(
    sqlite_url: str,
) -> None:
    with quota.connect(sqlite_url, durability="relaxed", batching=True) as limiter:
        assert limiter.rate_limit("k", 5, 60).count == 1
