"""The shell commands in the examples' docstrings work when pasted into bash.

A reader copies them from the file, so the file's text is what is checked,
not the docstring's value (where an escaped backslash counts once). Each
indented block of a module docstring is a command block: no line ends in two
backslashes, bash parses it, and a block that sets ``QUOTA_HASH_SECRET`` runs
its server command with the variable in the environment (``pip`` and the
servers are shell functions here, so nothing is installed or started).
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SERVERS = ("uvicorn", "flask", "gunicorn")


def _blocks(path: Path) -> list[str]:
    """The indented blocks of `path`'s module docstring, as they appear in the file."""
    source = path.read_text()
    tree = ast.parse(source)
    if not (tree.body and isinstance(tree.body[0], ast.Expr)):
        return []
    node = tree.body[0].value
    if not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
        return []
    lines = source.splitlines()[node.lineno - 1 : node.end_lineno]
    blocks: list[list[str]] = [[]]
    for line in lines:
        if line.startswith("    ") and line.strip():
            blocks[-1].append(line.strip())
        elif blocks[-1]:
            blocks.append([])
    return ["\n".join(block) for block in blocks if block]


CASES = [
    pytest.param(path, block, id=f"{path.relative_to(EXAMPLES)}:{n}")
    for path in sorted(EXAMPLES.rglob("*.py"))
    for n, block in enumerate(_blocks(path))
]


def test_the_examples_have_command_blocks() -> None:
    assert {path.name for path, *_ in (case.values for case in CASES)} >= {
        "fastapi_app.py",
        "flask_app.py",
        "manage.py",
    }


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize(("path", "block"), CASES)
def test_a_docstring_command_is_valid_shell(path: Path, block: str) -> None:
    assert not [line for line in block.splitlines() if line.endswith("\\\\")], block
    parsed = subprocess.run(["bash", "-n"], input=block, capture_output=True, text=True)
    assert parsed.returncode == 0, parsed.stderr
    if "QUOTA_HASH_SECRET=" not in block:
        return
    servers = "".join(
        f'{name}() {{ printenv QUOTA_HASH_SECRET >/dev/null && echo "{name} has the secret"; }}\n'
        for name in SERVERS
    )
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env.pop("QUOTA_HASH_SECRET", None)
    ran = subprocess.run(
        ["bash", "-e", "-c", f"pip() {{ :; }}\n{servers}{block}"],
        capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip
    assert ran.returncode == 0 and ran.stderr == "", ran.stderr
    assert "has the secret" in ran.stdout, ran.stdout
