"""Run from a checkout: the top-level ``cli/`` and ``migrations/`` folders as the packages
``quota._cli`` and ``quota._migrations``.

The wheel carries those folders inside the package (pyproject.toml's package-dir). A
checkout's own ``quota/`` (first on ``sys.path`` when run from its root, even with the
wheel installed) has a small stand-in for each that calls `stand_in`.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


def stand_in(name: str, folder: str) -> None:
    """Load the checkout's top-level `folder` as module `name`, in its place."""
    path = Path(__file__).resolve().parents[1] / folder
    spec = importlib.util.spec_from_file_location(
        name, path / "__init__.py", submodule_search_locations=[str(path)]
    )
    assert spec is not None and spec.loader is not None
    sys.modules[name] = module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
