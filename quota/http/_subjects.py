"""Naming one caller as the middleware does: the subject of an IP address or a token, and
the hashing secret from the environment (for tools that address a caller's policy)."""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping

from quota._core.errors import ConfigurationError
from quota.http._env import apply_env
from quota.http._identity import client_ip, hashed_subject


def hash_secret_from_env(env: Mapping[str, str]) -> bytes | None:
    """``$QUOTA_HASH_SECRET`` (alias ``$RATE_LIMIT_SECRET``) as `quota.http.HttpConfig.from_env`
    reads it.

    None when neither is set; `ConfigurationError`, with the middleware's
    message, for one it would refuse (under 16 bytes, not UTF-8).
    """
    names = ("QUOTA_HASH_SECRET", "RATE_LIMIT_SECRET")
    secret = apply_env({n: env[n] for n in names if n in env}, {}).get("hash_secret")
    if secret is None:
        return None
    key: bytes = secret.encode() if isinstance(secret, str) else secret
    return key


def ip_subject(ip: str, secret: bytes, *, ipv6_prefix: int = 64) -> str:
    """The subject the middleware keys a client at `ip` under (with `ipv6_prefix` as its own).

    Normalised as the middleware normalises a client's address: blanks and
    brackets stripped, an IPv4-mapped IPv6 address read as the IPv4 one, an
    IPv6 address keyed by its /`ipv6_prefix` network. `ConfigurationError`
    when `ip` is not an IP address.
    """
    address = client_ip(ip, {}, ())
    try:
        ipaddress.ip_address(address or "")
    except ValueError:
        raise ConfigurationError(f"not an IP address: {ip!r}") from None
    assert address is not None
    return hashed_subject("ip", address, secret, ipv6_prefix=ipv6_prefix)


def token_subject(token: str, secret: bytes) -> str:
    """The subject the middleware keys a caller presenting `token` (a bearer token or API key) under."""
    if not isinstance(token, str):
        raise ConfigurationError(f"token must be a string, got {token!r}")
    return hashed_subject("tok", token, secret)
