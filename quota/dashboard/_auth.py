"""The dashboard's credentials: the bearer token, the signed session cookie, CSRF tokens.

Pure functions over the token, with the standard library's `hmac` only: a
session cookie is ``<issued>.<nonce>.<mac>``, the MAC an HMAC-SHA256 keyed by
the token, so changing the token logs every session out. A session's CSRF token
is another HMAC of its nonce.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time

#: The session cookie's name.
SESSION_COOKIE = "quota_dashboard_session"
#: The login form's double-submit cookie (there is no session yet to bind its CSRF token to).
LOGIN_COOKIE = "quota_dashboard_login"
#: How long a session lasts (seconds).
SESSION_TTL = 12 * 3600


def _mac(token: str, message: str) -> str:
    return hmac.new(token.encode(), message.encode(), hashlib.sha256).hexdigest()


def same(given: str | None, expected: str) -> bool:
    """Whether `given` equals `expected`, compared in constant time (False for None)."""
    if given is None:
        return False
    return hmac.compare_digest(given.encode(), expected.encode())


def bearer(header: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, or None."""
    if not header:
        return None
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        return None
    return value.strip()


def new_session(token: str, now: float | None = None) -> str:
    """A fresh session cookie value, signed with `token`."""
    issued = int(time.time() if now is None else now)
    nonce = secrets.token_urlsafe(18)
    return f"{issued}.{nonce}.{_mac(token, f'session|{issued}|{nonce}')}"


def session_id(token: str, cookie: str | None, now: float | None = None) -> str | None:
    """The nonce of a valid, unexpired session `cookie` signed with `token`; None otherwise."""
    if not cookie:
        return None
    parts = cookie.split(".")
    if len(parts) != 3 or not parts[0].isdigit():
        return None
    issued, nonce, mac = parts
    if not same(mac, _mac(token, f"session|{issued}|{nonce}")):
        return None
    if (time.time() if now is None else now) - int(issued) > SESSION_TTL:
        return None
    return nonce


def csrf_token(token: str, session: str) -> str:
    """The CSRF token of the session whose nonce is `session`."""
    return _mac(token, f"csrf|{session}")
