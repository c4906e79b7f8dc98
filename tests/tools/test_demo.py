"""``quota demo`` on a live database touches only its own rows, and leaves none behind.

The demo runs on a simulated clock ahead of real time. Its cleanup once was a
global ``cleanup(grace=0)`` on that clock: it deleted other clients' windows that
had ended, and even windows still running for another minute in real time.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from click.testing import CliRunner

import quota
from quota._cli import main

pytestmark = pytest.mark.postgres

LIVE = "client:live"  # a window running for the next minute or less
LONG = "client:long"  # a window running for the next hour
ENDED = "client:ended"  # a window that ended a few seconds ago
BUCKET = "client:bucket"  # token-bucket state


def _rows(url: str) -> list[tuple[Any, ...]]:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        counters = conn.execute(
            "SELECT bucket_key, client_key, window_start, window_seconds, count"
            " FROM quota_counters ORDER BY bucket_key"
        ).fetchall()
        state = conn.execute(
            "SELECT bucket_key, client_key, window_seconds, value, stamp, expires_at"
            " FROM quota_state ORDER BY bucket_key"
        ).fetchall()
        usage = conn.execute("SELECT subject, name, used FROM quota_usage").fetchall()
        ledger = conn.execute("SELECT subject, name, kind FROM quota_ledger").fetchall()
    return (
        [("counters", *r) for r in counters]
        + [("state", *r) for r in state]
        + [("usage", *r) for r in usage]
        + [("ledger", *r) for r in ledger]
    )


def _other_clients(url: str) -> None:
    now = time.time()
    with quota.connect(url) as limiter:
        for _ in range(3):
            limiter.rate_limit(LIVE, 100, 60)
            limiter.rate_limit(LONG, 100, 3600)
            limiter.hit(BUCKET, "10/s burst 20")
    # A window that ended 10 to 70 seconds ago: a cleanup with the default grace keeps it.
    with quota.connect(url, clock=lambda: now - 70) as limiter:
        limiter.rate_limit(ENDED, 100, 60)


def test_the_demo_leaves_other_clients_counters_alone_and_nothing_of_its_own(
    pg_clean_url: str,
) -> None:
    _other_clients(pg_clean_url)
    before = _rows(pg_clean_url)
    keys = {row[2] for row in before}
    assert {f"k:{k}" for k in (LIVE, LONG, ENDED, BUCKET)} <= keys

    result = CliRunner().invoke(main, ["--url", pg_clean_url, "demo"])

    assert result.exit_code == 0, result.output
    assert "leaked key" in result.output and "denied" in result.output
    assert _rows(pg_clean_url) == before


def test_the_demo_never_prints_the_password(pg_clean_url: str) -> None:
    from urllib.parse import urlsplit

    parts = urlsplit(pg_clean_url)
    with_password = parts._replace(
        netloc=f"{parts.username or 'root'}:not-the-password@{parts.hostname}:{parts.port or 5432}"
    ).geturl()
    lines: list[str] = []
    from quota._tools.demo import run_demo

    run_demo(with_password, echo=lines.append)  # trust auth: any password is accepted
    assert not any("not-the-password" in line for line in lines), lines


def test_the_demo_cleans_up_after_itself_when_run_twice(pg_clean_url: str) -> None:
    runner = CliRunner()
    for _ in range(2):
        result = runner.invoke(main, ["--url", pg_clean_url, "demo", "--clients", "3"])
        assert result.exit_code == 0, result.output
    left = _rows(pg_clean_url)
    assert [row for row in left if row[0] in ("counters", "state")] == []
    assert not [row for row in left if "demo" in str(row)]
