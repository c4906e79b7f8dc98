"""Fuzzing both HTTP middlewares with attacker-controlled requests: each counted exactly once.

`N_REQUESTS` random requests, half through the ASGI middleware (called with
built scopes, on an `AsyncLimiter`, with a default class, ``Forwarded`` as
the chain header and ``CF-Connecting-IP`` from 10.0.0.0/8) and half through
the WSGI middleware (called with built environs, on a sync `Limiter`, no
default class, ``X-Forwarded-For`` and ``X-Real-IP``), both on ``memory://``
with a frozen clock. Methods, paths (percent-encoding, ``..``, ``//``,
Unicode, NUL, newlines, thousands of characters) and headers (bearer tokens
and API keys, the HMAC signature headers valid and broken in every way,
forwarding headers with garbage and thousands of hops, CORS preflights,
random others) are random, from peers trusted and untrusted. What is held
for every request:

- it is either let through uncounted by configuration (an excluded path, a
  safe method on a ``mutations_only`` class, a CORS preflight, a path no
  class covers when there is no default class), which the test decides from
  the method, the path and the two preflight header names alone, or it is
  counted exactly once: one call to the limiter on the caller's own bucket
  (``rate_limit`` or ``hit``, recorded by wrapping the limiter the
  middleware is given), one ``ratelimit.hits`` event, on the route class and
  with the cost the test expects. Shared buckets (the per-IP ceiling of
  unvalidated tokens, a tenant's) are counted at most once each, only beside
  an ``auth`` caller's own, and always when the request was allowed;
- nothing raises out of the middleware (a server's 500), the answer is the
  app's 200 or the middleware's 429, no header carries CR or LF, and there
  is no ``ratelimit.errors`` (nor ``hook_failed``) event: a fail-open pass
  caused by what a client sent is an uncounted request;
- the *trusted* tier is given to exactly the requests the test signed
  validly, and a bucket keyed by IP (anon, the token ceiling) is keyed by
  the peer whenever the peer is not a trusted proxy, whatever the client's
  forwarding headers say;
- afterwards the limiter's stored count of every key (each window of it)
  equals the costs of the hits recorded on it.

The seed is random per run (``$QUOTA_HTTP_FUZZ_SEED`` replays one) and is
printed with every failure, with the first examples of each kind.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import io
import os
import random
import secrets
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import quote, unquote_to_bytes

import quota
from quota.http import HttpConfig, RoutePolicy, hashed_subject
from quota.http.asgi import QuotaMiddleware
from quota.http.wsgi import QuotaWSGIMiddleware

#: Requests in total, split evenly between the ASGI and the WSGI middleware.
N_REQUESTS = 30_000
SEED_ENV = "QUOTA_HTTP_FUZZ_SEED"

NOW = 1_750_003_200 + 1234.25  # frozen: every count lands in one window
SECRET = "fuzz-hash-secret-0123456789"
HMAC_KEYS = {"k1": "fuzz-signing-secret-one-0123", "k2": "fuzz-signing-secret-two-4567"}
TRUSTED_PROXIES = ["10.0.0.0/8", "fd00::/8"]
ALLOWED_ORIGIN = "https://app.example"
SAFE = frozenset({"GET", "HEAD", "OPTIONS"})
HMAC_HEADERS = ("x-quota-key-id", "x-quota-timestamp", "x-quota-signature")


@dataclass(frozen=True)
class Route:
    name: str
    patterns: tuple[str, ...]
    rates: str
    methods: frozenset[str] | None = None
    mutations_only: bool = False
    cost: int = 1


#: The route classes, first match wins (the test's own table of them).
ROUTES = (
    Route("write", ("/api/items",), "20/minute", mutations_only=True),
    Route("search", ("/api/search", "/api/users/{id}/export"), "30/minute", cost=3),
    Route("upload", ("/upload",), "10/minute;100/hour", methods=frozenset({"POST", "PUT"})),
    Route("api", ("/api",), "50/minute;1000/hour"),
)
DEFAULT = Route("rest", ("/",), "100/minute")
EXCLUDE = ("/health", "/static")


def make_config(setup: tuple[str, bool, str, Any]) -> HttpConfig:
    _, default, forwarded_header, client_ip_header = setup
    return HttpConfig(
        policies=[
            RoutePolicy(
                name=r.name,
                paths=list(r.patterns),
                rates=r.rates,
                cost=r.cost,
                mutations_only=r.mutations_only,
                methods=None if r.methods is None else sorted(r.methods),
            )
            for r in ROUTES
        ],
        default=RoutePolicy(name=DEFAULT.name, rates=DEFAULT.rates) if default else None,
        exclude=list(EXCLUDE),
        trusted_proxies=TRUSTED_PROXIES,
        forwarded_header=forwarded_header,
        client_ip_header=client_ip_header,
        hash_secret=SECRET,
        hmac_keys=HMAC_KEYS,
        runtime_policies=False,
    )


#: The two set-ups: (driver, default class?, chain header, client-IP header).
ASGI_SETUP = ("ASGI", True, "forwarded", {"10.0.0.0/8": "cf-connecting-ip"})
WSGI_SETUP = ("WSGI", False, "x-forwarded-for", "x-real-ip")
#: The buckets a request may count on beside the caller's own (once each, at most).
SHARED_BUCKETS = ("auth-ceiling", "tenant")


# -- what the test expects, from the method and the path alone ----------------------


def covers(pattern: str, path: str) -> bool:
    """The documented rule: `pattern` covers its path and everything under it, by segments."""
    wanted = pattern.split("/")[1:]
    parts = path.split("/")
    if parts[0] != "" or len(parts) - 1 < len(wanted):
        return False
    for want, part in zip(wanted, parts[1:], strict=False):
        if not (part if want == "{id}" else part == want):
            return False
    return True


def expected_route(
    method: str, path: str, headers: list[tuple[str, bytes]], *, default: bool
) -> Route | None:
    """The class the request is counted on, or None when configuration lets it through."""
    method = method.upper()  # as RequestInfo.method is documented (and werkzeug reads it)
    names = {name.lower() for name, _ in headers}
    if method == "OPTIONS" and "origin" in names and "access-control-request-method" in names:
        return None  # a CORS preflight
    path = path or "/"
    if any(covers(p, path) for p in EXCLUDE):
        return None
    for route in ROUTES:
        if route.methods is not None and method not in route.methods:
            continue
        if any(covers(p, path) for p in route.patterns):
            return None if route.mutations_only and method in SAFE else route
    return DEFAULT if default else None


# -- the random requests ---------------------------------------------------------------


@dataclass
class Case:
    method: str
    target: bytes | None
    """The path as sent (percent-encoded, no query); None: the server gives no raw path."""
    decoded: bytes
    """The percent-decoded path."""
    query: bytes
    headers: list[tuple[str, bytes]]
    peer: str | None
    script: str = ""
    """A WSGI mount point (SCRIPT_NAME), or the ASGI root_path; part of the path."""
    wsgi_text: dict[int, str] = field(default_factory=dict)
    """Header index -> a value handed to WSGI as text outside latin-1 (some servers do)."""
    signed: bool | None = False
    """Whether the HMAC headers are valid (None: cannot tell, no raw path to sign)."""

    def signed_on(self, driver: str) -> bool | None:
        """`signed`, as the driver sees the request (WSGI gets `wsgi_text` in place of some headers)."""
        if driver == "WSGI" and any(
            self.headers[i][0].lower() in HMAC_HEADERS for i in self.wsgi_text
        ):
            return False  # a signature header replaced by text that no signature is made of
        return self.signed

    @property
    def path(self) -> str:
        return self.script + self.decoded.decode("latin-1")

    def describe(self) -> str:
        headers = [(n, _short(v)) for n, v in self.headers]
        return (
            f"method={self.method!r} target={_short(self.target)} path={_short(self.path)}"
            f" script={self.script!r} query={_short(self.query)} peer={self.peer!r}"
            f" headers={headers} wsgi_text={ {k: _short(v) for k, v in self.wsgi_text.items()} }"
        )


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}...<{len(text)} chars>"


METHODS = ["GET", "POST", "PUT", "DELETE", "OPTIONS", "HEAD", "PATCH"]
ODD_METHODS = [
    "get", "post", "options", "Options", "head", "Delete", "patch", "PROPFIND", "BREW",
    "M-SEARCH", "CONNECT", "TRACE", "", "G", "GET ", " POST", "POST\x00", "OPTIONS\n",
    "X" * 300, "ÖPTIONS", "\xdfET",
]  # fmt: skip
SEGMENTS = [
    "api", "items", "search", "users", "export", "upload", "health", "static", "x", "1", "42",
    "..", ".", "", "%2e%2e", "%2E", "%2F", "%2f", "%0A", "%0a", "%0D", "%0d%0a", "%00", "%09",
    "%20", "%25", "%3F", "%23", ";x=1", "%C3%A9", "%FF", "%E2%80%AE", "%ef%bf%bd", "API",
    "Items", "%61pi", "~", "*", "..%2F", "%5C", "\\", "a%0Ab", "items%0A", "%0Aitems",
]  # fmt: skip
UNICODE = ["é", "日本", "\u202e", "ß", "\u0663", "²", "\U0001f600", "\ufeff", "İ"]
PREFIXES = [
    "/api/items", "/api/items/{}", "/api/search", "/api/users/{}/export", "/api", "/upload",
    "/health", "/static", "/", "/other", "/apix", "/api/itemsx", "/uploads", "/healthz",
]  # fmt: skip
TRUSTED_PEERS = ["10.0.0.5", "10.20.30.40", "::ffff:10.0.0.7", "fd00::1"]
UNTRUSTED_PEERS = ["203.0.113.9", "198.51.100.7", "2001:db8::5", "2001:db8:0:1::9"]
ODD_PEERS = [None, "", "testclient", "unix:/run/app.sock", "::ffff:203.0.113.10", "fe80::1%eth0"]
IP_VALUES = [
    "1.2.3.4", "1.2.3.4:80", "[2001:db8::1]:443", "2001:db8::1", "[2001:db8::1]", "unknown", "",
    " ", ",", ",,,", "10.0.0.1, 10.0.0.2", "198.51.100.1, 10.0.0.9", "_hidden", "for=1.2.3.4",
    "::ffff:10.0.0.9", "::ffff:1.2.3.4", "fe80::1%eth0", "fe80::1%", "999.1.1.1",
    "1.2.3.4 , 10.0.0.1", "1.2.3.4\x00", "0.0.0.0", "255.255.255.255", "::", "::1", "127.0.0.1",
    "01.02.03.04", "1.2.3", "0x7f.0.0.1", "[::1", "1.2.3.4/8", "10.0.0.0/8", "1.2.3.4%eth0",
    "²", "\u0661\u0662\u0663.\u0661.\u0661.\u0661", "1" * 5000,
]  # fmt: skip
FORWARDED = [
    "for=1.2.3.4;proto=http", 'for="[2001:db8::1]:80"', "for=unknown", "for=_x;by=10.0.0.1",
    "for=1.2.3.4, for=10.0.0.2", ";;;", "for=", 'for="', "garbage",
]  # fmt: skip
TIMESTAMPS_BAD = [
    "--1", "-1", "²", "\u0663", "\u0661\u0667\u0665\u0660\u0660\u0660\u0663\u0662\u0660\u0660",
    "1" * 10_000, "9" * 16, "1.5", "1e9", "0x10", " ", "", "+1750004434", "1750004434.0",
    " 1750004434", "1750004434 ", "\t1750004434", "1750004434\n", "nan", "inf", "\x00",
    "1_750_004_434", "\uff10\uff11\uff12",
]  # fmt: skip
HEADER_NAMES = [
    "accept", "user-agent", "cookie", "host", "x-forwarded-proto", "x-forwarded-host",
    "x-original-url", "x-rewrite-url", "x-http-method-override", "true-client-ip",
    "x-client-ip", "via", "referer", "x-request-id", "authorization2", "x-api-key2",
    "x-quota-key", "x-quota-sig", "quota-signature", "access-control-request-headers",
]  # fmt: skip


T = TypeVar("T")


class Gen:
    """Seeded request generator."""

    def __init__(self, seed: int) -> None:
        self.r = r = random.Random(seed)
        # Long forwarding chains are slices of one, made once (mostly trusted hops).
        self.hops = [
            f"10.{r.randrange(256)}.{r.randrange(256)}.{r.randrange(256)}"
            if r.random() < 0.95
            else self.pick(IP_VALUES)
            for _ in range(5000)
        ]

    def chance(self, p: float) -> bool:
        return self.r.random() < p

    def pick(self, values: list[T]) -> T:
        return self.r.choice(values)

    def text(self, n: int | None = None, alphabet: str | None = None) -> str:
        r = self.r
        n = r.randint(0, 24) if n is None else n
        if alphabet is None:
            alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-._~+/="
        if n > 256:  # long: a random chunk repeated (random enough, and fast)
            chunk = "".join(r.choices(alphabet, k=256))
            return (chunk * (n // 256 + 1))[:n]
        return "".join(r.choices(alphabet, k=n))

    def raw_bytes(self, n: int | None = None) -> bytes:
        n = self.r.randint(0, 24) if n is None else n
        return self.r.randbytes(n)

    def value(self) -> bytes:
        """A header value: text, Unicode as UTF-8, raw bytes, or a known troublemaker."""
        r = self.r
        kind = r.randrange(8)
        if kind == 0:
            return self.raw_bytes()
        if kind == 1:
            return self.pick(UNICODE).encode()
        if kind == 2:
            return self.pick(TIMESTAMPS_BAD + IP_VALUES).encode()
        if kind == 3:
            return self.text(r.randint(1000, 20_000)).encode()
        return self.text().encode()

    # -- pieces --

    def method(self) -> str:
        return self.pick(METHODS) if self.chance(0.85) else self.pick(ODD_METHODS)

    def path(self) -> tuple[bytes, str]:
        """``(target, script)``: the path as sent (ASCII unless rarely), and a mount point."""
        r = self.r
        if self.chance(0.02):
            return self.pick([b"", b"*", b"api", b"http://evil.example/api/items", b"?"]), ""
        prefix = self.pick(PREFIXES)
        if "{}" in prefix:
            prefix = prefix.replace("{}", self.segment())
        parts = [prefix.rstrip("/")] if prefix != "/" else [""]
        for _ in range(r.choice([0, 0, 1, 1, 2, 3, 5])):
            parts.append(self.segment())
        text = "/".join(parts) or "/"
        if self.chance(0.1):
            text += "/"
        if self.chance(0.05):
            text = "/" + text
        if self.chance(0.05):
            text = text.replace("/", "//", 1)
        if self.chance(0.01):
            text += "/" + "a" * r.randint(2000, 20_000)
        if self.chance(0.005):
            text += "/x" * r.randint(1000, 5000)
        target = text.encode("ascii")
        if self.chance(0.01):  # a client sending UTF-8 (or junk) unencoded
            target += self.pick([b"\xc3\xa9", b"\xff", b"\xe2\x80\xae", b"\x80abc"])
        script = ""
        if self.chance(0.03):
            script = self.pick(["/api", "/mount", "/health"])
        return target, script

    def segment(self) -> str:
        if self.chance(0.15):
            return quote(self.pick(UNICODE), safe="")
        if self.chance(0.1):
            return quote(self.text(self.r.randint(1, 12), "abcxyz019%/?#\n\r\x00 é"), safe="")
        return str(self.pick(SEGMENTS))

    def token(self) -> bytes:
        r = self.r
        kind = r.randrange(7)
        if kind == 0:
            return b""
        if kind == 1:
            return self.text(r.randint(10_000, 60_000)).encode()
        if kind == 2:
            return self.pick(UNICODE).encode() + self.text().encode()
        if kind == 3:
            return self.raw_bytes()
        if kind == 4:
            return self.pick([b" ", b"  x  ", b"\t", b"a b", b"Bearer", b"\x00", b"null"])
        return self.text(r.randint(1, 40)).encode()

    def authorization(self) -> bytes:
        r = self.r
        scheme = self.pick(
            [
                b"Bearer",
                b"bearer",
                b"BEARER",
                b"Basic",
                b"Token",
                b"Digest",
                b"",
                b"Bearer\t",
                b"Bear",
                b"ApiKey",
            ]
        )
        sep = self.pick([b" ", b" ", b"  ", b"", b"\t"])
        out = scheme + sep + self.token()
        if self.chance(0.1):
            out = b"  " + out + b"  "
        if r.random() < 0.05:
            out = self.value()
        return out

    def ip_value(self) -> bytes:
        r = self.r
        kind = r.randrange(10)
        if kind == 0:  # up to thousands of hops, mostly trusted ones
            start = r.randrange(len(self.hops))
            hops = self.hops[start : start + r.choice([2, 5, 31, 32, 33, 100, 3000])]
            if self.chance(0.5):
                hops.insert(0, self.pick(IP_VALUES))
            if self.chance(0.3):
                hops.append(self.pick(IP_VALUES))
            return ", ".join(hops).encode()
        if kind == 1:
            return self.value()
        if kind == 2:
            return ", ".join(self.pick(IP_VALUES) for _ in range(r.randint(1, 6))).encode()
        if kind == 3:
            return f"{r.randrange(256)}.{r.randrange(256)}.{r.randrange(256)}.{r.randrange(256)}".encode()
        if kind == 4:
            return f"2001:db8:{r.randrange(65536):x}::{r.randrange(65536):x}".encode()
        return self.pick(IP_VALUES).encode("utf-8", "surrogatepass")

    def encode(self, text: str) -> bytes:
        """`text` as header bytes: latin-1 when it can be (``'²'`` is one byte), else UTF-8."""
        if self.chance(0.5):
            try:
                return text.encode("latin-1")
            except UnicodeEncodeError:
                pass
        return text.encode("utf-8", "surrogatepass")

    def forwarded(self) -> bytes:
        """An RFC 7239 ``Forwarded`` value: well formed, long, quoted, broken."""
        r = self.r
        kind = r.randrange(6)
        if kind == 0:
            return self.pick(FORWARDED).encode()
        if kind == 1:
            return self.ip_value()
        if kind == 2:
            return self.value()
        start = r.randrange(len(self.hops))
        hops = self.hops[start : start + r.choice([1, 2, 5, 31, 32, 33, 100, 1000])]
        if self.chance(0.5):
            hops.insert(0, self.pick(IP_VALUES))
        if self.chance(0.3):
            hops.append(self.pick(IP_VALUES))
        items = []
        for hop in hops:
            if ":" in hop and self.chance(0.7):
                hop = f'"[{hop}]:{r.randrange(65536)}"'
            elif self.chance(0.2):
                hop = f'"{hop}:{r.randrange(65536)}"'
            item = f"for={hop}"
            if self.chance(0.2):
                item = self.pick(
                    [
                        f"{item};proto=https",
                        f"by=10.0.0.1;{item}",
                        f"For={hop}",
                        f"{item};for=1.2.3.4",
                        f'{item};host="a,b"',
                        f"{item};x",
                    ]
                )
            items.append(item)
        return self.pick([", ", ",", " , "]).join(items).encode("utf-8", "surrogatepass")

    def hmac_headers(
        self, method: str, target: bytes | None
    ) -> tuple[list[tuple[str, bytes]], bool | None]:
        """The signature headers, and whether they make a valid signature (None: unknowable)."""
        r = self.r
        key_id = (
            self.pick(["k1", "k2"])
            if self.chance(0.8)
            else self.pick(
                ["k3", "", "K1", "k1 ", " k1", "k1,k2", "k1\x00", "default", "ķ1", "k" * 500]
            )
        )
        known = key_id in HMAC_KEYS
        offset = r.choice([0, 1, -1, 5, -5, 120, -299, 299, 300, -300])
        expired = r.choice([301, -301, 3600, -86400, 10**9, -NOW])
        stamp_kind = r.randrange(10)
        fresh = True
        if stamp_kind < 6:
            stamp = str(int(NOW) + offset)
            if self.chance(0.1):
                stamp = "000" + stamp  # leading zeros: still ASCII digits, still signed as sent
        elif stamp_kind < 8:
            stamp = str(max(0, int(NOW + expired)))
            fresh = False
        else:
            stamp = self.pick(TIMESTAMPS_BAD)
            fresh = False
        sig_kind = r.randrange(10)
        valid_sig = False
        signable = target is not None and target != b"" and target.isascii() and b"?" not in target
        secret = HMAC_KEYS.get(key_id, "unknown-secret-000000000000")
        raw_path = "" if target is None else target.decode("latin-1")
        message = f"{key_id}\n{method.upper()}\n{raw_path}\n{stamp}".encode(
            "utf-8", "surrogatepass"
        )
        good = hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()
        if sig_kind < 6:
            signature, valid_sig = good, True
        elif sig_kind == 6:
            signature, valid_sig = self.pick([good.upper(), f" {good} "]), True
        elif sig_kind == 7:
            flipped = "0" if good[-1] != "0" else "1"
            signature = self.pick([good[:-1] + flipped, good[:-2], good + "00", "", "zz" * 32])
        elif sig_kind == 8:
            other = f"{key_id}\n{method.upper()}\n/elsewhere\n{stamp}".encode(
                "utf-8", "surrogatepass"
            )
            signature = hmac.new(secret.encode(), other, hashlib.sha256).hexdigest()
        else:
            signature = self.pick(
                ["²" * 64, "\u0663" * 64, "g" * 64, "0" * 10_000, "-", "\udcff" * 4]
            )
        headers = [
            ("X-Quota-Key-Id", self.encode(key_id)),
            ("X-Quota-Timestamp", self.encode(stamp)),
            ("X-Quota-Signature", self.encode(signature)),
        ]
        drop = r.randrange(12)
        if drop < 3:  # a piece missing
            del headers[drop]
        valid = known and fresh and valid_sig and drop >= 3
        return headers, (None if valid and not signable else valid)

    def case(self) -> Case:
        r = self.r
        method = self.method()
        target, script = self.path()
        decoded = unquote_to_bytes(target.split(b"?", 1)[0])
        query = self.text(r.randint(0, 30)).encode() if self.chance(0.2) else b""
        headers: list[tuple[str, bytes]] = []
        signed: bool | None = False
        raw = target if self.chance(0.9) else None
        full_raw = None if raw is None else script.encode() + raw
        if self.chance(0.45):
            hmac_part, signed = self.hmac_headers(method, full_raw)
            headers += hmac_part
        if self.chance(0.3):
            headers.append(
                (
                    self.pick(["Authorization", "authorization", "AUTHORIZATION"]),
                    self.authorization(),
                )
            )
        if self.chance(0.2):
            headers.append((self.pick(["x-api-key", "X-API-Key"]), self.token()))
        for name in ("X-Forwarded-For", "CF-Connecting-IP", "X-Real-IP", "Forwarded"):
            if self.chance(0.25):
                value = self.forwarded() if name == "Forwarded" else self.ip_value()
                headers.append((name, value))
        preflight = method.upper() == "OPTIONS" and self.chance(0.6)
        if preflight or self.chance(0.25):
            headers.append(
                (
                    "Origin",
                    self.pick(
                        [
                            ALLOWED_ORIGIN,
                            ALLOWED_ORIGIN,
                            "https://evil.example",
                            "null",
                            "",
                            "*",
                            "https://app.example/",
                            "https://APP.example",
                        ]
                    ).encode()
                    if self.chance(0.85)
                    else self.value(),
                )
            )
        if preflight or self.chance(0.1):
            headers.append(
                (
                    "Access-Control-Request-Method",
                    self.pick([b"POST", b"DELETE", b"", b"get", self.value()]),
                )
            )
        for _ in range(r.choice([0, 0, 1, 2, 4])):
            name = (
                self.pick(HEADER_NAMES)
                if self.chance(0.6)
                else self.text(r.randint(1, 20), "abcdefghijklmnopqrstuvwxyz0123456789-")
            )
            headers.append((name, self.value()))
        if headers and self.chance(0.08):  # a header sent twice
            headers.append(self.pick(headers))
        r.shuffle(headers)
        counts = Counter(name.lower() for name, _ in headers)
        if any(counts[n] > 1 for n in HMAC_HEADERS):
            signed = False  # joined with ',': never a valid signature
        wsgi_text: dict[int, str] = {}
        if headers and self.chance(0.05):
            index = r.randrange(len(headers))
            wsgi_text[index] = self.pick(
                [
                    "\u0663",
                    "²",
                    "\udcff",
                    "\ud800x",
                    "日本",
                    "\u0661\u0667\u0665\u0660",
                    "\u202e",
                    "\u0661\u0667\u0665\u0660\u0660\u0660\u0664\u0664\u0663\u0664",
                    "1750004434\u00a0",
                ]
            )
        peer_kind = r.randrange(10)
        peer: str | None
        if peer_kind < 4:
            peer = self.pick(TRUSTED_PEERS)
        elif peer_kind < 9:
            peer = self.pick(UNTRUSTED_PEERS)
        else:
            peer = self.pick(ODD_PEERS)
        return Case(method, raw, decoded, query, headers, peer, script, wsgi_text, signed)


# -- recording what the middleware does ----------------------------------------------


def record_hits(limiter: Any, calls: list[tuple[str, int, tuple[int, ...]]]) -> None:
    """Wrap `limiter`'s two counting calls so each one is recorded (key, cost, windows)."""
    rate_limit, hit = limiter.rate_limit, limiter.hit

    def recorded_rate_limit(key: str, limit: int, window: int, **options: Any) -> Any:
        calls.append((key, options.get("cost", 1), (window,)))
        return rate_limit(key, limit, window, **options)

    def recorded_hit(key: str, rates: Any, **options: Any) -> Any:
        calls.append((key, options.get("cost", 1), tuple(rate.window for rate in rates)))
        return hit(key, rates, **options)

    limiter.rate_limit = recorded_rate_limit
    limiter.hit = recorded_hit


