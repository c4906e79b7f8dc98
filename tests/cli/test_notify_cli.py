"""``quota notify``: --once with --json, the secret from the environment, SIGTERM, a
worker SIGKILLed mid-delivery whose event a restarted worker delivers, bad options,
an old schema; and ``quota cleanup`` deleting delivered events.

Workers run as real processes (``python -m``-style, through `quota._cli.main`) against a
receiver on a free loopback port (`tests._webhook_receiver`).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import pytest
from click.testing import CliRunner

import quota
from quota._cli import main
from tests import _webhook_receiver
from tests.limiter.test_quotas import db_rows

SECRET = "whsec_cli"


def _run(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, list(args), env=env)
    return result.exit_code, result.stdout, result.stderr


def _fire(url: str, subjects: int = 1) -> list[int]:
    with quota.connect(url, pool_size=1) as limiter:
        return [
            e.id
            for i in range(subjects)
            for e in limiter.consume_quota(f"s{i}", "n", 1, "day", thresholds=(1,)).fired
        ]


def _delivered(url: str) -> list[int]:
    return [
        int(r[0])
        for r in db_rows(
            url, "SELECT id FROM quota_events WHERE delivered_at IS NOT NULL ORDER BY id"
        )
    ]


@contextlib.contextmanager
def _worker(url: str, *args: str) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", "from quota._cli import main; main()", "--url", url, "notify", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=10)


def _until(done: Callable[[], bool], timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if done():
            return True
        time.sleep(0.05)
    return done()


def test_once_delivers_and_prints_json_signed_with_the_env_secret(sql_url: str) -> None:
    ids = _fire(sql_url, 3)
    with _webhook_receiver.running(SECRET) as receiver:
        code, out, err = _run(
            "--url", sql_url, "notify", "--webhook", receiver.url, "--once", "--json",
            env={"QUOTA_WEBHOOK_SECRET": SECRET},
        )  # fmt: skip
    assert code == 0, err
    assert json.loads(out) == {"claimed": 3, "delivered": 3, "failed": 0}
    assert sorted(receiver.ids()) == ids and all(receiver.signed)
    assert "delivered event" in err
    assert _delivered(sql_url) == ids


def test_once_leaves_failed_events_for_later(sql_url: str) -> None:
    _fire(sql_url)
    with _webhook_receiver.running(statuses=[500]) as receiver:
        code, out, err = _run("--url", sql_url, "notify", "--webhook", receiver.url, "--once")
    assert code == 0, err
    assert "delivered 0 event(s), 1 failed" in out
    assert "HTTP 500" in err
    assert _delivered(sql_url) == []


def test_sigterm_stops_the_worker_cleanly(sql_url: str) -> None:
    ids = _fire(sql_url, 2)
    with (
        _webhook_receiver.running() as receiver,
        _worker(sql_url, "--webhook", receiver.url) as proc,
    ):
        assert _until(lambda: sorted(receiver.delivered_ids()) == ids)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
        _, err = proc.communicate(timeout=10)
    assert "received SIGTERM, stopping" in err
    assert _delivered(sql_url) == ids


def test_a_worker_killed_mid_delivery_leaves_the_event_to_the_next(sql_url: str) -> None:
    [event_id] = _fire(sql_url)
    with _webhook_receiver.running() as receiver:
        receiver.hold = True  # the receiver takes the request and does not answer
        with _worker(
            sql_url, "--webhook", receiver.url, "--lease", "3s", "--timeout", "2s"
        ) as proc:
            assert receiver.held.wait(30), "the worker never POSTed"
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)
        receiver.hold = False
        receiver.release.set()
        assert _delivered(sql_url) == []  # killed before it could mark it
        # Another worker: nothing to claim while the dead one's lease runs, then the event.
        started = time.monotonic()
        assert _until(
            lambda: (
                _run("--url", sql_url, "notify", "--webhook", receiver.url, "--once")[0] == 0
                and _delivered(sql_url) == [event_id]
            ),
            timeout=30,
        )
    assert time.monotonic() - started < 30
    assert receiver.ids() == [event_id, event_id]  # at least once: the receiver de-duplicates


def test_bad_options_exit_2(sql_url: str) -> None:
    code, _, err = _run("--url", sql_url, "notify", "--webhook", "ftp://example.com/", "--once")
    assert code == 2 and "webhook" in err
    code, _, err = _run(
        "--url", sql_url, "notify", "--webhook", "http://127.0.0.1:9/", "--lease", "5s",
        "--timeout", "10s", "--once",
    )  # fmt: skip
    assert code == 2 and "lease" in err
    code, _, err = _run("--url", sql_url, "notify", "--once")
    assert code == 2 and "--webhook" in err


def test_an_old_schema_exits_3_saying_to_migrate(sql_database: Callable[..., str]) -> None:
    url = sql_database("0006_leases")
    code, _, err = _run("--url", url, "notify", "--webhook", "http://127.0.0.1:9/", "--once")
    assert code == 3 and "quota migrate" in err, err


def test_cleanup_deletes_delivered_events(sql_url: str) -> None:
    _fire(sql_url, 2)
    with _webhook_receiver.running() as receiver:
        assert _run("--url", sql_url, "notify", "--webhook", receiver.url, "--once")[0] == 0
    code, out, _ = _run("--url", sql_url, "cleanup", "--json")
    assert code == 0 and json.loads(out)["events"]["deleted"] == 0  # delivered just now
    db_rows(sql_url, "UPDATE quota_events SET delivered_at = delivered_at - 31 * 86400")
    code, out, _ = _run("--url", sql_url, "cleanup")
    assert code == 0 and "2 delivered threshold event(s) deleted" in out
    assert db_rows(sql_url, "SELECT count(*) FROM quota_events") == [(0,)]


def test_cleanup_on_an_old_schema_leaves_events_out(sql_database: Callable[..., str]) -> None:
    url = sql_database("0006_leases")
    code, out, err = _run("--url", url, "cleanup", "--json")
    assert code == 0, err
    assert "events" not in json.loads(out)


@pytest.mark.parametrize(
    "option", ["--lease", "--timeout", "--max-backoff", "--batch", "--secret", "--once"]
)
def test_help_lists_every_option(option: str) -> None:
    code, out, _ = _run("notify", "--help")
    assert code == 0 and option in out
