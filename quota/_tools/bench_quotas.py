"""The durable-quota scenarios of ``quota bench --scenario quota|check``.

Each scenario runs one workload two ways, as `quota._tools.bench` does for rate
limits: through quota, and through the bare driver running the very same
statements (the SQL of `quota._sql.quotas` and `quota._sql.statements`, prepared) in the
same transaction shape, with the period, bucket keys and parameters
computed inline as any caller would have to. Every call is allowed (limits
are huge), so both sides do the same work:

* ``quota``: `consume_quota` on one of `keys` subjects with a fresh
  idempotency key per call; one transaction of two statements (charge the
  usage, append the ledger entry that claims the key);
* ``check``: `check` of two rate windows (a minute and an hour) and one daily
  quota on one of `keys` subjects; one transaction of four statements in
  the sorted order `check` uses (both windows, the usage, the ledger).
"""

from __future__ import annotations

import asyncio
import itertools
import sqlite3
import time
import uuid
from collections.abc import Callable
from typing import Any

from quota._core.url import StoreURL
from quota._limiter import connect, connect_async
from quota._limiter.quota_types import QuotaLimit, RateWindow
from quota._sql import quotas as q
from quota._sql import statements as _sql
from quota._stores.sqlite import aset_up, set_up
from quota._tools.bench import _key_stream, _pg_connections, _tasks, _threads

SCENARIOS = ("rate", "quota", "check")
LIMIT = 2**60
DAY = 86400
NAME = "bench"

Statement = tuple[str, tuple[Any, ...]]


def _day(now: float) -> tuple[int, int]:
    second = int(now)
    start = second - second % DAY
    return start, start + DAY


def _charge(subject: str, now: float) -> Statement:
    start, end = _day(now)
    return q.USAGE_CHARGE, (subject, NAME, start, end, "day", "UTC", LIMIT, 1, now, now)


def _entry(subject: str, key: str | None, used: int, now: float) -> Statement:
    start, end = _day(now)
    return q.LEDGER_CHARGE, (
        now, subject, NAME, "consume", 1, key, start, end, LIMIT, used, LIMIT - used,
    )  # fmt: skip


def _windows(subject: str, now: float) -> list[Statement]:
    second, stored = int(now), "k:" + subject
    out: list[Statement] = []
    for window in sorted((60, 3600), key=lambda w: f"{w}:{second - second % w}:{stored}"):
        start = second - second % window
        params = (f"{window}:{start}:{stored}", stored, start, window, 1, now, LIMIT)
        out.append((_sql.HIT_CAPPED, params))
    return out


class _Calls:
    """What one caller does per call, for the scenario: quota's call and the bare statements."""

    def __init__(self, scenario: str, keys: int, caller: int) -> None:
        self.scenario = scenario
        self.subject = _key_stream(keys, caller)
        # Fresh idempotency keys for every run: a replay would skip the work.
        prefix = f"{uuid.uuid4().hex[:8]}:{caller}:"
        self.key = (prefix + str(n) for n in itertools.count())

    def bare(self, run: Callable[[Statement], Any]) -> Any:
        """The statements of one call, each run by `run`, which returns its rows (sync)."""
        subject, now = self.subject(), time.time()
        if self.scenario == "check":
            for statement in _windows(subject, now):
                run(statement)
            rows = run(_charge(subject, now))
            return run(_entry(subject, None, int(rows[0][0]), now))
        rows = run(_charge(subject, now))
        return run(_entry(subject, next(self.key), int(rows[0][0]), now))

    async def abare(self, run: Callable[[Statement], Any]) -> Any:
        """`bare`, awaiting each statement."""
        subject, now = self.subject(), time.time()
        if self.scenario == "check":
            for statement in _windows(subject, now):
                await run(statement)
            rows = await run(_charge(subject, now))
            return await run(_entry(subject, None, int(rows[0][0]), now))
        rows = await run(_charge(subject, now))
        return await run(_entry(subject, next(self.key), int(rows[0][0]), now))

    def limits(self) -> tuple[RateWindow | QuotaLimit, ...]:
        subject = self.subject()
        return (
            RateWindow(subject, LIMIT, 60),
            RateWindow(subject, LIMIT, 3600),
            QuotaLimit(subject, NAME, LIMIT, "day"),
        )


# -- the sync face ------------------------------------------------------------------------


def sync_quota(scenario: str, url: str, concurrency: int, keys: int, duration: float) -> float:
    with connect(url, pool_size=concurrency) as limiter:

        def work(i: int, go: Callable[[], bool]) -> int:
            calls, n = _Calls(scenario, keys, i), 0
            limiter.quota_usage("bench:warm")  # connect outside the clock
            while go():
                if scenario == "check":
                    limiter.check(*calls.limits())
                else:
                    limiter.consume_quota(
                        calls.subject(), NAME, LIMIT, "day", idempotency_key=next(calls.key)
                    )
                n += 1
            return n

        return _threads(concurrency, duration, work)


