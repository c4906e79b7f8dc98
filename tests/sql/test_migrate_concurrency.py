"""Several instances migrating one fresh database at once: every run exits 0, one schema.

Each run is a real `quota migrate` process, started together, as a deploy that runs the
migration in every instance (or `uvicorn --workers 4` with migrations at startup) does.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

import quota
from quota._sql.schema import REVISIONS

RUNS = 8


def _migrate_together(url: str) -> list[subprocess.CompletedProcess[str]]:
    command = [sys.executable, "-c", "from quota._cli import main; main()", "migrate", "--url", url]
    processes = [
        subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(RUNS)
    ]
    done = []
    for process in processes:
        out, err = process.communicate(timeout=120)
        done.append(subprocess.CompletedProcess(command, process.returncode, out, err))
    return done


def _check(url: str, results: list[subprocess.CompletedProcess[str]]) -> None:
    failed = [r.stderr[-2000:] for r in results if r.returncode != 0]
    assert not failed, failed
    assert quota.current_revision(url) == REVISIONS[-1]
    with quota.connect(url) as limiter:
        assert limiter.rate_limit("after-migrate", 1, 60).allowed
        assert limiter.consume_quota("s", "n", 5, "day").allowed


@pytest.mark.postgres
@pytest.mark.parametrize("round_", range(2))
def test_concurrent_migrations_on_a_fresh_postgres_database(
    pg_make_database: Callable[[], str], round_: int
) -> None:
    url = pg_make_database()
    _check(url, _migrate_together(url))


@pytest.mark.parametrize("round_", range(2))
def test_concurrent_migrations_on_a_fresh_sqlite_file(tmp_path: Path, round_: int) -> None:
    url = f"sqlite:///{tmp_path / 'fresh.db'}"
    _check(url, _migrate_together(url))


@pytest.mark.postgres
def test_example_workers_starting_together_on_a_fresh_database(
    pg_make_database: Callable[[], str],
) -> None:
    """The Flask example migrates when it is imported, as each of `gunicorn -w 4`'s workers
    does: four at once on a fresh database all start."""
    import os

    url = pg_make_database()
    env = {**os.environ, "QUOTA_DATABASE_URL": url, "QUOTA_HASH_SECRET": "x" * 32}
    root = Path(__file__).resolve().parents[2]
    command = [sys.executable, "-c", "import examples.flask_app"]
    workers = [
        subprocess.Popen(command, cwd=root, env=env, stderr=subprocess.PIPE, text=True)
        for _ in range(4)
    ]
    errors = [w.communicate(timeout=120)[1] for w in workers]
    assert [w.returncode for w in workers] == [0, 0, 0, 0], errors
    assert quota.current_revision(url) == REVISIONS[-1]
