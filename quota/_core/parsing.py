"""Values a person writes as text in a setting: whole numbers, decimal numbers, true/false.

One reading of each for every place that takes one (environment variables,
URL query parameters, the command line, the settings table), so that the
same text means the same everywhere. Each function returns None for text it
does not read; the caller raises its own `ConfigurationError`, naming the
setting and the text.

Numbers are ASCII digits only: ``str.isdigit`` also takes ``'²'`` (which
`int` refuses) and ``'\\u0661\\u0660'`` (which `int` and `float` read as 10),
and a bounded number of them keeps `int` of thousands of digits out.
"""

from __future__ import annotations

import math
import re

#: Nineteen digits hold every 64-bit count (2**63 - 1 has nineteen).
_WHOLE = re.compile(r"[0-9]{1,19}")
_SIGNED_WHOLE = re.compile(r"-?[0-9]{1,19}")
#: Up to twenty digits either side of the point: the shortest text of any float
#: (``repr``, as quota writes numbers back) has at most 17 significant digits,
#: after at most three zeros behind the point (``0.00012345678901234567``), so
#: every number quota writes reads again; digits past the 17th only round.
_DECIMAL = re.compile(r"(?:[0-9]{1,20}(?:\.[0-9]{0,20})?|\.[0-9]{1,20})(?:[eE][+-]?[0-9]{1,3})?")

#: The words read as true and as false (any case, blanks around ignored).
TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
FALSE_WORDS = frozenset({"0", "false", "no", "off"})


def parse_whole(text: str, *, signed: bool = False) -> int | None:
    """The whole number `text` writes in ASCII digits (a leading ``-`` when `signed`), or None.

    Blanks around the digits are ignored; there is no range check beyond
    nineteen digits.
    """
    value = text.strip()
    return int(value) if (_SIGNED_WHOLE if signed else _WHOLE).fullmatch(value) else None


def parse_decimal(text: str) -> float | None:
    """The finite, non-negative number `text` writes in ASCII digits, or None.

    ``2``, ``0.5``, ``.5``, ``5.`` and ``1e-3`` read; a sign, ``nan``,
    ``inf``, ``1_000`` and text that overflows a float (``1e999``) do not.
    Blanks around the number are ignored.
    """
    value = text.strip()
    if not _DECIMAL.fullmatch(value):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def parse_flag(text: str) -> bool | None:
    """True for ``1``, ``true``, ``yes``, ``on``; False for ``0``, ``false``, ``no``, ``off``; else None.

    Any case; blanks around the word are ignored.
    """
    word = text.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    return None
