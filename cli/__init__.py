"""The ``quota`` command line (installed as ``quota._cli``); see `main`."""

from . import policy  # noqa: F401  (registers `quota policy`)
from .doctor import doctor as _doctor  # noqa: F401  (registers `quota doctor`)
from .main import main
from .quotas import usage as _usage  # noqa: F401  (registers `quota usage/grant/refund/ledger`)

__all__ = ["main"]
