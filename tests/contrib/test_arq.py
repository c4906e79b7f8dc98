"""`quota.contrib.arq.rate_limited`: arq jobs under one limit across real worker processes.

The fast tests call the decorated job in process, on a ``memory://`` limiter with a
hand-moved clock. The others run arq worker processes (tests/contrib/_arq_worker.py)
on a private redis-server, the limit kept in PostgreSQL, and read what the jobs did
off a journal (tests/contrib/_jobs_support.py): 60 jobs at ``5/second`` shared by two
workers; deferrals that cost no tries (a job registered with ``max_tries=1``, so never
run a second time, is deferred and still runs, at its first try); a concurrency slot freed a lease
after its worker is SIGKILLed.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path
from typing import IO, Any

import pytest
import redis
from arq import create_pool
from arq.connections import RedisSettings
from arq.constants import default_queue_name
from arq.worker import Retry, func

import quota
from quota.contrib import _jobs
from quota.contrib.arq import rate_limited
from tests._redis_cluster import running_server
from tests._support import Clock, parent_death_signal
from tests.contrib._jobs_support import per_second, read, starts, wait_for

ROOT = Path(__file__).resolve().parents[2]
POLL_DELAY = 0.05  # the workers' poll_delay (arq's default is 0.5)
READY_TIMEOUT = 30.0


# -- in process -----------------------------------------------------------------------------


class FakeRedis:
    """The ``ctx["redis"]`` of a worker, as far as a deferral uses it."""

    def __init__(self, fail: bool = False) -> None:
        self.decremented: list[str] = []
        self.fail = fail

    async def decr(self, name: str) -> int:
        if self.fail:
            raise ConnectionError("redis is down")
        self.decremented.append(name)
        return 0


def _ctx(redis: FakeRedis | None = None) -> dict[str, Any]:
    return {"job_id": "j1", "job_try": 1, **({"redis": redis} if redis else {})}


@pytest.mark.parametrize(
    ("arguments", "named"),
    [
        ({"rates": "nonsense"}, "nonsense"),
        ({"rates": "5/second", "key": ""}, "key"),
        ({"rates": "5/second", "key": 7}, "key"),
        ({"rates": "5/second", "concurrency": 0}, "concurrency"),
        ({"rates": "5/second", "concurrency": True}, "concurrency"),
        ({"rates": "5/second", "concurrency": 1, "lease": 0}, "lease"),
        ({"rates": "5/second", "limiter": "memory://"}, "limiter"),
    ],
)
def test_bad_arguments_are_refused_when_the_job_is_decorated(
    arguments: dict[str, Any], named: str
) -> None:
    async def job(ctx: dict[str, Any]) -> None: ...

    decorate = rate_limited(**arguments)  # a decorator factory checks nothing yet
    with pytest.raises(quota.ConfigurationError, match=named):
        decorate(job)


def test_a_sync_limiter_is_refused() -> None:
    limiter = quota.connect("memory://")
    try:

        async def job(ctx: dict[str, Any]) -> None: ...

        with pytest.raises(
            quota.ConfigurationError, match=r"limiter must be a quota\.AsyncLimiter"
        ):
            rate_limited("5/second", limiter=limiter)(job)  # type: ignore[arg-type]
    finally:
        limiter.close()


def test_only_coroutine_functions_are_jobs() -> None:
    def sync_job(ctx: dict[str, Any]) -> None: ...

    async def job(ctx: dict[str, Any]) -> None: ...

    with pytest.raises(quota.ConfigurationError, match="sync_job"):
        rate_limited("5/second")(sync_job)  # type: ignore[arg-type]
    # arq's registration wraps the limited job, not the other way round.
    with pytest.raises(quota.ConfigurationError, match="coroutine functions"):
        rate_limited("5/second")(func(job, name="job"))  # type: ignore[arg-type]


def test_the_job_keeps_its_name_and_signature() -> None:
    async def export(ctx: dict[str, Any], tenant: str) -> str:
        """Exports a tenant."""
        return tenant

    limited = rate_limited("5/second")(export)
    assert limited.__name__ == "export"
    assert limited.__qualname__ == export.__qualname__
    assert limited.__doc__ == "Exports a tenant."
    assert limited.__wrapped__ is export  # type: ignore[attr-defined]
    assert inspect.iscoroutinefunction(limited)
    assert func(limited).name == export.__qualname__  # arq's default name for it


def test_the_key_callable_gets_the_jobs_arguments_without_ctx(memory_url: str) -> None:
    seen: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def key(*args: Any, **kwargs: Any) -> str:
        seen.append((args, kwargs))
        return f"export:{args[0]}"

    async def main() -> None:
        limiter = quota.connect_async(memory_url, clock=Clock())
        try:

            @rate_limited("1/minute", key=key, limiter=limiter)
            async def export(ctx: dict[str, Any], tenant: str, *, full: bool) -> str:
                return f"{tenant} {full}"

            assert await export(_ctx(), "acme", full=True) == "acme True"
            assert await export(_ctx(), "globex", full=False) == "globex False"
            assert (await limiter.peek("export:acme", 1, 60)).remaining == 0
            assert (await limiter.peek("export:globex", 1, 60)).remaining == 0
            with pytest.raises(Retry):
                await export(_ctx(), "acme", full=True)
        finally:
            await limiter.aclose()

    asyncio.run(main())
    assert seen == [(("acme",), {"full": True}), (("globex",), {"full": False}),
                    (("acme",), {"full": True})]  # fmt: skip


def test_the_default_key_is_the_jobs_qualname(memory_url: str) -> None:
    async def main() -> None:
        limiter = quota.connect_async(memory_url, clock=Clock())
        try:
            limited = rate_limited("2/minute", limiter=limiter)(_module_job)
            await limited(_ctx())
            assert (await limiter.peek("_module_job", 2, 60)).remaining == 1
        finally:
            await limiter.aclose()

    asyncio.run(main())


async def _module_job(ctx: dict[str, Any]) -> None: ...


def test_a_denied_run_raises_retry_deferred_to_the_slot_and_takes_its_try_back(
    memory_url: str,
) -> None:
    clock = Clock(1_000_000.3)
    redis = FakeRedis()
    ran: list[int] = []

    async def main() -> list[float]:
        limiter = quota.connect_async(memory_url, clock=clock)
        try:

            @rate_limited("5/second", key="k", limiter=limiter)
            async def job(ctx: dict[str, Any], n: int) -> None:
                ran.append(n)

            for n in range(5):
                await job(_ctx(redis), n)
            assert redis.decremented == []  # an admitted run is a try
            defers = []
            for n in range(5, 25):
                with pytest.raises(Retry) as caught:
                    await job(_ctx(redis), n)
                assert caught.value.defer_score is not None
                defers.append(caught.value.defer_score / 1000)
            return defers
        finally:
            await limiter.aclose()

    defers = asyncio.run(main())
    assert ran == [0, 1, 2, 3, 4]
    # The slot opens 0.7 s later (the next second), a window later for each 5 deferred
    # before; the jitter is up to a slot's share, 0.2 s.
    for k, d in enumerate(defers):
        assert 0.7 + k // 5 <= d <= 0.9 + k // 5, defers
    assert len(set(defers)) > 15, defers  # jittered, not all at once
    assert redis.decremented == ["arq:retry:j1"] * 20


def test_a_deferral_whose_try_cannot_be_taken_back_is_still_deferred(
    memory_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    async def main() -> None:
        limiter = quota.connect_async(memory_url, clock=Clock())
        try:

            @rate_limited("1/minute", key="k", limiter=limiter)
            async def job(ctx: dict[str, Any]) -> None: ...

            await job(_ctx(FakeRedis(fail=True)))
            with pytest.raises(Retry):
                await job(_ctx(FakeRedis(fail=True)))
        finally:
            await limiter.aclose()

    with caplog.at_level(logging.WARNING, logger="quota"):
        asyncio.run(main())
    assert "could not be taken back" in caplog.text and "redis is down" in caplog.text


def test_a_run_holds_its_concurrency_slot_until_its_body_ends(memory_url: str) -> None:
    async def main() -> None:
        limiter = quota.connect_async(memory_url, clock=Clock())
        try:
            inside: list[int] = []

            @rate_limited("100/second", key="c", limiter=limiter, concurrency=1, lease=5)
            async def job(ctx: dict[str, Any], fail: bool) -> None:
                inside.append((await limiter.concurrency_usage("c")).held)
                # A second run while this one holds the only slot is deferred as busy.
                with pytest.raises(Retry) as caught:
                    await job(_ctx(), False)
                assert caught.value.defer_score is not None
                assert 1.0 <= caught.value.defer_score / 1000 <= 2.0
                if fail:
                    raise ValueError("the body failed")

            await job(_ctx(), False)
            assert (await limiter.concurrency_usage("c")).held == 0
            with pytest.raises(ValueError, match="the body failed"):
                await job(_ctx(), True)
            assert (await limiter.concurrency_usage("c")).held == 0
            assert inside == [1, 1]
        finally:
            await limiter.aclose()

    asyncio.run(main())


def test_without_a_limiter_the_event_loops_default_one_is_used(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("QUOTA_DATABASE_URL", sqlite_url)

    async def job(ctx: dict[str, Any]) -> None: ...

    limited = rate_limited("3/day", key="default")(job)

    async def main() -> None:
        try:
            await limited(_ctx())
        finally:
            await _jobs.default_async_limiter().aclose()

    asyncio.run(main())
    limiter = quota.connect(sqlite_url)
    try:
        assert limiter.peek("default", 3, 86_400).remaining == 2
    finally:
        limiter.close()


# -- worker processes -----------------------------------------------------------------------


class Workers:
    """arq worker processes (tests/contrib/_arq_worker.py) on one broker, store and journal;
    each in a session of its own, killed with its whole process group by `stop`."""

    def __init__(self, files: ExitStack, port: int, store: str, journal: Path) -> None:
        self.files = files
        self.journal = journal
        self.env = {**os.environ, "PYTHONPATH": str(ROOT), "ARQ_TEST_REDIS_PORT": str(port),
                    "ARQ_TEST_STORE": store, "ARQ_TEST_JOURNAL": str(journal),
                    "ARQ_TEST_POLL_DELAY": str(POLL_DELAY), "ARQ_TEST_MAX_JOBS": "4"}  # fmt: skip
        self.procs: list[subprocess.Popen[bytes]] = []
        self.errs: list[IO[bytes]] = []

    def start(self, count: int) -> list[int]:
        """Starts `count` workers; their pids once each has written its ``ready`` line."""
        started = []
        for _ in range(count):
            err = self.files.enter_context(tempfile.TemporaryFile())  # noqa: SIM115
            proc = subprocess.Popen(
                [sys.executable, "-m", "tests.contrib._arq_worker"], cwd=ROOT, env=self.env,
                stdin=subprocess.DEVNULL, stdout=err, stderr=err, start_new_session=True,
                preexec_fn=parent_death_signal(),
            )  # fmt: skip
            self.procs.append(proc)
            self.errs.append(err)
            started.append(proc.pid)
        wait_for(self.journal, lambda lines: set(started) <= _ready(lines),
                 timeout=READY_TIMEOUT, alive=self.dead)  # fmt: skip
        return started

    def dead(self) -> str | None:
        """What a worker that exited left on stderr (None while they all run)."""
        for proc, err in zip(self.procs, self.errs, strict=True):
            if proc.poll() is not None:
                err.seek(0)
                tail = err.read().decode(errors="replace")[-3000:]
                return f"worker {proc.pid} exited {proc.returncode}:\n{tail}"
        return None

    def kill(self, pid: int) -> None:
        """SIGKILL to the worker's whole process group, as a crash of its host would."""
        proc = next(p for p in self.procs if p.pid == pid)
        os.killpg(pid, signal.SIGKILL)
        proc.wait(timeout=10)

    def stop(self) -> None:
        for proc in self.procs:
            with suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def _ready(lines: list[dict[str, Any]]) -> set[int]:
    return {line["pid"] for line in lines if line["event"] == "ready"}