@dataclass
class Outcome:
    """What one request did."""

    calls: list[tuple[str, int, tuple[int, ...]]]
    events: list[str]
    app_calls: int
    status: int | None
    headers: list[tuple[bytes, bytes]]
    error: BaseException | None


class Findings:
    """Invariant violations by kind, with the first examples of each."""

    EXAMPLES = 3

    def __init__(self, seed: int, setup: tuple[str, bool, str, Any]) -> None:
        self.seed, self.setup, self.default = seed, setup, setup[1]
        self.driver = (
            f"{setup[0]} (default class: {setup[1]}, chain: {setup[2]}, client IP: {setup[3]})"
        )
        self.counts: Counter[str] = Counter()
        self.examples: dict[str, list[str]] = defaultdict(list)
        self.seen: set[tuple[str, int]] = set()

    def add(self, kind: str, index: int, case: Case | None, detail: str) -> None:
        if case is not None:
            if (kind, index) in self.seen:
                return  # one request counts once per kind
            self.seen.add((kind, index))
        self.counts[kind] += 1
        if len(self.examples[kind]) < self.EXAMPLES:
            where = "" if case is None else f"\n      request #{index}: {case.describe()}"
            self.examples[kind].append(f"{detail}{where}")

    def check(self, index: int, case: Case, out: Outcome) -> None:
        route = expected_route(case.method, case.path, case.headers, default=self.default)
        want = 0 if route is None else 1
        if out.error is not None:
            self.add("exception (a 500)", index, case, f"{type(out.error).__name__}: {out.error}")
        elif out.status not in (200, 429):
            self.add("status not 200/429", index, case, f"status {out.status}")
        for name, value in out.headers:
            if b"\r" in value or b"\n" in value or b"\r" in name or b"\n" in name:
                self.add("CR/LF in a response header", index, case, f"{name!r}: {_short(value)}")
        errors = [e for e in out.events if e in ("ratelimit.errors", "ratelimit.hook_failed")]
        if errors:
            self.add(
                "limiter or hook failure (errors/hook_failed event)",
                index,
                case,
                f"events {errors}",
            )
        if out.status == 429 and out.app_calls:
            self.add("429 yet the app ran", index, case, "")
        if out.status == 200 and out.app_calls != 1:
            self.add("200 without the app", index, case, f"app calls {out.app_calls}")
        own = [c for c in out.calls if c[0].split(":", 3)[2] not in SHARED_BUCKETS]
        shared = [c for c in out.calls if c[0].split(":", 3)[2] in SHARED_BUCKETS]
        got_calls, got_hits = len(own), out.events.count("ratelimit.hits")
        if got_calls != want or (out.error is None and got_hits != want):
            kind = (
                "uncounted"
                if got_calls < want
                else "counted but expected free"
                if want == 0
                else "counted more than once"
            )
            self.add(
                kind,
                index,
                case,
                f"expected {want} hit(s) on route"
                f" {route and route.name!r}; caller-bucket calls {got_calls}"
                f" ({[c[0] for c in own]}), hits events {got_hits}",
            )
        tiers = {key.split(":", 3)[2] for key, _, _ in own}
        scopes = Counter(key.split(":", 3)[2] for key, _, _ in shared)
        if any(n > 1 for n in scopes.values()) or (scopes and (not own or tiers != {"auth"})):
            self.add(
                "shared bucket counted wrongly", index, case, f"calls {[c[0] for c in out.calls]}"
            )
        if tiers == {"auth"} and out.status == 200 and scopes["auth-ceiling"] != 1:
            self.add(
                "allowed auth request without its per-IP ceiling counted",
                index,
                case,
                f"calls {[c[0] for c in out.calls]}",
            )
        for key, cost, _ in out.calls:
            _, route_name, tier, subject = key.split(":", 3)
            if route is not None and (route_name != route.name or cost != route.cost):
                self.add(
                    "counted on the wrong class or cost",
                    index,
                    case,
                    f"key {key!r} cost {cost}; expected class {route.name!r} cost {route.cost}",
                )
            signed = case.signed_on(self.setup[0])
            if signed is not None and tier not in SHARED_BUCKETS and (tier == "trusted") != signed:
                self.add(
                    "trusted tier without a valid signature"
                    if tier == "trusted"
                    else "valid signature not trusted",
                    index,
                    case,
                    f"key {key!r}",
                )
            if (
                tier in ("anon", "auth-ceiling")
                and case.peer in UNTRUSTED_PEERS
                and subject != hashed_subject("ip", case.peer, SECRET.encode())
            ):
                self.add(
                    "IP bucket behind an untrusted peer keyed by something else",
                    index,
                    case,
                    f"key {key!r}",
                )

    def check_stored(
        self, calls: list[tuple[str, int, tuple[int, ...]]], stored: Callable[[str, int], int]
    ) -> None:
        expected: Counter[tuple[str, int]] = Counter()
        for key, cost, windows in calls:
            for window in windows:
                expected[(key, window)] += cost
        for (key, window), total in expected.items():
            found = stored(key, window)
            if found != total:
                self.add(
                    "stored count differs from the hits",
                    -1,
                    None,
                    f"key {key!r} window {window}: stored {found}, hits recorded {total}",
                )

    def report(self) -> str:
        lines = [
            f"{self.driver}: invariant violations with seed {self.seed}"
            f" (replay: {SEED_ENV}={self.seed}):"
        ]
        for kind, count in self.counts.most_common():
            lines.append(f"  {kind}: {count} request(s)")
            lines += [f"    - {example}" for example in self.examples[kind]]
        return "\n".join(lines)

    def assert_none(self) -> None:
        assert not self.counts, self.report()


