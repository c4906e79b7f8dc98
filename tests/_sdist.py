"""A released project's own test files, from its sdist: fetched once with pip, cached.

For the suites of other projects run against quota (limits' storage tests, DRF's
throttling tests): `download` the sdist (or take ``$<sdist_env>``), `extract` the files
wanted, and `cached` keeps the result across runs in pytest's cache. Without PyPI the
tests skip with the reason, or fail when ``$<require_env>=1``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest


def unavailable(reason: str, require_env: str) -> None:
    """Skip with `reason`, or fail when ``$require_env`` is 1."""
    if os.environ.get(require_env) == "1":
        pytest.fail(f"{reason} (and {require_env}=1)", pytrace=False)
    pytest.skip(reason)


def download(project: str, version: str, into: Path, *, sdist_env: str, require_env: str) -> Path:
    """`project` `version`'s sdist, from ``$sdist_env`` or PyPI (into `into`)."""
    given = os.environ.get(sdist_env)
    if given:
        if not Path(given).is_file():
            pytest.fail(f"${sdist_env}={given!r} is not a file", pytrace=False)
        return Path(given)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
    command += ["--disable-pip-version-check", "-q", f"{project}=={version}", "-d", str(into)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired:
        unavailable(
            f"{project} {version}'s sdist: pip download timed out (no network?)", require_env
        )
        raise  # not reached
    sdists = sorted(into.glob(f"{project}-{version}.tar.gz"))
    if done.returncode != 0 or not sdists:
        tail = " ".join((done.stderr or done.stdout).split()[-40:])
        unavailable(
            f"could not fetch {project} {version}'s sdist (its test suite) with pip (needs"
            f" PyPI, or ${sdist_env}=path/to/{project}-{version}.tar.gz): {tail}",
            require_env,
        )
    return sdists[0]


def extract(sdist: Path, into: Path, top: str, keep: Callable[[str], bool]) -> int:
    """The plain files and directories of `sdist` whose names `keep` accepts, into `into`
    without the leading `top` (``name-version/``); how many there were."""
    with tarfile.open(sdist) as tar:
        members = [
            m
            for m in tar.getmembers()
            if keep(m.name) and ".." not in m.name and (m.isfile() or m.isdir())
        ]
        for member in members:
            member.name = member.name[len(top) :]
        if hasattr(tarfile, "data_filter"):
            tar.extractall(into, members=members, filter="data")
        else:  # Python < 3.10.12 / 3.11.4: the members are already plain files
            tar.extractall(into, members=members)
    return len(members)


def cached(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, name: str,
    ready: Callable[[Path], bool], fill: Callable[[Path], None],
) -> Path:  # fmt: skip
    """A directory `name` in pytest's cache that `ready` accepts, made by `fill` (in a
    staging directory, moved into place whole) when it is not there yet."""
    cache = getattr(request.config, "cache", None)
    base = cache.mkdir(f"{name}-sdist") if cache is not None else tmp_path_factory.mktemp("sdist")
    root = base / name
    if not ready(root):
        staging = Path(tempfile.mkdtemp(dir=base, prefix=".staging-"))
        fill(staging)
        try:
            staging.replace(root)
        except OSError:  # another run got there first
            if not ready(root):
                raise
    return root
