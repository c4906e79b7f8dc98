"""What every ``quota`` command does alike: --url anywhere, one exit-code table, --json,
progress on long work, Ctrl-C, timestamps under --every, human-readable times, and no
SQLite file made by a command that only reads."""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner, Result

import quota
from quota._cli import main
from quota._sql import ops as _ops

SECRET = "habits-hash-secret-0123456789"

#: The least each command needs to get as far as the database.
ARGS: dict[str, list[str]] = {
    "migrate": [],
    "downgrade": ["base"],
    "hit": ["k", "-l", "1", "-w", "60"],
    "peek": ["k", "-l", "1", "-w", "60"],
    "reset": ["k"],
    "top": [],
    "cleanup": [],
    "demo": [],
    "bench": ["-d", "0.1", "-r", "1", "-c", "1", "-k", "1"],
    "doctor": ["--timeout", "2"],
    "usage": ["alice"],
    "grant": ["alice", "llm", "1", "-p", "day"],
    "refund": ["alice", "llm", "job-1"],
    "ledger": ["alice"],
    "export": ["--from", "2026-01-01", "--to", "2026-02-01"],
    "notify": ["--webhook", "http://127.0.0.1:9/", "--once"],
    "policy list": [],
    "policy set": ["api", "--rates", "5/minute"],
    "policy delete": ["api"],
    "policy multiplier": ["auth", "2"],
    "policy abuse-threshold": ["3"],
    "policy settings": [],
    "policy unset": ["abuse_threshold"],
    "dashboard": ["--insecure-local", "--port", "0"],
}
#: Commands that create or migrate the database they are given.
CREATING = {"migrate", "demo", "bench"}
#: Commands whose output a script would read as one JSON document (``--json``); ``export``
#: streams JSON lines or CSV (``--format``) instead.
SCRIPTED = set(ARGS) - {"demo", "export", "dashboard"}
#: Commands that serve until stopped once they get going (tested in tests/dashboard).
SERVING = {"dashboard"}


def _leaves(group: click.Group, prefix: str = "") -> Iterator[tuple[str, click.Command]]:
    for name, command in group.commands.items():
        if isinstance(command, click.Group):
            yield f"{prefix}{name}", command
            yield from _leaves(command, f"{prefix}{name} ")
        else:
            yield f"{prefix}{name}", command


def _commands() -> dict[str, click.Command]:
    return {name: c for name, c in _leaves(main) if not isinstance(c, click.Group)}


def run(*args: str, env: dict[str, str | None] | None = None) -> Result:
    environ: dict[str, str | None] = {"QUOTA_DATABASE_URL": None, "QUOTA_HASH_SECRET": SECRET}
    environ.update(env or {})
    return CliRunner().invoke(main, list(args), env=environ)


def _invoke(command: str, url: str, *extra: str, where: str = "after") -> Result:
    """`command` with its least arguments, the URL given before or after the command."""
    words = command.split()
    if where == "after":
        return run(*words, *ARGS[command], *extra, "--url", url)
    return run("--url", url, *words, *ARGS[command], *extra)


def test_the_table_of_commands_is_complete() -> None:
    """A new command joins the tables above, and so every test below."""
    assert set(_commands()) == set(ARGS)


# -- 5: --url after every command and subcommand ------------------------------------------


def test_every_command_and_group_takes_url() -> None:
    for name, command in _leaves(main):
        options = {opt for p in command.params for opt in getattr(p, "opts", [])}
        assert "--url" in options, name


@pytest.mark.parametrize("command", sorted(set(ARGS) - {"demo", "bench", "downgrade"} - SERVING))
def test_the_url_after_the_command_wins_over_the_one_before(command: str, sqlite_url: str) -> None:
    words = command.split()
    result = run("--url", "nosuch://wrong", *words, *ARGS[command], "--url", sqlite_url)
    assert result.exit_code in (0, 4), result.output  # 4: delete of no override


def test_the_url_after_a_command_group_works(sqlite_url: str) -> None:
    result = run("--url", "nosuch://wrong", "policy", "--url", sqlite_url, "list")
    assert (result.exit_code, result.output.strip()) == (0, "no overrides")


# -- 6: one exit-code table ---------------------------------------------------------------


def test_help_states_the_exit_codes() -> None:
    out = run("--help").output
    for code in ("0", "1", "2", "3", "4", "130", "141"):
        assert re.search(rf"^\s+{code}\s", out, re.M), (code, out)


