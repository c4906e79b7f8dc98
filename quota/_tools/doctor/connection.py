"""Opening the database as the limiter would: the ``connectivity`` findings (and, for a
PostgreSQL server that refuses writes, ``standby`` or ``read_only``), and the `Session`
the other checks run on."""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from quota._core.url import StoreURL
from quota._tools.doctor.base import (
    ERROR,
    OK,
    Clock,
    Finding,
    Session,
    display_url,
    migrate_command,
)
from quota._tools.doctor.sqlite import sqlite_version_finding

Opened = Iterator[tuple[list[Finding], Session | None]]


@contextmanager
def connect_sqlite(parsed: StoreURL, clock: Clock, timeout: float) -> Opened:
    """The ``sqlite_version`` and ``connectivity`` findings, and a session on the file
    unless it cannot be opened for writing (closed on exit). Never creates the file."""
    findings = [sqlite_version_finding(sqlite3.sqlite_version_info, sqlite3.sqlite_version)]
    path = Path(parsed.target).absolute()
    shown = display_url(parsed.url)
    if not path.exists():
        findings.append(
            Finding(
                "connectivity", ERROR, f"no SQLite database at {path}",
                f"create it with `{migrate_command(shown)}` (check the path if one was expected)",
            )
        )  # fmt: skip
        yield findings, None
        return
    try:
        # mode=rw: never create the file; open it as the limiter would, for writing.
        conn = sqlite3.connect(
            f"{path.as_uri()}?mode=rw", uri=True, timeout=timeout, isolation_level=None
        )
        conn.execute("SELECT count(*) FROM sqlite_master").fetchall()
    except sqlite3.Error as exc:
        findings.append(
            Finding(
                "connectivity", ERROR, f"cannot open {path} for writing: {exc}",
                "check that the file is a SQLite database and that this user may write the file"
                " and its directory (SQLite creates -wal and -shm files beside it)",
            )
        )  # fmt: skip
        yield findings, None
        return
    try:

        def query(sql: str) -> Sequence[Sequence[Any]]:
            return conn.execute(sql).fetchall()

        if os.access(path, os.W_OK) and os.access(path.parent, os.W_OK):
            findings.append(Finding("connectivity", OK, f"opened {path}"))
        else:
            findings.append(
                Finding(
                    "connectivity", ERROR, f"{path} or its directory is read-only for this user",
                    "let the app's user write the file and its directory; every decision writes",
                )
            )  # fmt: skip
        yield findings, Session("sqlite", shown, query, clock, path)
    finally:
        conn.close()


@contextmanager
def connect_postgres(parsed: StoreURL, clock: Clock, timeout: float) -> Opened:
    """The ``connectivity`` finding (and ``standby`` or ``read_only``), and a session in
    one transaction unless the server cannot be reached (closed on exit)."""
    shown = display_url(parsed.url)
    try:
        import psycopg
    except ImportError:
        yield [
            Finding(
                "connectivity", ERROR, "psycopg 3 is not installed (the sync PostgreSQL driver)",
                "pip install 'quota[postgres]'",
            )
        ], None  # fmt: skip
        return
    try:
        conn = _pg_connect(psycopg, parsed, timeout)
    except Exception as exc:
        yield [
            Finding(
                "connectivity", ERROR, f"cannot connect to {shown}: {' '.join(str(exc).split())}",
                "check host, port, database name and credentials, and that the server is up"
                " (`pg_isready -h HOST -p PORT`)",
            )
        ], None  # fmt: skip
        return
    try:

        def query(sql: str, params: Sequence[Any] = ()) -> Sequence[Sequence[Any]]:
            with conn.transaction():  # a savepoint: a failing check leaves the others be
                return conn.execute(sql, params).fetchall()

        yield _pg_session_findings(query), Session("postgresql", shown, query, clock)
    finally:
        conn.close()


def _pg_connect(psycopg: Any, parsed: StoreURL, timeout: float) -> Any:
    """A psycopg connection in a transaction with its time budget."""
    # One transaction for every check, its time budget SET LOCAL: nothing is sent
    # at startup or left on the session (a transaction pooler refuses the one and
    # would hand the other to its next client); no statement is prepared by name.
    conn = psycopg.connect(
        parsed.target, autocommit=False, connect_timeout=max(1, round(timeout)),
        prepare_threshold=None,
    )  # fmt: skip
    conn.execute("SELECT set_config('statement_timeout', %s, true)", (str(int(timeout * 1000)),))
    if parsed.schema:  # ?schema=NAME: look where the stores look
        conn.execute("SELECT set_config('search_path', %s, true)", (f'"{parsed.schema}"',))
    return conn


def _pg_session_findings(query: Any) -> list[Finding]:
    """``connectivity`` (whom and where), then ``standby`` or ``read_only`` when the
    session cannot write."""
    version, user, database, standby, read_only = query(
        "SELECT current_setting('server_version'), current_user, current_database(),"
        " pg_is_in_recovery(), current_setting('transaction_read_only')"
    )[0]
    findings = [
        Finding(
            "connectivity", OK, f"connected to PostgreSQL {version} as {user}, database {database}"
        )
    ]
    if standby:
        findings.append(
            Finding(
                "standby", ERROR, "this server is a read-only standby; every decision writes",
                "point the URL at the primary",
            )
        )  # fmt: skip
    elif read_only == "on":
        findings.append(read_only_finding(user, database))
    return findings


def read_only_finding(user: str, database: str) -> Finding:
    """The error of a session that starts read-only on a primary (the role's or the
    database's ``default_transaction_read_only``): every decision writes."""
    return Finding(
        "read_only", ERROR,
        f"sessions of role {user} on database {database} are read-only"
        " (default_transaction_read_only is on); every decision writes, so each one fails",
        f'ALTER ROLE "{user}" SET default_transaction_read_only = off (or ALTER DATABASE'
        f' "{database}" RESET default_transaction_read_only, wherever it was set), or connect'
        " as a role that may write",
    )  # fmt: skip
