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

import pytest

import quota
from quota import Fallback
from tests._redis_cluster import RedisServer, find_binaries, running_server
from tests._support import T0, Clock, window_start
from tests.conftest import ENV_REQUIRE

pytestmark = pytest.mark.redis
PREFIX = "faults:"
DEADLINE = 20.0


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