@contextmanager
def _arq(store: str) -> Iterator[tuple[Workers, int]]:
    """A private broker, a journal and `Workers` (not started); everything ends with it."""
    with ExitStack() as files, running_server() as server:
        journal = Path(files.enter_context(tempfile.TemporaryDirectory())) / "journal"
        workers = Workers(files, server.port, store, journal)
        try:
            yield workers, server.port
        finally:
            workers.stop()


def _enqueue(port: int, name: str, *jobs: tuple[Any, ...]) -> None:
    async def main() -> None:
        pool = await create_pool(RedisSettings(host="127.0.0.1", port=port))
        try:
            for args in jobs:
                assert await pool.enqueue_job(name, *args) is not None
        finally:
            await pool.aclose()

    asyncio.run(main())


def _runs(lines: list[dict[str, Any]], job: str) -> list[dict[str, Any]]:
    return [line for line in lines if line["event"] == "run" and line["job"] == job]


def _lateness(runs: list[dict[str, Any]]) -> list[float]:
    """For each deferral, how much later than asked the job's next run began."""
    by_id: defaultdict[int, list[dict[str, Any]]] = defaultdict(list)
    for run in sorted(runs, key=lambda r: r["at"]):
        by_id[run["id"]].append(run)
    return sorted(
        after["at"] - (before["at"] + before["seconds"] + before["defer"])
        for chain in by_id.values()
        for before, after in itertools.pairwise(chain)
    )


