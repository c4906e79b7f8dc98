"""Hostile and malformed input: each case fails with a `ConfigurationError` (or a usage error,
or a rejected signature), never with another exception.

Every case here was reproduced on main before its fix: Unicode digits that pass
``str.isdigit()`` (``'²'``, Arabic-Indic ``'\u0661\u0660'``), numbers too big for a row or
for ``int()``, a clock that returns NaN, grants whose sum overflows a 64-bit
column, tier multipliers that overflow per request, passwords in messages.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

import quota
from quota._cli import main
from quota._core.decision import parse_duration
from quota._core.redaction import redact
from quota._core.url import KNOWN_SCHEMES, parse_url
from quota._limiter import quota_types as _quotas
from quota.http import HttpConfig, RoutePolicy, sign
from quota.http._identity import verify_signature
from tests._http_support import FRAMEWORKS, make_client
from tests._support import Clock

#: Characters ``str.isdigit()`` accepts that are not ASCII digits.
UNICODE_DIGITS = ["²", "\u0661\u0660", "\u0665", "߃", "\U0001d7d7", "¹²"]


def _cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.output


def _names(exc: BaseException, *parts: str) -> None:
    message = str(exc)
    for part in parts:
        assert part in message, message


# -- 1. only ASCII digits are numbers ------------------------------------------------------


@pytest.mark.parametrize("digits", UNICODE_DIGITS)
@pytest.mark.parametrize("template", ["{}/s", "10/{} minutes", "10/s burst {}", "{} per second"])
def test_rate_strings_take_only_ascii_digits(template: str, digits: str) -> None:
    text = template.format(digits)
    with pytest.raises(quota.ConfigurationError) as info:
        quota.parse_rates(text)
    assert repr(text) in str(info.value) or repr(digits) in str(info.value), str(info.value)


def test_the_bad_part_of_a_rate_is_named() -> None:
    with pytest.raises(quota.ConfigurationError) as info:
        quota.parse_rates("10/s;²/s")
    _names(info.value, "'²'", "limit")


@pytest.mark.parametrize("text", ["9" * 5000 + "/s", "10/s burst " + "9" * 5000])
def test_a_rate_with_thousands_of_digits_is_a_configuration_error(text: str) -> None:
    with pytest.raises(quota.ConfigurationError):
        quota.parse_rates(text)


@pytest.mark.parametrize(
    "text",
    [
        *UNICODE_DIGITS,
        "\u0661\u0660m",
        "²h",
        "9" * 5000,
        "99999999999999999999w",
        "-5",
        "+5",
        "5.0",
    ],
)
def test_durations_take_only_ascii_digits_and_are_bounded(text: str) -> None:
    with pytest.raises(quota.ConfigurationError) as info:
        parse_duration("window", text)
    _names(info.value, "window")


@pytest.mark.parametrize(
    "args",
    [
        ["policy", "set", "api", "--rates", "²/s"],
        ["policy", "set", "api", "--rates", "\u0661\u0660/s"],
        ["hit", "k", "--limit", "5", "--window", "²"],
        ["hit", "k", "--limit", "5", "--window", "\u0661\u0660m"],
        ["hit", "k", "--limit", "\u0661\u0660", "--window", "60"],
        ["hit", "k", "--limit", "5", "--window", "60", "--cost", "²"],
        ["cleanup", "--grace", "99999999999999999999w"],
        ["cleanup", "--grace", "²"],
        ["cleanup", "--batch-size", "\u0661\u0660"],
        ["top", "-n", "\u0661\u0660"],
        ["grant", "s", "n", "\u0661\u0660", "--period", "day"],
        ["grant", "s", "n", "5", "--period", "²h"],
        ["ledger", "s", "--since", "²d"],
        ["ledger", "s", "--since", "\u0661\u0660d"],
        ["ledger", "s", "--since", "5ñ"],
        ["ledger", "s", "--since", "\u0662\u0660\u0662\u0666-\u0660\u0661-\u0663\u0661"],
    ],
    ids=lambda args: " ".join(args),
)
def test_the_cli_refuses_unicode_digits_with_a_usage_error(tmp_path: Path, args: list[str]) -> None:
    url = f"sqlite:///{tmp_path / 'c.db'}"
    quota.migrate(url)
    code, out = _cli("--url", url, *args)
    assert code == 2, out
    assert "Traceback" not in out and "Error" in out, out


def _env(**variables: str) -> HttpConfig:
    return HttpConfig.from_env(
        variables, policies=[RoutePolicy(name="api", paths=["/api"], rates="10/minute")]
    )


NUMERIC_VARIABLES = [
    "QUOTA_HMAC_WINDOW",
    "RATE_LIMIT_WINDOW_SEC",
    "RATE_LIMIT_CAPACITY",
    "RATE_LIMIT_MAX_REQUESTS",
    "RATE_LIMIT_WINDOW_MS",
    "RATE_LIMIT_REFILL_PER_SEC",
    "RATE_LIMIT_API_PER_MIN",
    "RATE_LIMIT_API_AUTHED_PER_MIN",
    "QUOTA_POLICY_API_COST",
    "QUOTA_POLICY_CACHE_SECONDS",
]


@pytest.mark.parametrize(
    "value", [*UNICODE_DIGITS, "9" * 5000, "1e308", "nan", "inf", "-1", "0x10"]
)
@pytest.mark.parametrize("variable", NUMERIC_VARIABLES)
def test_numeric_environment_variables_take_only_ascii_numbers_in_bounds(
    variable: str, value: str
) -> None:
    extra = {"RATE_LIMIT_CAPACITY": "10"} if variable.startswith("RATE_LIMIT_WINDOW_MS") else {}
    extra |= {"RATE_LIMIT_CAPACITY": "10"} if variable == "RATE_LIMIT_REFILL_PER_SEC" else {}
    with pytest.raises(quota.ConfigurationError) as info:
        _env(**extra, **{variable: value})
    _names(info.value, variable)


@pytest.mark.parametrize("variable", ["QUOTA_TIER_MULTIPLIERS", "QUOTA_PLAN_SCALES"])
@pytest.mark.parametrize(
    "value", ["\u0661\u0660", "²", "1e308", "1e-308", "inf", "nan", "0", "-1", "1001"]
)
def test_factor_variables_are_finite_positive_and_bounded(variable: str, value: str) -> None:
    with pytest.raises(quota.ConfigurationError) as info:
        _env(**{variable: f"auth={value}"})
    _names(info.value, variable)


def test_numeric_environment_variables_still_parse() -> None:
    config = _env(
        QUOTA_HMAC_WINDOW="120",
        RATE_LIMIT_WINDOW_SEC="30",
        RATE_LIMIT_API_PER_MIN="7",
        QUOTA_POLICY_API_COST="2",
        QUOTA_TIER_MULTIPLIERS="auth=2.5,trusted=1000",
        QUOTA_PLAN_SCALES="pro=1.5,tiny=0.001",
        QUOTA_POLICY_CACHE_SECONDS="2.5",
        RATE_LIMIT_CAPACITY="50",
        RATE_LIMIT_WINDOW_MS="10000",
        RATE_LIMIT_REFILL_PER_SEC="0.5",
    )
    assert config.hmac_window == 120
    assert config.policies[0].base_rates[0].limit == 7
    assert config.policies[0].base_rates[0].window == 30
    assert config.policies[0].cost == 2
    assert config.tier_multipliers["auth"] == 2.5 and config.plan_scales["tiny"] == 0.001
    assert config.policy_cache_seconds == 2.5
    assert config.default is not None
    rate = config.default.base_rates[0]
    assert (rate.limit, rate.window, rate.refill_per_second) == (50, 10, 0.5)


@pytest.mark.parametrize("name", ["tier_multipliers", "plan_scales"])
@pytest.mark.parametrize("factor", [1e308, math.inf, math.nan, 0, -1, 1e-308, 1001])
def test_factors_given_in_code_are_bounded_too(name: str, factor: float) -> None:
    with pytest.raises(quota.ConfigurationError) as info:
        HttpConfig(**{name: {"auth": factor}})  # type: ignore[arg-type]
    _names(info.value, name)


KEYS = {"k1": b"signing-secret-0123456789"}
NOW = 1_750_000_000.0


@pytest.mark.parametrize(
    "stamp",
    ["--1", "²", "\u0661\u0660", "+5", " 5", "5 ", "5.0", "9" * 30, "9" * 5000, "", "-", "0x10", "5\x00",
     "1_000", " 1750000000"],
)  # fmt: skip
def test_a_malformed_signature_timestamp_is_rejected_never_raised(stamp: str) -> None:
    headers = sign("k1", KEYS["k1"], "GET", "/api", NOW)
    headers["x-quota-timestamp"] = stamp
    assert verify_signature(headers, "GET", "/api", NOW, KEYS, 300) == (None, "malformed")


def test_a_signature_over_a_padded_timestamp_is_not_trusted() -> None:
    """`` 1750000000`` signed as such: whitespace is not a timestamp, whatever was signed."""
    import hmac

    stamp = f" {int(NOW)}"
    message = f"k1\nGET\n/api\n{stamp}".encode()
    headers = {
        "x-quota-key-id": "k1",
        "x-quota-timestamp": stamp,
        "x-quota-signature": hmac.new(KEYS["k1"], message, "sha256").hexdigest(),
    }
    assert verify_signature(headers, "GET", "/api", NOW, KEYS, 300)[0] is None


@pytest.mark.parametrize(
    ("framework", "stamp"),
    # httpx (Starlette's test client) sends header values as ASCII only: '²' goes by Flask.
    [(framework, "--1") for framework in FRAMEWORKS] + [("flask", "²")],
)
def test_a_malformed_timestamp_is_counted_as_anon_not_let_through(
    framework: str, sqlite_url: str, clock: Clock, stamp: str
) -> None:
    """An exception in identity was a limiter failure: fail-open let the request through uncounted."""
    quota.migrate(sqlite_url)
    config = HttpConfig(
        policies=[RoutePolicy(name="api", paths=["/api"], rates="1/minute")],
        hash_secret="test-hash-secret-0123456789",
        hmac_keys={"k1": "signing-secret-0123456789"},
        runtime_policies=False,
    )
    client = make_client(framework, sqlite_url, clock, config)
    try:
        headers = {**sign("k1", "signing-secret-0123456789", "GET", "/api/items", clock.now)}
        headers["x-quota-timestamp"] = stamp
        statuses = [client.request("GET", "/api/items", dict(headers)).status for _ in range(2)]
        assert statuses == [200, 429]
        assert client.metrics.get("hmac_rejected", reason="malformed") == 2
    finally:
        client.close()


# -- 2. cleanup ---------------------------------------------------------------------------


@pytest.fixture
def limiter(sqlite_url: str) -> Iterator[quota.Limiter]:
    quota.migrate(sqlite_url)
    with quota.connect(sqlite_url) as limiter:
        yield limiter


@pytest.mark.parametrize("grace", [10**30, 2**63, 10 * 366 * 86400 + 1, -1, 1.5, True, "60"])
def test_cleanup_grace_is_bounded(limiter: quota.Limiter, grace: Any) -> None:
    with pytest.raises(quota.ConfigurationError) as info:
        limiter.cleanup(grace=grace)
    _names(info.value, "grace", repr(grace))


@pytest.mark.parametrize("dry_run", ["no", "", 0, 1, None])
def test_cleanup_dry_run_must_be_a_bool(limiter: quota.Limiter, dry_run: Any) -> None:
    with pytest.raises(quota.ConfigurationError) as info:
        limiter.cleanup(dry_run=dry_run)
    _names(info.value, "dry_run", repr(dry_run))


def test_cleanup_still_takes_its_bounds(limiter: quota.Limiter) -> None:
    assert limiter.cleanup(grace=10 * 366 * 86400, dry_run=True).dry_run
    assert limiter.cleanup(grace=0, dry_run=False).deleted == 0


# -- 3. hit's rates -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "rates", [None, 5, 1.5, b"10/s", object(), [None], [quota.Rate(limit=1, window=60), "x"]]
)
def test_hit_with_rates_that_are_not_rates_names_rates(limiter: quota.Limiter, rates: Any) -> None:
    with pytest.raises(quota.ConfigurationError) as info:
        limiter.hit("k", rates)
    _names(info.value, "rates")


# -- 4. redis URLs --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    ["redis://", "rediss://", "redis://:secret-pw@", "redis://:secret-pw@h:abc",
     "redis://:secret-pw@h:99999", "redis://:secret-pw@[::1", "redis://:secret-pw@h?db=x",
     "redis://:secret-pw@h?socket_timeout=x", "redis://:secret-pw@h/0?bogus_option=1"],
)  # fmt: skip
def test_a_bad_redis_url_is_a_configuration_error_naming_it_redacted(url: str) -> None:
    pytest.importorskip("redis")
    for connect in (quota.connect, quota.connect_async):
        with pytest.raises(quota.ConfigurationError) as info:
            connect(url)
        assert "secret-pw" not in str(info.value)
        assert redact(url) in str(info.value) or "redis" in str(info.value)
        if "bogus_option" in url:  # named at connect, not a TypeError at the first call
            assert "bogus_option" in str(info.value)


# -- 5. the clock ---------------------------------------------------------------------------

BAD_CLOCKS = [math.nan, math.inf, -math.inf, "1750000000", None, 1e300, -5.0, True]


def _calls(limiter: quota.Limiter) -> list[Callable[[], object]]:
    return [
        lambda: limiter.rate_limit("k", 5, 60),
        lambda: limiter.hit("k", "5/minute"),
        lambda: limiter.peek("k", 5, 60),
        lambda: limiter.cleanup(),
        lambda: limiter.consume_quota("s", "n", 5, "day"),
        lambda: limiter.consume_quota("s", "n", 5, 3600),
        lambda: limiter.grant_quota("s", "n", 5, "month"),
        lambda: limiter.refund_quota("s", "n", "key"),
        lambda: limiter.quota_usage("s"),
        lambda: limiter.cleanup_ledger(older_than=86400),
        lambda: limiter.check(quota.RateWindow("k", 5, 60), quota.QuotaLimit("s", "n", 5, "day")),
    ]


@pytest.mark.parametrize("now", BAD_CLOCKS, ids=repr)
def test_a_clock_that_is_not_finite_epoch_seconds_is_a_configuration_error(
    sqlite_url: str, now: object
) -> None:
    quota.migrate(sqlite_url)
    with quota.connect(sqlite_url, clock=lambda: now) as limiter:  # type: ignore[arg-type,return-value]
        for call in _calls(limiter):
            with pytest.raises(quota.ConfigurationError) as info:
                call()
            _names(info.value, "clock", repr(now))


@pytest.mark.parametrize("now", [math.nan, math.inf, "x"], ids=repr)
def test_the_async_face_checks_its_clock_too(sqlite_url: str, now: object) -> None:
    quota.migrate(sqlite_url)

    async def go() -> None:
        async with quota.connect_async(sqlite_url, clock=lambda: now) as limiter:  # type: ignore[arg-type,return-value]
            for call in (
                lambda: limiter.rate_limit("k", 5, 60),
                lambda: limiter.consume_quota("s", "n", 5, "day"),
                lambda: limiter.cleanup(),
            ):
                with pytest.raises(quota.ConfigurationError) as info:
                    await call()
                _names(info.value, "clock")

    asyncio.run(go())


def test_integer_and_small_clocks_still_work(sqlite_url: str) -> None:
    quota.migrate(sqlite_url)
    for now in (100, 100.0, 1_750_000_000):
        with quota.connect(sqlite_url, clock=lambda now=now: now) as limiter:  # type: ignore[misc]
            assert limiter.rate_limit(f"k{now}", 5, 60).allowed
            assert limiter.consume_quota(f"s{now}", "n", 5, "day").allowed


# -- 6. grants and limits stay within 64 bits -----------------------------------------------


@pytest.fixture
def quota_limiter(sql_url: str) -> Iterator[quota.Limiter]:
    with quota.connect(sql_url) as limiter:
        yield limiter


def test_grants_cannot_push_granted_past_what_a_row_holds(quota_limiter: quota.Limiter) -> None:
    subject = f"grant-{id(quota_limiter)}"
    big = _quotas.MAX_QUOTA_GRANTED
    with pytest.raises(quota.ConfigurationError) as info:
        quota_limiter.grant_quota(subject, "n", 2**62, "day")
    _names(info.value, "amount", repr(2**62))
    assert quota_limiter.grant_quota(subject, "n", big // 2, "day").granted == big // 2
    assert quota_limiter.grant_quota(subject, "n", big - big // 2, "day").granted == big
    with pytest.raises(quota.ConfigurationError) as info:
        quota_limiter.grant_quota(subject, "n", 1, "day")
    _names(info.value, "amount", "granted")
    # The refused grant wrote nothing: the row and the ledger are as they were,
    # and every later consume still works.
    [usage] = quota_limiter.quota_usage(subject)
    assert usage.granted == big
    assert [e.kind for e in quota_limiter.ledger(subject)] == ["grant", "grant"]
    limit = _quotas.MAX_QUOTA_LIMIT
    decision = quota_limiter.consume_quota(subject, "n", limit, "day", cost=limit)
    assert decision.allowed and decision.remaining == big
    assert quota_limiter.consume_quota(subject, "n", 5, "day").allowed


def test_quota_limits_and_costs_are_bounded_so_sums_fit(quota_limiter: quota.Limiter) -> None:
    limit = _quotas.MAX_QUOTA_LIMIT
    subject = f"big-{id(quota_limiter)}"
    for _ in range(2):
        quota_limiter.consume_quota(subject, "n", limit, "day", cost=limit)  # never a StorageError
    for call in (
        lambda: quota_limiter.consume_quota(subject, "n", limit + 1, "day"),
        lambda: quota_limiter.consume_quota(subject, "n", 2**62, "day", cost=2**62),
        lambda: quota.QuotaLimit(subject, "n", limit + 1, "day"),
        lambda: quota_limiter.grant_quota(subject, "n", _quotas.MAX_QUOTA_GRANTED + 1, "day"),
    ):
        with pytest.raises(quota.ConfigurationError):
            call()


# -- 7. multipliers cannot overflow per request ---------------------------------------------


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_the_largest_multipliers_still_decide(
    framework: str, sqlite_url: str, clock: Clock
) -> None:
    quota.migrate(sqlite_url)
    config = HttpConfig.from_env(
        {"QUOTA_TIER_MULTIPLIERS": "anon=1000"},
        policies=[RoutePolicy(name="api", paths=["/api"], rates=f"{2**62}/minute;10/s burst 20")],
        hash_secret="test-hash-secret-0123456789",
        runtime_policies=False,
    )
    client = make_client(framework, sqlite_url, clock, config)
    try:
        reply = client.request("GET", "/api/items")
        assert reply.status == 200
        assert not client.metrics.get("errors", route="api", mode="open")
    finally:
        client.close()


def test_scale_rate_never_builds_a_rate_out_of_bounds() -> None:
    from quota.http._capacity import scale_rate

    top = quota.Rate(limit=2**62, window=60, algorithm="token_bucket", burst=2**62,
                     refill_per_second=1e300)  # fmt: skip
    scaled = scale_rate(top, 1e6, 1)
    assert scaled.limit == scaled.burst == 2**62
    assert scaled.refill_per_second is not None and math.isfinite(scaled.refill_per_second)
    tiny = scale_rate(quota.Rate(limit=5, window=60, refill_per_second=1e-300), 1e-9, 1)
    assert tiny.refill_per_second is not None and tiny.refill_per_second > 0


# -- 8. URLs in messages are redacted -------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "secret"),
    [
        ("postgresql://user:pa@ss@host/db", "pa@ss"),
        ("postgresql://user:pa:ss@host/db", "pa:ss"),
        ("postgresql://user:p@:ss@host:5432/db?sslmode=require", "p@:ss"),
        ("postgresql://user:pa/ss@host/db", "pa/ss"),
        ("postgresql://user:pa?ss@host/db", "pa?ss"),
        ("postgresql://user:pa#ss@host/db", "pa#ss"),
        ("postgresql://host/db?user=u&password=hunter2", "hunter2"),
        ("postgresql://host/db?sslpassword=hunter2&sslmode=require", "hunter2"),
        ("postgresql://u:topsecret@host/db?application_name=a@b", "topsecret"),
        ("redis://:secret@host", "secret"),
        ("redis://:secret@host:6379/0", "secret"),
        ("rediss://default:secret@host/0?prefix=q", "secret"),
        ("postgresql+asyncpg://user:s3cr3t@host/db", "s3cr3t"),
    ],
)
def test_redact_hides_every_password(url: str, secret: str) -> None:
    hidden = redact(url)
    assert secret not in hidden, hidden
    assert "***" in hidden


def test_redact_keeps_what_is_not_a_password() -> None:
    assert redact("postgresql://app@db:5432/app") == "postgresql://app@db:5432/app"
    assert redact("postgresql://app:pw@db:5432/app?sslmode=require") == (
        "postgresql://app:***@db:5432/app?sslmode=require"
    )
    assert redact("sqlite:///quota.sqlite3") == "sqlite:///quota.sqlite3"
    assert redact("redis://:pw@cache:6379/0") == "redis://:***@cache:6379/0"


@pytest.mark.parametrize(
    "call",
    [
        lambda: quota.connect("postgresql+asyncpg://u:hunter2@db/x"),
        lambda: quota.connect_async("postgresql+psycopg://u:hunter2@db/x"),
        lambda: quota.migrate("memory://u:hunter2@x"),
        lambda: parse_url("nosuch://u:hunter2@db/x"),
        lambda: parse_url("postgresql://u:hunter2@db/x?prepared_statements=maybe"),
        lambda: parse_url("postgresql://u:hunter2@db/x?schema=1bad"),
        lambda: parse_url("redis://u:hunter2@db/0").sqlalchemy_url(),
        lambda: parse_url("sqlite+aiosqlite:///x.db").driver_for(asynchronous=False),
        lambda: parse_url("postgresql+asyncpg://u:hunter2@db/x").driver_for(asynchronous=False),
        lambda: parse_url("postgresql+psycopg://u:hunter2@db/x").driver_for(asynchronous=True),
        lambda: quota.connect("redis://:hunter2@db?prefix={x}"),
    ],
)
def test_configuration_errors_about_urls_never_print_the_password(call: Callable[[], Any]) -> None:
    with pytest.raises(quota.ConfigurationError) as info:
        call()
    assert "hunter2" not in str(info.value), str(info.value)


@pytest.mark.parametrize("scheme", KNOWN_SCHEMES)
@pytest.mark.parametrize("face", ["sync", "async"])
def test_a_bad_option_never_prints_the_password_whatever_the_scheme(
    scheme: str, face: str, tmp_path: Path
) -> None:
    """Every scheme, every face: a URL with a password and an option nobody reads."""
    host = f"/{tmp_path}/x.db" if scheme.startswith("sqlite") else "u:hunter2@127.0.0.1:1/0"
    url = f"{scheme}://{host}?bogus=1&password=hunter2"

    async def open_async() -> None:
        async with quota.connect_async(url) as limiter:
            await limiter.rate_limit("k", 1, 60)

    try:
        if face == "sync":
            with quota.connect(url) as limiter:
                limiter.rate_limit("k", 1, 60)
        else:
            asyncio.run(open_async())
    except quota.QuotaError as exc:
        assert "hunter2" not in str(exc), str(exc)
    else:
        pytest.fail(f"{url} was accepted")


def test_every_quota_error_hides_the_passwords_in_its_message() -> None:
    text = (
        "cannot reach memory://u:pw1@x or redis+cluster://:pw2@h:1, nor (mysql://a:pw3@h/d);"
        " tried host=h password=pw4"
    )
    for error in (
        quota.QuotaError,
        quota.ConfigurationError,
        quota.StorageError,
        quota.SchemaError,
    ):
        message = str(error(text))
        assert not any(f"pw{i}" in message for i in range(1, 5)), message
        assert "memory://u:***@x" in message
    assert str(quota.StorageError("retry in 5 s")) == "retry in 5 s"


def test_migrating_a_database_that_does_not_exist_says_so_in_plain_words(pg_url: str) -> None:
    missing = pg_url.rsplit("/", 1)[0] + "/quota_no_such_database"
    with pytest.raises(quota.StorageError) as info:
        quota.migrate(missing)
    message = str(info.value)
    assert 'database "quota_no_such_database" does not exist' in message
    assert "sqlalche.me" not in message and "Background on this error" not in message
    assert "(sqlalchemy." not in message


def test_the_cli_does_not_print_the_password_of_a_bad_url() -> None:
    code, out = _cli("--url", "nosuch://u:hunter2@db/x", "hit", "k", "-l", "1", "-w", "60")
    assert code == 2
    assert "hunter2" not in out
