"""The durable-quota commands: ``usage``, ``grant``, ``refund``, ``ledger``, and cleanup's retention.

Driven through click's runner on a migrated SQLite file; the data is made
through the library with a fixed clock, so periods never move under a test.
"""

from __future__ import annotations

import csv
import io
import json
import time
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

import quota
from quota._cli import main

TODAY = time.time()


def run(url: str, *args: str) -> Result:
    return CliRunner().invoke(main, ["--url", url, *args], env={"QUOTA_DATABASE_URL": None})


@pytest.fixture
def url(sqlite_url: str) -> str:
    with quota.connect(sqlite_url) as limiter:
        limiter.consume_quota("alice", "llm", 10, "day", cost=3, idempotency_key="job-1")
        limiter.consume_quota("alice", "search", 100, "month", tz="Europe/Berlin")
        limiter.consume_quota("bob", "llm", 10, "day")
    return sqlite_url


def test_usage_lists_every_running_quota_of_the_subject(url: str) -> None:
    result = run(url, "usage", "alice")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].split()[:7] == [
        "NAME", "PERIOD", "USED", "RESERVED", "LIMIT", "GRANTED", "REMAINING",
    ]  # fmt: skip
    assert lines[1].split()[:7] == ["llm", "day", "3", "0", "10", "0", "7"]
    assert lines[2].split()[:7] == ["search", "month@Europe/Berlin", "1", "0", "100", "0", "99"]
    assert len(lines) == 3

    data = json.loads(run(url, "usage", "alice", "--json").output)
    assert [(u["name"], u["used"], u["limit"]) for u in data] == [
        ("llm", 3, 10),
        ("search", 1, 100),
    ]
    assert "no quota" in run(url, "usage", "carol").output


def test_grant_adds_to_the_current_period(url: str) -> None:
    result = run(url, "grant", "alice", "llm", "5", "--period", "day", "--json")
    assert result.exit_code == 0, result.output
    assert (json.loads(result.output)["granted"], json.loads(result.output)["remaining"]) == (5, 12)
    with quota.connect(url) as limiter:
        [llm, _] = limiter.quota_usage("alice")
    assert (llm.granted, llm.used) == (5, 3)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--period", "fortnight"], "fortnight"),
        (["--period", "day", "--tz", "Mars/Olympus"], "tz"),
        (["--period", "3600", "--tz", "Europe/Berlin"], "tz"),
    ],
)
def test_grant_rejects_bad_periods_and_zones_with_exit_2(
    url: str, args: list[str], message: str
) -> None:
    result = run(url, "grant", "alice", "llm", "5", *args)
    assert result.exit_code == 2
    assert message in result.output


def test_refund_then_refund_again_says_so_and_exits_0(url: str) -> None:
    first = run(url, "refund", "alice", "llm", "job-1")
    assert first.exit_code == 0, first.output
    assert "refunded 3" in first.output

    again = run(url, "refund", "alice", "llm", "job-1", "--json")
    assert again.exit_code == 0
    assert json.loads(again.output)["status"] == "already_refunded"
    unknown = run(url, "refund", "alice", "llm", "nope")
    assert (unknown.exit_code, "nothing to refund" in unknown.output) == (0, True)
    with quota.connect(url) as limiter:
        assert limiter.quota_usage("alice")[0].used == 0


def test_ledger_exports_as_text_json_and_csv(url: str) -> None:
    run(url, "refund", "alice", "llm", "job-1")
    text = run(url, "ledger", "alice")
    assert text.exit_code == 0, text.output
    assert [line.split()[1] for line in text.output.splitlines()[1:]] == [
        "consume",
        "consume",
        "refund",
    ]
    assert "(refunded)" in text.output.splitlines()[1]

    entries = json.loads(run(url, "ledger", "alice", "--json").output)
    assert [(e["kind"], e["name"], e["cost"]) for e in entries] == [
        ("consume", "llm", 3),
        ("consume", "search", 1),
        ("refund", "llm", 3),
    ]
    rows = list(csv.DictReader(io.StringIO(run(url, "ledger", "alice", "--csv").output)))
    assert [(r["kind"], r["cost"], r["idempotency_key"]) for r in rows] == [
        ("consume", "3", "job-1"),
        ("consume", "1", ""),
        ("refund", "3", "job-1"),
    ]
    assert all(r["subject"] == "alice" for r in rows)


def test_ledger_since_filters_by_time(url: str) -> None:
    assert len(json.loads(run(url, "ledger", "alice", "--json", "--since", "1d").output)) == 2
    future = run(url, "ledger", "alice", "--json", "--since", "2999-01-01")
    assert json.loads(future.output) == []
    past = run(url, "ledger", "alice", "--json", "--since", "2000-01-01T00:00:00+01:00")
    assert len(json.loads(past.output)) == 2


