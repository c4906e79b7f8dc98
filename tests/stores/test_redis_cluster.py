"""The Redis Cluster store on a real cluster of its own: three masters, three replicas.

The cluster (tests/_redis_cluster.py; the ``redis_cluster`` fixture of tests/conftest.py,
which the contract tests share) is started once for the session on free loopback ports and
stopped at its end; each test works under a key prefix of its own. Tests that
kill a master leave the cluster healed (the node started again, as a replica of the one
promoted in its place) for the next. Without redis-server, redis-cli or redis-py they
skip, saying why; under QUOTA_TEST_REQUIRE_POSTGRES=1 (CI) a missing server fails them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import quota
from quota import Fallback
from quota._core.url import SCHEMALESS, parse_url
from quota._stores import redis as _redis
from quota._stores.redis_cluster import parse_cluster_url
from tests._redis_cluster import RedisCluster, running_cluster
from tests._support import T0, Backend, Clock

ALGORITHMS = ("fixed_window", "sliding_window", "token_bucket", "gcra")
DEADLINE = 30.0

# -- the cluster -------------------------------------------------------------------------------


@pytest.fixture
def cluster(redis_cluster: RedisCluster) -> Iterator[RedisCluster]:
    """The session's cluster, healed after the test (every killed node started again)."""
    yield redis_cluster
    redis_cluster.heal()


@pytest.fixture
def prefix() -> str:
    return f"quota-test-{uuid.uuid4().hex[:12]}:"


@pytest.fixture
def cluster_url(cluster: RedisCluster, prefix: str) -> Iterator[str]:
    """A cluster URL with a key prefix of its own; the keys are deleted afterwards."""
    yield cluster.url(prefix=prefix)
    cluster.heal()
    for port in cluster.masters():
        with cluster.node(port) as client:
            for key in list(client.scan_iter(match=prefix + "*", count=1000)):
                client.delete(key)


def _wait(condition: Callable[[], bool], what: str, timeout: float = DEADLINE) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what}: not within {timeout:g}s")
        time.sleep(0.02)


def _key_on(cluster: RedisCluster, prefix: str, master: int, stem: str) -> str:
    """A caller key whose rows live on `master`."""
    for i in range(10_000):
        key = f"{stem}-{i}"
        if cluster.master_of_key(f"{prefix}{{k:{key}}}:idx") == master:
            return key
    raise AssertionError(f"no key of {stem!r} lands on {master}")


# -- URLs ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "nodes", "prefix", "options"),
    [
        ("redis+cluster://h1:7001,h2:7002/", (("h1", 7001), ("h2", 7002)), "quota:", {}),
        ("redis+cluster://h1", (("h1", 6379),), "quota:", {}),
        (
            "rediss+cluster://app:p%40ss@[::1]:7001, h2:7002/0?prefix=app1:&socket_keepalive=true",
            (("::1", 7001), ("h2", 7002)),
            "app1:",
            {"username": "app", "password": "p@ss", "ssl": True, "socket_keepalive": True},
        ),
    ],
)
def test_a_cluster_url_names_startup_nodes_credentials_and_options(
    url: str, nodes: tuple[tuple[str, int], ...], prefix: str, options: dict[str, Any]
) -> None:
    target = parse_cluster_url(url)
    assert (target.nodes, target.prefix) == (nodes, prefix)
    assert {name: target.options.get(name) for name in options} == options
    assert parse_url(url).dialect == "redis-cluster"
    assert "redis-cluster" in SCHEMALESS


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("redis+cluster://:s3cret@/", "names no host"),
        ("redis+cluster://:s3cret@h1:7001,h2:port/", "Port could not be cast"),
        ("redis+cluster://:s3cret@h1:7001/2", "database 0 only"),
        ("redis+cluster://:s3cret@h1:7001/?db=1", "unknown option 'db'"),
        ("redis+cluster://:s3cret@h1:7001/?cluster=true", "unknown option 'cluster'"),
        ("redis+cluster://:s3cret@h1:7001/?prefix=a{b", "prefix"),
        ("redis+cluster://:s3cret@h1:7001/?socket_timeout=soon", "socket_timeout"),
        ("redis://:s3cret@h1:7001,h2:7002/0", r"several hosts.*redis\+cluster://"),
        ("redis://:s3cret@h1,h2/0", r"several hosts.*redis\+cluster://"),
        (
            "rediss://:s3cret@h1:7001/0?cluster=true",
            r"cluster= is not an option.*redis\+cluster://",
        ),
    ],
)
@pytest.mark.parametrize("connect", [quota.connect, quota.connect_async])
def test_a_bad_cluster_url_is_a_configuration_error_naming_it(
    url: str, says: str, connect: Callable[..., Any]
) -> None:
    with pytest.raises(quota.ConfigurationError, match=says) as info:
        connect(url)
    assert ":***@h" in str(info.value) or ":***@/" in str(info.value)
    assert "s3cret" not in str(info.value)


