"""`quota.contrib._provider.provider_pause`: how long a provider's response asks us to hold off.

One table per rule: ``Retry-After`` on 429/503 (seconds, HTTP dates, values
that do not parse, the cap), the "nothing remaining until a reset" headers on
any status (the IETF ``RateLimit`` field in both draft forms, ``RateLimit-*``,
``X-RateLimit-*`` with Unix-time and relative resets, OpenAI's Go durations),
the largest of several sources, and the `max_pause` check. The clock is
injected. A fuzz test feeds random text to every header: no exception, and
the answer is None or within ``(0, max_pause]``.
"""

from __future__ import annotations

import logging
import math
import time
from email.utils import formatdate
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quota import ConfigurationError
from quota.contrib._provider import IDEMPOTENT, provider_pause

NOW = 1_700_000_000.0
MAX = 60.0


class Headers:
    """A case-insensitive header mapping, as httpx, requests and aiohttp hand out."""

    def __init__(self, headers: dict[str, str]) -> None:
        self._headers = {name.lower(): value for name, value in headers.items()}

    def get(self, name: str, /) -> str | None:
        return self._headers.get(name.lower())


def pause(status: int, headers: dict[str, str], max_pause: float = MAX) -> float | None:
    return provider_pause(status, Headers(headers), max_pause=max_pause, now=NOW)


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.name == "quota" and r.levelno == logging.WARNING
    ]


RETRY_AFTER = [
    (429, "2", 2.0),
    (503, "2", 2.0),
    (429, "1.5", 1.5),
    (429, " 7 ", 7.0),
    (429, formatdate(NOW + 5, usegmt=True), 5.0),
    (429, formatdate(NOW - 5, usegmt=True), None),
    (429, "0", None),
    (200, "2", None),  # only on 429 and 503
    (500, "2", None),
    (301, formatdate(NOW + 5, usegmt=True), None),
]


@pytest.mark.parametrize(("status", "value", "expected"), RETRY_AFTER)
def test_retry_after(
    status: int, value: str, expected: float | None, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="quota")
    assert pause(status, {"Retry-After": value}) == expected
    assert warnings(caplog) == []