@pytest.mark.parametrize(
    "args",
    [["--json", "--csv"], ["--since", "yesterday"], ["--since", "90"]],
)
def test_ledger_rejects_bad_options_with_exit_2(url: str, args: list[str]) -> None:
    assert run(url, "ledger", "alice", *args).exit_code == 2


def test_cleanup_leaves_quotas_alone_and_trims_the_ledger_only_when_asked(
    sqlite_url: str,
) -> None:
    old = TODAY - 500 * 86400
    with quota.connect(sqlite_url, clock=lambda: old) as limiter:
        limiter.consume_quota("alice", "llm", 10, 60)  # a period of seconds, long over
        limiter.rate_limit("alice", 10, 60)

    plain = run(sqlite_url, "cleanup", "--grace", "0", "--json")
    assert plain.exit_code == 0, plain.output
    assert json.loads(plain.output)["deleted"] == 1  # the rate window
    with quota.connect(sqlite_url) as limiter:
        assert len(limiter.ledger("alice")) == 1
        assert len(limiter.quota_usage("alice", include_ended=True)) == 1

    dry = run(sqlite_url, "cleanup", "--ledger-older-than", "400d", "--dry-run", "--json")
    assert json.loads(dry.output)["ledger"] == {
        "deleted": 0,
        "expired": 1,
        "skipped": False,
        "dry_run": True,
        "released": 0,
    }
    done = run(sqlite_url, "cleanup", "--ledger-older-than", "400d")
    assert done.exit_code == 0, done.output
    assert "1 ledger entry deleted" in done.output
    with quota.connect(sqlite_url) as limiter:
        assert limiter.ledger("alice") == []
        assert len(limiter.quota_usage("alice", include_ended=True)) == 1  # usage stays


def test_cleanup_refuses_a_ledger_retention_under_a_day(tmp_path: Path) -> None:
    result = run(f"sqlite:///{tmp_path / 'q.db'}", "cleanup", "--ledger-older-than", "400")
    assert result.exit_code == 2
    assert "at least 1d" in result.output


def test_help_lists_the_quota_commands() -> None:
    output = CliRunner().invoke(main, ["--help"]).output
    for command in ("usage", "grant", "refund", "ledger"):
        assert f"  {command} " in output


@pytest.mark.parametrize("scenario", ["quota", "check"])
def test_bench_runs_the_quota_scenarios_beside_the_bare_driver(
    sqlite_url: str, scenario: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from quota._tools import bench as _bench

    # The rows the runs leave are what this test reads: keep bench from deleting them.
    monkeypatch.setattr(_bench, "_remove_keys", lambda *_args, **_kwargs: 0)
    result = run(
        sqlite_url, "bench", "--scenario", scenario, "-c", "2", "-k", "5", "-d", "0.2", "-r", "1",
        "--json",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["scenario"] == scenario
    assert report["bare_median_per_s"] > 0
    assert report["quota_median_per_s"] > 0
    with quota.connect(sqlite_url) as limiter:
        # The quota side really consumed: every call is in the usage and the ledger.
        usage = [u for i in range(5) for u in limiter.quota_usage(f"bench:{i}")]
        entries = [e for i in range(5) for e in limiter.ledger(f"bench:{i}")]
    assert sum(u.used for u in usage) == len(entries) > 0


def test_bench_rejects_an_unknown_scenario(sqlite_url: str) -> None:
    assert run(sqlite_url, "bench", "--scenario", "nope").exit_code == 2
    from quota._tools.bench import run_bench

    with pytest.raises(quota.ConfigurationError, match="scenario"):
        run_bench(sqlite_url, scenario="nope")


def test_usage_ledger_and_cleanup_show_reservations(sqlite_url: str) -> None:
    now = time.time()
    with quota.connect(sqlite_url, clock=lambda: now - 120) as limiter:
        held = limiter.reserve_quota("alice", "tokens", 40, 100, "day", ttl=60)
        limiter.reserve_quota("alice", "tokens", 30, 100, "day", ttl=3600)
    assert held.id is not None
    dry = run(sqlite_url, "cleanup", "--dry-run", "--json")
    assert json.loads(dry.output)["released"] == 1
    listed = run(sqlite_url, "usage", "alice").output.splitlines()
    assert listed[1].split()[:5] == ["tokens", "day", "0", "30", "100"]  # released on reading
    entries = run(sqlite_url, "ledger", "alice").output.splitlines()
    assert "RESERVED" in entries[0].split()
    assert [line.split()[1] for line in entries[1:]] == ["reserve", "reserve", "release"]
    rows = list(csv.DictReader(io.StringIO(run(sqlite_url, "ledger", "alice", "--csv").output)))
    assert rows[2]["reservation_id"] == held.id and rows[2]["reserved"] == "40"
    done = run(sqlite_url, "cleanup", "--json")
    assert json.loads(done.output)["released"] == 0  # the read released it already
