"""The core commands of the ``quota`` CLI: exit codes, JSON, the demo, cleanup --every."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner

import quota
from quota._cli import main


def _run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.output


def test_hit_exits_0_when_allowed_and_4_when_denied_with_headers(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'c.db'}"
    assert _run("--url", url, "migrate")[0] == 0
    code, out = _run("--url", url, "hit", "k", "--limit", "1", "--window", "1m")
    assert code == 0
    assert "X-RateLimit-Remaining: 0" in out
    code, out = _run("hit", "k", "--limit", "1", "--window", "60", "--json", "--url", url)
    assert code == 4
    data = json.loads(out)
    assert (data["allowed"], data["count"], data["limit"]) == (False, 2, 1)
    assert int(data["headers"]["Retry-After"]) == data["retry_after"] >= 1


def test_usage_and_database_errors_have_their_exit_codes(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'c.db'}"
    quota.migrate(url)
    code, out = _run("--url", url, "hit", "k", "--limit", "0", "--window", "60")
    assert code == 2 and "limit" in out
    code, out = _run("--url", url, "hit", "k", "--limit", "1", "--window", "fortnight")
    assert code == 2 and "window" in out
    code, out = _run("--url", "postgresql://root@127.0.0.1:1/x", "hit", "k", "-l", "1", "-w", "60")
    assert code == 3 and "Error" in out


def test_top_and_peek_and_reset(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'c.db'}"
    quota.migrate(url)
    for _ in range(3):
        _run("--url", url, "hit", "busy", "-l", "10", "-w", "1h")
    _run("--url", url, "hit", "quiet", "-l", "10", "-w", "1h")
    code, out = _run("--url", url, "top", "--json")
    assert code == 0
    assert [(u["key"], u["count"]) for u in json.loads(out)] == [("busy", 3), ("quiet", 1)]
    code, out = _run("--url", url, "peek", "busy", "-l", "3", "-w", "1h", "--json")
    assert code == 4 and json.loads(out)["count"] == 3
    code, out = _run("--url", url, "reset", "busy")
    assert code == 0 and "1 row(s)" in out
    assert _run("--url", url, "peek", "busy", "-l", "3", "-w", "1h")[0] == 0


def test_migrate_sql_prints_the_ddl_without_running_it(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'c.db'}"
    code, out = _run("--url", url, "migrate", "--sql")
    assert code == 0 and "CREATE TABLE quota_counters" in out
    assert quota.current_revision(url) is None


def test_demo_runs_on_a_fresh_database_in_seconds(tmp_path: Path) -> None:
    (tmp_path / "demo").mkdir()  # a new file, not a new directory: migrating makes none
    url = f"sqlite:///{tmp_path / 'demo' / 'q.db'}"
    started = time.monotonic()
    code, out = _run("--url", url, "demo")
    assert code == 0, out
    assert time.monotonic() - started < 10
    assert "leaked key" in out and "denied" in out
    assert "cleanup: deleted 6 ended window(s)" in out


def test_cleanup_every_stops_cleanly_on_sigterm(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'c.db'}"
    quota.migrate(url)
    proc = _every(url)
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()  # the first sweep runs at once
        assert "deleted 0 expired row(s)" in first
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        assert proc.stderr is not None
        assert "received SIGTERM, stopping" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=10)  # drains and closes both pipes


def test_the_module_level_functions_use_the_configured_database(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`quota.rate_limit` and `rate_limit_async` share one default limiter on $QUOTA_DATABASE_URL."""
    import asyncio

    from quota._limiter import default as _default

    url = f"sqlite:///{tmp_path / 'default.db'}"
    quota.migrate(url)
    monkeypatch.setenv("QUOTA_DATABASE_URL", url)
    monkeypatch.setattr(_default, "_sync", None)
    try:
        assert quota.rate_limit("k", 2, 60).allowed

        async def twice() -> list[bool]:
            allowed = [(await quota.rate_limit_async("k", 2, 60)).allowed for _ in range(2)]
            await _default.default_async_limiter().aclose()
            return allowed

        assert asyncio.run(twice()) == [True, False]  # the same counter, seen from asyncio
    finally:
        limiter = _default._sync
        if limiter is not None:
            limiter.close()


