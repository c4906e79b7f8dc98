"""Cancelled async calls leave no transaction, lock or lost charge behind.

A storm of `rate_limit`, `consume_quota`, `refund_quota` and `check` tasks runs
on async PostgreSQL (a pool of 3 connections, so tasks queue for one) and on
async SQLite, 8 at a time, and each call is cancelled at a random moment:
before it ran at all, after a few turns of the loop, while it waits for a
connection or opens one, in the middle of a statement or a transaction, or
after it had already finished. A call that returned is a promise: every charge
that came back allowed is in the ledger, every refund that came back is
marked, and the usage row equals what the ledger says. A call that was
cancelled may or may not have happened, but never in half. Afterwards nothing
is left open: no PostgreSQL session idle in a transaction or holding a lock,
no SQLite write lock held, and the limiter still commits what it is asked to.

Then, deterministically, the worst moments: a `consume_quota` cancelled once its
transaction has begun: on PostgreSQL while it waits for a row lock another
session holds, and right after its BEGIN ran on the server but before the
client heard back (a relay holds the answer); on SQLite while it waits in
BEGIN IMMEDIATE for the write lock another connection holds. Each once and, as
structured concurrency does it, more than once (a second `cancel()`, an anyio
cancel scope, which cancels again on every turn of the loop).

The storm's random choices come from one seed, printed, and named in every
failure; ``QUOTA_TEST_CANCEL_SEED=<seed>`` replays them (the timing still varies).
"""

from __future__ import annotations

import asyncio
import os
import random
import sqlite3
import subprocess
import sys
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import pytest

import quota
from quota._core.decision import stored_key
from tests._support import Clock
from tests.conftest import backend_params, dialect_of, store_url

SEED_ENV = "QUOTA_TEST_CANCEL_SEED"
#: Cancellations each backend's storm must reach (calls that raised CancelledError
#: or TimeoutError); the storm stops at `TARGET_CANCELLATIONS`, once enough calls
#: also returned to check the books by (`MIN_CHARGED`, `MIN_REFUNDED`), or at its
#: deadline. How many return depends on the machine's speed against the random delays.
MIN_CANCELLATIONS = 1000
TARGET_CANCELLATIONS = 3000
MIN_CHARGED = 50
MIN_REFUNDED = 10
WORKERS = 8
POOL_SIZE = 3
STORM_SECONDS = 20.0
MAX_CALLS_PER_WORKER = 5000
#: Longest random delay before the cancel, per backend: a PostgreSQL transaction
#: takes about a millisecond, an SQLite one a few hundred microseconds.
MAX_DELAY = {"postgresql": 0.004, "sqlite": 0.002}
#: Seconds a cancelled call may take to end, and a terminated backend to exit.
CALL_DEADLINE = 15.0
SETTLE_SECONDS = 10.0
LIMIT = 10**9  # no charge is ever denied: each call's outcome is charged or cancelled
NAME = "llm"
WINDOW = 3600


# -- direct access to the database: psycopg or sqlite3, never the limiter -------------------


