"""Who is calling: the client IP behind trusted proxies, credential hashes, HMAC-signed callers.

Pure functions and a few small classes (`Callers` resolves a request's
caller for a guard); nothing here does I/O. Identity is a *tier*, not a
gate: every caller gets one, the weakest being ``anon``.

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
import logging
import re
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from quota.http._config import HttpConfig

log = logging.getLogger("quota.http")

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
    from quota._core.errors import ConfigurationError

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


#: The forwarding-chain headers a trusted proxy may write (`HttpConfig.forwarded_header`).
CHAIN_HEADERS = ("x-forwarded-for", "forwarded")
#: Hops of a forwarding chain read at most, from the right; past them the last
#: address believed is the client.
MAX_HOPS = 32
#: Characters of a ``Forwarded`` header read at most, from the right: 32 hops of
#: 64 characters, or 16 of the longest elements a proxy writes (quoted IPv6
#: addresses with ports in ``for`` and ``by``, ``proto``, ``host``).
MAX_FORWARDED_CHARS = MAX_HOPS * 64

#: A header name: RFC 9110 token characters, lower case.
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9a-z-]+")
_TOKEN = r"[!#$%&'*+.^_`|~0-9A-Za-z-]+"
_PAIR_TEXT = rf"({_TOKEN})=(?:({_TOKEN})|\"((?:[^\"\\]|\\.)*)\")"
#: One RFC 7239 pair: name, token value, quoted value (without its quotes).
_PAIR = re.compile(_PAIR_TEXT, re.DOTALL)
#: One element and its comma: group 1 is the element, None when it does not
#: parse (then the element runs to the next comma, quoted or not). Each run of
#: spaces has one place it can go, so a failed match never backtracks far.
_ITEM = rf"[ \t]*(?:{_PAIR_TEXT}[ \t]*)?"
_ELEMENT = re.compile(rf"(?:({_ITEM}(?:;{_ITEM})*)(?=,|\Z)|[^,]*)(?:,|\Z)", re.DOTALL)
_QUOTED_PAIR = re.compile(r"\\(.)", re.DOTALL)
_PORT = re.compile(r"[0-9]{1,5}|_[A-Za-z0-9._-]+")
_OBFUSCATED = re.compile(r"_[A-Za-z0-9._-]+")
#: Longer than any address with a port (and an IPv6 zone) a proxy writes.
_MAX_NODE = 100
#: What a hop is when a proxy did not name its peer (``unknown``, ``_hidden``).
_HIDDEN = "hidden"
#: Peers whose parsed address a `ProxyRules` remembers (then it starts afresh).
_PEERS_KEPT = 4096

Node = Address | str | None
"""A hop of a chain: an address, `_HIDDEN`, or None when malformed."""


@dataclass(frozen=True, slots=True)
class ProxyRules:
    """How `client_ip` reads a request that came through `trusted` proxies.

    `HttpConfig` builds one at construction (see `proxy_rules`); the
    middleware passes it on every request.
    """

    trusted: tuple[Network, ...] = ()
    """The trusted proxies."""
    headers: tuple[tuple[Network, str], ...] = ()
    """A single-address header per proxy network, the most specific network first."""
    every: str | None = None
    """A single-address header believed from every trusted proxy."""
    chain: str = "x-forwarded-for"
    """The chain header the trusted proxies write: ``x-forwarded-for`` or ``forwarded``."""
    peers: dict[str, tuple[str | None, Address | None, bool]] = field(
        default_factory=dict, compare=False, repr=False
    )
    """Peers seen: the peer as a normalised address (None when it is not one),
    the address, and whether it is a trusted proxy."""

    def header_for(self, address: Address) -> str | None:
        """The single-address header believed from the proxy at `address`, if any."""
        for network, name in self.headers:
            if address.version == network.version and address in network:
                return name
        return self.every


def check_header_name(name: str, value: object) -> str:
    """`value` as a lower-case header name; `ConfigurationError` naming `name` otherwise."""
    from quota._core.errors import ConfigurationError

    header = value.strip().lower() if isinstance(value, str) and value.isascii() else None
    if header is None or not _HEADER_NAME.fullmatch(header):
        raise ConfigurationError(
            f"{name}: {value!r} is not a header name (letters, digits and !#$%&'*+-.^_`|~,"
            " e.g. 'cf-connecting-ip')"
        )
    return header


def check_forwarded_header(name: str, value: object) -> str:
    """`value` as one of `CHAIN_HEADERS`; `ConfigurationError` naming `name` otherwise."""
    from quota._core.errors import ConfigurationError

    header = value.strip().lower() if isinstance(value, str) else None
    if header not in CHAIN_HEADERS:
        raise ConfigurationError(f"{name} must be one of {', '.join(CHAIN_HEADERS)}, got {value!r}")
    return header


def check_client_ip_header(name: str, value: object) -> str | dict[str, str] | None:
    """`value` with its header names lower-cased; `ConfigurationError` naming `name` otherwise.

    None, a header name, or a mapping of CIDR (or address) to header name;
    an empty mapping is None. The CIDRs are checked by `proxy_rules`.
    """
    from quota._core.errors import ConfigurationError

    if value is None:
        return None
    if isinstance(value, str):
        return _single_header(name, value)
    if not isinstance(value, Mapping):
        raise ConfigurationError(
            f"{name} must be a header name or a mapping of CIDR to header name, got {value!r}"
        )
    out = {}
    for network, header in value.items():
        if not isinstance(network, (str, ipaddress.IPv4Network, ipaddress.IPv6Network,
                                    ipaddress.IPv4Address, ipaddress.IPv6Address)):  # fmt: skip
            raise ConfigurationError(f"{name}: {network!r} is not a CIDR (e.g. 10.0.0.0/8)")
        out[str(network).strip()] = _single_header(f"{name}[{str(network).strip()!r}]", header)
    return out or None


def _single_header(name: str, value: object) -> str:
    from quota._core.errors import ConfigurationError

    header = check_header_name(name, value)
    if header in CHAIN_HEADERS:
        raise ConfigurationError(
            f"{name}: {header!r} is a forwarding chain, not one address; choose the chain"
            " header the proxies write with forwarded_header"
        )
    return header


def proxy_rules(
    name: str, trusted: tuple[Network, ...], client_ip_header: str | Mapping[str, str] | None,
    forwarded_header: str = "x-forwarded-for",
) -> ProxyRules:  # fmt: skip
    """The `ProxyRules` of checked settings (see `check_client_ip_header`).

    A client-IP header needs trusted proxies, and each CIDR it is mapped from
    must lie within one of them (elsewhere it would never be read):
    `ConfigurationError` naming `name` otherwise.
    """
    from quota._core.errors import ConfigurationError

    if client_ip_header is not None and not trusted:
        raise ConfigurationError(
            f"{name} needs trusted_proxies: a client-IP header is only read from a trusted proxy"
        )
    if not isinstance(client_ip_header, Mapping):
        return ProxyRules(trusted, (), client_ip_header, forwarded_header)
    headers = []
    for text, header in client_ip_header.items():
        (network,) = parse_networks(name, [text])
        if not any(
            network.version == proxy.version and network.subnet_of(proxy)  # type: ignore[arg-type]
            for proxy in trusted
        ):
            raise ConfigurationError(
                f"{name}: {text!r} is not within trusted_proxies, so its header would never be read"
            )
        headers.append((network, header))
    headers.sort(key=lambda pair: -pair[0].prefixlen)
    return ProxyRules(trusted, tuple(headers), None, forwarded_header)


def client_ip(
    peer: str | None, headers: Mapping[str, str], trusted: ProxyRules | tuple[Network, ...]
) -> str | None:
    """The client's address as this server may believe it.

    The TCP `peer` is the client unless it is a trusted proxy. From a trusted
    peer the forwarding chain (``X-Forwarded-For``, or RFC 7239 ``Forwarded``
    when the rules say so; never both) is walked from the right, one hop per
    proxy: the first hop that is not a trusted proxy is the client, and what
    it wrote further left is never read. At each trusted hop (the peer
    included) whose network has a single-address header (``CF-Connecting-IP``
    and the like, see `ProxyRules`) that the request carries with a valid
    address, that address is the client. No such header is read otherwise.

    Hops may carry a port (``1.2.3.4:5555``, ``[2001:db8::1]:443``); a bare
    IPv6 address is an address. A hop a trusted proxy wrote as ``unknown`` or
    an obfuscated name (``_hidden``) is taken for a proxy inside the trusted
    chain that did not know its peer (a Unix socket), and the walk goes on to
    its left. A malformed hop ends the walk, as do the end of the chain and
    `MAX_HOPS` hops read: then the last address believed is the client, the
    last trusted proxy at worst. No header content makes this raise.

    `trusted` is the rules `HttpConfig` built, or bare trusted networks (read
    with ``X-Forwarded-For`` and no single-address header). Returns the peer
    as given when it is not an address (a test client's ``"testclient"``),
    None when there is no peer.
    """
    if peer is None:
        return None
    rules = trusted if isinstance(trusted, ProxyRules) else ProxyRules(trusted)
    seen = rules.peers.get(peer)
    if seen is None:
        seen = _peer(peer, rules.trusted)
        if len(rules.peers) >= _PEERS_KEPT:
            rules.peers.clear()
        rules.peers[peer] = seen
    text, address, is_proxy = seen
    if not is_proxy or address is None:
        return peer if text is None else text
    return str(_walk(address, headers, rules))


def _peer(peer: str, trusted: tuple[Network, ...]) -> tuple[str | None, Address | None, bool]:
    address = _address(peer)
    if address is None:
        return None, None, False
    return str(address), address, bool(trusted) and _is_trusted(address, trusted)


def _walk(address: Address, headers: Mapping[str, str], rules: ProxyRules) -> Address:
    """The client behind the trusted proxy at `address` (see `client_ip`)."""
    found = _header_address(address, headers, rules)
    if found is not None:
        return found
    chain = headers.get(rules.chain)
    if not chain:
        return address
    nodes = _forwarded_nodes(chain) if rules.chain == "forwarded" else _xff_nodes(chain)
    believed = address
    for node in nodes:
        if node is None:
            break
        if isinstance(node, str):
            continue
        believed = node
        if not _is_trusted(node, rules.trusted):
            break
        found = _header_address(node, headers, rules)
        if found is not None:
            return found
    return believed


def _header_address(
    address: Address, headers: Mapping[str, str], rules: ProxyRules
) -> Address | None:
    name = rules.header_for(address)
    if name is None:
        return None
    value = headers.get(name)
    if not value:
        return None
    node = _node(value)
    return None if node is None or isinstance(node, str) else node


def _xff_nodes(text: str) -> Iterator[Node]:
    """The hops of an ``X-Forwarded-For``, rightmost first, at most `MAX_HOPS`."""
    parts = text.rsplit(",", MAX_HOPS)
    for part in reversed(parts[-MAX_HOPS:]):
        if part.strip(" \t"):
            yield _node(part)


def _forwarded_nodes(text: str) -> Iterator[Node]:
    """The ``for=`` of each RFC 7239 element, rightmost first, at most `MAX_HOPS`.

    Elements are split on commas outside quoted strings, pairs on semicolons;
    names are case-insensitive; quoted values are unescaped; empty elements
    are skipped. An element that does not parse, or has no ``for=`` or two,
    is None (the walk stops there). Splitting resumes at the next comma after
    such an element, so text a client wrote cannot swallow the well-formed
    elements proxies appended to its right.
    """
    if len(text) > MAX_FORWARDED_CHARS:
        text = text[-MAX_FORWARDED_CHARS:]
        text = text[text.find(",") + 1 :] if "," in text else ""
    elements = [match[1] for match in _ELEMENT.finditer(text)]
    read = 0
    for element in reversed(elements):
        if element is not None and not element.strip(" \t"):
            continue
        read += 1
        if element is None or read > MAX_HOPS:
            yield None
            return
        node: Node = None
        count = 0
        for pair in _PAIR.finditer(element):
            if pair[1].lower() == "for":
                count += 1
                value = pair[2]
                if value is None:
                    value = _QUOTED_PAIR.sub(r"\1", pair[3])
                node = _node(value)
        yield node if count == 1 else None


def _node(text: str) -> Node:
    """One hop: ``1.2.3.4``, ``1.2.3.4:80``, ``[2001:db8::1]:443``, ``2001:db8::1``, ``unknown``…"""
    text = text.strip(" \t")
    if not text or len(text) > _MAX_NODE:
        return None
    if text[0] == "[":
        host, bracket, port = text[1:].partition("]")
        if not bracket or (port and (port[0] != ":" or not _PORT.fullmatch(port[1:]))):
            return None
        return _ip(host)
    host, colon, port = text.partition(":")
    if colon:
        if ":" in port:
            return _ip(text)  # a bare IPv6 address
        if not _PORT.fullmatch(port):
            return None
        text = host
    if text.lower() == "unknown" or _OBFUSCATED.fullmatch(text):
        return _HIDDEN
    return _ip(text)


def _ip(text: str) -> Address | None:
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


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


class Callers:
    """Who is calling, for a guard: the app's ``identify`` hook, else the built-in tiers.

    A valid signature makes the caller ``trusted``; a bearer token or API
    key (accepted by the ``token_validator`` hook, when there is one) makes
    it ``auth``; anyone else is ``anon``, keyed by client IP. Repeat
    callers' identities are kept (bounded; raw values stay in this
    process's memory). A failing hook counts ``hook_failed`` through `count`
    (``count(name, **labels)``) and falls back to the built-in tiers.
    """

    def __init__(
        self, secret: bytes, identify: IdentifyHook | None, validator: TokenValidator | None,
        count: Callable[..., None],
    ) -> None:  # fmt: skip
        self.secret = secret
        self._identify = identify
        self._validator = validator
        self._count = count
        self._identities: dict[tuple[str, str], Identity] = {}

    def resolve(
        self, request: RequestInfo, now: float, config: HttpConfig
    ) -> tuple[Identity, str | None]:
        """The request's `Identity`, and the client IP's subject when its token went unchecked."""
        if self._identify is not None:
            try:
                found = self._identify(request)
            except Exception:
                self._count("hook_failed", hook="identify")
                log.exception("quota: the identify hook failed; using the built-in tiers")
                found = None
            if found is not None:
                return found, None
        headers = request.headers
        key_id, reason = verify_signature(
            headers, request.method, request.raw_path, now, config.hmac_secrets, config.hmac_window
        )
        if key_id is not None:
            return Identity(TRUSTED, "key:" + key_id), None
        if reason is not None:
            self._count("hmac_rejected", reason=reason)
        token = credential(headers, config.api_key_headers)  # type: ignore[arg-type]
        if token is not None and self._token_ok(token):
            caller = self._cached(AUTH, "tok", token, config)
            if self._validator is not None or config.unvalidated_token_ceiling is None:
                return caller, None
            return caller, self._by_ip(request, config).subject
        return self._by_ip(request, config), None

    def subject(self, kind: str, value: str, ipv6_prefix: int) -> str:
        """The subject an IP (``kind="ip"``) or token (``"tok"``) is keyed under."""
        return hashed_subject(kind, value, self.secret, ipv6_prefix=ipv6_prefix)

    def _by_ip(self, request: RequestInfo, config: HttpConfig) -> Identity:
        ip = client_ip(request.peer, request.headers, config.proxy_rules)
        if ip is None:
            return Identity(ANON, "ip:unknown")
        return self._cached(ANON, "ip", ip, config)

    def _cached(self, tier: str, kind: str, value: str, config: HttpConfig) -> Identity:
        found = self._identities.get((kind, value))
        if found is None:
            found = Identity(tier, self.subject(kind, value, config.ipv6_prefix))
            if len(self._identities) >= 65536:
                self._identities.clear()
            self._identities[(kind, value)] = found
        return found

    def _token_ok(self, token: str) -> bool:
        if self._validator is None:
            return True
        try:
            return bool(self._validator(token))
        except Exception:
            self._count("hook_failed", hook="token_validator")
            log.exception("quota: the token validator failed; treating the caller as anon")
            return False
