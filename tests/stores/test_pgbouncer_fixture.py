"""The PgBouncer fixtures work with the bare drivers, and leave no PgBouncer behind.

The leak test is the control for the stores' own PgBouncer tests: through one shared
server connection in transaction mode, a session ``SET`` by one client IS seen by the
next, so a store that sets anything for the session would leak it to other clients.
"""

from __future__ import annotations

import asyncio
import os
import socket
import tempfile
from typing import Any
from urllib.parse import urlsplit

import psycopg
import pytest

from tests import _pgbouncer
from tests._pgbouncer import running_pgbouncer

pytestmark = pytest.mark.postgres


def connect(url: str) -> psycopg.Connection[tuple[object, ...]]:
    # No server-side prepared statements: PgBouncer 1.18 cannot route them in
    # transaction mode.
    return psycopg.connect(url, autocommit=True, prepare_threshold=None, connect_timeout=10)


def test_psycopg_through_the_transaction_bouncer(pgbouncer_txn_url: str) -> None:
    with connect(pgbouncer_txn_url) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)
        row = conn.execute("SELECT current_database(), inet_server_port()").fetchone()
    assert row == (urlsplit(pgbouncer_txn_url).path.lstrip("/"), 5432)


def test_asyncpg_through_the_transaction_bouncer(pgbouncer_txn_url: str) -> None:
    import asyncpg

    async def select_1() -> object:
        conn = await asyncpg.connect(pgbouncer_txn_url, statement_cache_size=0, timeout=10)
        try:
            return await conn.fetchval("SELECT 1")
        finally:
            await conn.close()

    assert asyncio.run(select_1()) == 1


def test_psycopg_through_the_session_bouncer(pgbouncer_session_url: str) -> None:
    with connect(pgbouncer_session_url) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)
        # Session mode: one server connection for the client's whole session.
        pid = conn.execute("SELECT pg_backend_pid()").fetchone()
        assert conn.execute("SELECT pg_backend_pid()").fetchone() == pid


def test_the_single_bouncer_serves_every_client_from_one_backend(
    pgbouncer_single_txn_url: str,
) -> None:
    with connect(pgbouncer_single_txn_url) as a, connect(pgbouncer_single_txn_url) as b:
        pid_a = a.execute("SELECT pg_backend_pid()").fetchone()
        pid_b = b.execute("SELECT pg_backend_pid()").fetchone()
        assert pid_a == a.execute("SELECT pg_backend_pid()").fetchone()
    assert pid_a == pid_b


def test_a_session_set_leaks_to_the_next_client(pgbouncer_single_txn_url: str) -> None:
    with connect(pgbouncer_single_txn_url) as a, connect(pgbouncer_single_txn_url) as b:
        assert b.execute("SHOW lock_timeout").fetchone() != ("1234ms",)
        a.execute("SET lock_timeout = '1234ms'")
        # Transaction mode runs no server_reset_query between clients: B inherits A's SET.
        assert b.execute("SHOW lock_timeout").fetchone() == ("1234ms",)


def _assert_gone(bouncer: _pgbouncer.PgBouncer) -> None:
    assert bouncer.process.returncode is not None  # exited, and reaped
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", bouncer.port), timeout=1).close()
    assert not bouncer.directory.exists()
    assert bouncer not in _pgbouncer._LIVE


def _server(pg_url: str) -> dict[str, object]:
    parts = urlsplit(pg_url)
    return {"server_host": parts.hostname or "127.0.0.1", "server_port": parts.port or 5432}


def test_a_stopped_bouncer_is_gone(pg_url: str, pgbouncer_binary: str) -> None:
    database = urlsplit(pg_url).path.lstrip("/")
    with running_pgbouncer(binary=pgbouncer_binary, **_server(pg_url)) as bouncer:
        with connect(bouncer.url(database)) as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)
        assert bouncer.process.poll() is None
        assert bouncer in _pgbouncer._LIVE
    _assert_gone(bouncer)
    bouncer.stop()  # again: nothing to do


def test_a_bouncer_is_stopped_when_the_test_fails(pg_url: str, pgbouncer_binary: str) -> None:
    with (
        pytest.raises(RuntimeError, match="the test failed"),
        running_pgbouncer(binary=pgbouncer_binary, **_server(pg_url)) as bouncer,
    ):
        raise RuntimeError("the test failed")
    _assert_gone(bouncer)


def test_a_bouncer_that_cannot_start_says_why_and_leaves_nothing(
    pgbouncer_binary: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = _pgbouncer._config
    monkeypatch.setattr(
        _pgbouncer, "_config", lambda *a, **k: config(*a, **k) + "no_such_setting = 1\n"
    )
    directories: list[str] = []
    mkdtemp = tempfile.mkdtemp

    def recording_mkdtemp(*args: Any, **kwargs: Any) -> str:
        directories.append(mkdtemp(*args, **kwargs))
        return directories[-1]

    monkeypatch.setattr(tempfile, "mkdtemp", recording_mkdtemp)
    live = set(_pgbouncer._LIVE)
    with pytest.raises(_pgbouncer.PgBouncerError, match=r"(?s)exited.*no_such_setting"):
        _pgbouncer.start_pgbouncer(binary=pgbouncer_binary)
    assert set(_pgbouncer._LIVE) == live
    assert len(directories) == 1
    assert not os.path.exists(directories[0])