def seed() -> int:
    value = os.environ.get(SEED_ENV)
    return int(value) if value else secrets.randbits(32)


def cases(seed: int, n: int) -> list[Case]:
    gen = Gen(seed)
    return [gen.case() for _ in range(n)]


# -- the two drivers -------------------------------------------------------------------


def asgi_scope(case: Case) -> dict[str, Any]:
    path = case.script + case.decoded.decode("utf-8", "replace")  # as uvicorn decodes it
    scope: dict[str, Any] = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": case.method,
        "scheme": "http",
        "path": path,
        "root_path": case.script,
        "query_string": case.query,
        "server": ("testserver", 80),
        "headers": [(name.lower().encode("latin-1"), value) for name, value in case.headers],
        "client": None if case.peer is None else (case.peer, 50000),
    }
    if case.target is not None:
        scope["raw_path"] = case.script.encode() + case.target
    return scope


def wsgi_environ(case: Case, index: int) -> dict[str, Any]:
    environ: dict[str, Any] = {
        "REQUEST_METHOD": case.method,
        "SCRIPT_NAME": case.script,
        "PATH_INFO": case.decoded.decode("latin-1"),  # PEP 3333: bytes as latin-1 text
        "QUERY_STRING": case.query.decode("latin-1"),
        "SERVER_NAME": "testserver",
        "SERVER_PORT": "80",
        "SERVER_PROTOCOL": "HTTP/1.1",
        "wsgi.url_scheme": "http",
        "wsgi.input": io.BytesIO(b""),
        "wsgi.errors": io.StringIO(),
        "wsgi.version": (1, 0),
        "wsgi.multithread": False,
        "wsgi.multiprocess": False,
        "wsgi.run_once": False,
    }
    if case.peer is not None:
        environ["REMOTE_ADDR"] = case.peer
    if case.target is not None:
        raw = (case.script.encode() + case.target).decode("latin-1")
        if case.query:
            raw += "?" + case.query.decode("latin-1")
        environ["RAW_URI" if index % 2 else "REQUEST_URI"] = raw
    for i, (name, value) in enumerate(case.headers):
        key = "HTTP_" + name.upper().replace("-", "_")
        text = case.wsgi_text.get(i, value.decode("latin-1"))
        environ[key] = environ[key] + "," + text if key in environ else text
    return environ