def sync_bare(
    scenario: str, parsed: StoreURL, concurrency: int, keys: int, duration: float
) -> float:
    if parsed.dialect == "sqlite":

        def work(i: int, go: Callable[[], bool]) -> int:
            conn = sqlite3.connect(parsed.target, isolation_level=None, check_same_thread=False)
            try:
                set_up(conn, 10.0)
                calls, n = _Calls(scenario, keys, i), 0

                def run(statement: Statement) -> Any:
                    return conn.execute(*statement).fetchall()

                while go():
                    conn.execute("BEGIN IMMEDIATE")
                    try:
                        calls.bare(run)
                    except BaseException:
                        conn.rollback()
                        raise
                    conn.execute("COMMIT")
                    n += 1
                return n
            finally:
                conn.close()

        return _threads(concurrency, duration, work)
    import psycopg

    def pg_work(i: int, go: Callable[[], bool]) -> int:
        with psycopg.connect(parsed.target, autocommit=True, prepare_threshold=0) as conn:
            calls, n = _Calls(scenario, keys, i), 0

            def run(statement: Statement) -> Any:
                return conn.execute(_sql.render(statement[0], "format"), statement[1]).fetchall()

            while go():
                with conn.transaction():
                    calls.bare(run)
                n += 1
            return n

    return _threads(concurrency, duration, pg_work)


# -- the async face -----------------------------------------------------------------------


async def async_quota(
    scenario: str, url: str, concurrency: int, keys: int, duration: float
) -> float:
    async with connect_async(url, pool_size=concurrency) as limiter:
        # Open the pool up front: connecting is not what is measured.
        await asyncio.gather(*(limiter.quota_usage("bench:warm") for _ in range(concurrency)))

        async def work(i: int, go: Callable[[], bool]) -> int:
            calls, n = _Calls(scenario, keys, i), 0
            while go():
                if scenario == "check":
                    await limiter.check(*calls.limits())
                else:
                    await limiter.consume_quota(
                        calls.subject(), NAME, LIMIT, "day", idempotency_key=next(calls.key)
                    )
                n += 1
            return n

        return await _tasks(concurrency, duration, work)


async def async_bare(
    scenario: str, parsed: StoreURL, concurrency: int, keys: int, duration: float
) -> float:
    if parsed.dialect == "sqlite":
        import aiosqlite

        async with aiosqlite.connect(parsed.target, isolation_level=None) as conn:
            await aset_up(conn, 10.0)
            # One connection: transactions of different tasks must not interleave
            # (quota's async SQLite store holds the same kind of lock).
            lock = asyncio.Lock()

            async def run(statement: Statement) -> Any:
                return await conn.execute_fetchall(*statement)

            async def work(i: int, go: Callable[[], bool]) -> int:
                calls, n = _Calls(scenario, keys, i), 0
                while go():
                    async with lock:
                        await conn.execute("BEGIN IMMEDIATE")
                        await calls.abare(run)
                        await conn.execute("COMMIT")
                    n += 1
                return n

            return await _tasks(concurrency, duration, work)
    async with _pg_connections(parsed.target, concurrency) as connections:

        async def pg_work(i: int, go: Callable[[], bool]) -> int:
            conn, calls, n = connections[i], _Calls(scenario, keys, i), 0
            prepared: dict[str, Any] = {}

            async def run(statement: Statement) -> Any:
                stmt = prepared.get(statement[0])
                if stmt is None:
                    text = _sql.render(statement[0], "numeric_dollar")
                    stmt = prepared[statement[0]] = await conn.prepare(text)
                return await stmt.fetch(*statement[1])

            while go():
                async with conn.transaction():
                    await calls.abare(run)
                n += 1
            return n

        return await _tasks(concurrency, duration, pg_work)


def measure(
    scenario: str, side: str, face: str, parsed: StoreURL, url: str, concurrency: int,
    keys: int, duration: float,
) -> float:  # fmt: skip
    """Calls per second of one side (``bare`` or ``quota``) of `scenario` on `face`."""
    if face == "sync":
        if side == "bare":
            return sync_bare(scenario, parsed, concurrency, keys, duration)
        return sync_quota(scenario, url, concurrency, keys, duration)
    if side == "bare":
        return asyncio.run(async_bare(scenario, parsed, concurrency, keys, duration))
    return asyncio.run(async_quota(scenario, url, concurrency, keys, duration))
