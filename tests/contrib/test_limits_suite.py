"""`limits`' own test suite, run against quota's ``quota+…`` storages.

limits ships its tests in its sdist. The sdist of the installed version is
fetched once (``pip download``) into pytest's cache directory, or taken from
``$QUOTA_LIMITS_SDIST`` (a ``limits-X.Y.Z.tar.gz``); its storage tests then run
in subprocesses, with ``tests/_limits_suite_plugin.py`` in place of limits'
conftest (which starts docker services): every storage parametrization gets
our storage on a migrated SQLite file or PostgreSQL database instead of
limits' services. Nothing of limits' is kept in this repository.

Which upstream tests run (`SHARDS`, each a subprocess, all at once):

* ``tests/test_storage.py`` and ``tests/aio/test_storage.py``:
  ``TestConcreteStorages`` (the storage string, ``incr`` with amounts and
  expiry, ``check``, ``reset``, ``clear``, the sliding window entry);
* ``tests/test_strategy.py`` and ``tests/aio/test_strategy.py``: the fixed
  window and sliding window counter strategies, in real time;
* ``tests/integration/test_concurrency.py``: 100 threads (tasks) on one limit.

Left out, with the reason the run reports:

* moving window tests (``TestMovingWindow``, ``TestAsyncMovingWindow``,
  ``test_moving_window``): unsupported by design, limits'
  ``MovingWindowRateLimiter`` refuses the storage;
* ``test_expiry_acquire_entry``, ``test_acquire_entry_custom_amount``: limits
  skips them itself for a storage without ``MovingWindowSupport``;
* tests that take no storage (``TestBaseStorage``, ``TestStorageErrors``,
  URI parsing, rate strings) are deselected; limits' memory, Redis and
  benchmark test files are about limits' own storages and are not run.

Without the sdist (no network, no pip) the test skips saying so, or fails
when ``QUOTA_TEST_REQUIRE_LIMITS_SUITE=1``. limits' sdists before 5.6 leave
out ``tests/utils.py`` and the async and concurrency tests: with such a
version installed the test skips, naming what is missing. The PostgreSQL row is marked
``postgres``, so ``QUOTA_TEST_REQUIRE_POSTGRES=1`` makes it fail, not skip,
without a server.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests import _sdist
from tests._limits_suite_plugin import EXCLUDED, URL_ENV

LIMITS_VERSION = importlib.metadata.version("limits")
SDIST_ENV = "QUOTA_LIMITS_SDIST"
REQUIRE_ENV = "QUOTA_TEST_REQUIRE_LIMITS_SUITE"
PLUGIN = "_limits_suite_plugin"
TESTS_DIR = Path(__file__).resolve().parents[1]

#: The upstream tests that run, split so the shards take about as long as each other.
SHARDS: dict[str, tuple[str, ...]] = {
    "storage": ("tests/test_storage.py", "tests/integration/test_concurrency.py"),
    "fixed": (
        "tests/test_strategy.py::TestFixedWindow",
        "tests/test_strategy.py::TestMovingWindow",
    ),
    "sliding": ("tests/test_strategy.py::TestSlidingWindow",),
    "aio-storage": ("tests/aio/test_storage.py",),
    "aio-fixed": (
        "tests/aio/test_strategy.py::TestAsyncFixedWindow",
        "tests/aio/test_strategy.py::TestAsyncMovingWindow",
    ),
    "aio-sliding": ("tests/aio/test_strategy.py::TestAsyncSlidingWindow",),
}

#: Skips the run may report: ours (`EXCLUDED`) and limits' own for a storage
#: without MovingWindowSupport.
ALLOWED_SKIPS = (*(reason for _, reason in EXCLUDED.values()), "does not support acquire entry")

#: limits' ``filterwarnings`` (its pytest.ini is not read: it asks for plugins we do not load).
INI = """\
[pytest]
filterwarnings =
    error
    module::ResourceWarning
    module::pytest.PytestUnraisableExceptionWarning
"""

#: Seconds the shards, all running at once, may take (about 15: limits' tests sleep in real time).
SHARD_TIMEOUT = 120


# -- the sdist ------------------------------------------------------------------------


def _fill(into: Path) -> None:
    """limits' sdist's ``tests/`` into `into`."""
    top = f"limits-{LIMITS_VERSION}/"
    sdist = _sdist.download(
        "limits", LIMITS_VERSION, into, sdist_env=SDIST_ENV, require_env=REQUIRE_ENV
    )
    if not _sdist.extract(sdist, into, top, lambda name: name.startswith(top + "tests/")):
        pytest.fail(f"{sdist} holds no {top}tests/", pytrace=False)


@pytest.fixture(scope="module")
def limits_tests(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding limits' ``tests/`` for the installed version, cached across runs."""
    root = _sdist.cached(
        request, tmp_path_factory, f"limits-{LIMITS_VERSION}",
        lambda root: (root / "tests").is_dir(), _fill,
    )  # fmt: skip
    needed = {"tests/utils.py", *(target.split("::")[0] for t in SHARDS.values() for target in t)}
    missing = sorted(path for path in needed if not (root / path).is_file())
    if missing:
        # Not a matter of the network: the sdist of this version lacks them.
        pytest.skip(
            f"limits {LIMITS_VERSION}'s sdist does not ship {', '.join(missing)}"
            " (sdists before 5.6 leave out part of limits' tests): nothing to run"
        )
    return root