def sent_to(sent: list[Any]) -> Callable[[Any], Awaitable[None]]:
    """An ASGI ``send`` that keeps the messages in `sent`."""

    async def send(message: Any) -> None:
        sent.append(message)

    return send


def run_asgi(seed: int, n: int, findings: Findings) -> None:
    async def main() -> None:
        limiter = quota.connect_async("memory://", clock=lambda: NOW)
        calls: list[tuple[str, int, tuple[int, ...]]] = []
        record_hits(limiter, calls)
        events: list[str] = []
        app_calls: list[int] = []

        async def app(scope: Any, receive: Any, send: Any) -> None:
            app_calls.append(1)
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"text/plain")],
                }
            )
            await send({"type": "http.response.body", "body": b"ok"})

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b"", "more_body": False}

        middleware = QuotaMiddleware(
            app,
            limiter=limiter,
            config=make_config(findings.setup),
            observer=lambda name, labels: events.append(name),
            cors_origins=[ALLOWED_ORIGIN],
        )
        for index, case in enumerate(cases(seed, n)):
            first_call, first_event, first_app = len(calls), len(events), len(app_calls)
            sent: list[Any] = []
            send = sent_to(sent)

            error = None
            try:
                await middleware(asgi_scope(case), receive, send)
            except Exception as exc:
                error = exc
            starts = [m for m in sent if m["type"] == "http.response.start"]
            status = starts[0]["status"] if len(starts) == 1 else None
            headers = list(starts[0]["headers"]) if len(starts) == 1 else []
            findings.check(
                index,
                case,
                Outcome(
                    calls[first_call:],
                    events[first_event:],
                    len(app_calls) - first_app,
                    status,
                    headers,
                    error,
                ),
            )
        counts = {}
        for key, _, windows in calls:
            for window in windows:
                if (key, window) not in counts:
                    counts[(key, window)] = (await limiter.peek(key, 2**62, window)).count
        findings.check_stored(calls, lambda key, window: counts[(key, window)])
        assert len(calls) > n // 4, "too few requests were counted to mean anything"
        await limiter.aclose()

    asyncio.run(main())


