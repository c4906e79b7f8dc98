"""The ``quota`` command line (installed as ``quota._cli``); see `main`.

`cli.main` holds the group, the options every command shares and the exit codes; each
other module registers its commands on it when imported here.
"""

from . import bench as _bench  # noqa: F401  (registers `quota bench/demo`)
from . import dashboard as _dashboard  # noqa: F401  (registers `quota dashboard`)
from . import export as _export  # noqa: F401  (registers `quota export`)
from . import maintenance as _maintenance  # noqa: F401  (registers `quota migrate/downgrade/cleanup`)
from . import policy  # noqa: F401  (registers `quota policy`)
from . import rate as _rate  # noqa: F401  (registers `quota hit/peek/reset/top`)
from .doctor import doctor as _doctor  # noqa: F401  (registers `quota doctor`)
from .main import main
from .notify import notify as _notify  # noqa: F401  (registers `quota notify`)
from .quotas import usage as _usage  # noqa: F401  (registers `quota usage/grant/refund/ledger`)

__all__ = ["main"]
