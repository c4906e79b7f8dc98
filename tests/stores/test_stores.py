"""What only the memory and Redis stores have: bounds, naming, TTLs, key layout, errors.

Their decisions are tested with every other store in ``tests/core/test_algorithms.py``
and ``tests/core/test_algorithms_equivalence.py``; this module covers the rest.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest

import quota
from quota._stores import redis as _redis
from quota._stores.memory import MemoryStore
from tests._support import T0, Clock
from tests.conftest import backend_params

ALGORITHMS = ("fixed_window", "sliding_window", "token_bucket", "gcra")

# -- memory ------------------------------------------------------------------------------------


def test_each_plain_memory_url_is_a_store_of_its_own() -> None:
    one, two = quota.connect("memory://"), quota.connect("memory://")
    assert one.rate_limit("k", 1, 60).allowed
    assert two.rate_limit("k", 1, 60).allowed
    assert not one.rate_limit("k", 1, 60).allowed


def test_a_named_memory_store_is_shared_by_sync_and_async_limiters() -> None:
    sync = quota.connect("memory://shared-by-name")
    asynchronous = quota.connect_async("memory://shared-by-name")
    assert sync.rate_limit("k", 2, 60, algorithm="gcra").allowed
    assert asyncio.run(asynchronous.rate_limit("k", 2, 60, algorithm="gcra")).allowed
    assert not sync.rate_limit("k", 2, 60, algorithm="gcra").allowed
    assert quota.connect("memory://another-name").rate_limit("k", 2, 60, algorithm="gcra").allowed


@pytest.mark.parametrize(
    ("url", "names"),
    [
        ("memory://?max_keys=0", "max_keys must be between 1"),
        ("memory://?max_keys=lots", "max_keys must be a positive integer, got 'lots'"),
        ("memory://?size=10", "unknown option 'size'.*max_keys"),
    ],
)
def test_bad_memory_options_are_configuration_errors(url: str, names: str) -> None:
    with pytest.raises(quota.ConfigurationError, match=names):
        quota.connect(url)


def test_a_named_store_keeps_its_first_bound() -> None:
    keep = quota.connect("memory://bounded?max_keys=5")
    with pytest.raises(quota.ConfigurationError, match="already exists with max_keys=5"):
        quota.connect("memory://bounded?max_keys=6")
    keep.close()


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_memory_holds_at_most_max_keys_dropping_the_least_recently_used(algorithm: str) -> None:
    clock = Clock()
    limiter = quota.connect("memory://?max_keys=3", clock=clock)
    for key in "abc":
        limiter.rate_limit(key, 1, 3600, algorithm=algorithm)
    assert not limiter.rate_limit("a", 1, 3600, algorithm=algorithm).allowed  # a: recently used

    limiter.rate_limit("d", 1, 3600, algorithm=algorithm)

    assert len(limiter.store) == 3  # type: ignore[arg-type]
    assert not limiter.rate_limit("a", 1, 3600, algorithm=algorithm).allowed  # kept
    assert limiter.rate_limit("b", 1, 3600, algorithm=algorithm).allowed  # dropped: fresh


def test_memory_drops_rows_idle_past_their_expiry_before_live_ones() -> None:
    clock = Clock()
    limiter = quota.connect("memory://?max_keys=100", clock=clock)
    for key in ("old-1", "old-2"):
        limiter.rate_limit(key, 5, 60, algorithm="token_bucket")
        limiter.rate_limit(key, 5, 60)
    clock.advance(2 * 3600)

    limiter.rate_limit("new", 5, 60)

    # The two least recently used rows had expired: they went. At most two go per new
    # row, so a request never pays for a long sweep (cleanup does that).
    rows = list(limiter.store._rows)  # type: ignore[attr-defined]
    assert [row.rsplit(":", 1)[1] for row in rows] == ["old-2", "old-2", "new"]


def test_memory_is_exact_under_threads() -> None:
    limiter = quota.connect("memory://", clock=lambda: T0)
    allowed = dict.fromkeys(ALGORITHMS, 0)
    lock = threading.Lock()
    barrier = threading.Barrier(8)

    def hammer() -> None:
        barrier.wait()
        for _ in range(50):
            for algorithm in ALGORITHMS:
                decision = limiter.rate_limit("k", 40, 3600, algorithm=algorithm)
                with lock:
                    allowed[algorithm] += decision.allowed

    threads = [threading.Thread(target=hammer) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert allowed == dict.fromkeys(ALGORITHMS, 40)
    assert limiter.peek("k", 40, 3600).count == 8 * 50


def test_memory_is_exact_under_asyncio_tasks() -> None:
    async def main() -> dict[str, int]:
        limiter = quota.connect_async("memory://", clock=lambda: T0)

        async def task(algorithm: str) -> bool:
            await asyncio.sleep(0)
            return (await limiter.rate_limit("k", 12, 60, algorithm=algorithm)).allowed

        results = await asyncio.gather(*(task(a) for a in ALGORITHMS for _ in range(30)))
        per = iter(results)
        return {a: sum(next(per) for _ in range(30)) for a in ALGORITHMS}

    assert asyncio.run(main()) == dict.fromkeys(ALGORITHMS, 12)


# -- what neither memory nor Redis keeps -----------------------------------------------------


@pytest.fixture(params=backend_params("memory", "redis"))
def schemaless_url(request: pytest.FixtureRequest) -> str:
    return "memory://" if request.param == "memory" else str(request.getfixturevalue("redis_url"))


def test_durable_quotas_need_a_sql_store(schemaless_url: str) -> None:
    with (
        quota.connect(schemaless_url) as limiter,
        pytest.raises(quota.ConfigurationError, match=r"durable quotas.* need sqlite:// or postgresql://"),
    ):  # fmt: skip
        limiter.consume_quota("acct", "api", 100, "day")


def test_there_is_no_schema_to_migrate(schemaless_url: str) -> None:
    with pytest.raises(quota.ConfigurationError, match="keeps no SQL schema"):
        quota.migrate(schemaless_url)


@pytest.mark.parametrize("statement", ["PG_TRY_LOCK", "PG_UNLOCK", "COUNTERS"])
def test_statements_a_store_does_not_keep_are_named(statement: str) -> None:
    from quota._sql import statements as _sql

    with pytest.raises(quota.ConfigurationError, match="memory store cannot run"):
        MemoryStore().execute(getattr(_sql, statement), (1,))


# -- Redis -----------------------------------------------------------------------------------


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[object]:
    import redis

    with redis.Redis.from_url(_redis.split_url(redis_url)[0]) as client:
        yield client


def _keys(client: object, url: str) -> dict[str, int]:
    prefix = _redis.split_url(url)[1]
    return {
        key.decode(): client.pttl(key)  # type: ignore[attr-defined]
        for key in client.scan_iter(match=prefix + "*")  # type: ignore[attr-defined]
    }


@pytest.mark.redis
def test_every_redis_row_has_a_ttl_and_cleanup_finds_nothing(
    redis_url: str, redis_client: object
) -> None:
    clock = Clock()
    limiter = quota.connect(redis_url, clock=clock)
    for algorithm in ALGORITHMS:
        limiter.rate_limit("alice", 5, 60, algorithm=algorithm)

    keys = _keys(redis_client, redis_url)

    prefix = _redis.split_url(redis_url)[1]
    start = int(clock.now) - int(clock.now) % 60
    assert set(keys) == {
        f"{prefix}{{k:alice}}:{suffix}"
        for suffix in (f"fw:60:{start}", "sw:60", "tb:60", "gcra:60", "idx")
    }
    assert all(0 < ttl <= (2 * 60 + _redis.GRACE) * 1000 for ttl in keys.values()), keys
    assert limiter.cleanup(grace=0) == quota.CleanupResult(deleted=0, expired=0)
    assert limiter.cleanup(dry_run=True).expired == 0


@pytest.mark.redis
def test_reset_finds_every_window_and_state_even_of_a_key_full_of_glob_characters(
    redis_url: str, redis_client: object
) -> None:
    clock = Clock()
    limiter = quota.connect(redis_url, clock=clock)
    key = "a*b?[c]\\d{e}:f"
    for window in (60, 3600):
        for algorithm in ALGORITHMS:
            limiter.rate_limit(key, 5, window, algorithm=algorithm)
    clock.advance(60)
    limiter.rate_limit(key, 5, 60)  # a second fixed window of 60 s
    limiter.rate_limit("a", 5, 60)  # a key the glob would match

    assert sorted(limiter.top(5), key=lambda u: (u.key, u.window)) == [
        quota.Usage("a", 60, 1, limiter.peek("a", 5, 60).reset_at),
        quota.Usage(key, 60, 1, limiter.peek(key, 5, 60).reset_at),
        quota.Usage(key, 3600, 1, limiter.peek(key, 5, 3600).reset_at),
    ]
    assert limiter.reset(key, 60) == 5
    assert limiter.reset(key) == 4
    assert limiter.reset(key) == 0
    assert set(_keys(redis_client, redis_url)) == {
        f"{_redis.split_url(redis_url)[1]}{{k:a}}:{suffix}"
        for suffix in (f"fw:60:{int(clock.now) - int(clock.now) % 60}", "idx")
    }


@pytest.mark.redis
def test_prefixes_keep_stores_apart(redis_url: str) -> None:
    other = redis_url.replace("prefix=", "prefix=other-")
    assert quota.connect(redis_url).rate_limit("k", 1, 60).allowed
    assert quota.connect(other).rate_limit("k", 1, 60).allowed
    assert not quota.connect(redis_url).rate_limit("k", 1, 60).allowed
    quota.connect(other).reset("k")


@pytest.mark.redis
def test_a_flushed_script_cache_is_reloaded(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A restarted Redis forgets its scripts: EVALSHA answers NOSCRIPT, the store loads it.
    monkeypatch.setitem(_redis.SHAS, "gcra", "0" * 40)
    limiter = quota.connect(redis_url)
    assert [limiter.rate_limit("k", 1, 60, algorithm="gcra").allowed for _ in range(2)] == [
        True,
        False,
    ]


@pytest.mark.parametrize("connect", [quota.connect, quota.connect_async])
def test_an_unreachable_redis_is_a_storage_error_without_the_password(connect: object) -> None:
    url = "redis://:s3cret@127.0.0.1:1/0"
    limiter = connect(url, timeout=2)  # type: ignore[operator]

    def call() -> object:
        decision = limiter.rate_limit("k", 1, 60, algorithm="gcra")
        return asyncio.run(decision) if asyncio.iscoroutine(decision) else decision

    with pytest.raises(
        quota.StorageError, match=r"Redis error on redis://:\*\*\*@127.0.0.1:1/0"
    ) as info:
        call()
    assert "s3cret" not in str(info.value)
    assert info.value.__cause__ is not None


def test_an_unreachable_redis_falls_back_to_memory() -> None:
    limiter = quota.connect("redis://127.0.0.1:1/0", fallback=True)
    decisions = [limiter.rate_limit("k", 2, 60, algorithm="token_bucket") for _ in range(3)]
    assert [d.allowed for d in decisions] == [True, True, False]
    limiter.close()


@pytest.mark.parametrize("prefix", ["", "a{b", "x}"])
def test_a_bad_redis_prefix_is_a_configuration_error(prefix: str) -> None:
    with pytest.raises(quota.ConfigurationError, match="prefix"):
        quota.connect(f"redis://127.0.0.1:6379/0?prefix={prefix}")


@pytest.mark.parametrize("connect", [quota.connect, quota.connect_async])
def test_batching_is_refused_where_there_is_nothing_to_batch(connect: object) -> None:
    # Redis batches (pipelines of scripts: tests/stores/test_redis_batching.py); memory has no round trip.
    with pytest.raises(quota.ConfigurationError, match="batching=True groups SQL statements"):
        connect("memory://", batching=True)  # type: ignore[operator]