def run_wsgi(seed: int, n: int, findings: Findings) -> None:
    limiter = quota.connect("memory://", clock=lambda: NOW)
    calls: list[tuple[str, int, tuple[int, ...]]] = []
    record_hits(limiter, calls)
    events: list[str] = []
    app_calls: list[int] = []

    def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        app_calls.append(1)
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"ok"]

    middleware = QuotaWSGIMiddleware(
        app,
        limiter=limiter,
        config=make_config(findings.setup),
        observer=lambda name, labels: events.append(name),
        cors_origins="*",
    )
    for index, case in enumerate(cases(seed, n)):
        first_call, first_event, first_app = len(calls), len(events), len(app_calls)
        started: list[tuple[str, list[tuple[str, str]]]] = []

        def start_response(
            status: str,
            headers: list[tuple[str, str]],
            exc_info: Any = None,
            started: list[Any] = started,
        ) -> Any:
            started.append((status, headers))
            return lambda data: None

        error = None
        status = None
        raw_headers: list[tuple[bytes, bytes]] = []
        try:
            body = b"".join(middleware(wsgi_environ(case, index), start_response))
            assert len(started) == 1, f"start_response called {len(started)} times"
            line, headers = started[0]
            status = int(line.split(" ", 1)[0])
            # What a server writes: latin-1 bytes (it fails, a 500, on anything else).
            raw_headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers]
            assert body
        except Exception as exc:
            error = exc
        findings.check(
            index,
            case,
            Outcome(
                calls[first_call:],
                events[first_event:],
                len(app_calls) - first_app,
                status,
                raw_headers,
                error,
            ),
        )
    findings.check_stored(calls, lambda key, window: limiter.peek(key, 2**62, window).count)
    assert len(calls) > n // 4, "too few requests were counted to mean anything"
    limiter.close()


# -- the tests ---------------------------------------------------------------------


def test_asgi_middleware_counts_every_fuzzed_request_exactly_once() -> None:
    value = seed()
    findings = Findings(value, ASGI_SETUP)
    print(f"{SEED_ENV}={value}")
    run_asgi(value, N_REQUESTS // 2, findings)
    findings.assert_none()


def test_wsgi_middleware_counts_every_fuzzed_request_exactly_once() -> None:
    value = seed()
    findings = Findings(value, WSGI_SETUP)
    print(f"{SEED_ENV}={value}")
    run_wsgi(value ^ 0x5A5A5A5A, N_REQUESTS // 2, findings)
    findings.assert_none()
