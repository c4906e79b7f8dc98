"""``quota export``: JSON lines and CSV that parse back to what `limiter.export` yields.

Through click's runner on SQLite and PostgreSQL, once as the installed ``quota``
command, and once on a million ledger entries, measuring the peak memory of the
process that exports them.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

import quota
from quota._cli import main
from tests.limiter.test_quotas import _truncate

DAY = 86400
#: Midnight UTC, 2025-06-16.
MIDNIGHT = 1_750_032_000
RANGE = ["--from", "2025-06-16", "--to", "2025-06-19"]


def run(url: str, *args: str) -> Result:
    return CliRunner().invoke(
        main, ["export", "--url", url, *args], env={"QUOTA_DATABASE_URL": None}
    )


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def fill(url: str) -> list[dict[str, Any]]:
    """Charges, a denial, a refund and a grant over three days; what the library exports."""
    clock = Clock(MIDNIGHT + 0.25)
    with quota.connect(url, clock=clock, pool_size=1) as limiter:
        for day in range(3):
            clock.now = MIDNIGHT + day * DAY + 0.25
            for i in range(4):
                for subject in ("alice", "bob", 'zoë, "the" tester'):
                    limiter.consume_quota(
                        subject, "llm", 6, "day", cost=2, idempotency_key=f"{day}-{i}"
                    )
                clock.now += 3600
            limiter.refund_quota("alice", "llm", f"{day}-0")
            limiter.grant_quota("bob", "llm", 3, "day")
        return [
            r.as_dict()
            for r in limiter.export(MIDNIGHT, MIDNIGHT + 3 * DAY, ledger=True, batch_size=7)
        ]


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def url(request: pytest.FixtureRequest) -> str:
    """A migrated, empty SQLite file or PostgreSQL database."""
    return str(
        request.getfixturevalue("sqlite_url" if request.param == "sqlite" else "pg_store_url")
    )


def _csv_value(value: Any) -> str:
    return "" if value is None else str(value)


def test_jsonl_parses_back_to_the_records_of_the_library(url: str) -> None:
    expected = fill(url)
    result = run(url, *RANGE, "--ledger", "--batch-size", "2")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert [json.loads(line) for line in lines] == expected
    assert {json.loads(line)["type"] for line in lines} == {"usage", "ledger"}
    assert result.stderr == ""  # no progress: stderr is no terminal
    # Totals: what each period used is what its ledger entries add up to.
    used: dict[tuple[str, int], int] = {}
    for record in map(json.loads, lines):
        if record["type"] == "ledger" and record["kind"] in ("consume", "refund"):
            sign = 1 if record["kind"] == "consume" else -1
            key = (record["subject"], record["period_start"])
            used[key] = used.get(key, 0) + sign * record["cost"]
    usage = [json.loads(line) for line in lines if json.loads(line)["type"] == "usage"]
    assert {(u["subject"], u["period_start"]): u["used"] for u in usage} == used
    assert len(usage) == 9


def test_csv_parses_back_with_a_type_column(url: str) -> None:
    expected = fill(url)
    result = run(url, *RANGE, "--ledger", "--format", "csv")
    assert result.exit_code == 0, result.output
    rows = list(csv.DictReader(io.StringIO(result.stdout)))
    header = result.stdout.splitlines()[0].split(",")
    assert header[:2] == ["type", "subject"]
    assert set(header) == set().union(*expected)
    assert rows == [{name: _csv_value(r.get(name)) for name in header} for r in expected]
    # Without --ledger: the usage columns only, and usage rows only.
    usage_only = run(url, *RANGE, "--format", "csv")
    rows = list(csv.DictReader(io.StringIO(usage_only.stdout)))
    assert {row["type"] for row in rows} == {"usage"}
    assert "kind" not in rows[0] and "id" not in rows[0]
    assert len(rows) == 9


def test_subject_and_the_range_bounds_select_as_the_library_does(url: str) -> None:
    expected = fill(url)
    alice = run(url, *RANGE, "--ledger", "--subject", "alice")
    assert [json.loads(line) for line in alice.stdout.splitlines()] == [
        r for r in expected if r["subject"] == "alice"
    ]
    # --from is included, --to excluded: the second day, given in another zone.
    second = run(url, "--from", "2025-06-17T02:00:00+02:00", "--to", "2025-06-18", "--ledger")
    records = [json.loads(line) for line in second.stdout.splitlines()]
    assert {r["period_start"] for r in records if r["type"] == "usage"} == {MIDNIGHT + DAY}
    assert [r for r in records if r["type"] == "ledger"] == [
        r
        for r in expected
        if r["type"] == "ledger" and MIDNIGHT + DAY <= r["at"] < MIDNIGHT + 2 * DAY
    ]
    # A second past midnight leaves out the day's periods (they start at midnight) and its
    # first charges (at a quarter second past): a record for each of the three subjects.
    later = run(url, "--from", "2025-06-17T00:00:01", "--to", "2025-06-18", "--ledger")
    kept = [json.loads(line) for line in later.stdout.splitlines()]
    assert kept == [r for r in records if r["type"] == "ledger" and r["at"] >= MIDNIGHT + DAY + 1]
    assert len(kept) == len(records) - 3 - 3


@pytest.mark.parametrize(
    ("args", "option", "value"),
    [
        (["--from", "2025-13-01", "--to", "2025-06-18"], "--from", "2025-13-01"),
        (["--from", "yesterday", "--to", "2025-06-18"], "--from", "yesterday"),
        (["--from", "2025-06-16", "--to", "16/06/2025"], "--to", "16/06/2025"),
        (["--from", "2025-06-16", "--to", "\u0662025-06-18"], "--to", "\u0662025-06-18"),
        (["--from", "2025-06-16", "--to", "2025-06-16"], "--to", "2025-06-16"),
        (["--from", "2025-06-17", "--to", "2025-06-16"], "--to", "2025-06-16"),
        ([*RANGE, "--format", "xml"], "--format", "xml"),
        ([*RANGE, "--batch-size", "0"], "--batch-size", "0"),
        ([*RANGE, "--batch-size", "100001"], "--batch-size", "100001"),
        ([*RANGE, "--subject", ""], "subject", "''"),
        (["--to", "2025-06-18"], "--from", ""),
    ],
)
def test_bad_arguments_are_usage_errors_naming_the_option_and_value(
    sqlite_url: str, args: list[str], option: str, value: str
) -> None:
    result = run(sqlite_url, *args)
    assert result.exit_code == 2, result.output
    assert option in result.output
    assert value in result.output
    assert "Traceback" not in result.output


def test_output_writes_a_file_that_appears_only_when_complete(
    sqlite_url: str, tmp_path: Path, memory_url: str
) -> None:
    expected = fill(sqlite_url)
    target = tmp_path / "usage.jsonl"
    result = run(sqlite_url, *RANGE, "--ledger", "--output", str(target))
    assert (result.exit_code, result.stdout) == (0, "")
    assert [json.loads(line) for line in target.read_text().splitlines()] == expected
    assert sorted(p.name for p in tmp_path.iterdir()) == ["quota.db", "usage.jsonl"]
    # A failed export leaves no file behind (nor its temporary), and an old file as it was.
    failed = tmp_path / "failed.csv"
    result = run(memory_url, *RANGE, "--output", str(failed))
    assert result.exit_code == 2 and "durable quotas" in result.output
    assert not failed.exists()
    result = run(memory_url, *RANGE, "--output", str(target))
    assert result.exit_code == 2
    assert [json.loads(line) for line in target.read_text().splitlines()] == expected
    assert sorted(p.name for p in tmp_path.iterdir()) == ["quota.db", "usage.jsonl"]
    # Through a symbolic link, the file it points to is written; the link stays.
    link = tmp_path / "link.jsonl"
    link.symlink_to(target)
    result = run(sqlite_url, *RANGE, "--subject", "bob", "--output", str(link))
    assert result.exit_code == 0 and link.is_symlink()
    assert {json.loads(line)["subject"] for line in target.read_text().splitlines()} == {"bob"}
    # A folder that does not exist is a usage error naming it.
    missing = run(sqlite_url, *RANGE, "--output", str(tmp_path / "no" / "x.csv"))
    assert missing.exit_code == 2 and "does not exist" in missing.output


def test_progress_goes_to_stderr_when_asked(sqlite_url: str) -> None:
    expected = fill(sqlite_url)
    result = run(sqlite_url, *RANGE, "--ledger", "--progress")
    assert result.exit_code == 0
    assert len(result.stdout.splitlines()) == len(expected)
    assert result.stderr == f"export: {len(expected):,} rows written\n"


def test_an_unreachable_database_is_exit_3() -> None:
    result = run("postgresql://root:sekrit@127.0.0.1:1/x", *RANGE)
    assert result.exit_code == 3, result.output
    assert "sekrit" not in result.output


# -- as a process: the installed command, and a million ledger entries ----------------------


def _quota_command() -> list[str]:
    """The installed ``quota`` script beside this interpreter."""
    script = Path(sys.executable).parent / "quota"
    if not script.exists():
        pytest.skip(f"no installed quota command at {script}")
    return [str(script)]


#: Runs the command in argv and prints its peak resident memory (KiB) on stdout. A child
#: starts out with the peak of the process it was forked from (Linux carries it through
#: exec), so the command is started by this small interpreter, not by the test's own.
_MEASURE = (
    "import resource, subprocess, sys\n"
    "code = subprocess.call(sys.argv[1:], stdout=subprocess.DEVNULL)\n"
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
    "sys.exit(code)\n"
)


def _run_measured(args: list[str], timeout: float) -> tuple[int, str, int]:
    """Run `args`: its exit code, its stderr and its peak resident memory in bytes.

    The whole process group is killed at `timeout`, and in any case at the end.
    """
    proc = subprocess.Popen(
        [sys.executable, "-I", "-c", _MEASURE, *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return proc.returncode, err, int(out.split()[-1]) * 1024


def test_the_installed_command_exports(sqlite_url: str, tmp_path: Path) -> None:
    expected = fill(sqlite_url)
    out = tmp_path / "ledger.csv"
    proc = subprocess.run(
        [*_quota_command(), "export", *RANGE, "--ledger", "--format", "csv", "--url", sqlite_url,
         "-o", str(out)],
        capture_output=True, text=True, timeout=60, start_new_session=True,
    )  # fmt: skip
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", "")
    with out.open(newline="") as stream:
        rows = list(csv.DictReader(stream))
    assert [(r["type"], r["subject"], r["id"]) for r in rows] == [
        (r["type"], r["subject"], _csv_value(r.get("id"))) for r in expected
    ]
    # To stdout, as JSON lines, and a bad date is exit 2 naming it.
    proc = subprocess.run(
        [*_quota_command(), "--url", sqlite_url, "export", *RANGE, "--subject", "bob"],
        capture_output=True, text=True, timeout=60, start_new_session=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert [json.loads(line) for line in proc.stdout.splitlines()] == [
        r for r in expected if r["subject"] == "bob" and r["type"] == "usage"
    ]
    proc = subprocess.run(
        [*_quota_command(), "--url", sqlite_url, "export", "--from", "2025-02-30", "--to", "x"],
        capture_output=True, text=True, timeout=60, start_new_session=True,
    )  # fmt: skip
    assert proc.returncode == 2 and "'--from'" in proc.stderr and "2025-02-30" in proc.stderr


def test_a_reader_that_goes_away_stops_the_export_quietly_with_141(sqlite_url: str) -> None:
    """``quota export … | head -1``: exit 141, nothing on stderr, as a Unix tool."""
    path = sqlite_url.removeprefix("sqlite:///")
    with contextlib.closing(sqlite3.connect(path)) as conn:
        series = (
            "(WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 20000)"
            " SELECT i FROM n)"
        )
        conn.execute(_LEDGER_ROWS.format(t0=MIDNIGHT, series=series))
        conn.commit()
    for fmt in ("jsonl", "csv"):
        proc = subprocess.Popen(
            [*_quota_command(), "export", *RANGE, "--ledger", "--format", fmt, "--url",
             sqlite_url],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
        )  # fmt: skip
        assert proc.stdout is not None and proc.stderr is not None
        try:
            first = proc.stdout.readline()
            proc.stdout.close()  # as `head -1` does once it has its line
            err = proc.stderr.read()
            code = proc.wait(timeout=60)
        finally:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            proc.stderr.close()
        assert first.startswith(b'{"type": "ledger"' if fmt == "jsonl" else b"type,")
        assert (code, err) == (141, b"")


#: The most memory ``quota export`` may take, whatever the size of the export.
MAX_RSS = 100 * 1024 * 1024

_LEDGER_ROWS = (
    "INSERT INTO quota_ledger (at, subject, name, kind, cost, idempotency_key, period_start,"
    " period_end, quota_limit, used, remaining)"
    " SELECT {t0} + i * 0.002, 'user-' || (i % 1000), 'llm', 'consume', 1, 'job-' || i, {t0},"
    " {t0} + 86400, 1000000, i / 1000 + 1, 1000000 - i / 1000 - 1 FROM {series}"
)


def _assert_exported_in_little_memory(url: str, rows: int) -> None:
    code, err, rss = _run_measured(
        [*_quota_command(), "export", "--url", url, "--from", "2025-06-16", "--to", "2025-06-17",
         "--ledger", "--format", "jsonl", "--output", os.devnull, "--progress"],
        timeout=90,
    )  # fmt: skip
    assert code == 0, err
    assert err.splitlines()[-1] == f"export: {rows:,} rows written"
    assert rss < MAX_RSS, f"peak RSS {rss / 2**20:.1f} MiB"


def test_a_million_ledger_entries_export_in_under_100_mb(tmp_path: Path) -> None:
    path = tmp_path / "big.db"
    url = f"sqlite:///{path}"
    quota.migrate(url)
    conn = sqlite3.connect(path)
    try:
        conn.execute("PRAGMA synchronous = OFF")
        series = (
            "(WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 1000000)"
            " SELECT i FROM n)"
        )
        conn.execute(_LEDGER_ROWS.format(t0=MIDNIGHT, series=series))
        conn.commit()
    finally:
        conn.close()
    _assert_exported_in_little_memory(url, 1_000_000)


@pytest.mark.postgres
def test_postgresql_exports_its_ledger_in_little_memory_too(pg_store_url: str) -> None:
    import psycopg

    rows = 300_000
    with psycopg.connect(pg_store_url, autocommit=True) as conn:
        series = f"generate_series(1, {rows}) AS i"
        conn.execute(_LEDGER_ROWS.format(t0=MIDNIGHT, series=series).encode())
    try:
        _assert_exported_in_little_memory(pg_store_url, rows)
    finally:
        _truncate(pg_store_url)