def test_an_unreachable_cluster_is_a_storage_error_and_a_fallback_bridges_it() -> None:
    url = "redis+cluster://:s3cret@127.0.0.1:1/"
    limiter = quota.connect(url, timeout=2)  # the client discovers the cluster on a call
    with pytest.raises(quota.StorageError, match=r"redis\+cluster://:\*\*\*@127.0.0.1:1/") as info:
        limiter.rate_limit("k", 1, 60)
    assert "s3cret" not in str(info.value) and info.value.__cause__ is not None
    with quota.connect(url, fallback=True) as bridged:
        assert [bridged.rate_limit("k", 2, 60).allowed for _ in range(3)] == [True, True, False]

    async def main() -> None:
        limiter = quota.connect_async(url, timeout=2)
        with pytest.raises(quota.StorageError, match=r"redis\+cluster://:\*\*\*@127"):
            await limiter.rate_limit("k", 1, 60)
        await limiter.aclose()

    asyncio.run(main())


# -- what the store does ----------------------------------------------------------------------


@pytest.mark.redis
@pytest.mark.parametrize("face", ["sync", "async"])
def test_every_operation_on_keys_spread_over_every_master(
    face: str, cluster: RedisCluster, cluster_url: str, prefix: str
) -> None:
    backend = Backend(f"cluster-{face}", cluster_url, Clock())
    try:
        keys = [f"user-{i}" for i in range(24)]
        homes = {cluster.master_of_key(f"{prefix}{{k:{key}}}:idx") for key in keys}
        assert homes == set(cluster.masters())  # every master holds some

        for algorithm in ALGORITHMS:
            for key in keys:
                decisions = [backend.rate_limit(key, 3, 60, algorithm=algorithm) for _ in range(4)]
                assert [d.allowed for d in decisions] == [True, True, True, False], (algorithm, key)
        assert backend.peek("user-0", 3, 60).count == 4
        assert not backend.peek("user-0", 3, 60, algorithm="gcra").allowed

        top = backend.top(100)
        assert sorted(u.key for u in top) == sorted(keys)
        assert {(u.window, u.count) for u in top} == {(60, 4)}
        assert backend.cleanup(grace=0) == quota.CleanupResult(deleted=0, expired=0)

        assert backend.reset("user-0") == 4  # its window and three states
        assert backend.reset("user-0") == 0
        assert backend.rate_limit("user-0", 3, 60, algorithm="gcra").allowed
        assert backend.peek("user-0", 3, 60).count == 0

        on_db_clock = backend.connect(clock="database")
        for algorithm in ALGORITHMS:
            hits = [
                on_db_clock.rate_limit("db-clock", 1, 60, algorithm=algorithm) for _ in range(2)
            ]
            assert [d.allowed for d in hits] == [True, False], algorithm
    finally:
        backend.close()

    # Every row carries a TTL: nothing for cleanup to do.
    for port in cluster.masters():
        with cluster.node(port) as client:
            for key in client.scan_iter(match=prefix + "*", count=1000):
                assert 0 < client.pttl(key) <= (2 * 60 + 60) * 1000, key


