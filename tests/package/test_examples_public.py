"""Every example uses quota's public names only: what users copy must keep working.

Each file under ``examples/`` is parsed with `ast` (never imported, so no
framework or database is needed) and refused for any private name of quota:
``from quota._x import …``, ``import quota._x``, ``from quota import _x``,
``quota._x`` (also through an alias, and below a public module:
``quota.http._core``), and ``importlib.import_module("quota._x")``. Nothing
is allowed by exception.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import quota

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def _private_module(dotted: str) -> bool:
    parts = dotted.split(".")
    return parts[0] == "quota" and any(_private(p) for p in parts[1:])


def _dotted(node: ast.expr) -> list[str] | None:
    """``a.b.c`` as ``["a", "b", "c"]``; None when it is not a plain name chain."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def private_uses(source: str, filename: str = "<example>") -> list[str]:
    """Every use of a private quota name in `source`, as ``line: text``."""
    tree = ast.parse(source, filename)
    found: list[str] = []
    quota_names: set[str] = set()  # names bound to quota, its modules or what they export
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] != "quota":
                    continue
                if _private_module(alias.name):
                    found.append(f"{node.lineno}: import {alias.name}")
                quota_names.add(alias.asname or "quota")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] != "quota":
                continue
            if _private_module(node.module):
                names = ", ".join(alias.name for alias in node.names)
                found.append(f"{node.lineno}: from {node.module} import {names}")
                continue
            for alias in node.names:
                if _private(alias.name):
                    found.append(f"{node.lineno}: from {node.module} import {alias.name}")
                quota_names.add(alias.asname or alias.name)
    # Look at each attribute chain once, whole: skip the attributes inside a longer one.
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and id(node) not in inner:
            chain = _dotted(node)
            if chain and chain[0] in quota_names and any(_private(p) for p in chain[1:]):
                found.append(f"{node.lineno}: {'.'.join(chain)}")
        elif isinstance(node, ast.Call) and node.args:
            func = _dotted(node.func) or []
            arg = node.args[0]
            if (
                func[-1:] in (["import_module"], ["__import__"])
                and isinstance(arg, ast.Constant)
                and isinstance(arg.value, str)
                and _private_module(arg.value)
            ):
                found.append(f"{node.lineno}: {'.'.join(func)}({arg.value!r})")
    return sorted(found, key=lambda line: int(line.split(":")[0]))


def _examples() -> list[Path]:
    return sorted(EXAMPLES.rglob("*.py"))


def test_there_are_examples_to_check() -> None:
    names = {path.name for path in _examples()}
    assert {"fastapi_app.py", "flask_app.py"} <= names


@pytest.mark.parametrize("path", _examples(), ids=lambda path: path.name)
def test_an_example_uses_only_public_names(path: Path) -> None:
    assert private_uses(path.read_text(), str(path)) == []


@pytest.mark.parametrize(
    "source",
    [
        "from quota._core.url import default_url",
        "from quota._tools.bench import run_bench as run",
        "import quota._sql.migrate",
        "import quota._sql.migrate as m",
        "from quota import _tools",
        "from quota import _tools as t",
        "from quota._sql import statements",
        "import quota\nquota._core.url.default_url()",
        "import quota as q\nq._sql.migrate.migrate()",
        "import quota.http\nquota.http._core.Guard",
        "from quota.http import _core",
        "from quota.http._responses import PolicyShape",
        "from quota import http\nhttp._responses",
        "from quota import Limiter\nLimiter._private_helper",
        "import importlib\nimportlib.import_module('quota._core.url')",
        "__import__('quota.http._core')",
        "def f():\n    from quota._core.decision import Decision\n    return Decision",
    ],
)
def test_the_check_catches_every_form_of_private_use(source: str) -> None:
    assert private_uses(source) != [], source


ROOT = EXAMPLES.parent
_PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.M | re.S)


def _snippets() -> list[tuple[str, str]]:
    """Every ```python block of README.md and the documentation, as (``file#n``, source)."""
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        blocks = _PYTHON_BLOCK.findall(path.read_text())
        found += [(f"{path.relative_to(ROOT)}#{i}", block) for i, block in enumerate(blocks)]
    return found


def test_readme_has_python_snippets() -> None:
    assert sum(name.startswith("README.md#") for name, _ in _snippets()) >= 3


@pytest.mark.parametrize(("name", "source"), _snippets(), ids=[n for n, _ in _snippets()])
def test_a_snippet_compiles_as_pasted_and_uses_only_public_names(name: str, source: str) -> None:
    """What a reader pastes into a file must at least be Python (no ``return`` at top level)."""
    compile(source, name, "exec")
    assert private_uses(source, name) == []


def test_getting_started_lists_every_extra() -> None:
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    table = (ROOT / "docs" / "getting-started.md").read_text()
    listed = set(re.findall(r"^\| `([a-z]+)` \|", table, re.M))
    assert set(extras) == listed


def test_the_check_passes_public_names() -> None:
    source = """
import importlib
import quota
import quota.http as qh
from quota import Decision, connect
from quota.http import HttpConfig
from quota.http.asgi import QuotaMiddleware
import other._private
from other import _private_too

quota.connect(quota.default_url())
quota.__version__
qh.HttpConfig.from_env()
importlib.import_module("quota.http.wsgi")
other._private.thing
limiter = connect("memory://")
limiter._internal  # not a name quota exports: a local object's business
"""
    assert private_uses(source) == []


def test_the_default_url_is_public(monkeypatch: pytest.MonkeyPatch) -> None:
    assert "default_url" in quota.__all__
    monkeypatch.delenv("QUOTA_DATABASE_URL", raising=False)
    assert quota.default_url() == "sqlite:///quota.sqlite3"
    monkeypatch.setenv("QUOTA_DATABASE_URL", "memory://shared")
    assert quota.default_url() == "memory://shared"
