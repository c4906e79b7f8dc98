"""The Redis store against faults made on a private ``redis-server`` of the test's own.

Each test starts a server on a free loopback port (tests/_redis_cluster.py
`running_server`) with the settings it needs, closes connections or changes the server
as a managed service, a proxy or another tool would, and stops it afterwards. The shared
Redis is never touched. Without redis-server or redis-py the tests skip, saying why;
under QUOTA_TEST_REQUIRE_POSTGRES=1 (CI) a missing server fails them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import quota
from quota import Fallback
from tests._redis_cluster import RedisServer, find_binaries, running_server
from tests._support import T0, Clock, window_start
from tests.conftest import ENV_REQUIRE

pytestmark = pytest.mark.redis
PREFIX = "faults:"
DEADLINE = 20.0
WEEK = 7 * 86400


@pytest.fixture
def server_settings() -> tuple[str, ...]:
    """Extra ``redis-server`` settings of the test's server (a test overrides this)."""
    return ()


@pytest.fixture
def server(server_settings: tuple[str, ...]) -> Iterator[RedisServer]:
    """A private redis-server for this test; skips (or fails, in CI) without one."""
    try:
        import redis  # noqa: F401
    except ImportError:
        pytest.skip("Redis fault tests need redis-py: pip install 'quota[redis]'")
    if find_binaries() is None:
        reason = "Redis fault tests need redis-server (apt-get install redis-server)"
        if os.environ.get(ENV_REQUIRE) == "1":
            pytest.fail(f"{reason} (and {ENV_REQUIRE}=1)", pytrace=False)
        pytest.skip(reason)
    with running_server(*server_settings) as private:
        yield private


def _counter(key: str, window: int = 3600, now: float = T0) -> str:
    """The Redis key of `key`'s fixed-window counter at `now`."""
    return f"{PREFIX}{{k:{key}}}:fw:{window}:{window_start(now, window)}"


def _wait(condition: Callable[[], bool], what: str, timeout: float = DEADLINE) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what}: not within {timeout:g}s")
        time.sleep(0.02)


def _down_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "is down" in r.getMessage()]


# -- idle connections the server closed ---------------------------------------------------


@pytest.mark.parametrize("fallback", [None, Fallback(timeout=2.0, probe_interval=0.2)])
def test_the_async_store_replaces_connections_the_server_killed_while_idle(
    server: RedisServer, fallback: Fallback | None, caplog: pytest.LogCaptureFixture
) -> None:
    """``CLIENT KILL`` between calls (as a proxy or a managed service closing idle
    connections does): every call is answered by Redis, each hit counted once."""
    caplog.set_level(logging.WARNING, logger="quota")

    async def main() -> list[bool]:
        limiter = quota.connect_async(server.url(prefix=PREFIX), clock=Clock(), fallback=fallback)
        allowed = []
        try:
            for _ in range(10):
                allowed.append((await limiter.rate_limit("idle", 5, 3600)).allowed)
                assert server.command("CLIENT", "KILL", "TYPE", "normal") >= 1
                for _ in range(50):  # the loop reads the server's end of the stream
                    await asyncio.sleep(0.01)
            assert limiter.store.up
        finally:
            await limiter.aclose()
        return allowed

    assert asyncio.run(main()) == [True] * 5 + [False] * 5
    assert int(server.command("GET", _counter("idle"))) == 10
    assert not _down_lines(caplog)


