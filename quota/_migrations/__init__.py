"""In a checkout, ``quota._migrations`` is the top-level ``migrations/`` folder.

The wheel carries ``migrations/`` here in place of this file (pyproject.toml's
package-dir). Run from a checkout (its ``quota/`` first on ``sys.path``, even
with the wheel installed), this module puts the folder's own package in its
place, so the Alembic scripts are read from ``migrations/``.
"""

from __future__ import annotations

from quota._checkout import stand_in

stand_in(__name__, "migrations")
