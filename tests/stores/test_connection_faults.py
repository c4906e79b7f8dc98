"""Connections killed under load: no connection is ever used by two operations at once.

A backend terminated by the server (``pg_terminate_backend``, as a restart or a
failover does) answers its in-flight statement with an error and closes. A pool that
put such a connection back could hand it to the next caller while asyncpg was still
reading the old answer: ``InternalClientError: cannot switch to state 12; another
operation (2) is in progress``. The store must close such a connection instead.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import Iterator

import asyncpg
import pytest

import quota

pytestmark = pytest.mark.postgres


class Killer:
    """Terminates every other backend of the test database every few milliseconds."""

    def __init__(self, url: str, seconds: float) -> None:
        self.url = url
        self.seconds = seconds
        self.killed = 0
        self._thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        import psycopg

        with psycopg.connect(self.url, autocommit=True) as conn:
            deadline = time.monotonic() + self.seconds
            while time.monotonic() < deadline:
                row = conn.execute(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                    " WHERE datname = current_database() AND pid <> pg_backend_pid()"
                ).fetchone()
                self.killed += int(row[0]) if row else 0
                time.sleep(0.01)

    def __enter__(self) -> Killer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._thread.join(self.seconds + 10)


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: BaseException | None = exc
    while seen is not None:
        yield seen
        seen = seen.__cause__ or seen.__context__


@pytest.mark.parametrize("batching", [False, True], ids=["one-by-one", "batching"])
def test_killed_connections_are_never_reused_mid_operation(
    pg_clean_url: str, batching: bool, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    errors: list[BaseException] = []
    key = f"killed-{uuid.uuid4().hex}"

    async def main() -> int:
        limiter = quota.connect_async(pg_clean_url, pool_size=3, batching=batching)
        answered = 0
        try:

            async def worker(stop: float) -> None:
                nonlocal answered
                while time.monotonic() < stop:
                    try:
                        await limiter.rate_limit(key, 10**9, 3600)
                        answered += 1
                    except quota.StorageError as exc:
                        errors.append(exc)
                    except Exception as exc:  # anything else is the bug
                        errors.append(exc)
                        raise

            with Killer(pg_clean_url, seconds=1.5) as killer:
                stop = time.monotonic() + 1.5
                await asyncio.gather(*(worker(stop) for _ in range(12)))
            assert killer.killed > 0
            # Afterwards calls go through again: a connection killed just before the
            # killer stopped fails the one call it was lent to, and no more.
            failed = 0
            for _ in range(30):
                try:
                    await limiter.rate_limit(key, 10**9, 3600)
                except quota.StorageError as exc:
                    errors.append(exc)
                    failed += 1
            assert failed <= 3
        finally:
            await limiter.aclose()
        return answered

    answered = asyncio.run(main())
    assert answered > 0
    assert errors, "the killer never hit a statement in flight"
    for exc in errors:
        assert isinstance(exc, quota.StorageError), repr(exc)
        for cause in _chain(exc):
            assert not isinstance(cause, asyncpg.exceptions.InternalClientError), repr(cause)
            assert "another operation" not in str(cause), repr(cause)
    assert "another operation" not in caplog.text