class Db:
    """The database behind a store URL, read and written on connections of its own."""

    def __init__(self, dialect: str, url: str) -> None:
        self.dialect = dialect
        self.url = url
        self.path = url.removeprefix("sqlite:///")
        #: PostgreSQL sessions that were there before the test (none of its limiters'):
        #: left out of every look at the other sessions.
        self.ignored: set[int] = set()

    def rows(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        if self.dialect == "sqlite":
            conn = sqlite3.connect(self.path, timeout=5, isolation_level=None)
            try:
                return list(conn.execute(sql, params).fetchall())
            finally:
                conn.close()
        import psycopg

        with psycopg.connect(self.url, autocommit=True) as pg:
            cursor = pg.execute(sql.replace("?", "%s"), params)
            return list(cursor.fetchall()) if cursor.description else []

    def used(self, subject: str) -> tuple[int, int] | None:
        rows = self.rows(
            "SELECT used, granted FROM quota_usage WHERE subject = ? AND name = ?", (subject, NAME)
        )
        assert len(rows) <= 1, rows  # the clock stands still: one period
        return (int(rows[0][0]), int(rows[0][1])) if rows else None

    def counted(self, key: str) -> int:
        rows = self.rows(
            "SELECT coalesce(sum(count), 0) FROM quota_counters WHERE client_key = ?",
            (stored_key(key),),
        )
        return int(rows[0][0])

    def ledger(self, subject: str) -> list[tuple[str | None, str, int, bool]]:
        """(idempotency_key, kind, cost, marked refunded) of each of `subject`'s entries."""
        return [
            (key, kind, int(cost), bool(marked))
            for key, kind, cost, marked in self.rows(
                "SELECT idempotency_key, kind, cost, refunded_at IS NOT NULL FROM quota_ledger"
                " WHERE subject = ? AND name = ? ORDER BY id",
                (subject, NAME),
            )
        ]

    # -- PostgreSQL: the other sessions of the test database ---------------------------------

    def _others(self, rows: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
        return [row for row in rows if row[0] not in self.ignored]

    def backends(self) -> list[tuple[Any, ...]]:
        """Client sessions of this database but the one asking: (pid, state, wait, query)."""
        return self._others(
            self.rows(
                "SELECT pid, state, wait_event_type, left(query, 60) FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()"
                " AND backend_type = 'client backend' ORDER BY pid"
            )
        )

    def sessions(self) -> int:
        """Sessions this database has had (the statistics may lag a little)."""
        rows = self.rows("SELECT sessions FROM pg_stat_database WHERE datname = current_database()")
        return int(rows[0][0])

    def idle_in_transaction(self) -> list[tuple[Any, ...]]:
        return [b for b in self.backends() if str(b[1]).startswith("idle in transaction")]

    def locks_of_others(self) -> list[tuple[Any, ...]]:
        """Locks held or awaited by other client sessions of this database."""
        return self._others(
            self.rows(
                "SELECT l.pid, l.locktype, l.mode, l.granted, a.state FROM pg_locks l"
                " JOIN pg_stat_activity a ON a.pid = l.pid"
                " WHERE a.datname = current_database() AND l.pid <> pg_backend_pid()"
                " AND a.backend_type = 'client backend' ORDER BY l.pid"
            )
        )

    def waiting_on_a_lock(self) -> list[tuple[Any, ...]]:
        """Sessions waiting for a lock: (pid, state, in a transaction)."""
        return self._others(
            self.rows(
                "SELECT pid, state, xact_start IS NOT NULL FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()"
                " AND backend_type = 'client backend' AND wait_event_type = 'Lock'"
            )
        )

    # -- SQLite: the write lock ------------------------------------------------------------

    def write_lock_free(self) -> str | None:
        """None if another connection takes the write lock at once, else SQLite's answer."""
        conn = sqlite3.connect(self.path, timeout=0, isolation_level=None)
        try:
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("ROLLBACK")
        except sqlite3.OperationalError as exc:
            return str(exc)
        finally:
            conn.close()
        return None

    def write_lock_free_for_another_process(self) -> str | None:
        """`write_lock_free`, asked by another process."""
        done = subprocess.run(
            [sys.executable, "-c", _TAKE_WRITE_LOCK, self.path],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        return None if done.returncode == 0 else done.stderr.strip().splitlines()[-1]


_TAKE_WRITE_LOCK = (
    "import sqlite3, sys\n"
    "conn = sqlite3.connect(sys.argv[1], timeout=0, isolation_level=None)\n"
    "conn.execute('BEGIN IMMEDIATE')\n"
    "conn.execute('ROLLBACK')\n"
)


def _truncated(url: str) -> Db:
    """`url`'s database with empty quota tables (`pg_clean_url` leaves them as they are)."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SET lock_timeout = '30s'")  # a session left holding a lock: fail, not hang
        conn.execute("TRUNCATE quota_usage, quota_ledger, quota_counters")
    db = Db("postgresql", url)
    db.ignored = {row[0] for row in db.backends()}
    return db


def _db(request: pytest.FixtureRequest, dialect: str) -> Db:
    """A database of `dialect` with empty quota tables (the table of backends' `store_url`)."""
    db = Db(dialect, store_url(request, dialect))
    if dialect == "postgresql":
        db.ignored = {row[0] for row in db.backends()}
    return db


@pytest.fixture(params=backend_params("postgresql-async", "sqlite-async"))
def db(request: pytest.FixtureRequest) -> Db:
    """An empty database of either dialect."""
    return _db(request, dialect_of(request.param))


def _connect(db: Db, clock: Clock) -> quota.AsyncLimiter:
    if db.dialect == "postgresql":
        return quota.connect_async(db.url, pool_size=POOL_SIZE, clock=clock)
    return quota.connect_async(db.url, clock=clock)


async def _settle(problems: Callable[[], list[Any]], seconds: float = SETTLE_SECONDS) -> list[Any]:
    """Ask `problems` until it finds none or `seconds` pass; return its last answer.

    A terminated PostgreSQL connection's backend may take a moment to notice and exit.
    """
    deadline = time.monotonic() + seconds
    while True:
        found = problems()
        if not found or time.monotonic() > deadline:
            return found
        await asyncio.sleep(0.05)


def _seed() -> int:
    seed = int(os.environ.get(SEED_ENV) or random.SystemRandom().randrange(2**32))
    print(f"cancellation seed: {seed} (replay with {SEED_ENV}={seed})")
    return seed


# -- the storm -----------------------------------------------------------------------------


@dataclass
class Record:
    """What the storm's calls did, by operation."""

    subject: str
    rate_key: str
    check_key: str
    calls: Counter[str] = field(default_factory=Counter)
    started: Counter[str] = field(default_factory=Counter)
    returned: Counter[str] = field(default_factory=Counter)
    cancelled: Counter[str] = field(default_factory=Counter)
    cancelled_before_running: int = 0
    #: Idempotency keys of every consume and check the storm started.
    sent_keys: set[str] = field(default_factory=set)
    #: Each consume and check that returned allowed: its key and cost.
    charged: dict[str, int] = field(default_factory=dict)
    #: Charged keys no refund has come back for yet.
    refundable: list[str] = field(default_factory=list)
    #: Each refund that returned: its key and status.
    refunded: dict[str, str] = field(default_factory=dict)
    refund_statuses: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)

    @property
    def cancellations(self) -> int:
        return sum(self.cancelled.values())

    def summary(self) -> str:
        return (
            f"{sum(self.calls.values())} calls, {self.cancellations} cancelled"
            f" ({self.cancelled_before_running} before running; by call {dict(self.cancelled)}),"
            f" {sum(self.returned.values())} returned ({dict(self.returned)}),"
            f" refunds {dict(self.refund_statuses)}"
        )


async def _cancel_at_random(
    call: Callable[[], Awaitable[Any]], rng: random.Random, max_delay: float
) -> tuple[bool, Any, bool]:
    """Run `call` and cancel it at a random moment: (cancelled, result, started running).

    The moment: before the task first runs; after 1 to 4 turns of the loop; after
    a random delay up to `max_delay` (mid-connect, mid-statement, mid-transaction,
    or after the call finished); or by `asyncio.wait_for` with such a timeout.
    Exceptions other than the cancellation propagate.
    """
    started = False

    async def run() -> Any:
        nonlocal started
        started = True
        return await call()

    how = rng.random()
    # Mostly within a call's length; now and then up to 5 times that, so that calls
    # which must first open a connection (PostgreSQL: ~5 ms) finish too.
    delay = rng.uniform(0, max_delay * (1 if rng.random() < 0.6 else 5))
    if how < 0.3:
        try:
            return False, await asyncio.wait_for(run(), delay), started
        except asyncio.TimeoutError as exc:
            if not isinstance(exc.__cause__, asyncio.CancelledError):
                raise  # the call's own TimeoutError, not wait_for's
            return True, None, started
    task = asyncio.ensure_future(run())
    if how < 0.4:
        pass  # cancelled before it ran at all
    elif how < 0.55:
        for _ in range(rng.randint(1, 4)):
            await asyncio.sleep(0)
    else:
        await asyncio.sleep(delay)
    task.cancel()
    done, _ = await asyncio.wait([task], timeout=CALL_DEADLINE)
    if not done:
        raise AssertionError(f"a cancelled call was still running {CALL_DEADLINE:g}s later")
    if task.cancelled():
        return True, None, started
    return False, task.result(), started  # finished before the cancel landed (or raised)


async def _one_call(
    limiter: quota.AsyncLimiter, rng: random.Random, rec: Record, max_delay: float
) -> None:
    pick = rng.random()
    key = f"k-{uuid.uuid4().hex}"
    cost = rng.randint(1, 5)
    call: Callable[[], Awaitable[Any]]
    if pick < 0.25:
        op = "rate_limit"
        call = lambda: limiter.rate_limit(rec.rate_key, LIMIT, WINDOW)  # noqa: E731
    elif pick < 0.4 and rec.refundable:
        op = "refund_quota"
        key = rng.choice(rec.refundable)
        call = lambda: limiter.refund_quota(rec.subject, NAME, key)  # noqa: E731
    elif pick < 0.75:
        op = "consume_quota"
        rec.sent_keys.add(key)
        call = lambda: limiter.consume_quota(  # noqa: E731
            rec.subject, NAME, LIMIT, "day", cost=cost, idempotency_key=key
        )
    else:
        op = "check"
        cost = 1
        rec.sent_keys.add(key)
        limits = (
            quota.RateWindow(rec.check_key, LIMIT, WINDOW),
            quota.QuotaLimit(rec.subject, NAME, LIMIT, "day"),
        )
        call = lambda: limiter.check(*limits, idempotency_key=key)  # noqa: E731
    rec.calls[op] += 1
    try:
        cancelled, result, started = await _cancel_at_random(call, rng, max_delay)
    except Exception as exc:
        rec.started[op] += 1
        rec.failures.append(f"{op} raised {type(exc).__name__}: {exc}")
        return
    rec.started[op] += started
    if cancelled:
        rec.cancelled[op] += 1
        rec.cancelled_before_running += not started
        return
    rec.returned[op] += 1
    if op == "rate_limit":
        if not result.allowed:
            rec.failures.append(f"rate_limit denied under a limit of {LIMIT}: {result}")
    elif op == "refund_quota":
        rec.refund_statuses[result.status] += 1
        if result.status not in ("refunded", "already_refunded"):
            rec.failures.append(f"the refund of a returned charge {key!r} said {result.status}")
            return
        rec.refunded[key] = result.status
        if key in rec.refundable:
            rec.refundable.remove(key)
    elif not result.allowed or result.replayed:
        rec.failures.append(f"{op} with a fresh key {key!r} was not a new charge: {result}")
    else:
        rec.charged[key] = cost
        rec.refundable.append(key)


async def _storm(
    limiter: quota.AsyncLimiter, rng: random.Random, rec: Record, dialect: str
) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + STORM_SECONDS
    # On a loaded machine a call takes many times its usual length and nearly every one
    # is cancelled: the delays stretch (up to 16-fold) while fewer than one call in a
    # hundred returns a charge, so that enough return to check the books by.
    stretch = 1.0

    async def worker() -> None:
        nonlocal stretch
        for _ in range(MAX_CALLS_PER_WORKER):
            if loop.time() > deadline or (
                rec.cancellations >= TARGET_CANCELLATIONS
                and len(rec.charged) >= MIN_CHARGED
                and len(rec.refunded) >= MIN_REFUNDED
            ):
                return
            await _one_call(limiter, rng, rec, MAX_DELAY[dialect] * stretch)
            calls = sum(rec.calls.values())
            if calls % 300 == 0 and len(rec.charged) * 100 < calls and stretch < 16:
                stretch *= 2

    await asyncio.gather(*(worker() for _ in range(WORKERS)))


def _check_the_books(db: Db, rec: Record) -> None:
    """The ledger holds every charge and refund that returned, and the usage row agrees."""
    consumed: dict[str | None, list[tuple[int, bool]]] = defaultdict(list)
    refunds: dict[str | None, list[int]] = defaultdict(list)
    kinds: Counter[str] = Counter()
    for key, kind, cost, marked in db.ledger(rec.subject):
        kinds[kind] += 1
        if kind == "consume":
            consumed[key].append((cost, marked))
        elif kind == "refund":
            refunds[key].append(cost)
    assert set(kinds) <= {"consume", "refund"}, kinds
    assert set(consumed) <= rec.sent_keys, "the ledger holds charges no call asked for"
    twice = {key: entries for key, entries in consumed.items() if len(entries) != 1}
    assert not twice, f"keys charged more than once: {twice}"

    lost = {
        key: (cost, consumed.get(key))
        for key, cost in rec.charged.items()
        if [c for c, _ in consumed.get(key, [])] != [cost]
    }
    assert not lost, f"{len(lost)} charges returned allowed but are not in the ledger: {lost}"
    unmarked = [key for key in rec.refunded if not consumed[key][0][1]]
    assert not unmarked, f"refunds returned but their charges are not marked refunded: {unmarked}"
    marked = {key for key, entries in consumed.items() if entries[0][1]}
    assert marked == set(refunds), "a charge is marked refunded exactly when a refund entry exists"
    wrong = {k: v for k, v in refunds.items() if v != [consumed[k][0][0]]}
    assert not wrong, f"refund entries that do not give back their charge once: {wrong}"

    charged = sum(cost for entries in consumed.values() for cost, _ in entries)
    refunded = sum(sum(costs) for costs in refunds.values())
    assert db.used(rec.subject) == (charged - refunded, 0), (charged, refunded)

    # Rate windows: every hit that returned is counted; none that never ran.
    for op, key in (("rate_limit", rec.rate_key), ("check", rec.check_key)):
        assert rec.returned[op] <= db.counted(key) <= rec.started[op], (op, db.counted(key))


async def _the_limiter_still_commits(db: Db, limiter: quota.AsyncLimiter, rec: Record) -> None:
    fresh = await limiter.rate_limit(f"fresh-{uuid.uuid4().hex}", 10, 60)
    assert (fresh.allowed, fresh.count) == (True, 1)
    before = db.used(rec.subject) or (0, 0)
    for cost in range(1, 6):
        key = f"after-{cost}"
        rec.sent_keys.add(key)
        decision = await limiter.consume_quota(
            rec.subject, NAME, LIMIT, "day", cost=cost, idempotency_key=key
        )
        assert (decision.allowed, decision.replayed) == (True, False)
        rec.charged[key] = cost
    # Read on a connection of our own while the limiter is open: committed, not pending.
    assert db.used(rec.subject) == (before[0] + 15, before[1])


def test_a_storm_of_random_cancellations_leaves_nothing_open_and_loses_no_returned_call(
    db: Db, clock: Clock
) -> None:
    seed = _seed()
    rng = random.Random(seed)
    tag = uuid.uuid4().hex[:8]
    rec = Record(subject=f"acct:{tag}", rate_key=f"ip:{tag}", check_key=f"user:{tag}")
    postgres = db.dialect == "postgresql"
    sessions_before = db.sessions() if postgres else 0

    async def main() -> None:
        limiter = _connect(db, clock)
        started = time.monotonic()
        try:
            await _storm(limiter, rng, rec, db.dialect)
            print(f"{db.dialect}: {rec.summary()} in {time.monotonic() - started:.1f}s")
            assert not rec.failures, rec.failures[:10]
            assert rec.cancellations >= MIN_CANCELLATIONS, rec.summary()
            # Cancelled at every stage, and enough calls returned to check the books by.
            assert rec.cancellations - rec.cancelled_before_running >= MIN_CANCELLATIONS // 2
            assert len(rec.charged) >= MIN_CHARGED, rec.summary()
            assert len(rec.refunded) >= MIN_REFUNDED, rec.summary()
            # The storm is over and the limiter still open: nothing is left mid-transaction.
            if postgres:
                assert await _settle(db.idle_in_transaction) == []
                assert await _settle(db.locks_of_others) == []
            else:
                assert db.write_lock_free() is None
            await _the_limiter_still_commits(db, limiter, rec)
        finally:
            await limiter.aclose()

    try:
        asyncio.run(main())
        if postgres:
            # Closed: no session of the limiter's (terminated ones included) lives on.
            assert asyncio.run(_settle(db.backends)) == [], "sessions outlived the closed limiter"
            assert db.locks_of_others() == []
            # Beyond the pool's first few, each replaced a connection thrown away.
            print(f"postgresql: {db.sessions() - sessions_before} sessions opened")
        else:
            assert db.write_lock_free() is None
        _check_the_books(db, rec)
    except BaseException:
        print(f"failed with seed {seed} ({SEED_ENV}={seed}): {rec.summary()}")
        raise


# -- the worst moment, deterministically: cancelled inside the transaction -------------------


async def _consume_after(limiter: quota.AsyncLimiter, subject: str, n: int) -> list[str]:
    keys = []
    for cost in range(1, n + 1):
        key = f"after-{cost}"
        decision = await limiter.consume_quota(
            subject, NAME, LIMIT, "day", cost=cost, idempotency_key=key
        )
        assert (decision.allowed, decision.replayed) == (True, False), decision
        keys.append(key)
    return keys


def _books_agree(db: Db, subject: str) -> list[tuple[str | None, str, int, bool]]:
    entries = db.ledger(subject)
    charged = sum(cost for _, kind, cost, _ in entries if kind == "consume")
    refunded = sum(cost for _, kind, cost, _ in entries if kind == "refund")
    assert db.used(subject) == (charged - refunded, 0), entries
    return entries


@pytest.mark.postgres
@pytest.mark.parametrize("times", [1, 2], ids=["cancelled-once", "cancelled-twice"])
def test_a_consume_cancelled_while_its_transaction_waits_for_a_row_lock_on_postgresql(
    pg_clean_url: str, clock: Clock, times: int
) -> None:
    """The pooled connection is not left idle in a transaction, and later charges commit.

    A connection given back to the pool mid-transaction ran every later charge
    inside that transaction, and none of them was ever committed.
    """
    import psycopg

    db = _truncated(pg_clean_url)
    subject = f"acct:{uuid.uuid4().hex[:8]}"

    async def main() -> None:
        limiter = quota.connect_async(db.url, pool_size=POOL_SIZE, clock=clock)
        try:
            await limiter.consume_quota(subject, NAME, LIMIT, "day", idempotency_key="first")
            with psycopg.connect(db.url) as holder:  # a transaction of its own
                holder.execute(
                    "SELECT used FROM quota_usage WHERE subject = %s FOR UPDATE", (subject,)
                )
                victim = asyncio.ensure_future(
                    limiter.consume_quota(
                        subject, NAME, LIMIT, "day", cost=7, idempotency_key="victim"
                    )
                )
                waiting = await _settle(lambda: [] if db.waiting_on_a_lock() else ["none yet"])
                assert waiting == [], "the consume never waited for the row lock"
                [(_, state, in_transaction)] = db.waiting_on_a_lock()
                assert (state, in_transaction) == ("active", True)
                for _ in range(times):
                    victim.cancel()
                    await asyncio.sleep(0)  # the task takes the cancellation in
                await asyncio.wait([victim], timeout=CALL_DEADLINE)
                assert victim.cancelled()
                holder.rollback()
            # The victim's transaction is rolled back (its session closed, or rolled back
            # and reused): nobody is left in a transaction or holding a lock.
            assert await _settle(db.idle_in_transaction) == []
            assert await _settle(db.locks_of_others) == []

            keys = await _consume_after(limiter, subject, 6)
            # Committed: seen from a connection of our own while the limiter is open.
            entries = _books_agree(db, subject)
            assert [k for k, kind, _, _ in entries if kind == "consume"] == ["first", *keys]
            assert db.used(subject) == (1 + 21, 0)  # the victim's charge was rolled back
            assert await _settle(db.idle_in_transaction) == []
            assert await _settle(db.locks_of_others) == []
        finally:
            await limiter.aclose()

    asyncio.run(main())
    assert db.used(subject) == (22, 0)  # still there once the limiter is closed
    assert asyncio.run(_settle(db.backends)) == []  # no session outlives the closed limiter


class _HoldingProxy:
    """A TCP relay in front of PostgreSQL that can hold back the server's replies.

    Bytes from the client go through at once; while `hold` is on, bytes from the
    server wait until it is off again. So a test can let a statement reach the
    server and keep its answer from the client: a cancellation then lands exactly
    between the two.
    """

    def __init__(self, host: str, port: int) -> None:
        self._upstream = (host, port)
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._server: asyncio.Server | None = None
        self._pumps: set[asyncio.Task[None]] = set()
        #: Bytes the clients sent while replies were held.
        self.sent_while_held = 0

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return int(self._server.sockets[0].getsockname()[1])

    def hold(self) -> None:
        self.sent_while_held = 0
        self._flowing.clear()

    def release(self) -> None:
        self._flowing.set()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self._upstream)
        pumps = [
            asyncio.ensure_future(self._pump(reader, up_writer, upstream=True)),
            asyncio.ensure_future(self._pump(up_reader, writer, upstream=False)),
        ]
        self._pumps.update(pumps)
        await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        for pump in pumps:
            pump.cancel()
        for stream in (writer, up_writer):
            stream.close()

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, upstream: bool
    ) -> None:
        try:
            while data := await reader.read(65536):
                if upstream:
                    if not self._flowing.is_set():
                        self.sent_while_held += len(data)
                else:
                    await self._flowing.wait()
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass

    async def close(self) -> None:
        self.release()
        if self._server is not None:
            self._server.close()
        for pump in self._pumps:
            pump.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()


@pytest.mark.postgres
def test_a_consume_cancelled_right_after_its_begin_reached_the_server_on_postgresql(
    pg_clean_url: str, clock: Clock
) -> None:
    """The worst moment: the server ran BEGIN, the client never heard back, and the task
    is cancelled. That connection must not go back to the pool as it is: every later
    charge would run inside its open transaction, and none would ever be committed."""
    db = _truncated(pg_clean_url)
    subject = f"acct:{uuid.uuid4().hex[:8]}"
    parts = urlsplit(db.url)

    async def main() -> None:
        proxy = _HoldingProxy(parts.hostname or "127.0.0.1", parts.port or 5432)
        port = await proxy.start()
        netloc = f"{parts.netloc.rpartition('@')[0]}@127.0.0.1:{port}".lstrip("@")
        limiter = quota.connect_async(
            parts._replace(netloc=netloc).geturl(), pool_size=1, clock=clock
        )
        try:
            await limiter.consume_quota(subject, NAME, LIMIT, "day", idempotency_key="first")
            proxy.hold()
            victim = asyncio.ensure_future(
                limiter.consume_quota(subject, NAME, LIMIT, "day", cost=7, idempotency_key="victim")
            )
            # BEGIN has reached the server and run there; its answer is held back.
            opened = await _settle(
                lambda: [] if proxy.sent_while_held and db.idle_in_transaction() else ["not yet"]
            )
            assert opened == [], "the consume never began its transaction"
            victim.cancel()
            await asyncio.wait([victim], timeout=CALL_DEADLINE)
            assert victim.cancelled()
            proxy.release()

            assert await _settle(db.idle_in_transaction) == []
            keys = await _consume_after(limiter, subject, 6)
            entries = _books_agree(db, subject)  # read while the limiter is open: committed
            assert [k for k, kind, _, _ in entries if kind == "consume"] == ["first", *keys]
            assert db.used(subject) == (1 + 21, 0)
            assert await _settle(db.idle_in_transaction) == []
            assert await _settle(db.locks_of_others) == []
        finally:
            await limiter.aclose()
            await proxy.close()

    asyncio.run(main())
    assert db.used(subject) == (22, 0)
    assert asyncio.run(_settle(db.backends)) == []  # no session outlives the closed limiter


@pytest.mark.parametrize("times", [1, 2], ids=["cancelled-once", "cancelled-twice"])
def test_a_consume_cancelled_while_waiting_for_the_write_lock_leaves_it_free_on_sqlite(
    sqlite_url: str, clock: Clock, times: int
) -> None:
    """Once the holder lets go, another process takes the write lock at once, and later
    charges commit. (A cancelled consume that had not begun may still be charged: the
    store finishes its transaction; the ledger and the usage agree either way.)"""
    db = Db("sqlite", sqlite_url)
    subject = "acct:1"

    async def main() -> None:
        limiter = quota.connect_async(db.url, clock=clock)
        try:
            await limiter.consume_quota(subject, NAME, LIMIT, "day", idempotency_key="first")
            holder = sqlite3.connect(db.path, timeout=0, isolation_level=None)
            try:
                holder.execute("BEGIN IMMEDIATE")  # another writer holds the file
                victim = asyncio.ensure_future(
                    limiter.consume_quota(
                        subject, NAME, LIMIT, "day", cost=7, idempotency_key="victim"
                    )
                )
                await asyncio.sleep(0.2)
                assert not victim.done(), "the consume did not wait for the write lock"
                for _ in range(times):
                    victim.cancel()
                    await asyncio.sleep(0)  # the task takes the cancellation in
            finally:
                holder.rollback()
                holder.close()
            await asyncio.wait([victim], timeout=CALL_DEADLINE)
            assert victim.cancelled()
            await asyncio.sleep(0.1)  # whatever the store still had queued has run
            assert db.write_lock_free() is None, "the limiter's connection holds the write lock"
            assert db.write_lock_free_for_another_process() is None

            keys = await _consume_after(limiter, subject, 6)
            entries = _books_agree(db, subject)
            charges = [k for k, kind, _, _ in entries if kind == "consume"]
            assert charges in (["first", *keys], ["first", "victim", *keys]), charges
            assert db.write_lock_free() is None
        finally:
            await limiter.aclose()
        assert db.write_lock_free() is None

    asyncio.run(main())
    entries = _books_agree(db, subject)
    assert {"after-1", "after-6"} <= {k for k, _, _, _ in entries}


@pytest.mark.parametrize("dialect", backend_params("postgresql", "sqlite"))
def test_a_consume_under_an_anyio_deadline_that_expires_while_it_waits_leaves_nothing_held(
    request: pytest.FixtureRequest, clock: Clock, dialect: str
) -> None:
    """anyio (Starlette, FastAPI, httpx) cancels a task again on every loop turn until it
    leaves the expired scope: the store sees many cancellations, not one."""
    anyio = pytest.importorskip("anyio")
    import psycopg

    db = _db(request, dialect)
    subject = f"acct:{uuid.uuid4().hex[:8]}"

    async def main() -> None:
        limiter = _connect(db, clock)
        try:
            await limiter.consume_quota(subject, NAME, LIMIT, "day", idempotency_key="first")
            if dialect == "postgresql":
                holder: Any = psycopg.connect(db.url)
                holder.execute(
                    "SELECT used FROM quota_usage WHERE subject = %s FOR UPDATE", (subject,)
                )
            else:
                holder = sqlite3.connect(db.path, timeout=0, isolation_level=None)
                holder.execute("BEGIN IMMEDIATE")
            # The holder lets go a little after the deadline, while the cancelled call
            # is still being wound down (a store that waits for its transaction to end
            # then finishes it, instead of waiting out its busy or lock timeout).
            release = asyncio.get_running_loop().call_later(0.3, holder.rollback)
            try:
                with anyio.move_on_after(0.2) as scope:
                    await limiter.consume_quota(
                        subject, NAME, LIMIT, "day", cost=7, idempotency_key="victim"
                    )
                assert scope.cancelled_caught, "the consume did not wait for the lock"
            finally:
                release.cancel()
                holder.rollback()
                holder.close()
            if dialect == "postgresql":
                assert await _settle(db.idle_in_transaction) == []
            else:
                await asyncio.sleep(0.1)  # whatever the store still had queued has run
                assert db.write_lock_free() is None, "the limiter's connection holds the write lock"
            await _consume_after(limiter, subject, 6)
            entries = _books_agree(db, subject)
            assert {f"after-{i}" for i in range(1, 7)} <= {k for k, _, _, _ in entries}
        finally:
            await limiter.aclose()

    asyncio.run(main())
    entries = _books_agree(db, subject)
    assert {f"after-{i}" for i in range(1, 7)} <= {k for k, _, _, _ in entries}
    if dialect == "postgresql":
        assert asyncio.run(_settle(db.backends)) == []  # no session outlives the closed limiter
    else:
        assert db.write_lock_free() is None
