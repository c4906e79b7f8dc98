"""``quota bench --algorithm``: every algorithm beside the bare fixed-window baseline.

Tiny runs (a fifth of a second): these check that each side runs what it says,
not how fast; the figures are in docs/performance.md.
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner, Result

import quota
from quota._cli import main
from quota._core.algorithms import state_key
from quota._sql import statements as _sql
from quota._tools import bench as _bench
from quota._tools.bench import WINDOW
from tests.conftest import backend_params

ALGORITHMS = ("fixed_window", "sliding_window", "token_bucket", "gcra")


def bench(url: str, *args: str) -> Result:
    return CliRunner().invoke(
        main,
        ["--url", url, "bench", "-c", "2", "-k", "3", "-d", "0.2", "-r", "2", "--json", *args],
        env={"QUOTA_DATABASE_URL": None},
    )


def _hammered(url: str, algorithm: str) -> int:
    """How many bench keys hold state of `algorithm` (the quota side's work).

    The state itself says little: 2**60 tokens less a few is 2**60 in a double.
    """
    with quota.connect(url) as limiter:
        return sum(
            bool(
                limiter.store.execute(
                    _sql.STATE_PEEK, (state_key(algorithm, WINDOW, f"k:bench:{i}"),)
                )
            )
            for i in range(3)
        )


@pytest.mark.parametrize("dialect", backend_params("sqlite", "redis"))
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_bench_runs_the_algorithm_beside_the_bare_fixed_window(
    request: pytest.FixtureRequest, dialect: str, algorithm: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = str(request.getfixturevalue(f"{dialect}_url"))
    # The rows the runs leave are what this test reads: keep bench from deleting them.
    monkeypatch.setattr(_bench, "_remove_keys", lambda *_args, **_kwargs: 0)

    result = bench(url, "--algorithm", algorithm)

    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert (report["algorithm"], report["scenario"]) == (algorithm, "rate")
    assert report["bare_median_per_s"] > 0 and report["quota_median_per_s"] > 0
    assert report["ratio_median"] > 0
    for other in ALGORITHMS[1:]:
        assert _hammered(url, other) == (3 if other == algorithm else 0), other


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_bench_on_memory_reports_one_thread_without_a_baseline(algorithm: str) -> None:
    result = bench("memory://", "--algorithm", algorithm)

    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert (report["concurrency"], report["bare_per_s"], report["ratio_median"]) == (1, [], None)
    assert report["quota_median_per_s"] > 1000


def test_bench_table_on_memory_says_there_is_no_baseline() -> None:
    result = CliRunner().invoke(main, ["--url", "memory://", "bench", "-d", "0.1", "-r", "1"])
    assert result.exit_code == 0, result.output
    assert "no bare driver to compare with: decisions per second on one thread" in result.output
    assert "bare" not in result.output.split("\n")[2]


def test_bench_rejects_an_unknown_algorithm_and_one_outside_the_rate_scenario(
    sqlite_url: str,
) -> None:
    assert bench(sqlite_url, "--algorithm", "leaky").exit_code == 2
    from quota._tools.bench import run_bench

    with pytest.raises(quota.ConfigurationError, match="algorithm must be one of"):
        run_bench(sqlite_url, algorithm="leaky")
    with pytest.raises(quota.ConfigurationError, match="rate scenario only"):
        run_bench(sqlite_url, algorithm="gcra", scenario="quota")


@pytest.mark.parametrize("dialect", backend_params("sqlite", "memory"))
def test_bench_acquire_runs_hit_and_acquire_side_by_side(
    request: pytest.FixtureRequest, dialect: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = "memory://" if dialect == "memory" else str(request.getfixturevalue("sqlite_url"))
    # The rows the runs leave are what this test reads: keep bench from deleting them.
    monkeypatch.setattr(_bench, "_remove_keys", lambda *_args, **_kwargs: 0)

    result = bench(url, "--acquire", "--algorithm", "token_bucket")

    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["acquire"] is True and report["algorithm"] == "token_bucket"
    assert len(report["bare_per_s"]) == len(report["quota_per_s"]) == 2
    assert report["ratio_median"] > 0
    if dialect == "sqlite":
        assert _hammered(url, "token_bucket") == 3  # both sides ran the bucket
    text = CliRunner().invoke(
        main, ["--url", url, "bench", "-c", "1", "-k", "3", "-d", "0.1", "-r", "1", "--acquire"]
    )
    assert "ratio acquire/hit" in text.output, text.output


def test_bench_acquire_is_for_the_rate_scenario() -> None:
    result = bench("memory://", "--acquire", "--scenario", "quota")
    assert result.exit_code != 0 and "acquire" in result.output


def test_bench_telemetry_runs_quota_with_and_without_it(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from quota._wrappers.telemetry import Recorder

    decided = []
    original = Recorder.decided

    def spy(self: Recorder, allowed: bool, algorithm: str, *, count: bool = True) -> None:
        decided.append(allowed)
        original(self, allowed, algorithm, count=count)

    monkeypatch.setattr(Recorder, "decided", spy)
    sides = []
    telemetry = _bench._telemetry

    def watched(on: bool):  # type: ignore[no-untyped-def]
        sides.append(on)
        return telemetry(on)

    monkeypatch.setattr(_bench, "_telemetry", watched)

    result = bench(sqlite_url, "--telemetry")

    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["telemetry"] is True
    assert len(report["bare_per_s"]) == len(report["quota_per_s"]) == 2
    assert report["ratio_median"] > 0
    # Run 1 is baseline then telemetry, run 2 the other way round.
    assert sides == [False, True, True, False]
    assert decided and all(decided)
    text = CliRunner().invoke(
        main, ["--url", sqlite_url, "bench", "-c", "1", "-k", "3", "-d", "0.1", "-r", "1",
               "--telemetry"],
    )  # fmt: skip
    assert "ratio telemetry on/off" in text.output, text.output


def test_bench_telemetry_is_for_the_rate_scenario_on_sql() -> None:
    result = bench("memory://", "--telemetry")
    assert result.exit_code != 0 and "telemetry" in result.output