@pytest.mark.parametrize("command", sorted(ARGS))
@pytest.mark.parametrize("url", ["nosuch://db/x", "mysql://db/app", "sqlite://"])
def test_a_bad_url_is_exit_2_on_every_command(command: str, url: str) -> None:
    for where in ("before", "after"):
        result = _invoke(command, url, where=where)
        assert result.exit_code == 2, (where, result.output)
        assert "Traceback" not in result.output


@pytest.mark.parametrize("command", sorted(ARGS))
def test_an_unreachable_database_is_exit_3_on_every_command(command: str) -> None:
    result = _invoke(command, "postgresql://root:sekrit@127.0.0.1:1/x")
    assert result.exit_code == 3, result.output
    assert "sekrit" not in result.output


# -- 8: reading commands never create a SQLite file ----------------------------------------


@pytest.mark.parametrize("command", sorted(set(ARGS) - CREATING))
def test_a_missing_sqlite_file_is_exit_3_and_stays_missing(command: str, tmp_path: Path) -> None:
    path = tmp_path / "absent.db"
    result = _invoke(command, f"sqlite:///{path}")
    assert result.exit_code == 3, result.output
    assert "migrate" in result.output
    if command != "doctor":  # doctor reports it as a finding of its own
        assert "does not exist" in result.output
    assert not path.exists()


def test_a_missing_sqlite_directory_is_exit_3_too(tmp_path: Path) -> None:
    result = run("top", "--url", f"sqlite:///{tmp_path / 'no' / 'such.db'}")
    assert result.exit_code == 3 and "does not exist" in result.output


# -- 7: --json on every command a script reads ---------------------------------------------


def test_every_scripted_command_has_json() -> None:
    commands = _commands()
    for name in SCRIPTED:
        options = {opt for p in commands[name].params for opt in getattr(p, "opts", [])}
        assert "--json" in options, name


def test_reset_migrate_downgrade_and_policy_delete_speak_json(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'j.db'}"
    migrated = run("migrate", "--url", url, "--json")
    assert migrated.exit_code == 0, migrated.output
    assert json.loads(migrated.stdout)["revision"] == quota.current_revision(url)
    run("hit", "k", "-l", "5", "-w", "60", "--url", url)
    reset = run("reset", "k", "--url", url, "--json")
    assert json.loads(reset.stdout) == {"key": "k", "window": None, "deleted": 1}

    run("policy", "set", "api", "--rates", "5/minute", "--url", url)
    gone = run("policy", "delete", "api", "--url", url, "--json")
    assert json.loads(gone.stdout) == {"route": "api", "subject": "*", "deleted": True}
    again = run("policy", "delete", "api", "--url", url, "--json")
    assert again.exit_code == 4
    assert json.loads(again.stdout) == {"route": "api", "subject": "*", "deleted": False}

    down = run("downgrade", "base", "--drop-data", "--url", url, "--json")
    assert down.exit_code == 0, down.output
    assert json.loads(down.stdout) == {"revision": None}
    assert run("migrate", "--sql", "--json", "--url", url).exit_code == 2


# -- 4: human-readable times in text, epoch seconds in JSON ---------------------------------

ISO_Z = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ"


def test_hit_peek_and_top_print_when_a_window_resets(sqlite_url: str) -> None:
    hit = run("hit", "k", "-l", "1", "-w", "1h", "--url", sqlite_url)
    assert re.search(rf"in a 1h window, 0 remaining, resets in \S+ \({ISO_Z}\)$", hit.output, re.M)
    denied = run("peek", "k", "-l", "1", "-w", "1h", "--url", sqlite_url)
    assert denied.exit_code == 4
    assert re.search(rf"resets in \S+ \({ISO_Z}\), retry in \S+", denied.output), denied.output
    top = run("top", "--url", sqlite_url).output.splitlines()
    assert top[0].split() == ["COUNT", "WINDOW", "RESETS", "IN", "RESETS", "AT", "(UTC)", "KEY"]
    assert re.fullmatch(rf"\s+1\s+1h\s+(\d+m)?(\d+s)?\s+{ISO_Z}\s+k", top[1]), top[1]
    data = json.loads(run("hit", "k", "-l", "1", "-w", "1h", "--json", "--url", sqlite_url).stdout)
    assert isinstance(data["reset_at"], int) and data["reset_at"] > time.time()


