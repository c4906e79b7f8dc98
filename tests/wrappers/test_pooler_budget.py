"""The fallback's time budget behind a transaction pooler, where no statement_timeout is set.

A table lock held from a direct connection makes every decision wait; through
PgBouncer in transaction mode (``prepared_statements=False``) the client must
still give up within the budget and let memory decide.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
import pytest

import quota

pytestmark = pytest.mark.postgres

BUDGET = 0.2
#: What the budget may be overrun by on a busy 2-core machine: a cancel round trip,
#: the watchdog's tick (a quarter of the budget) and scheduling.
MARGIN = 0.5


@contextmanager
def counters_locked(pg_url: str) -> Iterator[None]:
    """Every write to quota_counters waits while this holds the table."""
    with psycopg.connect(pg_url) as conn:
        conn.execute("LOCK TABLE quota_counters IN EXCLUSIVE MODE")
        yield
        conn.rollback()


def _count(pg_url: str, key: str) -> int:
    with psycopg.connect(pg_url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT coalesce(sum(count), 0) FROM quota_counters WHERE client_key = %s",
            (f"k:{key}",),
        ).fetchone()
    assert row is not None
    return int(row[0])


def test_sync_face_holds_the_budget_through_a_transaction_pooler(
    pgbouncer_txn_url: str, pg_url: str
) -> None:
    key = f"budget-{uuid.uuid4().hex}"
    url = pgbouncer_txn_url + "?prepared_statements=false"
    fallback = quota.Fallback(timeout=BUDGET, probe_interval=0.2)
    with quota.connect(url, fallback=fallback, pool_size=2) as limiter:
        assert limiter.rate_limit(key, 100, 3600).allowed
        assert limiter.store.up  # type: ignore[attr-defined]
        assert _count(pg_url, key) == 1  # decided by the database, through the pooler
        with counters_locked(pg_url):
            started = time.monotonic()
            # In a thread, so that a call that ignored the budget fails the test, not hangs it.
            result: list[quota.Decision] = []
            call = threading.Thread(
                target=lambda: result.append(limiter.rate_limit(key, 100, 3600))
            )
            call.start()
            call.join(BUDGET + MARGIN)
            took = time.monotonic() - started
        call.join(10)
        assert result and result[0].allowed
        assert took < BUDGET + MARGIN, took
        assert not limiter.store.up  # type: ignore[attr-defined]
        # Back once the lock is gone: the probe finds the database again.
        deadline = time.monotonic() + 10
        while not limiter.store.up and time.monotonic() < deadline:  # type: ignore[attr-defined]
            limiter.rate_limit(key, 100, 3600)
            time.sleep(0.05)
        assert limiter.store.up  # type: ignore[attr-defined]


def test_async_face_holds_the_budget_through_a_transaction_pooler(
    pgbouncer_txn_url: str, pg_url: str
) -> None:
    key = f"budget-{uuid.uuid4().hex}"
    url = pgbouncer_txn_url + "?prepared_statements=false"

    async def main() -> None:
        fallback = quota.Fallback(timeout=BUDGET, probe_interval=0.2)
        async with quota.connect_async(url, fallback=fallback, pool_size=2) as limiter:
            # The first call may wait at most one budget for the pool to open.
            for _ in range(50):
                await limiter.rate_limit(key, 100, 3600)
                if _count(pg_url, key):
                    break
                await asyncio.sleep(0.05)
            assert limiter.store.up  # type: ignore[attr-defined]
            assert _count(pg_url, key) >= 1
            with counters_locked(pg_url):
                started = time.monotonic()
                # Bounded, so that a call that ignored the budget fails the test, not hangs it.
                decision = await asyncio.wait_for(limiter.rate_limit(key, 100, 3600), 5)
                took = time.monotonic() - started
                assert decision.allowed
                assert took < BUDGET + MARGIN, took
                assert not limiter.store.up  # type: ignore[attr-defined]

    asyncio.run(main())
