"""``manage.py quota …`` and ``manage.py quota_cleanup``: quota's command line on the
project's database, with quota's exit codes."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import pytest
from django.core.management import call_command

from quota.contrib.django import get_limiter

pytestmark = pytest.mark.usefixtures("quota_db")


@pytest.fixture
def now(django_clock: Any) -> float:
    """The limiters' clock at the real time: the command line reads the real one."""
    django_clock.now = time.time()
    return float(django_clock.now)


def run(*args: str) -> int:
    """``call_command``, returning the exit code (0 when it returns)."""
    try:
        call_command(*args)
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0


def test_peek_reset_and_their_exit_codes(now: float, capsys: pytest.CaptureFixture[str]) -> None:
    key = f"cmd-{uuid.uuid4().hex}"
    assert get_limiter().rate_limit(key, 1, 60).allowed
    assert run("quota", "peek", key, "--limit", "1", "--window", "60") == 4  # denied
    assert run("quota", "reset", key) == 0
    assert run("quota", "peek", key, "--limit", "1", "--window", "60") == 0
    capsys.readouterr()


def test_top_lists_the_keys_counted_in_django(
    now: float, capsys: pytest.CaptureFixture[str]
) -> None:
    key = f"top-{uuid.uuid4().hex}"
    for _ in range(3):
        get_limiter().rate_limit(key, 10, 3600)
    capsys.readouterr()
    assert run("quota", "top", "-n", "1000", "--json") == 0
    listed = {row["key"]: row["count"] for row in json.loads(capsys.readouterr().out)}
    assert listed[key] == 3


def test_usage_shows_durable_quotas(now: float, capsys: pytest.CaptureFixture[str]) -> None:
    subject = f"user-{uuid.uuid4().hex}"
    decision = get_limiter().consume_quota(subject, "api-calls", 1000, "month", cost=5)
    assert decision.allowed
    capsys.readouterr()
    assert run("quota", "usage", subject, "--json") == 0
    out = capsys.readouterr().out
    assert "api-calls" in out and '"used": 5' in out


def test_doctor_and_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert run("quota", "doctor") == 0
    assert run("quota", "no-such-command") == 2
    assert run("quota") == 0  # the help
    assert "Usage: manage.py quota" in capsys.readouterr().out


def test_cleanup_deletes_ended_windows(
    django_clock: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    django_clock.now = 1_000_000_000.0  # long ago: the windows have ended
    key = f"old-{uuid.uuid4().hex}"
    get_limiter().rate_limit(key, 5, 60)
    capsys.readouterr()
    assert run("quota_cleanup", "--dry-run", "--json") == 0
    assert json.loads(capsys.readouterr().out)["expired"] >= 1
    assert get_limiter().peek(key, 5, 60).count == 1
    assert run("quota_cleanup", "--json", "--grace", "0") == 0
    assert json.loads(capsys.readouterr().out)["deleted"] >= 1
    assert get_limiter().peek(key, 5, 60).count == 0


def test_cleanup_every_is_checked_like_quota_cleanup(capsys: pytest.CaptureFixture[str]) -> None:
    assert run("quota_cleanup", "--every", "0") == 2
    assert "--every" in capsys.readouterr().err
