"""Who is calling: the client IP behind trusted proxies, credential hashes, HMAC-signed callers.

Pure functions and one small class; nothing here does I/O. Identity is a
*tier*, not a gate: every caller gets one, the weakest being ``anon``.

==========  =============================================  ========================
tier        when                                           subject (part of the key)
==========  =============================================  ========================
trusted     a valid HMAC-SHA256 signature (see `sign`)     ``key:<key id>``
auth        a bearer token or API key is present           ``tok:<keyed hash>``
anon        everyone else                                  ``ip:<keyed hash>``
==========  =============================================  ========================

No raw IP or token ever leaves this module: they are reduced to an
HMAC-SHA256 of the value under the server's hash secret, so the database
holds only digests that cannot be reversed without that secret.
"""

from __future__ import annotations

import hmac
import ipaddress
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Address = ipaddress.IPv4Address | ipaddress.IPv6Address

ANON = "anon"
AUTH = "auth"
TRUSTED = "trusted"

#: The headers of a signed request (`sign` builds them).
KEY_ID_HEADER = "x-quota-key-id"
TIMESTAMP_HEADER = "x-quota-timestamp"
SIGNATURE_HEADER = "x-quota-signature"

#: A timestamp header as `sign` writes it: whole epoch seconds in ASCII digits
#: (fifteen of them reach far past any clock).
_TIMESTAMP = re.compile(r"[0-9]{1,15}")

#: Why a signature was not accepted; each is counted in the metrics.
HMAC_REASONS = ("malformed", "unknown_key", "expired", "bad_signature")

#: Hex digits of a keyed hash kept in a key: 128 bits, short enough for a readable key.
HASH_HEX = 32


@dataclass(frozen=True, slots=True)
class Identity:
    """The tier a request falls in and the subject it is counted under."""

    tier: str
    """``anon``, ``auth``, ``trusted``, or a tier the app's hook names (``admin``…)."""
    subject: str
    """A stable, PII-free name of the caller (a hash, a key id, an account id)."""
    tenant: str | None = None
    """The tenant whose plan scales the limits (see `Plans`), if the app knows it."""


@dataclass(slots=True)
class RequestInfo:
    """What the core needs of an HTTP request, from either an ASGI scope or a WSGI environ."""

    method: str
    """Upper-case method."""
    path: str
    """Decoded path, for matching route classes."""
    raw_path: str
    """The path as sent (percent-encoded, no query string): what a signature covers."""
    headers: Mapping[str, str]
    """Lower-case names; repeated headers joined with ``,``."""
    peer: str | None
    """The address of the TCP peer (the last proxy, or the client itself)."""
    raw: Any = None
    """The ASGI scope or WSGI environ, for the app's own hooks."""


def parse_networks(name: str, values: object) -> tuple[Network, ...]:
    """CIDRs (or bare addresses) as networks; raise `ConfigurationError` naming `name`."""
    from quota._errors import ConfigurationError

    if isinstance(values, str):
        values = [v for v in values.replace(";", ",").split(",") if v.strip()]
    if not isinstance(values, (list, tuple, frozenset, set)):
        raise ConfigurationError(f"{name} must be a list of CIDRs, got {values!r}")
    networks = []
    for value in values:
        try:
            networks.append(ipaddress.ip_network(str(value).strip(), strict=False))
        except ValueError as exc:
            raise ConfigurationError(
                f"{name}: {value!r} is not an IP address or CIDR (e.g. 10.0.0.0/8)"
            ) from exc
    return tuple(networks)


def _address(text: str) -> Address | None:
    try:
        address = ipaddress.ip_address(text.strip().strip("[]"))
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def client_ip(
    peer: str | None, headers: Mapping[str, str], trusted: tuple[Network, ...]
) -> str | None:
    """The client's address as this server may believe it.

    Headers are believed only from a trusted peer (a proxy in `trusted`):
    ``cf-connecting-ip`` first, then ``x-forwarded-for`` read from the right,
    skipping trusted hops; the first untrusted address is the client. A
    header from any other peer is ignored, so a client cannot pick its own
    key by sending one. Returns the peer as given when it is not an address
    (a test client's ``"testclient"``), None when there is no peer.
    """
    if peer is None:
        return None
    address = _address(peer)
    if address is None:
        return peer
    if not trusted or not _is_trusted(address, trusted):
        return str(address)
    cf = headers.get("cf-connecting-ip")
    if cf:
        real = _address(cf)
        if real is not None:
            return str(real)
    forwarded = headers.get("x-forwarded-for")
    if not forwarded:
        return str(address)
    candidate = address
    for part in reversed(forwarded.split(",")):
        hop = _address(part)
        if hop is None:
            break  # garbage from here on: the last address we believed stands
        candidate = hop
        if not _is_trusted(hop, trusted):
            break
    return str(candidate)


def _is_trusted(address: Address, trusted: tuple[Network, ...]) -> bool:
    return any(address.version == net.version and address in net for net in trusted)