JOBS, RATE = 60, 5


@pytest.mark.slow
@pytest.mark.postgres
def test_60_jobs_on_two_workers_start_at_most_5_a_second(pg_store_url: str) -> None:
    with _arq(pg_store_url) as (workers, port):
        pids = workers.start(2)
        _enqueue(port, "paced", *((n,) for n in range(JOBS)))
        lines = wait_for(
            workers.journal, lambda lines: len(starts(lines, job="paced")) >= JOBS,
            timeout=JOBS / RATE + 25, alive=workers.dead,
        )  # fmt: skip
        time.sleep(0.5)  # a start too many would come now, if at all
        lines = read(workers.journal)

    started = starts(lines, job="paced")
    seconds = per_second(started)
    print(f"starts per second {sorted(seconds.items())}")
    assert max(seconds.values()) <= RATE, seconds
    assert started[-1] - started[0] <= JOBS / RATE + 15, started[-1] - started[0]
    bodies = [line for line in lines if line["event"] == "start"]
    assert sorted(line["id"] for line in bodies) == list(range(JOBS))  # each once
    assert {line["pid"] for line in bodies} == set(pids), Counter(b["pid"] for b in bodies)
    runs = _runs(lines, "paced")
    assert Counter(r["outcome"] for r in runs)["failed"] == 0, runs
    slowest = max(r["seconds"] for r in runs)
    assert slowest <= 0.5, slowest
    # Deferred up to a dozen times each, and yet every body ran at its first try.
    assert {line["job_try"] for line in lines if "job_try" in line} == {1}
    late = _lateness(runs)
    print(
        f"{len(runs)} runs for {JOBS} jobs in {started[-1] - started[0]:.2f}s, slowest call"
        f" {slowest * 1000:.1f}ms; a deferred job ran again later than asked by"
        f" median {statistics.median(late) * 1000:.0f}ms, max {late[-1] * 1000:.0f}ms"
        f" (poll_delay {POLL_DELAY * 1000:.0f}ms)"
    )