def test_usage_and_grant_print_when_a_period_resets(sqlite_url: str) -> None:
    granted = run("grant", "alice", "llm", "5", "-p", "day", "--url", sqlite_url)
    assert re.search(rf"resets in \S+ \({ISO_Z}\)", granted.output), granted.output
    usage = run("usage", "alice", "--url", sqlite_url).output.splitlines()
    assert "RESETS IN" in usage[0] and "RESETS AT (UTC)" in usage[0]
    assert re.search(rf"\s\d+[hms]\S*\s+{ISO_Z}$", usage[1]), usage[1]
    data = json.loads(run("usage", "alice", "--json", "--url", sqlite_url).stdout)
    assert isinstance(data[0]["resets_at"], int)


def test_durations_read_as_a_person_would() -> None:
    from quota._cli.main import human_duration, utc

    cases = [(0, "0s"), (42, "42s"), (72, "1m12s"), (3600, "1h"), (5400, "1h30m"), (90061, "1d1h")]
    assert [human_duration(s) for s in dict(cases)] == [text for _, text in cases]
    assert utc(0) == "1970-01-01T00:00:00Z"
    assert utc(0.25) == "1970-01-01T00:00:00.250Z"


# -- 3: --every stamps each line -----------------------------------------------------------


def _every(url: str, *args: str) -> tuple[list[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", "from quota._cli import main; main()", "cleanup", "--every", "1s",
         "--url", url, *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline(), proc.stdout.readline()]  # two sweeps, a second apart
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=10)
        assert proc.returncode == 0, err
        return lines + out.splitlines(), err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)


def test_every_prefixes_each_line_with_the_utc_time(sqlite_url: str) -> None:
    lines, err = _every(sqlite_url)
    for line in lines[:2]:
        stamp, _, rest = line.partition(" ")
        moment = dt.datetime.fromisoformat(stamp.replace("Z", "+00:00"))
        assert abs(moment.timestamp() - time.time()) < 30
        assert rest.strip() == "deleted 0 expired row(s)"
    assert re.fullmatch(rf"{ISO_Z} received SIGTERM, stopping", err.strip()), err


def test_every_with_json_prints_one_stamped_object_per_line(sqlite_url: str) -> None:
    lines, _ = _every(sqlite_url, "--json")
    for line in lines[:2]:
        data = json.loads(line)
        assert re.fullmatch(ISO_Z, data["time"]) and data["deleted"] == 0


# -- 1: cleanup: progress, and Ctrl-C says what was done -----------------------------------


def _expired_rows(url: str, n: int) -> None:
    path = url.removeprefix("sqlite:///")
    with sqlite3.connect(path) as conn:
        conn.executemany(
            "INSERT INTO quota_counters VALUES (?, ?, ?, 60, 1, 1.0)",
            ((f"60:0:k:old{i}", f"k:old{i}", 0) for i in range(n)),
        )
    conn.close()


def _left(url: str) -> int:
    with sqlite3.connect(url.removeprefix("sqlite:///")) as conn:
        (count,) = conn.execute("SELECT count(*) FROM quota_counters").fetchone()
    conn.close()
    return int(count)