def ip_subject_value(ip: str, ipv6_prefix: int) -> str:
    """What an IP is keyed by: the address, or its /`ipv6_prefix` network for IPv6.

    One IPv6 subscriber usually holds a whole /64; keying single addresses
    would hand them 2**64 buckets.
    """
    address = _address(ip)
    if isinstance(address, ipaddress.IPv6Address) and ipv6_prefix < 128:
        network = ipaddress.IPv6Network((address, ipv6_prefix), strict=False)
        return f"{network.network_address}/{ipv6_prefix}"
    return ip


def keyed_hash(secret: bytes, kind: str, value: str) -> str:
    """HMAC-SHA256 of `value` (domain-separated by `kind`) under `secret`, as 32 hex digits."""
    digest = hmac.digest(secret, f"{kind}\x00{value}".encode("utf-8", "surrogatepass"), "sha256")
    return digest.hex()[:HASH_HEX]


def credential(headers: Mapping[str, str], api_key_headers: tuple[str, ...]) -> str | None:
    """The bearer token or API key a request carries, if any."""
    authorization = headers.get("authorization")
    if authorization:
        scheme, _, token = authorization.strip().partition(" ")
        value = token.strip() if scheme.lower() == "bearer" else authorization.strip()
        if value:
            return value
    for name in api_key_headers:
        value = headers.get(name, "").strip()
        if value:
            return value
    return None


def signature_message(key_id: str, method: str, path: str, timestamp: int | str) -> bytes:
    """The bytes a caller signs: ``keyId\\nMETHOD\\npath\\ntimestamp``."""
    return f"{key_id}\n{method.upper()}\n{path}\n{timestamp}".encode()


def sign(
    key_id: str, secret: str | bytes, method: str, path: str, timestamp: float | None = None
) -> dict[str, str]:
    """The headers that make a request *trusted*: key id, timestamp and HMAC-SHA256 signature.

    `path` is the request path as sent, without the query string. The
    server accepts the signature for ±`hmac_window` seconds (5 minutes by
    default) around `timestamp` (default: now).
    """
    ts = int(time.time() if timestamp is None else timestamp)
    key = secret.encode() if isinstance(secret, str) else secret
    signature = hmac.new(key, signature_message(key_id, method, path, ts), "sha256").hexdigest()
    return {KEY_ID_HEADER: key_id, TIMESTAMP_HEADER: str(ts), SIGNATURE_HEADER: signature}


def verify_signature(
    headers: Mapping[str, str], method: str, path: str, now: float,
    keys: Mapping[str, bytes], window: int,
) -> tuple[str | None, str | None]:  # fmt: skip
    """``(key_id, None)`` for a valid signature, ``(None, reason)`` for a bad one, ``(None, None)`` for none.

    Every key id in `keys` is accepted at once, so a secret is rotated by
    adding the new id, moving callers over, then removing the old one. The
    comparison is constant-time.
    """
    key_id = headers.get(KEY_ID_HEADER)
    stamp = headers.get(TIMESTAMP_HEADER)
    given = headers.get(SIGNATURE_HEADER)
    if key_id is None and stamp is None and given is None:
        return None, None
    # Exactly what `sign` sends: ASCII digits, a bounded number of them. An
    # exception here would be a limiter failure, and fail-open would let the
    # request through uncounted; ``str.isdigit`` takes '²' (int() refuses it)
    # and '\u0661\u0660' (int() reads 10), and int() of thousands of digits raises.
    if (
        not isinstance(key_id, str)
        or not key_id
        or not isinstance(given, str)
        or not given
        or not isinstance(stamp, str)
        or not _TIMESTAMP.fullmatch(stamp)
    ):
        return None, "malformed"
    secret = keys.get(key_id)
    if secret is None:
        return None, "unknown_key"
    if abs(int(now) - int(stamp)) > window:  # timestamps are whole seconds
        return None, "expired"
    try:
        message = signature_message(key_id, method, path, stamp)
        given_bytes = bytes.fromhex(given.strip())
    except ValueError:  # UnicodeEncodeError (a lone surrogate) is one too
        return None, "malformed"
    expected = hmac.new(secret, message, "sha256")
    if not hmac.compare_digest(expected.digest(), given_bytes):
        return None, "bad_signature"
    return key_id, None


#: An app's own say on who is calling: return an `Identity`, or None for the built-in tiers.
IdentifyHook = Callable[[RequestInfo], "Identity | None"]
#: Decides whether a presented token or API key is one the app accepts (else: anon tier).
TokenValidator = Callable[[str], bool]


def hashed_subject(kind: str, value: str, secret: bytes, *, ipv6_prefix: int = 64) -> str:
    """The subject the middleware keys an IP (``kind="ip"``) or a token (``"tok"``) under.

    ``quota policy set --ip/--token`` uses it to name one caller in an
    override without storing the raw value.
    """
    if kind == "ip":
        value = ip_subject_value(value, ipv6_prefix)
    elif kind != "tok":
        raise ValueError(f"kind must be 'ip' or 'tok', got {kind!r}")
    return f"{kind}:{keyed_hash(secret, kind, value)}"
