"""The async SQLite store and the end of its event loop.

aiosqlite's worker thread hands each result to the loop that asked for it;
handed to a loop closed meanwhile, the worker dies of "Event loop is closed".
So nothing the store gives the worker may still be running when the call that
gave it has returned and the store is closed: not a failed or cancelled
opening, not the worker's stop.
"""

from __future__ import annotations

import asyncio
import sqlite3
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import quota
from quota._core.errors import StorageError
from quota._sql import statements as _sql
from quota._stores.sqlite import AsyncSQLiteStore

WORKER = "_connection_worker_thread"


@pytest.fixture
def thread_errors(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[BaseException | None]]:
    """Exceptions that ended a thread during the test (`threading.excepthook`)."""
    errors: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: errors.append(args.exc_value))
    yield errors


def _workers(before: set[threading.Thread]) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t not in before and WORKER in t.name]


def _join(workers: list[threading.Thread]) -> None:
    for worker in workers:
        worker.join(10)
        assert not worker.is_alive(), "the worker did not stop"


def _store(path: Path) -> AsyncSQLiteStore:
    return AsyncSQLiteStore(str(path), f"sqlite:///{path}")


def _hold_worker_connect(
    monkeypatch: pytest.MonkeyPatch,
) -> tuple[threading.Event, threading.Event]:
    """Make the worker's connect wait for `release`; `entered` is set once it waits."""
    entered, release = threading.Event(), threading.Event()
    connect: Callable[..., sqlite3.Connection] = sqlite3.connect

    def held(*args: Any, **kwargs: Any) -> sqlite3.Connection:
        if WORKER in threading.current_thread().name:
            entered.set()
            assert release.wait(10), "never released"
        return connect(*args, **kwargs)

    monkeypatch.setattr(sqlite3, "connect", held)
    return entered, release


def test_a_call_cancelled_while_connecting_waits_for_the_connection(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, thread_errors: list[BaseException | None]
) -> None:
    path = tmp_path / "quota.db"
    quota.migrate(f"sqlite:///{path}")
    before = set(threading.enumerate())
    entered, release = _hold_worker_connect(monkeypatch)
    store = _store(path)
    loop = asyncio.new_event_loop()
    try:
        call = loop.create_task(store.execute(_sql.SCHEMA_VERSION, ()))
        assert loop.run_until_complete(asyncio.to_thread(entered.wait, 10))
        call.cancel()
        # The connect goes on only if the call is still waiting for it once the
        # cancellation has reached it; a call that returned at once leaves it held.
        loop.call_soon(lambda: call.done() or release.set())
        loop.run_until_complete(asyncio.wait({call}))
        assert call.cancelled()
        loop.run_until_complete(store.aclose())
        loop.run_until_complete(loop.shutdown_default_executor())
    finally:
        loop.close()
        release.set()  # the loop is closed: whatever the worker hands it now is lost
    _join(_workers(before))
    assert thread_errors == []


def test_a_cancelled_call_keeps_the_connection_it_was_opening(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, thread_errors: list[BaseException | None]
) -> None:
    path = tmp_path / "quota.db"
    quota.migrate(f"sqlite:///{path}")
    before = set(threading.enumerate())
    entered, release = _hold_worker_connect(monkeypatch)
    store = _store(path)

    async def main() -> list[Any]:
        call = asyncio.create_task(store.execute(_sql.SCHEMA_VERSION, ()))
        assert await asyncio.to_thread(entered.wait, 10)
        call.cancel()
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await call
        connected = store._conn
        try:
            assert connected is not None, "the connection opened was dropped"
            rows = await store.execute(_sql.SCHEMA_VERSION, ())
            assert store._conn is connected, "a second connection was opened"
            return list(rows)
        finally:
            await store.aclose()

    assert asyncio.run(main())
    _join(_workers(before))
    assert thread_errors == []


def test_closing_while_another_task_opens_closes_the_connection_it_opens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, thread_errors: list[BaseException | None]
) -> None:
    path = tmp_path / "quota.db"
    quota.migrate(f"sqlite:///{path}")
    before = set(threading.enumerate())
    entered, release = _hold_worker_connect(monkeypatch)
    store = _store(path)

    async def main() -> None:
        call = asyncio.create_task(store.execute(_sql.SCHEMA_VERSION, ()))
        assert await asyncio.to_thread(entered.wait, 10)
        closing = asyncio.create_task(store.aclose())
        await asyncio.sleep(0)  # a loop turn: aclose starts while the connect is held
        release.set()
        await asyncio.gather(call, closing)
        assert store._conn is None and store._inline is None, "left open after aclose"

    asyncio.run(main())
    _join(_workers(before))
    assert thread_errors == []


def test_a_failed_open_returns_once_the_worker_has_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, thread_errors: list[BaseException | None]
) -> None:
    """aiosqlite stops its worker when connecting fails; the failed call waits for that."""
    before = set(threading.enumerate())
    (tmp_path / "a-directory").mkdir()
    store = _store(tmp_path / "a-directory")  # exists, and SQLite cannot open it
    loop = asyncio.new_event_loop()
    handed: list[str] = []  # what the worker hands the loop, as it does
    hand = loop.call_soon_threadsafe

    def recorded(callback: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        handed.append(getattr(callback, "__name__", repr(callback)))
        return hand(callback, *args, **kwargs)

    monkeypatch.setattr(loop, "call_soon_threadsafe", recorded)
    # The loop's thread keeps the GIL until it waits for something: the
    # worker cannot stop behind its back between the failure and the return.
    interval = sys.getswitchinterval()
    sys.setswitchinterval(5.0)

    async def call() -> list[str]:
        with pytest.raises(StorageError, match="unable to open"):
            await store.execute(_sql.SCHEMA_VERSION, ())
        return list(handed)

    try:
        at_return = loop.run_until_complete(call())
    finally:
        sys.setswitchinterval(interval)
        loop.close()
    _join(_workers(before))
    assert at_return == handed, "the worker handed the loop more after the call returned"
    assert thread_errors == []