def _interrupt_after(slices: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C after `slices` committed slices of the cleanup (its progress callback raises)."""
    real = _ops.cleanup

    def cleanup(*args: Any, progress: Callable[[int], None] | None = None, **kw: Any) -> Any:
        calls = [0]

        def interrupting(deleted: int) -> None:
            if progress is not None:
                progress(deleted)
            calls[0] += 1
            if calls[0] >= slices:
                raise KeyboardInterrupt

        return real(*args, progress=interrupting, **kw)

    monkeypatch.setattr(_ops, "cleanup", cleanup)


def test_ctrl_c_during_cleanup_says_how_many_rows_went_and_exits_130(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _expired_rows(sqlite_url, 2500)
    _interrupt_after(1, monkeypatch)
    result = run("cleanup", "--url", sqlite_url)
    assert result.exit_code == 130, result.output
    assert "cleanup interrupted: at least 1,000 rows deleted" in result.output
    assert "Aborted" not in result.output and "Traceback" not in result.output
    assert _left(sqlite_url) == 1500


def test_ctrl_c_elsewhere_is_exit_130_without_aborted(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupted(*_args: Any, **_kw: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(quota.Limiter, "top", interrupted)
    result = run("top", "--url", sqlite_url)
    assert result.exit_code == 130
    assert "interrupted" in result.output and "Aborted" not in result.output


def test_cleanup_progress_is_quiet_off_a_terminal_unless_asked(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys.modules["quota._cli.maintenance"], "PROGRESS_EVERY", 0.0)
    _expired_rows(sqlite_url, 2500)
    quiet = run("cleanup", "--url", sqlite_url, "--batch-size", "1000")
    assert quiet.exit_code == 0
    assert quiet.stderr == ""
    assert quiet.stdout.strip() == "deleted 2,500 expired row(s)"

    _expired_rows(sqlite_url, 2500)
    loud = run("cleanup", "--url", sqlite_url, "--progress")
    assert loud.exit_code == 0
    progress = loud.stderr.splitlines()
    assert progress == [f"cleanup: {n} rows deleted so far" for n in ("1,000", "2,000", "2,500")]
    assert loud.stdout.strip() == "deleted 2,500 expired row(s)"


def _read_until(fd: int, needle: str | None, timeout: float) -> str:
    """What a terminal at `fd` shows until `needle` appears (None: until it closes)."""
    import select

    seen, deadline = "", time.monotonic() + timeout
    while (needle is None or needle not in seen) and time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.2)
        if not ready:
            continue
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # the other end closed
            break
        if not chunk:
            break
        seen += chunk.decode(errors="replace")
    return seen


def test_a_real_sigint_stops_a_long_cleanup_on_a_terminal_with_its_count(
    sqlite_url: str,
) -> None:
    """stderr on a terminal: progress without --progress; Ctrl-C: the count, exit 130."""
    import pty

    _expired_rows(sqlite_url, 300_000)
    terminal, stderr = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-c", "from quota._cli import main; main()", "cleanup",
         "--url", sqlite_url],
        stdout=subprocess.PIPE, stderr=stderr, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    os.close(stderr)
    try:
        shown = _read_until(terminal, "rows deleted so far", timeout=30)
        assert "rows deleted so far" in shown, shown  # the sweep is under way, and says so
        proc.send_signal(signal.SIGINT)
        shown += _read_until(terminal, None, timeout=30)  # all the rest
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)
        os.close(terminal)
    assert proc.returncode == 130, (out, shown)
    match = re.search(r"cleanup interrupted: at least ([\d,]+) rows deleted", shown)
    assert match, shown
    assert "Traceback" not in shown and "Aborted" not in shown
    reported = int(match.group(1).replace(",", ""))
    gone = 300_000 - _left(sqlite_url)
    assert 0 < reported <= gone < 300_000


# -- 2: bench says what it is doing, on a terminal -------------------------------------------


def test_bench_prints_a_line_per_run_when_asked_and_none_otherwise(sqlite_url: str) -> None:
    args = ["bench", "-d", "0.1", "-r", "2", "-c", "1", "-k", "5", "--json", "--url", sqlite_url]
    quiet = run(*args)
    assert quiet.exit_code == 0, quiet.output
    assert quiet.stderr == ""
    json.loads(quiet.stdout)

    loud = run(*args, "--progress")
    assert loud.exit_code == 0, loud.output
    lines = loud.stderr.splitlines()
    runs = [line for line in lines if line.startswith("bench: run ")]
    assert len(runs) == 4, lines  # two runs, each of both sides
    assert all(re.search(r"run [12]/2: (bare|quota) .*[\d,]+/s$", line) for line in runs), runs
    json.loads(loud.stdout)


def test_sigterm_stops_a_long_every_sweep_between_batches(sqlite_url: str) -> None:
    _expired_rows(sqlite_url, 300_000)
    proc = subprocess.Popen(
        [sys.executable, "-c", "from quota._cli import main; main()", "cleanup", "--every", "1h",
         "--progress", "--url", sqlite_url],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    try:
        assert proc.stderr is not None
        first = proc.stderr.readline()
        assert "rows deleted so far" in first, first
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)
    assert proc.returncode == 0, err
    assert re.search(rf"^{ISO_Z} received SIGTERM, stopping$", err, re.M), err
    match = re.search(rf"^{ISO_Z} stopped mid-sweep: at least ([\d,]+) rows deleted$", err, re.M)
    assert match, err
    assert 0 < int(match.group(1).replace(",", "")) == 300_000 - _left(sqlite_url)