def test_an_http_date_without_a_zone_is_utc(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TZ", "XYZ-9")  # the machine's local time is 9 hours ahead of UTC
    time.tzset()
    try:
        assert pause(429, {"Retry-After": formatdate(NOW + 5)}) == 5.0  # "... -0000"
    finally:
        monkeypatch.undo()
        time.tzset()


@pytest.mark.parametrize(
    "value", ["-1", "abc", "", "1e400", "nan", "inf", "-inf", "0x10", "٣", "1.", "x" * 5000]
)
def test_retry_after_that_does_not_parse_is_ignored_with_a_warning(
    value: str, caplog: pytest.LogCaptureFixture
) -> None:
    assert pause(429, {"Retry-After": value}) is None
    [message] = warnings(caplog)
    assert "Retry-After" in message
    assert repr(value[:100] + "…" if len(value) > 100 else value) in message
    assert len(message) < 250


def test_retry_after_that_does_not_parse_leaves_the_reset_headers() -> None:
    assert pause(429, {"Retry-After": "soon", "RateLimit": '"default";r=0;t=30'}) == 30.0


def test_valid_retry_after_wins_over_the_reset_headers() -> None:
    assert pause(429, {"Retry-After": "2", "RateLimit": '"default";r=0;t=30'}) == 2.0
    assert (
        pause(429, {"Retry-After": "0", "X-RateLimit-Remaining": "0", "X-RateLimit-Reset": "9"})
        is None
    )
    # on another status, Retry-After is not read at all
    assert pause(200, {"Retry-After": "2", "RateLimit": '"default";r=0;t=30'}) == 30.0


@pytest.mark.parametrize(
    "headers",
    [
        {"Retry-After": "1000000000000"},
        {"Retry-After": "9" * 500},
        {"Retry-After": formatdate(NOW + 86_400, usegmt=True)},
        {"RateLimit": '"default";r=0;t=1000000000000'},
        {"X-RateLimit-Remaining": "0", "X-RateLimit-Reset": str(int(NOW) + 3600)},
        {"x-ratelimit-remaining-tokens": "0", "x-ratelimit-reset-tokens": "2h"},
    ],
)
def test_a_longer_pause_is_capped_with_a_warning(
    headers: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    assert pause(429, headers) == MAX
    [message] = warnings(caplog)
    assert "max_pause=60.0" in message


RESETS = [
    # IETF structured field (drafts 08-10), on a 200
    ({"RateLimit": '"default";r=0;t=30'}, 30.0),
    ({"RateLimit": '"default";r=3;t=30'}, None),
    ({"RateLimit": '"default";r=0'}, None),
    ({"RateLimit": '"default";r=0;t=0'}, None),
    ({"RateLimit": '"min";r=5;t=10, "day";r=0;t=3600'}, 3600.0),
    ({"RateLimit": '"a";r=0;t=10, "b";r=0;t=20, "c";r=1;t=50'}, 20.0),
    ({"RATELIMIT": 'default ; R=0 ; T=30'}, 30.0),
    ({"RateLimit": '"a,b;r=9;t=99";r=0;t=30'}, 30.0),  # separators inside the name
    ({"RateLimit": '"a;r=0;t=99, b";r=5;t=1'}, None),
    ({"RateLimit": '"a\\";r=0;t=99, b";r=5;t=1'}, None),  # an escaped quote
    ({"RateLimit": '"a\\"b";r=0;t=30'}, 30.0),
    ({"RateLimit": '"default";r=0;t=abc'}, None),
    ({"RateLimit": '"default";r=0;t=-5'}, None),
    ({"RateLimit": '"default";r=0;t=30' + " " * 5000}, None),  # too long to read
    # older draft's dictionary
    ({"RateLimit": "limit=100, remaining=0, reset=30"}, 30.0),
    ({"RateLimit": "limit=100, remaining=1, reset=30"}, None),
    ({"RateLimit": "limit=100, remaining=0"}, None),
    # RateLimit-Remaining / -Reset
    ({"RateLimit-Remaining": "0", "RateLimit-Reset": "12"}, 12.0),
    ({"RateLimit-Remaining": "1", "RateLimit-Reset": "12"}, None),
    ({"RateLimit-Reset": "12"}, None),
    ({"RateLimit-Remaining": "0"}, None),
    ({"RateLimit-Remaining": "zero", "RateLimit-Reset": "12"}, None),
    # X-RateLimit-*: a reset above 10**9 is a Unix time, else seconds from now
    ({"X-RateLimit-Remaining": "0", "X-RateLimit-Reset": str(int(NOW) + 42)}, 42.0),
    ({"X-RateLimit-Remaining": "0", "X-RateLimit-Reset": str(int(NOW) - 42)}, None),
    ({"X-RateLimit-Remaining": "0", "X-RateLimit-Reset": "42"}, 42.0),
    ({"X-RateLimit-Remaining": "0", "X-RateLimit-Reset-After": "1.25"}, 1.25),
    ({"X-RateLimit-Remaining": "0", "X-RateLimit-Reset": "0"}, None),
    ({"X-RateLimit-Remaining": "4", "X-RateLimit-Reset": "42"}, None),
    ({"X-RateLimit-Remaining": "-1", "X-RateLimit-Reset": "42"}, None),
    # OpenAI: Go durations
    ({"x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "1s"}, 1.0),
    ({"x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "20ms"}, 0.02),
    ({"x-ratelimit-remaining-tokens": "0", "x-ratelimit-reset-tokens": "6m0s"}, 360.0),
    ({"x-ratelimit-remaining-tokens": "0", "x-ratelimit-reset-tokens": "1h2m3.5s"}, 3723.5),
    ({"x-ratelimit-remaining-tokens": "0", "x-ratelimit-reset-tokens": "1500us"}, 0.0015),
    ({"x-ratelimit-remaining-tokens": "0", "x-ratelimit-reset-tokens": "0"}, None),
    ({"x-ratelimit-remaining-tokens": "0", "x-ratelimit-reset-tokens": "1x"}, None),
    ({"x-ratelimit-remaining-tokens": "0", "x-ratelimit-reset-tokens": "-1s"}, None),
    ({"x-ratelimit-remaining-tokens": "5", "x-ratelimit-reset-tokens": "6m0s"}, None),
    (
        {
            "x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "2s",
            "x-ratelimit-remaining-tokens": "0", "x-ratelimit-reset-tokens": "7s",
        },
        7.0,
    ),
    (
        {
            "x-ratelimit-remaining-requests": "3", "x-ratelimit-reset-requests": "9s",
            "x-ratelimit-remaining-tokens": "0", "x-ratelimit-reset-tokens": "7s",
        },
        7.0,
    ),
    # several sources: the largest
    (
        {
            "RateLimit": '"default";r=0;t=5',
            "RateLimit-Remaining": "0", "RateLimit-Reset": "9",
            "X-RateLimit-Remaining": "0", "X-RateLimit-Reset": "3",
        },
        9.0,
    ),
    (
        {
            "RateLimit": '"default";r=0;t=5',
            "X-RateLimit-Remaining": "0", "X-RateLimit-Reset": str(int(NOW) + 11),
            "X-RateLimit-Reset-After": "2",
        },
        11.0,
    ),
    ({"Content-Type": "application/json"}, None),
]  # fmt: skip


@pytest.mark.parametrize(("headers", "expected"), RESETS)
@pytest.mark.parametrize("status", [200, 429])
def test_reset_headers(
    status: int,
    headers: dict[str, str],
    expected: float | None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert pause(status, headers, max_pause=86_400) == expected
    assert warnings(caplog) == []  # values that do not parse are ignored quietly


@pytest.mark.parametrize("max_pause", [0, -1, 0.0, math.nan, math.inf, -math.inf, True, "60", None])
def test_max_pause_must_be_a_positive_number(max_pause: Any) -> None:
    with pytest.raises(
        ConfigurationError, match="max_pause must be a positive number of seconds, got"
    ) as info:
        provider_pause(429, Headers({"Retry-After": "1"}), max_pause=max_pause)
    assert repr(max_pause) in str(info.value)


def test_now_defaults_to_the_clock() -> None:
    ahead = formatdate(time.time() + 30, usegmt=True)
    result = provider_pause(429, Headers({"Retry-After": ahead}), max_pause=MAX)
    assert result is not None and 28 < result <= 30


def _httpx(items: dict[str, str]) -> Any:
    return pytest.importorskip("httpx").Headers(items)


def _requests(items: dict[str, str]) -> Any:
    return pytest.importorskip("requests.structures").CaseInsensitiveDict(items)


def _aiohttp(items: dict[str, str]) -> Any:
    multidict = pytest.importorskip("multidict")  # aiohttp's response headers
    return multidict.CIMultiDictProxy(multidict.CIMultiDict(items))


@pytest.mark.parametrize("build", [_httpx, _requests, _aiohttp])
def test_the_clients_header_objects(build: Any) -> None:
    headers = build({"retry-after": "3", "ratelimit": '"default";r=0;t=30'})
    assert provider_pause(429, headers, max_pause=MAX, now=NOW) == 3.0
    assert provider_pause(200, headers, max_pause=MAX, now=NOW) == 30.0
    headers = build({"X-RATELIMIT-REMAINING": "0", "X-RateLimit-Reset": "4"})
    assert provider_pause(200, headers, max_pause=MAX, now=NOW) == 4.0


def test_idempotent_methods() -> None:
    assert {"GET", "HEAD", "OPTIONS", "PUT", "DELETE"} == IDEMPOTENT
    assert "POST" not in IDEMPOTENT and "PATCH" not in IDEMPOTENT


FUZZ = settings(
    max_examples=300,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
NAMES = [
    "Retry-After", "RateLimit", "RateLimit-Remaining", "RateLimit-Reset",
    "X-RateLimit-Remaining", "X-RateLimit-Reset", "X-RateLimit-Reset-After",
    "x-ratelimit-remaining-requests", "x-ratelimit-reset-requests",
    "x-ratelimit-remaining-tokens", "x-ratelimit-reset-tokens",
]  # fmt: skip
PIECES = [
    "0", "1", "9", "30", "1700000000", "9" * 400, "٣", "²", "-", ".", "e", "nan", "inf", " ", "\x00",
    '"', "\\", ",", ";", "=", "r", "t", "r=0", "t=30", ";r=0;t=", "remaining=0", "reset=",
    "s", "ms", "m", "h", "µs", "Thu, 01 Jan 1970 00:00:00 GMT", "Fri, 31 Dec 9999 23:59:59 GMT",
    "-0000", "+9999", "\udcff", '"' * 50,
]  # fmt: skip
VALUE = st.one_of(
    st.text(max_size=30),
    st.lists(st.sampled_from(PIECES), max_size=12).map("".join),
    st.lists(st.one_of(st.sampled_from(PIECES), st.text(max_size=3)), max_size=8).map("".join),
)


@FUZZ
@given(
    status=st.sampled_from([200, 429, 503]),
    headers=st.dictionaries(st.sampled_from(NAMES), VALUE),
    max_pause=st.floats(min_value=1e-3, max_value=1e9),
    now=st.floats(min_value=0, max_value=4e9),
)
def test_fuzz_never_raises_and_stays_in_range(
    status: int, headers: dict[str, str], max_pause: float, now: float
) -> None:
    result = provider_pause(status, Headers(headers), max_pause=max_pause, now=now)
    assert result is None or (type(result) is float and 0 < result <= max_pause)
