"""Passwords out of URLs and messages: `redact` one URL, `redact_text` every URL in a text.

Pure text work, below everything else: `quota.QuotaError` runs every message through
`redact_text`, and `quota._core.url` shows URLs with `redact`.
"""

from __future__ import annotations

import re

#: A password given as a query parameter (libpq's ``password`` and ``sslpassword``).
_QUERY_PASSWORD = re.compile(r"(?i)(^|[?&;\s])((?:ssl)?pass(?:word|wd)?=)[^&;#\s]*")


def redact(url: str) -> str:
    """`url` without its password, for messages and logs.

    Never raises. Hides the password of ``scheme://user:password@host`` even
    when it holds (unencoded) ``@``, ``:``, ``/``, ``?`` or ``#``: everything
    between the user name and the last ``@`` before the path is the password.
    A ``password=`` (or ``sslpassword=``) query parameter is hidden too.
    Text without ``://`` gets the same treatment (``user:pw@host``, or a
    libpq key/value string with ``password=…``).
    """
    if not isinstance(url, str):
        return repr(url)
    scheme, sep, rest = url.partition("://")
    if not sep:  # not a URL (``user:pw@host`` or ``host=… password=…``): hide the same
        scheme, rest = "", url
    first_at = rest.find("@")
    if first_at >= 0:
        # The host part ends at the first "/" after an "@" (libpq: credentials never
        # hold a "/" it understands, so a "/" before the last "@" is still password).
        slash = rest.find("/", first_at)
        head, tail = (rest, "") if slash < 0 else (rest[:slash], rest[slash:])
        creds, _, host = head.rpartition("@")
        if ":" in creds:
            creds = creds.split(":", 1)[0] + ":***"
        rest = f"{creds}@{host}{tail}"
    return scheme + sep + _QUERY_PASSWORD.sub(r"\1\2***", rest)


#: A URL inside a message: a scheme, ``://``, then everything up to a blank or a quote.
#: (``scheme://[``: a bracketed IPv6 host, or a template such as ``redis://[:password@]host``.)
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://(?!\[)[^\s'\"<>`]+")


def redact_text(text: str) -> str:
    """`text` with the password of every URL in it hidden (see `redact`), whatever its
    scheme, and every ``password=`` parameter outside one too."""
    if "://" in text:
        text = _URL_IN_TEXT.sub(lambda found: redact(found.group(0)), text)
    return _QUERY_PASSWORD.sub(r"\1\2***", text)
