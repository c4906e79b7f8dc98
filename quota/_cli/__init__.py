"""In a checkout, ``quota._cli`` is the top-level ``cli/`` folder.

The wheel carries ``cli/`` here in place of this file (pyproject.toml's
package-dir). Run from a checkout (its ``quota/`` first on ``sys.path``, even
with the wheel installed), this module puts the folder's own package in its
place, so the command line is the one in ``cli/``.
"""

from __future__ import annotations

from quota._checkout import stand_in

stand_in(__name__, "cli")
