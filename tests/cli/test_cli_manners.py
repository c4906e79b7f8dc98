"""Small manners of the ``quota`` command: a closed pipe is a quiet exit on every command,
``bench`` leaves no rows behind, ``peek`` reads a key without knowing its limit, and a
long key is shown cut."""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import click
import pytest

import quota
from tests.cli.test_cli_habits import ARGS, SERVING, _invoke, run

BROKEN_PIPE = 141


# -- a closed pipe ----------------------------------------------------------------------------


def test_demo_into_head_exits_quietly(tmp_path: Path) -> None:
    """``quota demo | head -1``: the reader goes after one line; no traceback, no exit 1,
    and the demo still removes its own rows."""
    url = f"sqlite:///{tmp_path / 'demo.sqlite3'}"
    env = {**os.environ, "QUOTA_DATABASE_URL": url}
    proc = subprocess.Popen(
        [sys.executable, "-c", "from quota._cli import main; main()", "demo"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stderr is not None
    first = proc.stdout.readline()
    proc.stdout.close()  # as `head -1` does once it has its line
    try:
        err = proc.stderr.read()
        code = proc.wait(timeout=60)
    finally:
        proc.kill()
        proc.stderr.close()
    assert first.startswith(b"database: ")
    assert (code, err) == (BROKEN_PIPE, b"")
    with quota.connect(url) as limiter:
        assert limiter.top(10) == []


# (``export`` writes its records straight to the stream, not through click.echo: its
# closed pipe is tested for real in tests/cli/test_export_cli.py.)
@pytest.mark.parametrize("command", sorted(set(ARGS) - {"export"} - SERVING))
def test_every_command_exits_141_when_its_output_pipe_closes(
    command: str, sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def closed(*_args: Any, **_kwargs: Any) -> None:
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(click, "echo", closed)
    result = _invoke(command, sqlite_url)
    assert result.exit_code == BROKEN_PIPE, (result.exit_code, result.exception)


# -- bench cleans up --------------------------------------------------------------------------


def test_bench_leaves_none_of_its_keys_behind(sql_url: str) -> None:
    with quota.connect(sql_url) as limiter:
        limiter.rate_limit("someone", 10, 3600)
    result = run("bench", "-d", "0.1", "-r", "1", "-c", "1", "-k", "50", "--url", sql_url)
    assert result.exit_code == 0, result.output
    with quota.connect(sql_url) as limiter:
        assert [u.key for u in limiter.top(100)] == ["someone"]  # only what was there before


def test_bench_of_another_algorithm_leaves_no_state_either(sqlite_url: str) -> None:
    args = ["bench", "-d", "0.1", "-r", "1", "-c", "1", "-k", "20", "--algorithm", "gcra"]
    assert run(*args, "--url", sqlite_url).exit_code == 0
    path = sqlite_url.removeprefix("sqlite:///")
    with contextlib.closing(sqlite3.connect(path)) as conn:
        assert conn.execute("SELECT count(*) FROM quota_state").fetchone() == (0,)


@pytest.mark.parametrize("scenario", ["quota", "check"])
def test_bench_of_quotas_leaves_no_usage_or_ledger_rows(sqlite_url: str, scenario: str) -> None:
    with quota.connect(sqlite_url) as limiter:
        limiter.consume_quota("bench:1", "other", limit=5, period="day")  # not the bench's
    args = ["bench", "-d", "0.1", "-r", "1", "-c", "1", "-k", "20", "--scenario", scenario]
    result = run(*args, "--url", sqlite_url)
    assert result.exit_code == 0, result.output
    path = sqlite_url.removeprefix("sqlite:///")
    with contextlib.closing(sqlite3.connect(path)) as conn:
        for table in ("quota_counters", "quota_state", "quota_usage", "quota_ledger"):
            names = conn.execute(f"SELECT * FROM {table}").fetchall()
            assert all("other" in row for row in names), (table, names[:3])


# -- peek without a limit -----------------------------------------------------------------------


def test_peek_without_limit_lists_the_windows_the_key_has(sql_url: str) -> None:
    with quota.connect(sql_url) as limiter:
        for _ in range(3):
            limiter.rate_limit("alice", 10, 60)
        limiter.rate_limit("alice", 100, 3600)
        limiter.rate_limit("bob", 10, 60)
    text = run("peek", "alice", "--url", sql_url)
    assert text.exit_code == 0, text.output
    lines = text.stdout.splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("'alice': 3 hit(s) in a 1m window, resets in ")
    assert lines[1].startswith("'alice': 1 hit(s) in a 1h window, resets in ")
    data = json.loads(run("peek", "alice", "--json", "--url", sql_url).stdout)
    assert [(d["key"], d["window"], d["count"]) for d in data] == [
        ("alice", 60, 3),
        ("alice", 3600, 1),
    ]
    none = run("peek", "carol", "--url", sql_url)
    assert (none.exit_code, none.stdout.strip()) == (0, "'carol': no window running")


def test_peek_needs_limit_and_window_together(sqlite_url: str) -> None:
    result = run("peek", "alice", "--limit", "3", "--url", sqlite_url)
    assert result.exit_code == 2
    assert "--limit and --window together" in result.output


def test_peek_with_limit_and_window_is_unchanged(sqlite_url: str) -> None:
    run("hit", "alice", "-l", "1", "-w", "60", "--url", sqlite_url)
    result = run("peek", "alice", "-l", "1", "-w", "60", "--url", sqlite_url)
    assert result.exit_code == 4, result.output


# -- long keys ---------------------------------------------------------------------------------


def test_a_long_key_is_shown_cut_with_its_length(sqlite_url: str) -> None:
    key = "x" * 100_000
    result = run("hit", key, "-l", "5", "-w", "60", "--url", sqlite_url)
    assert result.exit_code == 0
    first = result.stdout.splitlines()[0]
    assert len(first) < 300, len(first)
    assert "… (100,000 characters)" in first
    assert json.loads(run("hit", key, "-l", "5", "-w", "60", "--json", "--url", sqlite_url)
                      .stdout)["key"] == key  # fmt: skip
    assert len(run("peek", key, "--url", sqlite_url).stdout) < 300
    assert len(run("reset", key, "--url", sqlite_url).stdout) < 300