# -- the run --------------------------------------------------------------------------


@dataclass
class Outcomes:
    """What limits' suite did, test by test."""

    passed: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    """Test -> reason."""
    failed: dict[str, str] = field(default_factory=dict)
    """Test -> message (failures and errors)."""
    reruns: dict[str, list[str]] = field(default_factory=dict)
    """Test -> why each earlier run of a ``flaky`` test failed."""

    def read(self, junit: Path) -> None:
        for case in ET.parse(junit).getroot().iter("testcase"):
            name = f"{case.get('classname')}.{case.get('name')}"
            reruns = [p.get("value", "") for p in case.iter("property") if p.get("name") == "rerun"]
            if reruns:
                self.reruns[name] = reruns
            problem = case.find("failure")
            if problem is None:
                problem = case.find("error")
            skipped = case.find("skipped")
            if problem is not None:
                self.failed[name] = f"{problem.get('message')}\n{problem.text or ''}"
            elif skipped is not None:
                self.skipped[name] = skipped.get("message") or ""
            else:
                self.passed.append(name)

    def summary(self) -> str:
        reasons = Counter(reason for reason in self.skipped.values())
        lines = [
            f"{len(self.passed)} passed, {len(self.skipped)} skipped, {len(self.failed)} failed"
        ]
        lines += [f"  skipped {n}: {reason}" for reason, n in reasons.items()]
        lines += [f"  rerun (flaky): {name}: {why}" for name, why in self.reruns.items()]
        return "\n".join(lines)


def _run_shards(root: Path, urls: dict[str, str], tmp_path: Path) -> Outcomes:
    """Run every shard at once, shard `name` on quota URL ``urls[name]``."""
    ini = tmp_path / "pytest.ini"
    ini.write_text(INI)
    # limits' ``tests`` package is found from the cwd; our plugin by its own name, from a
    # folder holding it alone (our tests folder on the path would make its ``http``
    # package shadow the standard library's, which redis-py imports through PyJWT).
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / f"{PLUGIN}.py").write_text((TESTS_DIR / f"{PLUGIN}.py").read_text())
    env = {
        **os.environ,
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
        "PYTHONPATH": os.pathsep.join([str(plugins), os.environ.get("PYTHONPATH", "")]),
    }
    running: dict[str, tuple[subprocess.Popen[str], Path]] = {}
    try:
        for name, targets in SHARDS.items():
            junit = tmp_path / f"{name}.xml"
            command = [sys.executable, "-m", "pytest", *targets, "-c", str(ini)]
            command += ["--rootdir", str(root), "--noconftest", "-p", PLUGIN]
            command += ["-p", "no:cacheprovider", "-q", "-rfEs", f"--junitxml={junit}"]
            process = subprocess.Popen(
                command,
                cwd=root,
                env={**env, URL_ENV: urls[name]},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            running[name] = (process, junit)
        outcomes = Outcomes()
        problems = []
        deadline = time.monotonic() + SHARD_TIMEOUT
        for name, (process, junit) in running.items():
            try:
                output, _ = process.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                problems.append(f"shard {name}: still running after {SHARD_TIMEOUT} s")
                continue
            if not junit.is_file():
                problems.append(f"shard {name} exited {process.returncode}:\n{output[-4000:]}")
                continue
            outcomes.read(junit)
            if process.returncode not in (0, 1):  # 1: some tests failed (reported below)
                problems.append(f"shard {name} exited {process.returncode}:\n{output[-4000:]}")
        assert not problems, "\n".join(problems)
        return outcomes
    finally:
        for process, _ in running.values():
            if process.poll() is None:
                process.kill()
                process.communicate()


def _check(outcomes: Outcomes) -> None:
    assert not outcomes.failed, "\n\n".join(f"{k}: {v}" for k, v in outcomes.failed.items())
    unexpected = {
        name: reason
        for name, reason in outcomes.skipped.items()
        if not any(allowed in reason for allowed in ALLOWED_SKIPS)
    }
    assert not unexpected, f"skipped for a reason not in ALLOWED_SKIPS: {unexpected}"
    # Not vacuous: every shard's strategy or storage tests ran and passed.
    for needle in ("TestConcreteStorages", "TestFixedWindow", "TestSlidingWindow",
                   "TestAsyncFixedWindow", "TestAsyncSlidingWindow", "TestConcurrency",
                   "TestAsyncConcurrency"):  # fmt: skip
        assert any(f".{needle}." in name for name in outcomes.passed), (needle, outcomes.summary())


def test_limits_own_storage_tests_pass_on_quota(
    sql_dialect: str,
    sql_database: Callable[[], str],
    limits_tests: Path,
    tmp_path: Path,
) -> None:
    urls = {name: sql_database() for name in SHARDS}  # migrated, one database a shard
    outcomes = _run_shards(limits_tests, urls, tmp_path)
    # -rP shows it.
    print(f"limits {LIMITS_VERSION}'s suite on quota+{sql_dialect}: {outcomes.summary()}")
    _check(outcomes)