@pytest.mark.slow
@pytest.mark.postgres
def test_deferrals_are_not_tries(pg_store_url: str) -> None:
    # "tight" is registered with max_tries=1 at "1/second": of 7 jobs enqueued at once, one
    # runs in each aligned second, so six are deferred, and a deferral that counted as a
    # try would leave arq no try to run them with.
    count = 7
    with _arq(pg_store_url) as (workers, port):
        workers.start(2)
        _enqueue(port, "tight", *((n,) for n in range(count)))
        # Done when the queue is empty: every job ran, or arq gave up on some (max tries).
        with redis.Redis(host="127.0.0.1", port=port) as broker:
            wait_for(workers.journal, lambda _: broker.zcard(default_queue_name) == 0,
                     timeout=count + 15, alive=workers.dead)  # fmt: skip
        lines = read(workers.journal)

    runs = _runs(lines, "tight")
    assert [r for r in runs if r["outcome"] == "failed"] == []
    deferrals = Counter(r["id"] for r in runs if r["outcome"] == "deferred")
    print(f"deferrals per job {sorted(deferrals.items())}")
    assert len(deferrals) >= count - 1, deferrals
    bodies = [line for line in lines if line["event"] == "start"]
    assert sorted(line["id"] for line in bodies) == list(range(count))
    assert {line["job_try"] for line in [*bodies, *runs]} == {1}


@pytest.mark.slow
@pytest.mark.postgres
def test_the_slot_of_a_killed_worker_is_free_a_lease_later(pg_store_url: str) -> None:
    lease = 2.0  # "hold" runs with concurrency=1, lease=2
    limiter = quota.connect(pg_store_url, pool_size=1)
    try:
        with _arq(pg_store_url) as (workers, port):
            (pid,) = workers.start(1)
            _enqueue(port, "hold", (1, 60.0))
            wait_for(workers.journal, lambda lines: bool(starts(lines, job="hold")),
                     timeout=15, alive=workers.dead)  # fmt: skip
            time.sleep(lease)  # renewed at least once while it runs
            usage = limiter.concurrency_usage("hold")
            assert usage.held == 1 and usage.limit == 1, usage
            assert usage.holders[0].split(":")[1] == str(pid), usage
            workers.kill(pid)
            killed = time.time()
            deadline = killed + lease + 1.0
            while (usage := limiter.concurrency_usage("hold", 1)).held and time.time() < deadline:
                time.sleep(0.05)
            freed = time.time() - killed
    finally:
        limiter.close()
    print(f"slot free {freed:.2f}s after the worker was killed (lease {lease:g}s)")
    assert usage.held == 0 and usage.free == 1, (usage, freed)