@pytest.mark.redis
def test_a_replica_as_the_only_startup_node_serves_every_key(
    cluster: RedisCluster, prefix: str, cluster_url: str
) -> None:
    replica = next(r for replicas in cluster.masters().values() for r in replicas)
    with quota.connect(f"redis+cluster://127.0.0.1:{replica}/?prefix={prefix}") as limiter:
        assert all(limiter.rate_limit(f"k{i}", 1, 60).allowed for i in range(20))
        assert not any(limiter.rate_limit(f"k{i}", 1, 60).allowed for i in range(20))


@pytest.mark.redis
def test_the_cluster_keeps_no_schema_and_no_durable_quotas(cluster_url: str) -> None:
    with pytest.raises(quota.ConfigurationError, match="keeps no SQL schema"):
        quota.migrate(cluster_url)
    with (
        quota.connect(cluster_url) as limiter,
        pytest.raises(quota.ConfigurationError, match=r"durable quotas.* need sqlite://"),
    ):
        limiter.consume_quota("acct", "api", 100, "day")


@pytest.mark.redis
@pytest.mark.slow
def test_processes_on_one_key_allow_exactly_the_limit_under_every_algorithm(
    cluster_url: str,
) -> None:
    from tests._algorithm_workers import algorithm_worker
    from tests._workers import run_processes

    limit, hits = 50, 40  # 4 x 40 = 160 hits per algorithm for 50 allowed
    results = run_processes(
        multiprocessing.get_context("spawn"),
        algorithm_worker,
        [(cluster_url, limit, 3600, hits, T0)] * 4,
    )
    assert {a: sum(r[a] for r in results) for a in ALGORITHMS} == dict.fromkeys(ALGORITHMS, limit)
    with quota.connect(cluster_url, clock=lambda: T0) as limiter:
        assert limiter.peek("hammered-fixed_window", limit, 3600).count == 4 * hits


def _hammer(
    limiter: Any,
    keys: list[str],
    limit: int,
    hits: int,
    threads: int,
    during: Callable[[], None],
    *,
    algorithms: tuple[str, ...] = ALGORITHMS,
    start_after: int = 40,
) -> dict[tuple[str, str], int]:
    """`threads` threads hit every (algorithm, key) `hits` times each; `during` runs once
    `start_after` calls are done. Returns the allowed hits of each (algorithm, key)."""
    allowed: dict[tuple[str, str], int] = {(a, k): 0 for a in algorithms for k in keys}
    done = [0]
    errors: list[BaseException] = []
    lock = threading.Lock()

    def work() -> None:
        try:
            for _ in range(hits):
                for algorithm in algorithms:
                    for key in keys:
                        decision = limiter.rate_limit(key, limit, 3600, algorithm=algorithm)
                        with lock:
                            allowed[(algorithm, key)] += decision.allowed
                            done[0] += 1
        except BaseException as exc:  # reported below
            errors.append(exc)

    workers = [threading.Thread(target=work) for _ in range(threads)]
    for worker in workers:
        worker.start()
    try:
        _wait(lambda: done[0] >= start_after or errors != [], "the first hits")
        during()
    finally:
        for worker in workers:
            worker.join(timeout=60)
    assert not errors, errors
    assert not any(worker.is_alive() for worker in workers)
    return allowed


@pytest.mark.redis
@pytest.mark.parametrize("batching", [False, True])
def test_script_flush_on_every_node_mid_run_reloads_and_counts_exactly(
    cluster: RedisCluster, cluster_url: str, batching: bool
) -> None:
    keys = [f"flushed-{i}" for i in range(6)]
    with quota.connect(cluster_url, clock=lambda: T0, batching=batching) as limiter:
        flushed = []

        def flush() -> None:
            for port in cluster.ports:
                flushed.append(cluster.command(port, "SCRIPT", "FLUSH"))

        allowed = _hammer(limiter, keys, 20, 8, 4, flush)  # 4 threads x 8 = 32 hits, 20 allowed
        assert flushed and all(flushed)
        assert allowed == dict.fromkeys(allowed, 20)
        assert {limiter.peek(key, 20, 3600).count for key in keys} == {32}


