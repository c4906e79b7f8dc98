"""Django REST framework's own throttling tests, run on quota's throttles.

DRF ships its tests in its sdist. The sdist of the installed version is
fetched once (``pip download``) into pytest's cache directory, or taken from
``$QUOTA_DRF_SDIST`` (a ``djangorestframework-X.Y.Z.tar.gz``); its
``tests/test_throttling.py`` then runs, unchanged, in a subprocess with
``tests/contrib/drf/_drf_suite_plugin.py`` in place of DRF's conftest:
DRF's throttle classes are replaced by quota's, which count on a migrated
SQLite file or PostgreSQL database (``QUOTA["URL"]``). Django's own tables
are in an in-memory SQLite database apart from quota's, so DRF's
``TestCase`` classes run as they are on both: a test's open transaction
never holds a lock quota's counters wait for. Every test passes but the documented differences,
which must fail (``xfail(strict=True)``). Nothing of DRF's is kept in this
repository.

Without the sdist (no network, no pip) the test skips saying so, or fails
when ``QUOTA_TEST_REQUIRE_DRF_SUITE=1``. The PostgreSQL row is marked
``postgres``, so ``QUOTA_TEST_REQUIRE_POSTGRES=1`` makes it fail, not skip,
without a server.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path

import pytest

from tests import _sdist
from tests.contrib.drf._drf_suite_plugin import URL_ENV, XFAIL

pytestmark = pytest.mark.slow

DRF_VERSION = importlib.metadata.version("djangorestframework")
SDIST_ENV = "QUOTA_DRF_SDIST"
REQUIRE_ENV = "QUOTA_TEST_REQUIRE_DRF_SUITE"
PLUGIN = "_drf_suite_plugin"
HERE = Path(__file__).resolve().parent
TARGET = "tests/test_throttling.py"
RUN_TIMEOUT = 180

INI = """\
[pytest]
filterwarnings =
    error
"""


def _fill(into: Path) -> None:
    """The sdist's ``tests/__init__.py`` and `TARGET` into `into`."""
    top = f"djangorestframework-{DRF_VERSION}/"
    wanted = {top + "tests/__init__.py", top + TARGET}
    sdist = _sdist.download(
        "djangorestframework", DRF_VERSION, into, sdist_env=SDIST_ENV, require_env=REQUIRE_ENV
    )
    if _sdist.extract(sdist, into, top, wanted.__contains__) != len(wanted):
        pytest.fail(f"{sdist} lacks {sorted(wanted)}", pytrace=False)


@pytest.fixture(scope="module")
def drf_tests(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding DRF's throttling tests for the installed version, cached across runs."""
    return _sdist.cached(
        request, tmp_path_factory, f"djangorestframework-{DRF_VERSION}",
        lambda root: (root / TARGET).is_file(), _fill,
    )  # fmt: skip


def _run(root: Path, url: str, tmp_path: Path) -> tuple[dict[str, str], str]:
    """Run DRF's throttling tests on `url`: each test's outcome, and the run's output."""
    ini = tmp_path / "pytest.ini"
    ini.write_text(INI)
    # DRF's ``tests`` package is found from the cwd; our plugin by its own name, from a
    # folder holding it alone (our tests folder on the path would shadow DRF's ``tests``).
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / f"{PLUGIN}.py").write_text((HERE / f"{PLUGIN}.py").read_text())
    junit = tmp_path / "drf.xml"
    env = {
        **os.environ,
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
        "PYTHONPATH": os.pathsep.join([str(plugins), os.environ.get("PYTHONPATH", "")]),
        URL_ENV: url,
    }
    env.pop("DJANGO_SETTINGS_MODULE", None)
    command = [sys.executable, "-m", "pytest", TARGET, "-c", str(ini), "--rootdir", str(root)]
    command += ["--noconftest", "-p", PLUGIN, "-p", "pytest_django.plugin"]
    command += ["-p", "no:cacheprovider"]
    command += ["-q", "-rfEx", f"--junitxml={junit}"]
    done = subprocess.run(
        command, cwd=root, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT
    )
    output = done.stdout + done.stderr
    assert junit.is_file(), f"DRF's tests exited {done.returncode}:\n{output[-4000:]}"
    outcomes: dict[str, str] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname')}.{case.get('name')}"
        if case.find("failure") is not None or case.find("error") is not None:
            outcomes[name] = "failed"
        elif (skipped := case.find("skipped")) is not None:
            xfailed = skipped.get("type") == "pytest.xfail"
            outcomes[name] = "xfailed" if xfailed else f"skipped: {skipped.get('message')}"
        else:
            outcomes[name] = "passed"
    return outcomes, output


def test_drf_throttling_tests_pass_on_quota(
    sql_dialect: str, sql_database: Callable[[], str], drf_tests: Path, tmp_path: Path
) -> None:
    outcomes, output = _run(drf_tests, sql_database(), tmp_path)
    counts = {
        kind: sum(1 for v in outcomes.values() if v == kind) for kind in set(outcomes.values())
    }
    print(f"DRF {DRF_VERSION}'s test_throttling.py on quota ({sql_dialect}): {counts}")  # -rP
    failed = {name: kind for name, kind in outcomes.items() if kind not in ("passed", "xfailed")}
    assert not failed, f"{failed}\n{output[-6000:]}"
    xfailed = {name.rsplit(".", 1)[1] for name, kind in outcomes.items() if kind == "xfailed"}
    assert xfailed == set(XFAIL), output[-4000:]
    # Not vacuous: the tests that count, time and key requests ran and passed on quota.
    for needle in (
        "ThrottlingTests.test_request_throttling_multiple_throttles",
        "ThrottlingTests.test_throttle_rate_change_negative",
        "ThrottlingTests.test_requests_are_throttled",
        "ScopedRateThrottleTests.test_scoped_rate_throttle",
        "XffSpoofingTests.test_xff_spoofing_doesnt_change_machine_id_with_two_app_proxies",
    ):
        assert any(name.endswith(needle) and kind == "passed" for name, kind in outcomes.items()), (
            needle,
            output[-4000:],
        )
    assert len(outcomes) >= 25, output[-4000:]
