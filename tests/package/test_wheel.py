"""The wheel is self-contained: migrations and CLI inside `quota`, nothing generic at the top.

Builds the wheel from a copy of the working tree (so the checkout gets no
``build/`` directory), installs it into a clean virtualenv (dependencies
come from the normal package index) and drives the installed ``quota``
command from a directory where the checkout is not importable.
"""

from __future__ import annotations

import ast
import configparser
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
WEEK = 7 * 24 * 3600

#: pip output meaning "no package index reachable", as opposed to a broken package.
_NO_INDEX = (
    "No matching distribution found",
    "Could not find a version that satisfies",
    "NewConnectionError",
    "Temporary failure in name resolution",
    "Network is unreachable",
    "ProxyError",
    "ConnectTimeoutError",
)


def _run(
    args: list[str | Path], cwd: Path, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "VIRTUAL_ENV"}}
    env.setdefault("PIP_DISABLE_PIP_VERSION_CHECK", "1")
    return subprocess.run(
        [str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def _pip_step(done: subprocess.CompletedProcess[str], what: str) -> None:
    if done.returncode == 0:
        return
    output = done.stdout + done.stderr
    if any(sign in output for sign in _NO_INDEX):
        pytest.skip(f"{what}: pip cannot reach a package index:\n{output[-2000:]}")
    pytest.fail(f"{what} failed:\n{output[-4000:]}")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("wheel")
    source = root / "src"
    shutil.copytree(
        REPO,
        source,
        ignore=shutil.ignore_patterns(
            ".git", "tests", "build", "dist", "*.egg-info", "__pycache__", ".venv", "*.sqlite3*",
            ".pytest_cache", ".ruff_cache", ".mypy_cache",
        ),
    )  # fmt: skip
    dist = root / "dist"
    done = _run([sys.executable, "-m", "build", "--wheel", "--outdir", dist, source], cwd=root)
    _pip_step(done, "python -m build --wheel")
    (built,) = dist.glob("quota-*.whl")
    return built


def test_the_wheel_carries_migrations_and_cli_inside_the_package(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        scripts = archive.read(entry_points).decode()

    assert "quota/_migrations/env.py" in names
    assert "quota/_migrations/script.py.mako" in names
    assert any(n.startswith("quota/_migrations/versions/") and n.endswith(".py") for n in names)
    assert "quota/_cli/__init__.py" in names
    # The folders themselves, not the checkout's stand-ins in quota/_cli and quota/_migrations.
    with zipfile.ZipFile(wheel) as archive:
        for package, folder in (("_cli", "cli"), ("_migrations", "migrations")):
            carried = archive.read(f"quota/{package}/__init__.py").decode()
            assert carried == (REPO / folder / "__init__.py").read_text(), package
    assert "quota/py.typed" in names
    top_level = {n.split("/", 1)[0] for n in names}
    assert {t for t in top_level if not t.endswith(".dist-info")} == {"quota"}
    parser = configparser.ConfigParser()
    parser.read_string(scripts)
    assert parser["console_scripts"]["quota"] == "quota._cli:main"


def test_the_wheel_carries_every_layer_and_no_benchmark_code(wheel: Path) -> None:
    """One package per layer, the Redis store's Lua scripts; no report, no plotting."""
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        sources = {n: archive.read(n).decode() for n in names if n.endswith(".py")}

    for layer in ("_core", "_sql", "_stores", "_wrappers", "_limiter", "_tools"):
        assert f"quota/{layer}/__init__.py" in names, layer
    assert "quota/http/shedding.py" in names
    assert "quota/_tools/doctor/runner.py" in names
    assert "quota/_stores/lua/common.lua" in names
    # The dashboard's templates and static files, every one the repository has.
    here = Path(__file__).resolve().parents[2] / "quota" / "dashboard"
    assets = sorted(
        p.relative_to(here.parent.parent).as_posix()
        for p in [*here.glob("templates/*"), *here.glob("static/*")]
    )
    assert assets and not set(assets) - set(names), set(assets) - set(names)
    # The Django app with its migrations and management commands (found by Django on disk).
    for name in ("migrations/0001_initial.py", "management/commands/quota_cleanup.py"):
        assert f"quota/contrib/django/{name}" in names, name
    # The Django admin's templates, every one the repository has.
    django_app = here.parent / "contrib" / "django"
    pages = sorted(
        p.relative_to(here.parent.parent).as_posix()
        for p in django_app.glob("templates/admin/quota/*")
    )
    assert pages and not set(pages) - set(names), set(pages) - set(names)
    # The batching report (benchmarks/report.py) and its plots stay in the repository.
    assert not [n for n in names if "_bench_report" in n or n.rsplit("/", 1)[-1] == "report.py"]
    plotting = []
    for name, source in sources.items():
        for node in ast.walk(ast.parse(source, name)):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                modules = [node.module or ""]
            else:
                continue
            if any(m.split(".")[0] in ("matplotlib", "benchmarks") for m in modules):
                plotting.append(f"{name}:{node.lineno}")
    assert plotting == [], plotting


def test_the_installed_wheel_migrates_and_rate_limits(wheel: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    done = _run([sys.executable, "-m", "venv", venv], cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    python = venv / "bin" / "python"
    quota_cmd = venv / "bin" / "quota"
    _pip_step(_run([python, "-m", "pip", "install", wheel], cwd=tmp_path), "pip install the wheel")

    where = _run([python, "-c", "import quota; print(quota.__file__)"], cwd=tmp_path)
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()).is_relative_to(venv)
    for generic in ("cli", "migrations"):
        probe = _run([python, "-c", f"import {generic}"], cwd=tmp_path)
        assert probe.returncode != 0, f"the wheel installed a top-level {generic!r} module"

    url = f"sqlite:///{tmp_path / 'w.db'}"
    migrated = _run([quota_cmd, "--url", url, "migrate"], cwd=tmp_path)
    assert migrated.returncode == 0, migrated.stdout + migrated.stderr

    # Windows are aligned to the epoch, so two hits on the real clock can fall in
    # two windows. A window of about a week whose current one has more than an
    # hour left cannot straddle a boundary between the two hits (at most 300 s
    # each): each second added to the length moves `now % window` back by
    # `now // window` (thousands of seconds), so one is found in a few steps.
    now = int(time.time())
    window = next(w for w in range(WEEK, 2 * WEEK) if w - now % w > 3600)
    hit = ["--url", url, "hit", "k", "--limit", "1", "--window", str(window)]
    allowed = _run([quota_cmd, *hit], cwd=tmp_path)
    assert allowed.returncode == 0, allowed.stdout + allowed.stderr
    denied = _run([quota_cmd, *hit], cwd=tmp_path)
    assert denied.returncode == 4, denied.stdout + denied.stderr


def _checkout_copy(root: Path) -> Path:
    """The working tree as a user's checkout is after ``pip install .``: sources, no venv."""
    checkout = root / "checkout"
    shutil.copytree(
        REPO,
        checkout,
        ignore=shutil.ignore_patterns(
            ".git", "build", "dist", "*.egg-info", "__pycache__", ".venv", "*.sqlite3*",
            ".pytest_cache", ".ruff_cache", ".mypy_cache",
        ),
    )  # fmt: skip
    return checkout


def test_the_examples_run_from_the_checkout_root_with_the_wheel_installed(
    wheel: Path, tmp_path: Path
) -> None:
    """README's way: ``pip install .``, then the examples from the checkout's root, where
    the checkout's ``quota/`` comes before the installed one on ``sys.path``."""
    venv = tmp_path / "venv"
    done = _run([sys.executable, "-m", "venv", venv], cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    python = venv / "bin" / "python"
    install = [python, "-m", "pip", "install", f"{wheel}[fastapi,flask]", "uvicorn"]
    _pip_step(_run(install, cwd=tmp_path), "pip install the wheel with the examples' extras")
    checkout = _checkout_copy(tmp_path)
    env = {
        "QUOTA_HASH_SECRET": "s" * 32,
        "QUOTA_DATABASE_URL": f"sqlite:///{tmp_path / 'examples.db'}",
        "PYTHONDONTWRITEBYTECODE": "1",
    }

    flask_app = (
        "import quota, examples.flask_app as m;"
        " print(quota.__file__);"
        " print([m.app.test_client().get('/api/directory').status_code for _ in range(2)])"
    )
    ran = subprocess.run(
        [python, "-c", flask_app], cwd=checkout, env={**os.environ, **env},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stdout + ran.stderr
    where, statuses = ran.stdout.strip().splitlines()[-2:]
    assert Path(where).is_relative_to(checkout)  # the checkout's quota/, as the user gets it
    assert statuses == "[200, 200]"

    migrate = _run(
        [venv / "bin" / "quota", "--url", env["QUOTA_DATABASE_URL"], "migrate"], checkout
    )
    assert migrate.returncode == 0, migrate.stdout + migrate.stderr

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    log = tmp_path / "uvicorn.log"
    with log.open("w") as output:
        server = subprocess.Popen(
            [venv / "bin" / "uvicorn", "examples.fastapi_app:app", "--fd", str(listener.fileno())],
            cwd=checkout, env={**os.environ, **env}, pass_fds=[listener.fileno()],
            stdout=output, stderr=subprocess.STDOUT,
        )  # fmt: skip
    listener.close()
    try:
        status, deadline = None, time.monotonic() + 60
        while status is None and time.monotonic() < deadline and server.poll() is None:
            try:
                with urllib.request.urlopen(
                    f"http://127.0.0.1:{port}/api/directory", timeout=5
                ) as r:
                    status = r.status
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.2)
        assert status == 200, log.read_text()
    finally:
        server.terminate()
        server.wait(timeout=30)
