"""The batching report is a script of the repository, no longer a `quota bench` option.

``python benchmarks/report.py DIR`` runs the grid (here: SQLite only, tiny
measurements) and writes ``report.json``; ``quota bench --report`` is gone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from quota._cli import main

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "report.py"


def test_the_report_script_writes_report_json(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k != "QUOTA_DATABASE_URL"}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(out), "-d", "0.02", "-r", "1", "--json"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    printed = json.loads(done.stdout)
    written = json.loads((out / "report.json").read_text())
    assert printed["grid"] == written["grid"]
    assert {cell["store"] for cell in written["grid"]} == {"sqlite"}
    assert {cell["side"] for cell in written["grid"]} == {"bare", "one-by-one", "batched"}
    assert written["cleanup"] == []  # PostgreSQL only
    assert "batched / bare" in written["table"]


def test_the_report_script_refuses_a_bad_option(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path), "-r", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert not (tmp_path / "report.json").exists()


def test_quota_bench_has_no_report_option(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["bench", "--report", str(tmp_path)])
    assert result.exit_code == 2
    assert "No such option '--report'" in result.output