@pytest.mark.redis
def test_a_batched_pipeline_spans_masters_and_reloads_lost_scripts_async(
    cluster: RedisCluster, cluster_url: str
) -> None:
    keys = [f"batched-{i}" for i in range(12)]

    async def main() -> list[bool]:
        limiter = quota.connect_async(cluster_url, clock=lambda: T0, batching=True)
        try:
            first = await asyncio.gather(*(limiter.rate_limit(k, 2, 60) for k in keys * 2))
            for port in cluster.ports:
                cluster.command(port, "SCRIPT", "FLUSH")
            then = await asyncio.gather(*(limiter.rate_limit(k, 2, 60) for k in keys))
            counts = {(await limiter.peek(k, 2, 60)).count for k in keys}
            assert counts == {3}
            return [d.allowed for d in first + then]
        finally:
            await limiter.aclose()

    assert asyncio.run(main()) == [True] * 24 + [False] * 12


@pytest.mark.redis
def test_an_async_batch_is_one_round_trip_per_master(
    cluster: RedisCluster, cluster_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Group commit on the async face: the scripts of a batch go out as one pipeline to
    each master that owns some of their keys, not as one command each."""
    from redis.asyncio.cluster import ClusterNode

    pipelines: list[int] = []
    singles: list[str] = []
    execute_pipeline = ClusterNode.execute_pipeline
    execute_command = ClusterNode.execute_command

    async def counted_pipeline(self: Any, commands: list[Any]) -> bool:
        pipelines.append(len(commands))
        return await execute_pipeline(self, commands)

    async def counted_command(self: Any, *args: Any, **kwargs: Any) -> Any:
        singles.append(str(args[0]))
        return await execute_command(self, *args, **kwargs)

    monkeypatch.setattr(ClusterNode, "execute_pipeline", counted_pipeline)
    monkeypatch.setattr(ClusterNode, "execute_command", counted_command)
    keys = [f"trip-{i}" for i in range(30)]

    async def main() -> list[int]:
        limiter = quota.connect_async(cluster_url, clock=lambda: T0, batching=True)
        try:
            await limiter.rate_limit("warm-up", 5, 60)  # the cluster discovered
            store = limiter.store
            while not hasattr(store, "planner"):  # the batcher (and fallback) wrap the store
                store = store.store
            # On every master (a replica promoted by an earlier test has no script cache).
            await store._send("SCRIPT", ("LOAD", _redis.SCRIPTS["fixed_window"]))
            pipelines.clear()
            singles.clear()
            commands = [("EVALSHA", store.planner.hit_args(_sql_hit_params(key))) for key in keys]
            replies = await store._send("PIPELINE", tuple(commands))
            return [int(reply) for reply in replies]
        finally:
            await limiter.aclose()

    assert asyncio.run(main()) == [1] * len(keys)
    assert sum(pipelines) == len(keys)
    assert len(pipelines) <= len(cluster.masters())
    assert "EVALSHA" not in singles


def _sql_hit_params(key: str) -> tuple[Any, ...]:
    """The parameters of the fixed window's hot statement for `key` (one hit, 60 s windows)."""
    start = int(T0) - int(T0) % 60
    return (f"60:{start}:k:{key}", f"k:{key}", start, 60, 1, T0)


@pytest.mark.redis
@pytest.mark.parametrize("batching", [False, True])
def test_a_resharded_slot_is_followed_without_marking_the_store_down(
    cluster: RedisCluster, cluster_url: str, prefix: str, batching: bool, caplog: Any
) -> None:
    masters = sorted(cluster.masters())
    key = _key_on(cluster, prefix, masters[0], "moving")
    slot = int(cluster.command(masters[0], "CLUSTER", "KEYSLOT", f"{prefix}{{k:{key}}}:idx"))
    fallback = Fallback(timeout=2.0, probe_interval=0.1)
    caplog.set_level(logging.WARNING, logger="quota")
    with quota.connect(
        cluster_url, clock=lambda: T0, fallback=fallback, batching=batching
    ) as limiter:
        limiter.peek(key, 60, 3600)  # the client has the slot map before the move

        def move() -> None:
            source = cluster.start_moving(slot, masters[1])
            time.sleep(0.2)  # hits meet the migrating slot: ASK and TRYAGAIN
            cluster.finish_moving(slot, source, masters[1])

        algorithms = ("fixed_window", "gcra")
        allowed = _hammer(limiter, [key], 60, 30, 3, move, algorithms=algorithms, start_after=30)
        assert limiter.store.up
        assert allowed == dict.fromkeys(allowed, 60)
        assert limiter.peek(key, 60, 3600).count == 3 * 30
    assert cluster.master_of_key(f"{prefix}{{k:{key}}}:idx") == masters[1]
    assert not [r for r in caplog.records if "is down" in r.getMessage()]


@pytest.mark.redis
@pytest.mark.parametrize("with_fallback", [False, True])
def test_the_async_store_replaces_connections_every_node_killed_while_idle(
    cluster: RedisCluster, cluster_url: str, prefix: str, with_fallback: bool, caplog: Any
) -> None:
    """``CLIENT KILL TYPE normal`` on every node between calls: each call is answered
    by the cluster, each hit counted once."""
    caplog.set_level(logging.WARNING, logger="quota")
    fallback = Fallback(timeout=2.0, probe_interval=0.2) if with_fallback else None
    keys = [f"idle-{i}" for i in range(6)]

    async def main() -> list[bool]:
        limiter = quota.connect_async(cluster_url, clock=lambda: T0, fallback=fallback)
        allowed = []
        try:
            for _ in range(4):
                for key in keys:
                    allowed.append((await limiter.rate_limit(key, 2, 3600)).allowed)
                for port in cluster.ports:
                    cluster.command(port, "CLIENT", "KILL", "TYPE", "normal")
                for _ in range(50):  # the loop reads the servers' end of the streams
                    await asyncio.sleep(0.01)
            assert limiter.store.up
            counts = {(await limiter.peek(key, 2, 3600)).count for key in keys}
            assert counts == {4}
        finally:
            await limiter.aclose()
        return allowed

    assert asyncio.run(main()) == [True] * 12 + [False] * 12
    assert not [r for r in caplog.records if "is down" in r.getMessage()]


@pytest.mark.redis
def test_doctor_checks_the_eviction_policy_of_every_master(
    cluster: RedisCluster, cluster_url: str
) -> None:
    findings = quota.diagnose(cluster_url, timeout=5)
    (connectivity,) = [f for f in findings if f.check == "connectivity"]
    assert connectivity.severity == "ok" and "3 masters" in connectivity.message
    eviction = [f for f in findings if f.check == "eviction"]
    assert len(eviction) == 3
    assert {f.severity for f in eviction} == {"ok"}
    assert all("noeviction" in f.message for f in eviction)


def _reshard(cluster: RedisCluster, source: int, target: int, slots: int) -> None:
    """``redis-cli --cluster reshard``: move `slots` slots (and their keys) from the master
    on port `source` to the one on `target`, as an operator would.

    redis-cli refuses, changing nothing, while the nodes do not yet agree on the slot map
    (a reshard just before still spreading by gossip): it is asked again then, as an
    operator would, for up to a minute."""
    deadline = time.monotonic() + 60
    while True:
        moved = subprocess.run(
            [cluster.cli, "--cluster", "reshard", f"127.0.0.1:{source}",
             "--cluster-from", cluster.node_id(source), "--cluster-to", cluster.node_id(target),
             "--cluster-slots", str(slots), "--cluster-yes"],
            stdin=subprocess.DEVNULL, capture_output=True, timeout=240, check=False,
        )  # fmt: skip
        out = moved.stdout.decode()[-2000:] + moved.stderr.decode()[-2000:]
        if moved.returncode == 0 or "agree about configuration" not in out:
            break
        assert time.monotonic() < deadline, out
        time.sleep(0.5)
    assert moved.returncode == 0, out


@pytest.mark.redis
def test_resharding_under_async_load_is_invisible(redis_cluster: RedisCluster, caplog: Any) -> None:
    """``redis-cli --cluster reshard`` moving 1,000 slots there and back while tasks hit
    keys spread over every master, one by one, with group commit and with a fallback: no
    call raises, none is decided from memory, and every hit is counted once."""
    caplog.set_level(logging.WARNING, logger="quota")
    with running_cluster() as cluster:  # its slot map is the test's to change
        masters = sorted(cluster.masters())
        modes = {
            "one-by-one": {},
            "batching": {"batching": True},
            "fallback": {"fallback": Fallback(timeout=5.0, probe_interval=0.2)},
            "fallback-batching": {
                "fallback": Fallback(timeout=5.0, probe_interval=0.2), "batching": True
            },
        }  # fmt: skip
        keys = [f"reshard-{i}" for i in range(200)]
        limit = 10**6

        async def main() -> dict[str, tuple[int, int, int, list[str], bool]]:
            resharded = asyncio.Event()
            limiters = {
                mode: quota.connect_async(cluster.url(prefix=f"{mode}:"), **options)
                for mode, options in modes.items()
            }
            tallies = {mode: [0, 0, []] for mode in modes}  # calls, allowed, errors

            async def work(mode: str, start: int) -> None:
                limiter, tally = limiters[mode], tallies[mode]
                i = start
                while not resharded.is_set() and tally[0] < 200_000:
                    i += 7
                    try:
                        decision = await limiter.rate_limit(keys[i % len(keys)], limit, 3600)
                    except Exception as exc:  # reported below
                        tally[2].append(f"{type(exc).__name__}: {exc}")
                        continue
                    tally[0] += 1
                    tally[1] += decision.allowed

            async def reshard() -> None:
                try:
                    await asyncio.sleep(0.5)  # the load under way
                    await asyncio.to_thread(_reshard, cluster, masters[0], masters[1], 1000)
                    await asyncio.to_thread(_reshard, cluster, masters[1], masters[0], 1000)
                finally:
                    resharded.set()

            try:
                await asyncio.gather(
                    reshard(), *(work(mode, w) for mode in modes for w in range(8))
                )
                results = {}
                for mode, limiter in limiters.items():
                    stored = sum([(await limiter.peek(key, limit, 3600)).count for key in keys])
                    calls, allowed, errors = tallies[mode]
                    results[mode] = (calls, allowed, stored, errors, limiter.store.up)
                return results
            finally:
                for limiter in limiters.values():
                    await limiter.aclose()

        results = asyncio.run(main())
    for mode, (calls, allowed, stored, errors, up) in results.items():
        assert errors == [], (mode, len(errors), errors[:5])
        assert calls > 0 and allowed == calls and stored == calls, (mode, calls, allowed, stored)
        assert up, mode
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


# -- a master killed ------------------------------------------------------------------------


@pytest.mark.redis
def test_a_master_killed_mid_load_with_a_fallback_bridges_and_comes_back(
    cluster: RedisCluster, cluster_url: str, prefix: str
) -> None:
    victim = sorted(cluster.masters())[0]
    key = _key_on(cluster, prefix, victim, "victim")
    limit = 10
    fallback = Fallback(timeout=0.5, probe_interval=0.1)
    calls = [0]
    allowed = [0]
    owing = [0]  # calls decided by the cluster before the outage's hits were written back
    errors: list[BaseException] = []
    went_down = threading.Event()
    stop = threading.Event()
    with (
        quota.connect(cluster_url, fallback=fallback) as limiter,
        quota.connect(cluster_url) as plain,
    ):
        store: Any = limiter.store

        def work() -> None:
            try:
                while not stop.is_set():
                    pending = store.up and store.health.owes()
                    allowed[0] += limiter.rate_limit(key, limit, 3600).allowed
                    owing[0] += pending or (store.up and store.health.owes())
                    calls[0] += 1
                    if not limiter.store.up:
                        went_down.set()
                    time.sleep(0.002)
            except BaseException as exc:  # reported below
                errors.append(exc)

        worker = threading.Thread(target=work)
        worker.start()
        try:
            _wait(lambda: calls[0] >= 20 or errors != [], "the first hits")
            cluster.kill(victim)
            _wait(went_down.is_set, "the store marked down")
            promoted = cluster.wait_promoted(victim)
            _wait(lambda: limiter.store.up, "the probe switching back")
            back_at = calls[0]
            _wait(lambda: calls[0] >= back_at + 20, "hits after the switch back")
        finally:
            stop.set()
            worker.join(timeout=30)
        assert not errors, errors
        # One process: the cluster's allowance, then memory's own during the outage; the
        # cluster may allow calls made after the switch back before the write-back landed.
        assert limit <= allowed[0] <= 2 * limit + owing[0], (allowed[0], owing[0])
        assert cluster.master_of_key(f"{prefix}{{k:{key}}}:idx") == promoted
        # Decisions come from the cluster again: a fresh key counted there.
        assert limiter.rate_limit("after", 5, 60).allowed
        assert plain.peek("after", 5, 60).count == 1
        # The outage's hits were written back to the same window.
        assert plain.peek(key, limit, 3600).count >= limit


@pytest.mark.redis
def test_a_master_killed_under_async_group_commit_with_a_fallback_bridges_and_comes_back(
    cluster: RedisCluster, cluster_url: str, prefix: str
) -> None:
    """Concurrent tasks batching into per-node pipelines: a master killed mid-load never
    raises into a caller, and decisions come from the cluster again after promotion."""
    victim = sorted(cluster.masters())[0]
    key = _key_on(cluster, prefix, victim, "batched-victim")
    limit = 10
    counts = {"calls": 0, "allowed": 0, "owing": 0}

    async def main() -> None:
        limiter = quota.connect_async(
            cluster_url, batching=True, fallback=Fallback(timeout=0.5, probe_interval=0.1)
        )
        store: Any = limiter.store
        went_down = asyncio.Event()

        async def hits() -> None:
            while True:
                pending = store.up and store.health.owes()
                decisions = await asyncio.gather(
                    *(limiter.rate_limit(key, limit, 3600) for _ in range(8))
                )
                if pending or (store.up and store.health.owes()):
                    counts["owing"] += len(decisions)  # see the sync test
                counts["calls"] += len(decisions)
                counts["allowed"] += sum(d.allowed for d in decisions)
                if not limiter.store.up:
                    went_down.set()
                await asyncio.sleep(0.002)

        async def until(condition: Callable[[], bool], what: str) -> None:
            deadline = time.monotonic() + DEADLINE
            while not condition():
                assert time.monotonic() < deadline, (
                    f"not within {DEADLINE}s: {what} {store.health.last_error!r}"
                )
                await asyncio.sleep(0.01)

        worker = asyncio.ensure_future(hits())
        try:
            await until(lambda: counts["calls"] >= 40 or worker.done(), "the first hits")
            cluster.kill(victim)
            await until(lambda: went_down.is_set() or worker.done(), "the store marked down")
            await asyncio.to_thread(cluster.wait_promoted, victim)
            await until(lambda: limiter.store.up or worker.done(), "the probe switching back")
            back_at = counts["calls"]
            await until(lambda: counts["calls"] >= back_at + 40 or worker.done(), "hits after")
            assert not worker.done(), worker.exception()  # no exception reached a caller
            assert (await limiter.rate_limit("batched-after", 5, 60)).allowed
        finally:
            worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await worker
            await limiter.aclose()

    asyncio.run(main())
    # One process: the cluster's allowance, then memory's own during the outage (and
    # what the cluster allowed after the switch back, before the write-back landed).
    assert limit <= counts["allowed"] <= 2 * limit + counts["owing"], counts
    with quota.connect(cluster_url) as plain:
        assert plain.peek("batched-after", 5, 60).count == 1  # counted on the cluster


@pytest.mark.redis
@pytest.mark.parametrize("face", ["sync", "async"])
def test_a_master_killed_without_a_fallback_raises_storage_errors_until_promoted(
    face: str, cluster: RedisCluster, cluster_url: str, prefix: str
) -> None:
    victim = sorted(cluster.masters())[0]
    key = _key_on(cluster, prefix, victim, "victim")
    backend = Backend(f"cluster-{face}", cluster_url, Clock())
    try:
        assert backend.rate_limit(key, 1000, 60).allowed
        cluster.kill(victim)
        failures: list[BaseException] = []
        deadline = time.monotonic() + DEADLINE
        while True:
            try:
                decision = backend.rate_limit(key, 1000, 60)
            except Exception as exc:  # every one must be a StorageError
                failures.append(exc)
            else:
                if failures:
                    break
            assert time.monotonic() < deadline, f"not back: {len(failures)}, {failures[-1:]}"
            time.sleep(0.02)
        assert decision.allowed
        assert all(isinstance(exc, quota.StorageError) for exc in failures), {
            type(exc) for exc in failures
        }
        assert all(exc.__cause__ is not None for exc in failures)
        promoted = cluster.wait_promoted(victim)  # the cluster's own view may lag the client's
        assert cluster.master_of_key(f"{prefix}{{k:{key}}}:idx") == promoted
    finally:
        backend.close()


@pytest.mark.redis
@pytest.mark.parametrize("face", ["sync", "async"])
def test_a_script_load_goes_to_every_master(
    face: str, cluster: RedisCluster, cluster_url: str
) -> None:
    from quota._stores import redis as _redis

    for port in cluster.ports:
        cluster.command(port, "SCRIPT", "FLUSH")
    backend = Backend(f"cluster-{face}", cluster_url, Clock())
    try:
        send = backend.limiter.store._send
        reply = send("SCRIPT", ("LOAD", _redis.SCRIPTS["gcra"]))
        sha = backend.run(reply) if backend.is_async else reply
    finally:
        backend.close()
    assert sha == _redis.SHAS["gcra"]
    for port in cluster.masters():
        assert cluster.command(port, "SCRIPT", "EXISTS", sha) == [1], port


@pytest.mark.parametrize("face", ["sync", "async"])
@pytest.mark.parametrize("algorithm", ["fixed_window", "token_bucket"])
def test_acquire_waits_exactly_on_a_cluster(cluster_url: str, face: str, algorithm: str) -> None:
    clock = Clock()
    pauses: list[float] = []

    def sleep(seconds: float) -> None:
        pauses.append(seconds)
        clock.advance(seconds)

    backend = Backend(f"redis-{face}", cluster_url, clock, sleep=sleep)
    try:
        rate = quota.Rate(limit=2, window=1, algorithm=algorithm)
        admitted = [backend.acquire("wait", rate, timeout=5) for _ in range(6)]
        assert all(d.allowed for d in admitted)
        # Two at once, then one sleep per wait, each admitted when it wakes.
        assert len(pauses) == (2 if algorithm == "fixed_window" else 4)
        with pytest.raises(quota.RateLimitTimeout):
            backend.acquire("wait", quota.Rate(limit=1, window=60), timeout=0)
            backend.acquire("wait", quota.Rate(limit=1, window=60), timeout=0)
    finally:
        backend.close()


@pytest.mark.parametrize("face", ["sync", "async"])
@pytest.mark.parametrize("algorithm", ["fixed_window", "sliding_window", "token_bucket", "gcra"])
def test_a_denied_multi_rate_acquire_gives_back_on_a_cluster(
    cluster_url: str, face: str, algorithm: str
) -> None:
    backend = Backend(f"redis-{face}", cluster_url, Clock())
    try:
        short = quota.Rate(limit=5, window=1, algorithm=algorithm)
        rates = [short, quota.Rate(limit=2, window=60)]
        for key in ("a", "b", "c"):  # keys in different slots
            for _ in range(2):
                assert backend.acquire(key, rates, timeout=0).allowed
            for _ in range(3):
                with pytest.raises(quota.RateLimitTimeout):
                    backend.acquire(key, rates, timeout=0)
            assert sum(backend.hit(key, short).allowed for _ in range(6)) == 3
    finally:
        backend.close()
