"""The PostgreSQL stores behind a real PgBouncer 1.18: transaction mode with
``prepared_statements=False``, and session mode without it.

No mocks: a private PgBouncer (tests/_pgbouncer.py) in front of the session's
database, worker processes (``spawn``) racing on one key, a second client of the
same server connection reading what the first left behind, and the server's own
views (pg_locks, pg_stat_activity) read over a direct connection.

Every bouncer has two server connections unless said otherwise; the stores' pools
are kept tiny (1 to 3), since the server is shared.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import multiprocessing
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import unquote, urlsplit

import psycopg
import pytest
from click.testing import CliRunner

import quota
from quota._cli import main
from quota._sql.schema import HEAD
from quota._sql.statements import CLEANUP_LOCK_ID
from tests import _pgbouncer_workers, _workers
from tests._pgbouncer import running_pgbouncer

pytestmark = pytest.mark.postgres

SPAWN = multiprocessing.get_context("spawn")
#: The URL query that makes a store work behind a transaction pooler.
POOLED = "prepared_statements=false"
#: A fixed instant, for durable quotas: no period boundary is crossed mid-test.
NOW = 1_782_907_200.5  # 2026-07-01 12:00:00.5 UTC
#: The session settings a store must never leave on a pooler's server connection.
SETTINGS = ("statement_timeout", "lock_timeout", "synchronous_commit", "jit")
#: How long the polls below wait for the server to reach a state, at most.
DEADLINE = 10.0


# -- helpers ----------------------------------------------------------------------------------


def pooled(url: str) -> str:
    """`url` (no query of its own) with ``?prepared_statements=false``."""
    return f"{url}?{POOLED}"


def unique(prefix: str) -> str:
    """A key, subject or name no other test (or run) uses."""
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def rows(url: str, sql: str, params: tuple[Any, ...] | None = None) -> list[tuple[Any, ...]]:
    """Rows of `sql`, read over a connection of its own (directly, for a direct URL)."""
    with psycopg.connect(url, autocommit=True, prepare_threshold=None) as conn:
        cursor = conn.execute(sql, params)
        return list(cursor.fetchall()) if cursor.description else []


def counted(direct_url: str, key: str) -> int:
    """The hits the database holds for `key`, over every window."""
    [(count,)] = rows(
        direct_url,
        "SELECT coalesce(sum(count), 0) FROM quota_counters WHERE client_key = %s",
        ("k:" + key,),
    )
    return int(count)


def advisory_locks(direct_url: str) -> int:
    """Advisory locks held in this database (the server is shared: others' are not counted)."""
    [(count,)] = rows(
        direct_url,
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'"
        " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
    )
    return int(count)


def blocked_pids(direct_url: str, statement: str) -> list[int]:
    """Backends of this database waiting on a lock in a statement starting with `statement`."""
    found = rows(
        direct_url,
        "SELECT pid, query FROM pg_stat_activity WHERE datname = current_database()"
        " AND wait_event_type = 'Lock'",
    )
    return [int(pid) for pid, query in found if str(query).startswith(statement)]


def wait_until(condition: Callable[[], bool], what: str, timeout: float = DEADLINE) -> None:
    """Poll `condition` until it holds; fail saying `what` was awaited after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"still waiting after {timeout:g}s for {what}")
        time.sleep(0.02)


@contextlib.contextmanager
def valve(direct_url: str, after: float) -> Iterator[None]:
    """A safety valve: `after` seconds in, cancel every statement of this database that waits
    on a lock, so that a regression which blocks where it should not fails, never hangs."""

    def release() -> None:
        rows(
            direct_url,
            "SELECT pg_cancel_backend(pid) FROM pg_stat_activity WHERE datname = current_database()"
            " AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()",
        )

    timer = threading.Timer(after, release)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


async def async_wait_until(
    condition: Callable[[], bool], what: str, timeout: float = DEADLINE
) -> None:
    """`wait_until` that lets the event loop run between polls."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"still waiting after {timeout:g}s for {what}")
        await asyncio.sleep(0.02)


def window_with_room(room: float = 600.0) -> int:
    """A fixed window of an hour or more whose current window has `room` seconds left.

    The exactness tests run on the real clock: a window boundary crossed mid-test
    would split the hits between two windows.
    """
    now = time.time()
    for window in range(3600, 7200, 60):  # windows of other lengths end at other times
        if window - now % window >= room:
            return window
    raise AssertionError(f"no window of 3600-7200 s has {room} s left at {now}")


def session_settings(url: str) -> dict[str, str]:
    """`SETTINGS` as a fresh client of `url` sees them."""
    with psycopg.connect(url, autocommit=True, prepare_threshold=None) as conn:
        return {name: str(conn.execute(f"SHOW {name}").fetchone()[0]) for name in SETTINGS}  # type: ignore[index]


def run_async(face: str, make: Callable[[], Any], body: Callable[[Any], Any]) -> Any:
    """Run `body(limiter)` on a limiter `make()` builds, closing it after, on either face.

    For the async face `body` returns a coroutine, run on a loop of its own.
    """
    if face == "sync":
        with make() as limiter:
            return body(limiter)

    async def main() -> Any:
        async with make() as limiter:
            return await body(limiter)

    return asyncio.run(main())


def connect(face: str, url: str, **options: Any) -> Callable[[], Any]:
    """A factory of a limiter of `face` on `url` (a pool of 2 unless said otherwise)."""
    options.setdefault("pool_size", 2)
    factory = quota.connect if face == "sync" else quota.connect_async
    return lambda: factory(url, **options)


async def _calls(limiter: Any, n: int, call: Callable[[Any], Any]) -> list[Any]:
    return [await call(limiter) for _ in range(n)]


def calls(face: str, limiter: Any, n: int, call: Callable[[Any], Any]) -> Any:
    """`n` calls of `call(limiter)` in order: a list, or for the async face a coroutine of one."""
    if face == "sync":
        return [call(limiter) for _ in range(n)]
    return _calls(limiter, n, call)


def server_of(url: str) -> dict[str, Any]:
    """`running_pgbouncer` keywords for the server and user of `url`."""
    parts = urlsplit(url)
    return {
        "server_host": parts.hostname or "127.0.0.1",
        "server_port": parts.port or 5432,
        "user": unquote(parts.username or "root"),
        "password": unquote(parts.password or ""),
    }


def database_of(url: str) -> str:
    return unquote(urlsplit(url).path.lstrip("/"))


@pytest.fixture
def fresh_txn_url(pg_url: str, pgbouncer_binary: str) -> Iterator[str]:
    """`pg_url`'s database through a transaction-mode bouncer of this test's own (2 server
    connections, none opened yet): no statement any other client prepared is on them."""
    with running_pgbouncer(binary=pgbouncer_binary, **server_of(pg_url)) as bouncer:
        yield bouncer.url(database_of(pg_url))


@pytest.fixture(scope="module")
def wide_txn_url(pg_url: str, pgbouncer_binary: str) -> Iterator[str]:
    """`pg_url`'s database through a transaction-mode bouncer with 4 server connections.

    A cleanup holds two while it waits (its lock's transaction and its DELETE), so a
    second cleanup alongside it needs a third.
    """
    with running_pgbouncer(
        binary=pgbouncer_binary, default_pool_size=4, **server_of(pg_url)
    ) as bouncer:
        yield bouncer.url(database_of(pg_url))


# -- 1. exactness across processes, through the transaction pooler ------------------------------

PROCESSES = 4
LIMIT = 40
HITS = 3 * LIMIT // PROCESSES  # 30 calls a process, 120 in all: three times the limit


@pytest.mark.parametrize(
    ("face", "options"),
    [
        pytest.param("sync", {}, id="sync"),
        pytest.param("async", {"tasks": 3}, id="async"),
        pytest.param("async", {"tasks": 4, "batching": True}, id="async-batching"),
    ],
)
def test_processes_through_the_transaction_pooler_allow_exactly_the_limit(
    pgbouncer_txn_url: str, pg_url: str, face: str, options: dict[str, Any]
) -> None:
    key, window = unique("exact"), window_with_room()
    allowed = _workers.run_processes(
        SPAWN,
        _pgbouncer_workers.hit_worker,
        [(pooled(pgbouncer_txn_url), face, key, LIMIT, window, HITS, options)] * PROCESSES,
    )

    assert sum(allowed) == LIMIT, f"allowed per process: {allowed}"
    assert counted(pg_url, key) == PROCESSES * HITS  # every hit counted once, none lost
    with quota.connect(pooled(pgbouncer_txn_url), pool_size=1) as limiter:
        assert limiter.peek(key, LIMIT, window).count == PROCESSES * HITS


# -- 2. durable quotas from processes, through the transaction pooler ---------------------------


def _check_durable_quotas(
    results: list[dict[str, list[Any]]], direct_url: str, subject: str, name: str,
    keys: list[str], refund_keys: list[str], grant: int,
) -> None:  # fmt: skip
    cost = _pgbouncer_workers.cost_of
    processes = len(results)
    # Every key was charged once; every process got that one charge's decision back.
    seen: dict[str, list[tuple[bool, int, bool]]] = {}
    for result in results:
        for key, allowed, used, replayed in result["consumed"]:
            seen.setdefault(key, []).append((allowed, used, replayed))
    assert sorted(seen) == sorted(keys)
    for key, outcomes in seen.items():
        assert len(outcomes) == processes, (key, outcomes)
        assert all(allowed for allowed, _, _ in outcomes), (key, outcomes)
        assert sum(not replayed for _, _, replayed in outcomes) == 1, (key, outcomes)
        assert len({used for _, used, _ in outcomes}) == 1, (key, outcomes)
    # Every refund key was refunded once, by one process, for its whole cost.
    refunds: dict[str, list[tuple[bool, str, int]]] = {}
    for result in results:
        for key, refunded, status, amount in result["refunded"]:
            refunds.setdefault(key, []).append((refunded, status, amount))
    for key in refund_keys:
        outcomes = sorted(refunds[key], reverse=True)
        assert outcomes[0] == (True, "refunded", cost(key)), (key, outcomes)
        assert outcomes[1:] == [(False, "already_refunded", 0)] * (processes - 1), (key, outcomes)

    # The tables, read directly: usage is the ledger's sum, and nothing was charged twice.
    [(used, granted)] = rows(
        direct_url,
        "SELECT used, granted FROM quota_usage WHERE subject = %s AND name = %s",
        (subject, name),
    )
    ledger = rows(
        direct_url,
        "SELECT kind, cost, idempotency_key, refunded_at IS NOT NULL FROM quota_ledger"
        " WHERE subject = %s AND name = %s",
        (subject, name),
    )
    consumed = [(key, c) for kind, c, key, _ in ledger if kind == "consume"]
    refunded = [(key, c) for kind, c, key, _ in ledger if kind == "refund"]
    grants = [c for kind, c, _, _ in ledger if kind == "grant"]
    assert sorted(consumed) == sorted((key, cost(key)) for key in keys)  # one charge a key
    assert sorted(refunded) == sorted((key, cost(key)) for key in refund_keys)
    assert sorted(key for kind, _, key, marked in ledger if kind == "consume" and marked) == sorted(
        refund_keys
    )
    assert {kind for kind, _, _, _ in ledger} == {"consume", "refund", "grant"}  # no denial
    assert used == sum(c for _, c in consumed) - sum(c for _, c in refunded)
    assert used == sum(cost(key) for key in keys if key not in refund_keys)
    assert granted == sum(grants) == grant * processes


def test_durable_quotas_from_processes_through_the_transaction_pooler(
    pgbouncer_txn_url: str, pg_url: str
) -> None:
    subject, name, grant = unique("subject"), "credits", 5
    keys = [f"job-{i}" for i in range(12)]
    refund_keys = keys[::3]
    faces = ["sync", "async", "sync"]
    results = _workers.run_processes(
        SPAWN,
        _pgbouncer_workers.quota_worker,
        [
            (pooled(pgbouncer_txn_url), face, subject, name, keys, refund_keys, grant, NOW, seed)
            for seed, face in enumerate(faces)
        ],
    )

    _check_durable_quotas(results, pg_url, subject, name, keys, refund_keys, grant)
    with quota.connect(pooled(pgbouncer_txn_url), clock=lambda: NOW, pool_size=1) as limiter:
        [usage] = limiter.quota_usage(subject)
        assert len(limiter.ledger(subject)) == len(keys) + len(refund_keys) + len(faces)
    assert (usage.used, usage.granted) == rows(
        pg_url, "SELECT used, granted FROM quota_usage WHERE subject = %s", (subject,)
    )[0]


# -- 3. cleanup's lock through the transaction pooler: one at a time, never leaked -------------


def _seed_expired(url: str, n: int) -> list[str]:
    """`n` keys in 60 s windows that ended two hours ago, written through `url`."""
    keys = [f"{unique('old')}:{i}" for i in range(n)]
    with quota.connect(url, clock=lambda: time.time() - 7200, pool_size=1) as limiter:
        for key in keys:
            limiter.rate_limit(key, 10, 60)
    return keys


def _rows_left(direct_url: str) -> int:
    return int(rows(direct_url, "SELECT count(*) FROM quota_counters")[0][0])


def cleanup(face: str, url: str) -> quota.CleanupResult:
    """One ``cleanup(grace=0)`` by a limiter of its own."""
    return run_async(face, connect(face, url), lambda limiter: limiter.cleanup(grace=0))  # type: ignore[no-any-return]


def idle_in_transaction(direct_url: str, but: int) -> int:
    """Backends of this database other than `but` sitting in an open transaction."""
    [(count,)] = rows(
        direct_url,
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
        " AND state LIKE 'idle in transaction%%' AND pid <> %s",
        (but,),
    )
    return int(count)


def test_cleanup_through_the_pooler_skips_while_the_lock_is_held_and_never_leaks_it(
    pgbouncer_txn_url: str, pg_clean_url: str
) -> None:
    url = pooled(pgbouncer_txn_url)
    _seed_expired(url, 6)
    assert advisory_locks(pg_clean_url) == 0

    # Hold the lock ourselves, directly, as a cleanup of another app instance would.
    with valve(pg_clean_url, 2 * DEADLINE), psycopg.connect(pg_clean_url) as holder:
        taken = holder.execute("SELECT pg_try_advisory_xact_lock(%s)", (CLEANUP_LOCK_ID,))
        assert taken.fetchone() == (True,)
        holder_pid = holder.info.backend_pid
        skipped = [cleanup("sync", url), cleanup("async", url)]
        assert [(r.skipped, r.deleted) for r in skipped] == [(True, 0), (True, 0)]
        assert _rows_left(pg_clean_url) == 6
        assert advisory_locks(pg_clean_url) == 1  # ours: a lost try takes nothing
        # The losers' lock transactions are gone with their connections, not left open
        # on a server connection of the pooler.
        wait_until(
            lambda: idle_in_transaction(pg_clean_url, holder_pid) == 0,
            "the skipped cleanups' lock transactions to end",
        )
        holder.commit()

    assert advisory_locks(pg_clean_url) == 0
    done = cleanup("sync", url)
    assert (done.skipped, done.deleted) == (False, 6)
    assert _rows_left(pg_clean_url) == 0
    assert advisory_locks(pg_clean_url) == 0
    _seed_expired(url, 3)
    done = cleanup("async", url)
    assert (done.skipped, done.deleted) == (False, 3)
    assert advisory_locks(pg_clean_url) == 0
    assert idle_in_transaction(pg_clean_url, 0) == 0


def _cleanup_in_thread(face: str, url: str) -> tuple[threading.Thread, dict[str, Any]]:
    """A cleanup running in a thread of its own; its result or error lands in the dict."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["result"] = cleanup(face, url)
        except Exception as exc:
            out["error"] = exc

    thread = threading.Thread(target=run, name=f"cleanup-{face}", daemon=True)
    thread.start()
    return thread, out


@pytest.mark.parametrize("face", ["sync", "async"])
@pytest.mark.parametrize("outcome", ["finishes", "raises"])
def test_a_second_cleanup_through_the_pooler_skips_while_the_first_runs(
    wide_txn_url: str, pg_clean_url: str, face: str, outcome: str
) -> None:
    """A first cleanup (of `face`) takes the lock, then waits on a row we hold locked; the
    others started meanwhile (either face) skip. Then the first either finishes, or has its
    DELETE cancelled and raises: either way the lock is released."""
    url = pooled(wide_txn_url)
    keys = _seed_expired(url, 6)
    blocker = psycopg.connect(pg_clean_url)
    thread: threading.Thread | None = None
    with valve(pg_clean_url, 2 * DEADLINE):
        try:
            blocker.execute(
                "SELECT 1 FROM quota_counters WHERE client_key = %s FOR UPDATE", ("k:" + keys[0],)
            )
            thread, first = _cleanup_in_thread(face, url)
            wait_until(
                lambda: (
                    advisory_locks(pg_clean_url) == 1
                    and len(blocked_pids(pg_clean_url, "WITH swept AS (DELETE FROM quota_counters"))
                    == 1
                ),
                "the first cleanup to hold the lock and wait on the locked row",
            )

            others = [cleanup("sync", url), cleanup("async", url)]
            assert [(r.skipped, r.deleted) for r in others] == [(True, 0), (True, 0)]
            assert advisory_locks(pg_clean_url) == 1  # still the first one's

            if outcome == "raises":
                [pid] = blocked_pids(pg_clean_url, "WITH swept AS (DELETE FROM quota_counters")
                assert rows(pg_clean_url, "SELECT pg_cancel_backend(%s)", (pid,)) == [(True,)]
                thread.join(DEADLINE)
                assert not thread.is_alive()
                assert isinstance(first.get("error"), quota.StorageError), first
                assert "cancel" in str(first["error"]), first
                assert advisory_locks(pg_clean_url) == 0  # released by the cleanup that raised
                blocker.rollback()
                after = cleanup(face, url)  # and nothing stands in the way of the next one
                assert (after.skipped, after.deleted) == (False, 6)
            else:
                blocker.rollback()
                thread.join(DEADLINE)
                assert not thread.is_alive()
                assert "error" not in first, first
                assert (first["result"].skipped, first["result"].deleted) == (False, 6)
            assert _rows_left(pg_clean_url) == 0
            assert advisory_locks(pg_clean_url) == 0
        finally:
            blocker.close()  # lets a first cleanup still waiting go on
            if thread is not None:
                thread.join(DEADLINE)


# -- 4. nothing a store sets reaches the next client of the same server connection -------------


def _decide_and_consume(face: str, url: str, subject: str) -> None:
    """A few decisions and a durable consume (its transaction SETs LOCAL) on `url`."""

    def body(limiter: Any) -> Any:
        if face == "sync":
            for _ in range(5):
                limiter.rate_limit(subject, 3, 3600)
            limiter.peek(subject, 3, 3600)
            return limiter.consume_quota(subject, "n", 10, "day", 2, "once")

        async def run() -> Any:
            for _ in range(5):
                await limiter.rate_limit(subject, 3, 3600)
            await limiter.peek(subject, 3, 3600)
            return await limiter.consume_quota(subject, "n", 10, "day", 2, "once")

        return run()

    options = {"fallback": quota.Fallback(timeout=0.05), "pool_size": 2}
    decision = run_async(face, connect(face, url, **options), body)
    assert decision.allowed


@pytest.mark.parametrize("face", ["sync", "async"])
def test_nothing_set_reaches_the_next_client_of_the_one_server_connection(
    pgbouncer_single_txn_url: str, pg_url: str, face: str
) -> None:
    defaults = session_settings(pg_url)  # the server's, for this role and database
    assert session_settings(pgbouncer_single_txn_url) == defaults
    subject = unique("leak")
    url = f"{pgbouncer_single_txn_url}?{POOLED}"

    _decide_and_consume(face, url, subject)

    # The consume went through that one server connection: the ledger has it.
    assert rows(pg_url, "SELECT kind FROM quota_ledger WHERE subject = %s", (subject,)) == [
        ("consume",)
    ]
    assert session_settings(pgbouncer_single_txn_url) == defaults


def test_doctor_sets_nothing_on_the_one_server_connection(
    pgbouncer_single_txn_url: str, pg_url: str
) -> None:
    defaults = session_settings(pg_url)
    findings = quota.diagnose(pooled(pgbouncer_single_txn_url), timeout=3)
    assert [f for f in findings if f.severity == "error"] == []
    assert session_settings(pgbouncer_single_txn_url) == defaults


# -- 5. direct mode through a transaction pooler fails, and says what to do ---------------------


def _hold_a_server(url: str) -> psycopg.Connection[Any]:
    """A client of `url` in an open transaction: it keeps the bouncer's idle server connection."""
    holder = psycopg.connect(url, prepare_threshold=None)
    holder.execute("SELECT 1")
    return holder


@pytest.mark.parametrize("face", ["sync", "async"])
def test_direct_mode_through_a_transaction_pooler_fails_naming_the_option(
    fresh_txn_url: str, face: str
) -> None:
    """The store prepares its statement on the one server connection open; we then hold
    that one, so the next call reaches a new one, where the statement does not exist."""
    key = unique("direct")

    def body(limiter: Any) -> Any:
        if face == "sync":
            assert limiter.rate_limit(key, 5, 3600).allowed
            with _hold_a_server(fresh_txn_url), pytest.raises(quota.StorageError) as info:
                limiter.rate_limit(key, 5, 3600)
            return info

        async def run() -> Any:
            assert (await limiter.rate_limit(key, 5, 3600)).allowed
            with _hold_a_server(fresh_txn_url):
                with pytest.raises(quota.StorageError) as info:
                    await limiter.rate_limit(key, 5, 3600)
                return info

        return run()

    info = run_async(face, connect(face, fresh_txn_url, pool_size=1), body)
    message = str(info.value)
    assert "does not exist" in message
    assert "prepared_statements=False" in message
    assert "PgBouncer" in message


@pytest.mark.parametrize("face", ["sync", "async"])
def test_a_lost_prepared_statement_does_not_mark_a_fallback_store_down(
    fresh_txn_url: str, pg_url: str, face: str, caplog: pytest.LogCaptureFixture
) -> None:
    key = unique("lost")

    def body(limiter: Any) -> Any:
        if face == "sync":
            first = limiter.rate_limit(key, 5, 3600)
            with _hold_a_server(fresh_txn_url):
                return first, limiter.rate_limit(key, 5, 3600), limiter.store.up

        async def run() -> Any:
            first = await limiter.rate_limit(key, 5, 3600)
            with _hold_a_server(fresh_txn_url):
                return first, await limiter.rate_limit(key, 5, 3600), limiter.store.up

        return run()

    fallback = quota.Fallback(timeout=2.0, probe_interval=60)
    caplog.set_level(logging.WARNING, logger="quota")
    first, second, up = run_async(
        face, connect(face, fresh_txn_url, pool_size=1, fallback=fallback), body
    )

    assert (first.count, second.count) == (1, 1)  # the second from memory, which was empty
    assert up  # a statement error, not an outage: the store is not taken for down
    assert counted(pg_url, key) == 1
    [record] = [r for r in caplog.records if r.name == "quota"]
    assert record.levelno == logging.ERROR
    assert "rejected" in record.getMessage()
    assert "prepared_statements=False" in record.getMessage()


# -- 6. the fallback through the pooler ---------------------------------------------------------


@pytest.mark.parametrize("face", ["sync", "async"])
def test_with_a_fallback_decisions_come_from_the_store_through_the_pooler(
    pgbouncer_txn_url: str, pg_url: str, face: str
) -> None:
    """A budget of 1 s, not the default 50 ms: a slow moment of a shared machine would
    rightly send a call to memory, and this test is about the calls that don't."""
    key, calls_made, limit = unique("fallback"), 50, 30
    metrics = quota.Metrics()
    factory = connect(
        face, pooled(pgbouncer_txn_url), fallback=quota.Fallback(timeout=1.0), metrics=metrics
    )

    def body(limiter: Any) -> Any:
        decisions = calls(face, limiter, calls_made, lambda lim: lim.rate_limit(key, limit, 3600))
        if face == "sync":
            return decisions, limiter.store.up

        async def run() -> Any:
            return await decisions, limiter.store.up

        return run()

    decisions, up = run_async(face, factory, body)

    assert up
    assert [d.count for d in decisions] == list(range(1, calls_made + 1))
    assert sum(d.allowed for d in decisions) == limit
    assert counted(pg_url, key) == calls_made
    totals = metrics.snapshot()["totals"]
    assert (totals["fallback"], totals["fail_open"]) == (0, 0)


@pytest.mark.parametrize("face", ["sync", "async"])
def test_a_statement_past_the_budget_is_cancelled_on_the_server_and_counted_once(
    pgbouncer_txn_url: str, pg_url: str, face: str
) -> None:
    """Behind the pooler the budget is held by the client (no session statement_timeout):
    a hit stuck on a row lock past it is decided from memory, the store is down (a timeout
    is an outage), the statement is cancelled on the server, and the hit is written back
    once when the store returns (the lock is gone by the first probe, a second later)."""
    key, budget = unique("budget"), 0.3
    factory = connect(
        face, pooled(pgbouncer_txn_url), fallback=quota.Fallback(timeout=budget, probe_interval=1)
    )
    lock_row = "SELECT 1 FROM quota_counters WHERE client_key = %s FOR UPDATE"
    cancelled = "the statement past its budget to be cancelled on the server"
    blocker = psycopg.connect(pg_url)
    with valve(pg_url, 5):
        try:
            if face == "sync":
                with factory() as limiter:
                    assert limiter.rate_limit(key, 5, 3600).count == 1
                    blocker.execute(lock_row, ("k:" + key,))
                    start = time.monotonic()
                    stuck = limiter.rate_limit(key, 5, 3600)
                    elapsed = time.monotonic() - start
                    down = not limiter.store.up
                    wait_until(
                        lambda: not blocked_pids(pg_url, "INSERT INTO quota_counters"), cancelled, 3
                    )
                    blocker.rollback()
                    wait_until(
                        lambda: limiter.store.up and not limiter.store.health.owes(),
                        "the store to be back, the outage's hit written back",
                    )
            else:

                async def main() -> tuple[quota.Decision, float, bool]:
                    async with factory() as limiter:
                        assert (await limiter.rate_limit(key, 5, 3600)).count == 1
                        blocker.execute(lock_row, ("k:" + key,))
                        start = time.monotonic()
                        stuck = await limiter.rate_limit(key, 5, 3600)
                        elapsed = time.monotonic() - start
                        down = not limiter.store.up
                        # Polled on the loop: asyncpg's cancel request is a task of it.
                        await async_wait_until(
                            lambda: not blocked_pids(pg_url, "INSERT INTO quota_counters"),
                            cancelled,
                            3,
                        )
                        blocker.rollback()
                        await async_wait_until(
                            lambda: limiter.store.up and not limiter.store.health.owes(),
                            "the store to be back, the outage's hit written back",
                        )
                        return stuck, elapsed, down

                stuck, elapsed, down = asyncio.run(main())
        finally:
            blocker.close()

    assert (stuck.allowed, stuck.count) == (True, 1)  # decided from memory
    assert elapsed < budget + 1.5, elapsed
    assert down
    assert counted(pg_url, key) == 2  # the stuck hit once: written back, not also committed


@pytest.fixture
def role_without_writes(pg_url: str) -> Iterator[str]:
    """A login role that may read the schema version but write no counter; dropped after."""
    role = f"quota_noperm_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(f'CREATE ROLE "{role}" LOGIN')
        try:
            conn.execute(f'GRANT USAGE ON SCHEMA public TO "{role}"')
            conn.execute(f'GRANT SELECT ON quota_alembic_version TO "{role}"')
            yield role
        finally:
            # Its connections are closed by now; DROP OWNED revokes the grants above.
            conn.execute(f'DROP OWNED BY "{role}"')
            conn.execute(f'DROP ROLE "{role}"')


@pytest.mark.parametrize("face", ["sync", "async"])
def test_a_permission_error_is_no_outage_the_store_stays_up(
    pg_url: str, role_without_writes: str, face: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Directly, not through the bouncer (its auth_file lists root only), but in the
    pooler's mode: the option changes how statements are sent, not what an error means."""
    parts = urlsplit(pg_url)
    url = pooled(
        parts._replace(
            netloc=f"{role_without_writes}@{parts.hostname}:{parts.port or 5432}"
        ).geturl()
    )
    key = unique("noperm")
    fallback = quota.Fallback(timeout=2.0, probe_interval=60)  # one ERROR line a minute
    caplog.set_level(logging.WARNING, logger="quota")

    def body(limiter: Any) -> Any:
        decisions = calls(face, limiter, 5, lambda lim: lim.rate_limit(key, 3, 3600))
        if face == "sync":
            return decisions, limiter.store.up

        async def run() -> Any:
            return await decisions, limiter.store.up

        return run()

    decisions, up = run_async(face, connect(face, url, fallback=fallback), body)

    assert [d.allowed for d in decisions] == [True, True, True, False, False]  # memory, exact
    assert up
    assert counted(pg_url, key) == 0
    [record] = [r for r in caplog.records if r.name == "quota"]
    assert record.levelno == logging.ERROR
    assert "rejected" in record.getMessage()
    assert "permission denied" in record.getMessage()


# -- 7. migrate and doctor through the pooler --------------------------------------------------


def _cli(*args: str) -> Any:
    return CliRunner().invoke(main, list(args), env={"QUOTA_DATABASE_URL": None})


def _table_oids(direct_url: str) -> list[tuple[Any, ...]]:
    return rows(
        direct_url,
        "SELECT relname, oid FROM pg_class WHERE relname LIKE 'quota%' AND relkind IN ('r', 'p')"
        " ORDER BY relname",
    )


def test_migrate_through_the_pooler_is_a_no_op_on_a_migrated_database(
    pgbouncer_txn_url: str, pg_url: str
) -> None:
    url = pooled(pgbouncer_txn_url)
    tables = _table_oids(pg_url)
    assert tables

    quota.migrate(url)
    # And twice from processes of their own, through the CLI: asyncpg numbers its named
    # statements per process, so a second process would find the first one's statements
    # still on the pooler's server connections ("already exists") if any were named.
    for _ in range(2):
        result = subprocess.run(
            [sys.executable, "-c", "from quota._cli import main; main()", "--url", url, "migrate"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        assert f"quota schema at {HEAD}" in result.stderr
    assert _table_oids(pg_url) == tables  # nothing dropped or made anew
    assert quota.current_revision(url) == quota.current_revision(pg_url) == HEAD


@pytest.mark.parametrize("option", [True, False], ids=["pooled", "plain-url"])
def test_doctor_through_the_pooler(pgbouncer_txn_url: str, option: bool) -> None:
    url = pooled(pgbouncer_txn_url) if option else pgbouncer_txn_url
    result = _cli("doctor", "--url", url, "--json")

    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    findings = {f["check"]: f for f in data["findings"]}
    assert findings["connectivity"]["severity"] == "ok", findings
    assert findings["schema"]["severity"] == "ok", findings
    assert data["counts"]["error"] == 0


def test_migrate_through_a_pooler_creates_the_schema_of_a_fresh_database(
    pg_make_database: Callable[[], str], pgbouncer_binary: str
) -> None:
    direct = pg_make_database()
    with running_pgbouncer(binary=pgbouncer_binary, **server_of(direct)) as bouncer:
        url = pooled(bouncer.url(database_of(direct)))
        assert quota.current_revision(url) is None

        quota.migrate(url)

        assert quota.current_revision(url) == quota.current_revision(direct) == HEAD
        with quota.connect(url, pool_size=2, clock=lambda: NOW) as limiter:
            assert limiter.rate_limit("k", 1, 60).allowed
            assert not limiter.rate_limit("k", 1, 60).allowed
            assert limiter.consume_quota("s", "n", 5, "day", 2, "key").used == 2
        assert _cli("doctor", "--url", url).exit_code == 0


# -- 8. session mode: the plain URL works --------------------------------------------------------


def test_processes_through_the_session_pooler_allow_exactly_the_limit(
    pgbouncer_session_url: str, pg_url: str
) -> None:
    """One server connection per client for its whole session: one connection per process
    (the bouncer has two), so no client waits for another to leave."""
    key, window, limit, hits = unique("session"), window_with_room(), 25, 25
    allowed = _workers.run_processes(
        SPAWN,
        _pgbouncer_workers.hit_worker,
        [
            (pgbouncer_session_url, "sync", key, limit, window, hits, {"pool_size": 1}),
            (pgbouncer_session_url, "async", key, limit, window, hits, {"pool_size": 1}),
        ],
    )

    assert sum(allowed) == limit, f"allowed per process: {allowed}"
    assert counted(pg_url, key) == 2 * hits


def test_durable_quotas_from_processes_through_the_session_pooler(
    pgbouncer_session_url: str, pg_url: str
) -> None:
    subject, name, grant = unique("subject"), "credits", 3
    keys = [f"job-{i}" for i in range(8)]
    refund_keys = keys[1::3]
    results = _workers.run_processes(
        SPAWN,
        _pgbouncer_workers.quota_worker,
        [
            (pgbouncer_session_url, face, subject, name, keys, refund_keys, grant, NOW, seed, 1)
            for seed, face in enumerate(["sync", "async"])
        ],
    )

    _check_durable_quotas(results, pg_url, subject, name, keys, refund_keys, grant)
