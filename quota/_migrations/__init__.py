"""In a checkout, ``quota._migrations`` is the top-level ``migrations/`` folder.

The wheel carries ``migrations/`` here in place of this file (pyproject.toml's
package-dir). Run from a checkout (its ``quota/`` first on ``sys.path``, even
with the wheel installed), this module puts the folder's own package in its
place, so the Alembic scripts are read from ``migrations/``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_FOLDER = Path(__file__).resolve().parents[2] / "migrations"
_spec = importlib.util.spec_from_file_location(
    __name__, _FOLDER / "__init__.py", submodule_search_locations=[str(_FOLDER)]
)
assert _spec is not None and _spec.loader is not None
sys.modules[__name__] = _module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)
