"""Who the client is behind proxies: forwarding chains, client-IP headers, ports, RFC 7239.

`client_ip` walks from the TCP peer leftwards through the chain the trusted
proxies wrote; a client-IP header (``CF-Connecting-IP`` and the like) is read
only where the configuration says which proxies set it. No header content
makes it raise. The end-to-end tests run the real middlewares (Starlette and
Flask) on SQLite.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import quota
from quota.http import HttpConfig, RoutePolicy
from quota.http._env import ENV_VARS
from quota.http._identity import client_ip, parse_networks
from tests._http_support import FRAMEWORKS, HttpClient, make_client
from tests._support import Clock

#: nginx and the internal load balancers, and one Cloudflare range of each family.
NGINX = ["10.0.0.0/8", "fd00::/8"]
CLOUDFLARE = ["173.245.48.0/20", "2400:cb00::/32"]
PROXIES = [*NGINX, *CLOUDFLARE]
NETWORKS = parse_networks("trusted_proxies", PROXIES)
CF_ONLY = {"173.245.48.0/20": "cf-connecting-ip", "2400:cb00::/32": "cf-connecting-ip"}


def ip(peer: str | None, headers: dict[str, str], **options: Any) -> str | None:
    """`client_ip` under an `HttpConfig` built from `options` (trusting `PROXIES` by default)."""
    options.setdefault("trusted_proxies", PROXIES)
    return client_ip(peer, headers, HttpConfig(**options).proxy_rules)


# -- the default: only the chain header, no client-IP header ----------------------------


@pytest.mark.parametrize(
    ("peer", "headers", "expected"),
    [
        # A CF-Connecting-IP is not read unless configured, from any peer.
        ("10.0.0.1", {"cf-connecting-ip": "192.0.2.1", "x-forwarded-for": "198.51.100.7"},
         "198.51.100.7"),
        ("10.0.0.1", {"cf-connecting-ip": "192.0.2.1"}, "10.0.0.1"),
        ("173.245.48.5", {"cf-connecting-ip": "192.0.2.1"}, "173.245.48.5"),
        ("198.51.100.9", {"cf-connecting-ip": "192.0.2.1"}, "198.51.100.9"),
        # Ports a proxy appends.
        ("10.0.0.1", {"x-forwarded-for": "198.51.100.7:5555"}, "198.51.100.7"),
        ("10.0.0.1", {"x-forwarded-for": "[2001:db8::1]:443"}, "2001:db8::1"),
        ("10.0.0.1", {"x-forwarded-for": "[2001:db8::1]"}, "2001:db8::1"),
        ("10.0.0.1", {"x-forwarded-for": "2001:db8::1"}, "2001:db8::1"),
        ("10.0.0.1", {"x-forwarded-for": "2001:db8::1:443"}, "2001:db8::1:443"),
        ("10.0.0.1", {"x-forwarded-for": "[::ffff:198.51.100.7]:80"}, "198.51.100.7"),
        ("10.0.0.1", {"x-forwarded-for": "192.0.2.9, 198.51.100.7:5555, 10.0.0.3:80"},
         "198.51.100.7"),
        ("fd00::1", {"x-forwarded-for": "198.51.100.7:1, [fd00::2]:8080"}, "198.51.100.7"),
        # A port that is not one stops the walk: the last address believed stands.
        ("10.0.0.1", {"x-forwarded-for": "198.51.100.7:123456"}, "10.0.0.1"),
        ("10.0.0.1", {"x-forwarded-for": "198.51.100.7:"}, "10.0.0.1"),
        ("10.0.0.1", {"x-forwarded-for": "[2001:db8::1]x"}, "10.0.0.1"),
        ("10.0.0.1", {"x-forwarded-for": "198.51.100.7, [2001:db8::1:443"}, "10.0.0.1"),
        # `unknown` (and an obfuscated name) from a trusted hop: an internal hop, walked past.
        ("10.0.0.1", {"x-forwarded-for": "198.51.100.7, unknown"}, "198.51.100.7"),
        ("10.0.0.1", {"x-forwarded-for": "198.51.100.7, UNKNOWN, 10.0.0.3"}, "198.51.100.7"),
        ("10.0.0.1", {"x-forwarded-for": "198.51.100.7, _sidecar"}, "198.51.100.7"),
        ("10.0.0.1", {"x-forwarded-for": "198.51.100.7, unknown:80"}, "198.51.100.7"),
        # ... with nothing real to its left, the last address believed is the client.
        ("10.0.0.1", {"x-forwarded-for": "unknown"}, "10.0.0.1"),
        ("10.0.0.1", {"x-forwarded-for": "10.0.0.3, unknown"}, "10.0.0.3"),
        # An untrusted hop ends the walk; what it wrote further left is not read.
        ("10.0.0.1", {"x-forwarded-for": "unknown, 198.51.100.7"}, "198.51.100.7"),
        # A peer that is not trusted: its headers are never read.
        ("198.51.100.9", {"x-forwarded-for": "192.0.2.1:5, unknown"}, "198.51.100.9"),
    ],
)  # fmt: skip
def test_the_chain_is_walked_from_the_peer(
    peer: str, headers: dict[str, str], expected: str
) -> None:
    assert client_ip(peer, headers, NETWORKS) == expected
    assert ip(peer, headers) == expected


def test_a_chain_longer_than_the_bound_falls_back_to_the_last_address_believed() -> None:
    chain = "198.51.100.7, " + ", ".join(f"10.0.{i // 250}.{i % 250 + 1}" for i in range(5000))

    found = ip("10.9.9.9", {"x-forwarded-for": chain})

    # 32 hops are read: the last one read is believed, the client beyond it is not reached.
    assert found is not None and found.startswith("10.0.")
    assert found == "10.0.19.219"
    assert ip("10.9.9.9", {"x-forwarded-for": "198.51.100.7" + ", 10.0.0.1" * 31}) == (
        "198.51.100.7"
    )


def test_peers_seen_before_are_read_alike_and_the_memory_of_them_is_bounded() -> None:
    rules = HttpConfig(trusted_proxies=PROXIES).proxy_rules

    for _ in range(2):
        assert client_ip("10.0.0.1", {"x-forwarded-for": "198.51.100.7"}, rules) == "198.51.100.7"
        assert client_ip("10.0.0.1", {"x-forwarded-for": "198.51.100.8"}, rules) == "198.51.100.8"
        assert client_ip("10.0.0.1", {}, rules) == "10.0.0.1"
        assert client_ip("::ffff:198.51.100.7", {"x-forwarded-for": "1.1.1.1"}, rules) == (
            "198.51.100.7"
        )
        assert client_ip("testclient", {}, rules) == "testclient"
    for i in range(1, 10_001):
        assert client_ip(f"2001:db8::{i:x}", {}, rules) == f"2001:db8::{i:x}"
    assert len(rules.peers) <= 4096


# -- client-IP headers: per proxy, or from every trusted proxy ----------------------------


@pytest.mark.parametrize(
    ("peer", "headers", "expected"),
    [
        # Straight to nginx: the client's own CF-Connecting-IP is not believed.
        ("10.0.0.1", {"cf-connecting-ip": "192.0.2.1", "x-forwarded-for": "198.51.100.7"},
         "198.51.100.7"),
        # Through Cloudflare, then nginx: the header of the Cloudflare hop is.
        ("10.0.0.1", {"cf-connecting-ip": "203.0.113.50",
                      "x-forwarded-for": "192.0.2.99, 173.245.48.5"}, "203.0.113.50"),
        ("10.0.0.1", {"cf-connecting-ip": "203.0.113.50",
                      "x-forwarded-for": "192.0.2.99, [2400:cb00::7]:443"}, "203.0.113.50"),
        # Cloudflare as the peer.
        ("173.245.48.5", {"cf-connecting-ip": "2001:db8::9"}, "2001:db8::9"),
        ("173.245.48.5", {"cf-connecting-ip": "::ffff:203.0.113.50"}, "203.0.113.50"),
        # A header that is not an address: the chain decides.
        ("173.245.48.5", {"cf-connecting-ip": "nonsense", "x-forwarded-for": "203.0.113.50"},
         "203.0.113.50"),
        ("173.245.48.5", {"cf-connecting-ip": "1.2.3.4, 5.6.7.8"}, "173.245.48.5"),
        # Another header from Cloudflare is not read.
        ("173.245.48.5", {"x-real-ip": "192.0.2.1"}, "173.245.48.5"),
    ],
)  # fmt: skip
def test_a_header_mapped_to_a_proxy_is_believed_only_from_that_proxy(
    peer: str, headers: dict[str, str], expected: str
) -> None:
    assert ip(peer, headers, client_ip_header=CF_ONLY) == expected


def test_each_proxy_network_has_its_own_header_and_the_most_specific_wins() -> None:
    mapping = {"10.0.0.0/8": "x-real-ip", "10.9.0.0/16": "Fly-Client-IP", **CF_ONLY}
    both = {"x-real-ip": "192.0.2.1", "fly-client-ip": "192.0.2.2", "cf-connecting-ip": "192.0.2.3"}

    assert ip("10.1.0.1", both, client_ip_header=mapping) == "192.0.2.1"
    assert ip("10.9.0.1", both, client_ip_header=mapping) == "192.0.2.2"
    assert ip("173.245.48.1", both, client_ip_header=mapping) == "192.0.2.3"
    assert ip("fd00::1", both, client_ip_header=mapping) == "fd00::1"
    assert ip("198.51.100.9", both, client_ip_header=mapping) == "198.51.100.9"


def test_a_header_given_as_a_name_is_believed_from_every_trusted_proxy() -> None:
    headers = {"cf-connecting-ip": "192.0.2.1", "x-forwarded-for": "198.51.100.7"}

    assert ip("10.0.0.1", headers, client_ip_header="CF-Connecting-IP") == "192.0.2.1"
    assert ip("173.245.48.5", headers, client_ip_header="cf-connecting-ip") == "192.0.2.1"
    # ... and never from a peer that is not trusted.
    assert ip("198.51.100.9", headers, client_ip_header="cf-connecting-ip") == "198.51.100.9"
    assert ip("10.0.0.1", {"x-real-ip": "192.0.2.1"}, client_ip_header="cf-connecting-ip") == (
        "10.0.0.1"
    )


def test_a_header_is_read_at_a_trusted_hop_further_down_the_chain() -> None:
    headers = {"x-real-ip": "192.0.2.1", "x-forwarded-for": "198.51.100.7, 10.0.0.5"}
    mapping = {"10.0.0.0/24": "x-real-ip"}

    assert ip("fd00::1", headers, client_ip_header=mapping) == "192.0.2.1"
    # The walk reached an untrusted hop before any hop the header is believed from.
    headers["x-forwarded-for"] = "10.0.0.5, 198.51.100.7"
    assert ip("fd00::1", headers, client_ip_header=mapping) == "198.51.100.7"


# -- RFC 7239 Forwarded -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("for=198.51.100.7", "198.51.100.7"),
        ("for=192.0.2.60;proto=http;by=203.0.113.43", "192.0.2.60"),
        ("proto=https;FOR=198.51.100.7", "198.51.100.7"),
        ('For="[2001:db8:cafe::17]:4711"', "2001:db8:cafe::17"),
        ('for="[2001:db8:cafe::17]"', "2001:db8:cafe::17"),
        ('for="198.51.100.7:47011"', "198.51.100.7"),
        ('for="198.51.100.7"', "198.51.100.7"),
        ('for="\\1\\9\\8.51.100.7"', "198.51.100.7"),
        ("for=198.51.100.7 ; proto=https", "198.51.100.7"),
        # Several elements and several field lines (joined with commas).
        ("for=192.0.2.43, for=198.51.100.17", "198.51.100.17"),
        ("for=192.0.2.43, for=198.51.100.17, for=10.0.0.5", "198.51.100.17"),
        ("for=192.0.2.43,for=198.51.100.17;by=10.0.0.5,for=10.0.0.6", "198.51.100.17"),
        ("for=198.51.100.7,,for=10.0.0.5", "198.51.100.7"),
        # Quoted commas and semicolons do not split.
        ('for=198.51.100.7;host="a,b;c=d"', "198.51.100.7"),
        ('for=192.0.2.1, for=198.51.100.7;ext="x\\",for=10.0.0.9"', "198.51.100.7"),
        # unknown and obfuscated identifiers are walked past.
        ("for=198.51.100.7, for=unknown", "198.51.100.7"),
        ('for=198.51.100.7, for="unknown"', "198.51.100.7"),
        ("for=198.51.100.7, for=_nginx", "198.51.100.7"),
        ('for=198.51.100.7, for="_gazonk:_port", for=10.0.0.5', "198.51.100.7"),
        ('for=192.0.2.43,for="[2001:db8:cafe::17]",for=unknown', "2001:db8:cafe::17"),
        ("for=unknown", "10.0.0.1"),
        ("for=10.0.0.5, for=_nginx", "10.0.0.5"),
        # Malformed: the walk stops, the last address believed stands.
        ('for=198.51.100.7, for="unterminated', "10.0.0.1"),
        ("for=198.51.100.7, garbage;;=", "10.0.0.1"),
        ("for=198.51.100.7, proto=https", "10.0.0.1"),
        ("for=198.51.100.7, for=10.0.0.5;for=10.0.0.6", "10.0.0.1"),
        ("for=198.51.100.7, for=[2001:db8::1]", "10.0.0.1"),
        ("for=198.51.100.7, for=10.0.0.5 x", "10.0.0.1"),
        ("for=198.51.100.7, for=not-an-ip, for=10.0.0.5", "10.0.0.5"),
        ('for=198.51.100.7, for=", for=10.0.0.5', "10.0.0.5"),
        ('for=198.51.100.7, for="1.2.3.4:99999999"', "10.0.0.1"),
        ("198.51.100.7", "10.0.0.1"),
        # What a client wrote cannot swallow the elements appended to its right.
        ('for=", for=198.51.100.7', "198.51.100.7"),
        ('x="\\, for="[2001:db8::7]:1"', "2001:db8::7"),
        ('for=192.0.2.1;by="a, for=198.51.100.7;proto=https', "198.51.100.7"),
        ('"a","b", for=198.51.100.7', "198.51.100.7"),
    ],
)
def test_the_forwarded_header_is_parsed_as_rfc_7239(value: str, expected: str) -> None:
    assert ip("10.0.0.1", {"forwarded": value}, forwarded_header="forwarded") == expected


def test_a_long_forwarded_header_is_read_from_the_right_only() -> None:
    hops = ", ".join(f"for=10.0.{i // 250}.{i % 250 + 1};proto=https" for i in range(3000))

    found = ip("10.9.9.9", {"forwarded": "for=198.51.100.7, " + hops}, forwarded_header="forwarded")

    assert found is not None and found.startswith("10.0.")
    short = "for=198.51.100.7" + ", for=10.0.0.1" * 31
    assert ip("10.9.9.9", {"forwarded": short}, forwarded_header="forwarded") == "198.51.100.7"


def test_only_the_configured_chain_header_is_read() -> None:
    both = {"x-forwarded-for": "192.0.2.1", "forwarded": "for=198.51.100.7"}

    assert ip("10.0.0.1", both, forwarded_header="forwarded") == "198.51.100.7"
    assert ip("10.0.0.1", both, forwarded_header="Forwarded") == "198.51.100.7"
    assert ip("10.0.0.1", both) == "192.0.2.1"
    assert ip("10.0.0.1", {"x-forwarded-for": "192.0.2.1"}, forwarded_header="forwarded") == (
        "10.0.0.1"
    )
    assert ip("10.0.0.1", {"forwarded": "for=198.51.100.7"}) == "10.0.0.1"


def test_a_client_ip_header_works_with_forwarded_too() -> None:
    headers = {"cf-connecting-ip": "203.0.113.50", "forwarded": "for=192.0.2.99, for=173.245.48.5"}

    assert ip("10.0.0.1", headers, client_ip_header=CF_ONLY, forwarded_header="forwarded") == (
        "203.0.113.50"
    )
    headers["forwarded"] = "for=192.0.2.99"
    assert ip("10.0.0.1", headers, client_ip_header=CF_ONLY, forwarded_header="forwarded") == (
        "192.0.2.99"
    )


# -- no header content ever raises --------------------------------------------------------

_PIECES = [
    "for=", "For", "=", ";", ",", ", ", '"', "\\", "\\\"", "[", "]", ":", "::", "unknown", "_x",
    "10.0.0.1", "10.0.0.5", "198.51.100.7", "173.245.48.5", "2001:db8::1", "fd00::1",
    "::ffff:10.0.0.1", "fe80::1%eth0", "443", "99999999", "9" * 300, " ", "\t", "\x00", "ñ",
    "\u0661", "²", "\ud800", "\udcff", "\U0001f600", "proto=https", "by=", "host=", "x" * 50,
]  # fmt: skip


def _noise(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.6:
        return "".join(rng.choice(_PIECES) for _ in range(rng.randint(0, 12)))
    if kind < 0.8:
        return "".join(chr(rng.randint(0, 0x10FFFF)) for _ in range(rng.randint(0, 20)))
    if kind < 0.95:
        return ", ".join(rng.choice(_PIECES) for _ in range(rng.randint(0, 60)))
    return ",".join(rng.choice(["for=10.0.0.1", "10.0.0.1", '"', "unknown"]) for _ in range(4000))


def test_no_header_content_makes_it_raise() -> None:
    configs = [
        HttpConfig(trusted_proxies=PROXIES),
        HttpConfig(trusted_proxies=PROXIES, forwarded_header="forwarded"),
        HttpConfig(trusted_proxies=PROXIES, client_ip_header=CF_ONLY),
        HttpConfig(trusted_proxies=PROXIES, client_ip_header="x-real-ip",
                   forwarded_header="forwarded"),
        HttpConfig(),
    ]  # fmt: skip
    rng = random.Random(7239)
    peers = [None, "10.0.0.1", "173.245.48.5", "fd00::1", "198.51.100.9", "testclient", "::1"]
    for _ in range(5000):
        headers = {
            name: _noise(rng)
            for name in ("x-forwarded-for", "forwarded", "cf-connecting-ip", "x-real-ip")
            if rng.random() < 0.7
        }
        peer = rng.choice(peers)
        for config in configs:
            found = client_ip(peer, headers, config.proxy_rules)
            assert found is None or isinstance(found, str)
            if peer is not None and peer != "testclient" and found is not None:
                # Always an address: one the peer or a trusted proxy named.
                assert quota.http.hashed_subject("ip", found, b"k" * 16).startswith("ip:")


# -- configuration ------------------------------------------------------------------------


def test_the_settings_are_normalised() -> None:
    config = HttpConfig(
        trusted_proxies=PROXIES,
        client_ip_header={"173.245.48.0/20": " CF-Connecting-IP "},
        forwarded_header=" Forwarded ",
    )

    assert config.client_ip_header == {"173.245.48.0/20": "cf-connecting-ip"}
    assert config.forwarded_header == "forwarded"
    assert HttpConfig(client_ip_header="X-Real-IP", trusted_proxies=NGINX).client_ip_header == (
        "x-real-ip"
    )
    assert HttpConfig().client_ip_header is None
    assert HttpConfig().forwarded_header == "x-forwarded-for"


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"client_ip_header": "cf connecting ip"}, "client_ip_header.*'cf connecting ip'"),
        ({"client_ip_header": ""}, "client_ip_header"),
        ({"client_ip_header": "x-réal-ip"}, "client_ip_header"),
        ({"client_ip_header": 5}, "client_ip_header"),
        ({"client_ip_header": ["cf-connecting-ip"]}, "client_ip_header"),
        ({"client_ip_header": "x-forwarded-for"}, "client_ip_header.*forwarded_header"),
        ({"client_ip_header": "Forwarded"}, "client_ip_header.*forwarded_header"),
        ({"client_ip_header": {"173.245.48.0/20": "bad name"}}, "client_ip_header.*'bad name'"),
        ({"client_ip_header": {"ten/8": "x-real-ip"}}, "client_ip_header.*'ten/8'"),
        ({"client_ip_header": {"192.168.0.0/16": "x-real-ip"}},
         "client_ip_header.*'192.168.0.0/16'.*trusted_proxies"),
        ({"client_ip_header": {"10.0.0.0/7": "x-real-ip"}}, "client_ip_header.*'10.0.0.0/7'"),
        ({"client_ip_header": {"10.0.0.0/8": 5}}, "client_ip_header"),
        ({"forwarded_header": "x-real-ip"}, "forwarded_header.*'x-real-ip'"),
        ({"forwarded_header": None}, "forwarded_header"),
    ],
)  # fmt: skip
def test_bad_settings_name_the_field_and_value(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(quota.ConfigurationError, match=message):
        HttpConfig(trusted_proxies=PROXIES, **settings)


def test_a_client_ip_header_needs_trusted_proxies() -> None:
    with pytest.raises(quota.ConfigurationError, match=r"client_ip_header.*trusted_proxies"):
        HttpConfig(client_ip_header="cf-connecting-ip")
    with pytest.raises(quota.ConfigurationError, match=r"client_ip_header.*trusted_proxies"):
        HttpConfig(client_ip_header={"10.0.0.0/8": "x-real-ip"})


def test_the_environment_sets_both() -> None:
    env = {
        "QUOTA_TRUSTED_PROXIES": ",".join(PROXIES),
        "QUOTA_CLIENT_IP_HEADER": "173.245.48.0/20=CF-Connecting-IP, 2400:cb00::/32=cf-connecting-ip",
        "QUOTA_FORWARDED_HEADER": "Forwarded",
    }
    config = HttpConfig.from_env(env)

    assert config.client_ip_header == CF_ONLY
    assert config.forwarded_header == "forwarded"
    one = HttpConfig.from_env({"QUOTA_TRUSTED_PROXIES": "10.0.0.0/8",
                               "QUOTA_CLIENT_IP_HEADER": "X-Real-IP"})  # fmt: skip
    assert one.client_ip_header == "x-real-ip"
    assert {"QUOTA_CLIENT_IP_HEADER", "QUOTA_FORWARDED_HEADER"} <= set(ENV_VARS)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"QUOTA_CLIENT_IP_HEADER": "cf connecting ip"}, r"\$QUOTA_CLIENT_IP_HEADER"),
        ({"QUOTA_CLIENT_IP_HEADER": "10.0.0.0/8=x-real-ip,oops"}, r"\$QUOTA_CLIENT_IP_HEADER"),
        ({"QUOTA_CLIENT_IP_HEADER": "ten/8=x-real-ip"}, r"\$QUOTA_CLIENT_IP_HEADER.*'ten/8'"),
        ({"QUOTA_CLIENT_IP_HEADER": "192.168.0.0/16=x-real-ip"},
         r"\$QUOTA_CLIENT_IP_HEADER.*trusted_proxies"),
        ({"QUOTA_FORWARDED_HEADER": "x-real-ip"}, r"\$QUOTA_FORWARDED_HEADER.*'x-real-ip'"),
    ],
)  # fmt: skip
def test_a_bad_variable_is_named(env: dict[str, str], message: str) -> None:
    with pytest.raises(quota.ConfigurationError, match=message):
        HttpConfig.from_env({"QUOTA_TRUSTED_PROXIES": "10.0.0.0/8", **env})


# -- end to end, through the middlewares --------------------------------------------------

LIMIT = 3
Make = Callable[..., HttpClient]


@pytest.fixture(params=FRAMEWORKS)
def make(request: pytest.FixtureRequest, sqlite_url: str, clock: Clock) -> Iterator[Make]:
    clients: list[HttpClient] = []

    def build(peer: str, **settings: Any) -> HttpClient:
        config = HttpConfig(
            policies=[RoutePolicy(name="api", paths=["/api"], rates=f"{LIMIT}/minute")],
            hash_secret="client-ip-test-secret-0123",
            runtime_policies=False,
            **settings,
        )
        clients.append(make_client(request.param, sqlite_url, clock, config, peer=peer))
        return clients[-1]

    yield build
    for client in clients:
        client.close()


@pytest.mark.parametrize("client_ip_header", [None, CF_ONLY])
def test_a_spoofed_cf_connecting_ip_through_nginx_gets_no_fresh_bucket(
    make: Make, client_ip_header: dict[str, str] | None
) -> None:
    settings = {} if client_ip_header is None else {"client_ip_header": client_ip_header}
    client = make("10.0.0.2", trusted_proxies=PROXIES, **settings)

    replies = [
        client.request("GET", "/api/items", {"CF-Connecting-IP": f"192.0.2.{i}",
                                             "X-Forwarded-For": "198.51.100.7"})
        for i in range(20)
    ]  # fmt: skip

    assert [r.status for r in replies].count(429) == 20 - LIMIT
    assert [r.header("X-RateLimit-Remaining") for r in replies[:4]] == ["2", "1", "0", "0"]


@pytest.mark.parametrize(
    ("header", "template"),
    [("X-Forwarded-For", "{ip}:{port}"), ("Forwarded", 'for="{ip}:{port}";proto=https')],
)
def test_clients_behind_a_proxy_that_appends_ports_get_a_bucket_each(
    make: Make, header: str, template: str
) -> None:
    settings = {"forwarded_header": "forwarded"} if header == "Forwarded" else {}
    client = make("10.0.0.2", trusted_proxies=NGINX, **settings)

    def send(address: str, port: int) -> int:
        value = template.format(ip=address, port=port)
        return client.request("GET", "/api/items", {header: value}).status

    first = [send("198.51.100.7", 40000 + i) for i in range(LIMIT + 1)]
    second = [send("198.51.100.8", 50000 + i) for i in range(LIMIT + 1)]

    assert first == [200] * LIMIT + [429]
    assert second == [200] * LIMIT + [429]