@pytest.mark.parametrize("server_settings", [("--timeout", "1")])
def test_the_async_store_survives_the_servers_idle_timeout(
    server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A server with ``timeout 1`` closes the store's idle connections; the next calls
    still reach it (and a key at its limit stays at it)."""
    caplog.set_level(logging.WARNING, logger="quota")
    fallback = Fallback(timeout=2.0, probe_interval=0.2)

    def idle_closed() -> bool:  # only the asking connection is left
        return int(server.command("INFO", "clients")["connected_clients"]) <= 1

    async def main() -> list[bool]:
        limiter = quota.connect_async(server.url(prefix=PREFIX), clock=Clock(), fallback=fallback)
        allowed = []
        try:
            for _ in range(3):
                for _ in range(2):
                    allowed.append((await limiter.rate_limit("timeout", 2, 3600)).allowed)
                await asyncio.to_thread(_wait, idle_closed, "the server closing idle clients")
                await asyncio.sleep(0.1)  # the loop reads the server's end of the stream
            assert limiter.store.up
        finally:
            await limiter.aclose()
        return allowed

    assert asyncio.run(main()) == [True] * 2 + [False] * 4
    assert int(server.command("GET", _counter("timeout"))) == 6
    assert not _down_lines(caplog)


# -- statement errors: a key of another type, a permission missing ------------------------


def _decide(face: str, url: str, calls: list[tuple[str, int]], **options: Any) -> list[bool]:
    """Open a limiter on `face` ("sync" or "async") and make `calls` ((key, limit) for
    an hour's window) in order; the allowed flag of each, and the store up after them."""
    if face == "sync":
        with quota.connect(url, clock=Clock(), **options) as limiter:
            allowed = [limiter.rate_limit(key, limit, 3600).allowed for key, limit in calls]
            assert limiter.store.up
            return allowed

    async def main() -> list[bool]:
        limiter = quota.connect_async(url, clock=Clock(), **options)
        try:
            allowed = [(await limiter.rate_limit(k, n, 3600)).allowed for k, n in calls]
            assert limiter.store.up
            return allowed
        finally:
            await limiter.aclose()

    return asyncio.run(main())


@pytest.mark.parametrize("face", ["sync", "async"])
def test_a_key_of_another_type_is_a_statement_error_and_the_store_stays_up(
    server: RedisServer, face: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A counter key holding a set (another tool writing under the prefix): that call
    is decided from memory and logged at ERROR; every other key stays decided by Redis."""
    caplog.set_level(logging.WARNING, logger="quota")
    server.command("SADD", _counter("poisoned"), "not-a-counter")
    fallback = Fallback(timeout=2.0, probe_interval=0.2)
    calls = [("full", 5)] * 5 + [("poisoned", 5)] + [("full", 5)] * 10 + [("fresh", 5)] * 3
    allowed = _decide(face, server.url(prefix=PREFIX), calls, fallback=fallback)
    assert allowed == [True] * 5 + [True] + [False] * 10 + [True] * 3
    assert int(server.command("GET", _counter("full"))) == 15
    assert int(server.command("GET", _counter("fresh"))) == 3
    assert server.command("TYPE", _counter("poisoned")) == b"set"
    assert not _down_lines(caplog)
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert any("WRONGTYPE" in line for line in errors), errors


@pytest.mark.parametrize("face", ["sync", "async"])
def test_without_a_fallback_a_key_of_another_type_raises_a_statement_error(
    server: RedisServer, face: str
) -> None:
    server.command("SADD", _counter("poisoned"), "not-a-counter")
    with pytest.raises(quota.StorageError, match="WRONGTYPE") as raised:
        _decide(face, server.url(prefix=PREFIX), [("poisoned", 5)])
    assert raised.value.outage is False


@pytest.mark.parametrize("face", ["sync", "async"])
def test_a_missing_acl_permission_is_an_error_naming_the_command_and_the_user(
    server: RedisServer, face: str, caplog: pytest.LogCaptureFixture
) -> None:
    server.command(
        "ACL", "SETUSER", "limited", "on", ">s3cret", "~*", "&*", "+@all", "-evalsha", "-eval"
    )
    url = server.url(prefix=PREFIX, user="limited", password="s3cret")
    with pytest.raises(quota.StorageError) as raised:
        _decide(face, url, [("denied", 5)])
    assert raised.value.outage is False
    message = str(raised.value)
    assert "'limited'" in message and "EVALSHA" in message, message
    assert "s3cret" not in message

    caplog.set_level(logging.WARNING, logger="quota")
    fallback = Fallback(timeout=2.0, probe_interval=0.2)
    assert _decide(face, url, [("denied", 1)] * 2, fallback=fallback) == [True, False]
    assert not _down_lines(caplog)
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert any("'limited'" in line and "EVALSHA" in line for line in errors), errors


@pytest.mark.parametrize("face", ["sync", "async"])
def test_a_write_back_rejected_as_a_statement_error_is_dropped_and_the_store_comes_back(
    server: RedisServer, face: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Hits counted in memory during an outage for a key that holds another type in
    Redis: their write-back fails every time, so it is dropped (logged at ERROR) and the
    other keys' hits are written back; the store does not stay down for the window."""
    caplog.set_level(logging.WARNING, logger="quota")
    # The hits are written back only while their window runs: a week's window, at the
    # time of day (its start is epoch-aligned).
    now = time.time()
    server.command("SADD", _counter("poisoned", WEEK, now), "not-a-counter")
    fallback = Fallback(timeout=2.0, probe_interval=0.1)
    server.command("ACL", "SETUSER", "app", "on", ">s3cret", "~*", "&*", "+@all")
    url = server.url(prefix=PREFIX, user="app", password="s3cret")
    owed = [("poisoned", 10)] * 2 + [("good", 10)] * 3

    def outage() -> None:  # the app's connections dropped, new ones refused
        server.command("ACL", "SETUSER", "app", "off")
        server.command("CLIENT", "KILL", "USER", "app")

    def sync() -> None:
        with quota.connect(url, clock=Clock(now), fallback=fallback) as limiter:
            limiter.peek("warm-up", 10, WEEK)
            outage()
            limiter.rate_limit("trigger", 10, WEEK)
            assert not limiter.store.up
            assert [limiter.rate_limit(k, n, WEEK).allowed for k, n in owed] == [True] * 5
            server.command("ACL", "SETUSER", "app", "on")
            _wait(lambda: limiter.store.up, "the store back")
            # It switches back first, then writes the outage's hits back.
            _wait(lambda: not limiter.store.health.owes(), "the write-back")

    async def main() -> None:
        limiter = quota.connect_async(url, clock=Clock(now), fallback=fallback)
        try:
            await limiter.peek("warm-up", 10, WEEK)
            outage()
            for _ in range(50):  # the loop reads the server's end of the stream
                await asyncio.sleep(0.01)
            await limiter.rate_limit("trigger", 10, WEEK)
            assert not limiter.store.up
            for key, limit in owed:
                assert (await limiter.rate_limit(key, limit, WEEK)).allowed
            server.command("ACL", "SETUSER", "app", "on")
            deadline = time.monotonic() + DEADLINE
            while not limiter.store.up or limiter.store.health.owes():
                # It switches back first, then writes the outage's hits back.
                assert time.monotonic() < deadline, f"the write-back: not within {DEADLINE:g}s"
                await asyncio.sleep(0.02)
        finally:
            await limiter.aclose()

    if face == "sync":
        sync()
    else:
        asyncio.run(main())
    assert int(server.command("GET", _counter("good", WEEK, now))) == 3
    assert server.command("TYPE", _counter("poisoned", WEEK, now)) == b"set"
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert any("dropped" in line and "k:poisoned" in line for line in errors), errors


# -- doctor: eviction ---------------------------------------------------------------------


def _findings(url: str, check: str) -> list[quota.Finding]:
    return [f for f in quota.diagnose(url, timeout=5) if f.check == check]


@pytest.mark.parametrize("server_settings", [("--maxmemory-policy", "allkeys-lru")])
def test_doctor_warns_of_an_eviction_policy_that_drops_counters(server: RedisServer) -> None:
    from click.testing import CliRunner

    from quota._cli import main

    url = server.url(prefix=PREFIX)
    (connectivity,) = _findings(url, "connectivity")
    assert connectivity.severity == "ok" and "Redis 7" in connectivity.message
    (eviction,) = _findings(url, "eviction")
    assert eviction.severity == "warn"
    assert "allkeys-lru" in eviction.message and "noeviction" in eviction.fix
    result = CliRunner().invoke(main, ["doctor", "--url", url, "--strict"], env={})
    assert result.exit_code != 0 and "allkeys-lru" in result.output, result.output

    server.command("CONFIG", "SET", "maxmemory-policy", "volatile-ttl")
    (eviction,) = _findings(url, "eviction")
    assert eviction.severity == "warn" and "volatile-ttl" in eviction.message
    assert "TTL" in eviction.message


def test_doctor_finds_noeviction_safe_and_says_when_config_get_is_refused(
    server: RedisServer,
) -> None:
    (eviction,) = _findings(server.url(), "eviction")
    assert eviction.severity == "ok" and "noeviction" in eviction.message

    server.command("CONFIG", "SET", "maxmemory-policy", "allkeys-lfu")
    server.command("ACL", "SETUSER", "app", "on", ">s3cret", "~*", "&*", "+@all", "-config")
    (eviction,) = _findings(server.url(user="app", password="s3cret"), "eviction")
    assert eviction.severity == "warn" and "allkeys-lfu" in eviction.message
    assert "CONFIG GET" in eviction.message and "INFO" in eviction.message

    server.command("ACL", "SETUSER", "app", "-info")
    (eviction,) = _findings(server.url(user="app", password="s3cret"), "eviction")
    assert eviction.severity == "warn" and "could not read" in eviction.message
    assert "noeviction" in eviction.fix


def test_with_group_commit_a_key_of_another_type_fails_only_its_own_call(
    server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """``batching=True``: the poisoned key's script fails inside a pipeline of other
    callers' scripts; only its caller is decided from memory, the others get Redis's
    answer (a key at its limit stays denied)."""
    caplog.set_level(logging.WARNING, logger="quota")
    server.command("SADD", _counter("poisoned"), "not-a-counter")
    fallback = Fallback(timeout=2.0, probe_interval=0.2)

    async def main() -> list[list[bool]]:
        limiter = quota.connect_async(
            server.url(prefix=PREFIX), clock=Clock(), fallback=fallback, batching=True
        )
        try:
            for _ in range(5):
                assert (await limiter.rate_limit("full", 5, 3600)).allowed
            rounds = []
            for _ in range(3):
                keys = ["full", "poisoned", *["full"] * 9, *["fresh"] * 3]
                decisions = await asyncio.gather(
                    *(limiter.rate_limit(key, 5, 3600) for key in keys)
                )
                rounds.append([d.allowed for d in decisions])
            assert limiter.store.up
            return rounds
        finally:
            await limiter.aclose()

    rounds = asyncio.run(main())
    full = [allowed for decisions in rounds for allowed in decisions[:1] + decisions[2:11]]
    assert full == [False] * 30
    assert int(server.command("GET", _counter("full"))) == 5 + 30
    assert int(server.command("GET", _counter("fresh"))) == 9
    assert not _down_lines(caplog)