def _every(url: str) -> subprocess.Popen[str]:
    """``quota cleanup --every 1s`` on `url`, its stdout and stderr piped."""
    return subprocess.Popen(
        [sys.executable, "-c", "from quota._cli import main; main()", "--url", url,
         "cleanup", "--every", "1s"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip


def _every_until_exit(url: str, *, timeout: float) -> tuple[int | None, int | None, str]:
    """Run ``cleanup --every 1s`` on `url` for up to `timeout` seconds, then SIGTERM it.

    Returns the exit code if it exited by itself within `timeout` (else None), the exit
    code it ended with (after SIGTERM, if sent), and its stderr.
    """
    proc = subprocess.Popen(
        [sys.executable, "-c", "from quota._cli import main; main()", "--url", url,
         "cleanup", "--every", "1s"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    try:
        code: int | None = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        code = None
        proc.send_signal(signal.SIGTERM)
    finally:
        if proc.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        if proc.poll() is None:
            proc.kill()
        _, err = proc.communicate(timeout=10)
    return code, proc.returncode, err


def test_cleanup_every_on_an_unmigrated_sqlite_file_exits_3_at_once(tmp_path: Path) -> None:
    """A missing schema does not mend itself: no point retrying it every period."""
    import sqlite3

    path = tmp_path / "empty.db"
    sqlite3.connect(path).close()  # the file exists, with no quota tables
    code, _, err = _every_until_exit(f"sqlite:///{path}", timeout=30)
    assert code == 3, err
    assert "quota" in err and "migrate" in err
    assert err.count("Error:") == 1, err


@pytest.mark.postgres
def test_cleanup_every_on_an_unmigrated_postgres_database_exits_3_at_once(
    pg_make_database: Callable[[], str],
) -> None:
    code, _, err = _every_until_exit(pg_make_database(), timeout=30)
    assert code == 3, err
    assert "migrate" in err
    assert err.count("Error:") == 1, err


def test_cleanup_every_keeps_going_through_an_outage() -> None:
    """An unreachable server may come back: report each failed run, keep the schedule."""
    proc = _every("postgresql://root@127.0.0.1:1/quota")
    assert proc.stderr is not None
    seen: list[str] = []
    try:
        # Two failed runs reported (however slowly a loaded machine starts it), and still
        # running; then SIGTERM stops it cleanly.
        deadline = time.monotonic() + 60
        while sum("Error:" in line for line in seen) < 2 and time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            seen.append(line)
        assert sum("Error:" in line for line in seen) >= 2, "".join(seen)
        assert proc.poll() is None, "".join(seen)
        proc.send_signal(signal.SIGTERM)
        _, rest = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    err = "".join(seen) + rest
    assert proc.returncode == 0, err
    assert "received SIGTERM, stopping" in err


def test_cleanup_every_tells_permanent_errors_from_passing_ones() -> None:
    """A refused privilege or login stops the schedule; a lock timeout, a deadlock or a
    server restart is retried next period."""
    import sqlite3

    psycopg_errors = pytest.importorskip("psycopg.errors")
    from quota._cli.maintenance import _permanent

    def caused_by(cause: BaseException) -> quota.StorageError:
        error = quota.StorageError("PostgreSQL error")
        error.__cause__ = cause
        return error

    permanent = [
        quota.SchemaError("run quota migrate"),
        quota.ConfigurationError("bad"),
        caused_by(psycopg_errors.InsufficientPrivilege()),
        caused_by(psycopg_errors.InvalidPassword()),
        caused_by(psycopg_errors.InvalidCatalogName()),
    ]
    readonly = sqlite3.OperationalError("attempt to write a readonly database")
    readonly.sqlite_errorcode = 8  # SQLITE_READONLY
    permanent.append(caused_by(readonly))
    passing = [
        quota.StorageError("connection refused"),
        caused_by(psycopg_errors.LockNotAvailable()),
        caused_by(psycopg_errors.DeadlockDetected()),
        caused_by(psycopg_errors.AdminShutdown()),
        caused_by(psycopg_errors.QueryCanceled()),
        caused_by(sqlite3.OperationalError("database is locked")),
    ]
    assert [_permanent(e) for e in permanent] == [True] * len(permanent)
    assert [_permanent(e) for e in passing] == [False] * len(passing)
