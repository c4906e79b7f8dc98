"""Bad arguments, bad URLs and odd keys.

A bad value fails with `quota.ConfigurationError` (also a `ValueError`) whose
message names the argument and the value. Any string is a valid key, on
every backend, and distinct strings never share a counter.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import re
from collections.abc import Callable
from pathlib import Path

import pytest

import quota
from tests._support import Backend, OpenBackend

MAX_WINDOW = 366 * 24 * 3600


def test_configuration_error_is_a_value_error_under_quota_error() -> None:
    assert issubclass(quota.ConfigurationError, ValueError)
    assert issubclass(quota.ConfigurationError, quota.QuotaError)
    assert issubclass(quota.SchemaError, quota.StorageError)
    assert issubclass(quota.StorageError, quota.QuotaError)


def _assert_names(exc: BaseException, name: str, value: object) -> None:
    message = str(exc)
    assert name in message, message
    assert repr(value) in message, message


@pytest.mark.parametrize(
    "key",
    ["", 42, b"ip:1.2.3.4", None],
    ids=["empty", "int", "bytes", "None"],
)
def test_a_key_that_is_not_a_non_empty_str_is_rejected(backend: Backend, key: object) -> None:
    for call in (
        lambda: backend.rate_limit(key, 5, 60),
        lambda: backend.peek(key, 5, 60),
        lambda: backend.reset(key),
    ):
        with pytest.raises(quota.ConfigurationError) as info:
            call()
        _assert_names(info.value, "key", key)


BAD_NUMBERS = [0, -1, 1.5, 60.0, True, "60"]
BAD_NUMBER_IDS = ["zero", "negative", "float", "whole-float", "True", "str"]


@pytest.mark.parametrize("limit", BAD_NUMBERS, ids=BAD_NUMBER_IDS)
def test_a_limit_that_is_not_a_positive_int_is_rejected(backend: Backend, limit: object) -> None:
    for call in (lambda: backend.rate_limit("k", limit, 60), lambda: backend.peek("k", limit, 60)):
        with pytest.raises(ValueError) as info:
            call()
        assert isinstance(info.value, quota.ConfigurationError)
        _assert_names(info.value, "limit", limit)
    assert backend.peek("k", 5, 60).count == 0


BAD_WINDOWS = [0, -1, 1.5, 60.0, True, "0", "1x", "-1m", "367d", dt.timedelta(0),
               dt.timedelta(seconds=1.5), dt.timedelta(days=367), b"60"]  # fmt: skip
BAD_WINDOW_IDS = ["zero", "negative", "float", "whole-float", "True", "str-zero", "str-unit",
                  "str-negative", "str-over-366-days", "timedelta-zero", "timedelta-fraction",
                  "timedelta-over-366-days", "bytes"]  # fmt: skip


@pytest.mark.parametrize(
    "window", [*BAD_WINDOWS, MAX_WINDOW + 1], ids=[*BAD_WINDOW_IDS, "over-366-days"]
)
def test_a_window_that_is_not_a_positive_int_up_to_366_days_is_rejected(
    backend: Backend, window: object
) -> None:
    for call in (
        lambda: backend.rate_limit("k", 5, window),
        lambda: backend.peek("k", 5, window),
        lambda: backend.reset("k", window=window),
        lambda: quota.Rate(limit=5, window=window),  # type: ignore[arg-type]
        lambda: quota.RateWindow("k", 5, window),  # type: ignore[arg-type]
    ):
        with pytest.raises(quota.ConfigurationError) as info:
            call()
        _assert_names(info.value, "window", window)


@pytest.mark.parametrize(
    "window", ["1m", "60", "60s", " 1M ", dt.timedelta(minutes=1), dt.timedelta(seconds=60.0)]
)
def test_a_window_is_taken_as_the_command_line_takes_it_or_a_timedelta(
    backend: Backend, window: object
) -> None:
    """`quota hit -w 1m` and `rate_limit(key, 2, "1m")` count the same 60-second window."""
    assert quota.Rate(limit=2, window=window).window == 60  # type: ignore[arg-type]
    assert quota.RateWindow("k", 2, window).window == 60  # type: ignore[arg-type]
    assert [backend.rate_limit("k", 2, window).allowed for _ in range(2)] == [True, True]
    denied = backend.rate_limit("k", 2, 60)
    assert (denied.allowed, denied.window, denied.count) == (False, 60, 3)
    assert backend.peek("k", 2, window).count == 3
    assert backend.peek("k", 2, window, algorithm="sliding_window").limit == 2
    assert backend.hit("k", quota.Rate(limit=2, window=window)).window == 60  # type: ignore[arg-type]
    assert backend.reset("k", window) >= 1
    assert backend.peek("k", 2, 60).count == 0


def test_a_quota_period_and_an_abuse_window_take_durations_too(sqlite_url: str) -> None:
    assert quota.QuotaLimit("s", "n", 1, "30d").period == 30 * 86400
    assert quota.QuotaLimit("s", "n", 1, dt.timedelta(hours=12)).period == 12 * 3600  # type: ignore[arg-type]
    assert quota.QuotaLimit("s", "n", 1, "month").period == "month"
    for bad in ("fortnight", "0", dt.timedelta(seconds=0.5), 1.5):
        with pytest.raises(quota.ConfigurationError) as info:
            quota.QuotaLimit("s", "n", 1, bad)  # type: ignore[arg-type]
        _assert_names(info.value, "period", bad)
    limiter = quota.connect(sqlite_url)
    charged = limiter.consume_quota("s", "n", 2, "1h")
    assert charged.resets_at - charged.period_start == 3600
    assert limiter.consume_quota("s", "n", 2, 3600).used == 2  # the same quota, charged twice
    limiter.close()
    detector = quota.AbuseDetector(threshold=3, window="1m", interval=dt.timedelta(minutes=15))
    assert (detector.window, detector.interval) == (60, 900)
    with pytest.raises(quota.ConfigurationError) as info:
        quota.AbuseDetector(threshold=3, window="1x", interval=900)
    _assert_names(info.value, "window", "1x")


def test_a_window_of_exactly_366_days_is_accepted(backend: Backend) -> None:
    assert backend.rate_limit("k", 5, MAX_WINDOW).allowed


@pytest.mark.parametrize(
    ("name", "value"),
    [("grace", -1), ("grace", 1.5), ("batch_size", 0), ("batch_size", True)],
)
def test_bad_cleanup_arguments_are_rejected(backend: Backend, name: str, value: object) -> None:
    with pytest.raises(quota.ConfigurationError) as info:
        backend.cleanup(**{name: value})
    _assert_names(info.value, name, value)


def test_a_bad_top_count_names_n(backend: Backend) -> None:
    with pytest.raises(quota.ConfigurationError) as info:
        backend.top(0)
    assert re.search(r"\bn\b", str(info.value)), str(info.value)


@pytest.mark.parametrize(
    ("option", "value"),
    [("count_denied", "yes"), ("clock", 5), ("timeout", 0), ("timeout", True), ("pool_size", 0)],
)
@pytest.mark.parametrize("connect", [quota.connect, quota.connect_async])
def test_bad_options_fail_when_the_limiter_is_built(
    tmp_path: Path, connect: object, option: str, value: object
) -> None:
    with pytest.raises(quota.ConfigurationError) as info:
        connect(f"sqlite:///{tmp_path / 'q.db'}", **{option: value})  # type: ignore[operator]
    _assert_names(info.value, option, value)


# --- URLs -------------------------------------------------------------------------------

EVERY_SCHEME = ["sqlite", "sqlite+aiosqlite", "postgresql", "postgresql+asyncpg"]


@pytest.mark.parametrize("url", ["nosuchdb://localhost:6379/0", "ftp://root@db/app", "quota.db"])
@pytest.mark.parametrize("connect", [quota.connect, quota.connect_async, quota.migrate])
def test_an_unknown_url_scheme_lists_the_known_ones(connect: object, url: str) -> None:
    with pytest.raises(quota.ConfigurationError) as info:
        connect(url)  # type: ignore[operator]
    message = str(info.value)
    assert url in message
    for scheme in EVERY_SCHEME:
        assert scheme in message


@pytest.mark.parametrize(
    "url",
    [
        "sqlite:///:memory:",
        "sqlite://",
        "sqlite+aiosqlite:///:memory:",
        "sqlite:///file::memory:?cache=shared",
    ],
)
@pytest.mark.parametrize("connect", [quota.connect, quota.connect_async])
def test_an_in_memory_sqlite_url_is_rejected(connect: object, url: str) -> None:
    with pytest.raises(quota.ConfigurationError) as info:
        connect(url)  # type: ignore[operator]
    assert url in str(info.value)
    assert "memory" in str(info.value)


@pytest.mark.parametrize(
    "url", ["sqlite+aiosqlite:///x.db", "postgresql+asyncpg://root@127.0.0.1:5432/test"]
)
def test_connect_with_an_async_driver_points_to_connect_async(url: str) -> None:
    with pytest.raises(quota.ConfigurationError) as info:
        quota.connect(url)
    assert url in str(info.value)
    assert "connect_async" in str(info.value)


@pytest.mark.parametrize(
    "url", ["sqlite+pysqlite:///x.db", "postgresql+psycopg://root@127.0.0.1:5432/test"]
)
def test_connect_async_with_a_sync_driver_points_to_connect(url: str) -> None:
    with pytest.raises(quota.ConfigurationError) as info:
        quota.connect_async(url)
    assert url in str(info.value)
    assert re.search(r"quota\.connect\(", str(info.value)), str(info.value)


def test_connecting_opens_nothing(tmp_path: Path) -> None:
    """Connections open on first use: building a limiter on a bad path does not fail."""
    missing = tmp_path / "no" / "such" / "dir" / "q.db"
    limiter = quota.connect(f"sqlite:///{missing}")
    limiter.close()
    assert not missing.parent.exists()
    with pytest.raises(quota.StorageError):
        quota.connect(f"sqlite:///{missing}").rate_limit("k", 1, 60)


# --- odd keys ---------------------------------------------------------------------------

LONG = "x" * 100_000
#: What a stored digest of LONG looks like, passed in as a plain key.
LONG_DIGEST = "h:" + hashlib.sha256(LONG.encode()).hexdigest()

WEIRD_KEYS = {
    "nul": "a\x00b",
    "nul-prefix-twin": "a",
    "only-nul": "\x00",
    "quotes": 'it\'s "quoted" `back`',
    "sql": "'; DROP TABLE quota_counters; --",
    "emoji": "user:\N{GRINNING FACE}\N{PILE OF POO}",
    "lone-surrogate": "\ud800",
    "surrogate-pair-halves": "\ud83d\ude00",
    "percent-and-backslash": "100% \\ %s $1 ?",
    "newlines-and-tabs": "a\nb\r\nc\td",
    "long": LONG,
    "long-twin": LONG[:-1] + "y",
    "long-prefix": LONG[:-1],
    "digest-lookalike": LONG_DIGEST,
    "k-prefix-lookalike": "k:a",
    "whitespace": " ",
    "200-byte-boundary": "\N{GREEK SMALL LETTER ALPHA}" * 100,
    "201-byte-boundary": "\N{GREEK SMALL LETTER ALPHA}" * 100 + "z",
}


def test_odd_keys_work_and_never_share_a_counter(backend: Backend) -> None:
    keys = list(WEIRD_KEYS.values())
    assert len(set(keys)) == len(keys)

    for key in keys:
        first = backend.rate_limit(key, 1, 60)
        assert first.allowed, f"{key[:40]!r} shares a counter with an earlier key"
        assert first.count == 1
        assert first.key == key
    for key in keys:
        assert not backend.rate_limit(key, 1, 60).allowed, repr(key[:40])
        assert backend.peek(key, 1, 60).count == 2, repr(key[:40])

    assert len(backend.top(100)) == len(keys)
    for key in keys:
        assert backend.reset(key) == 1, repr(key[:40])
    assert backend.top(100) == []


def test_the_sql_injection_key_leaves_the_table_alone(backend: Backend) -> None:
    backend.rate_limit("victim", 10, 60)
    backend.rate_limit(WEIRD_KEYS["sql"], 10, 60)
    backend.reset(WEIRD_KEYS["sql"])

    assert backend.peek("victim", 10, 60).count == 1


# --- URL forms that work --------------------------------------------------------------


@pytest.mark.parametrize(
    ("face", "prefix"),
    [
        ("sync", "sqlite+pysqlite://"),
        ("async", "sqlite+aiosqlite://"),
    ],
)
def test_explicit_sqlite_drivers_connect(
    sqlite_url: str, face: str, prefix: str, open_backend: OpenBackend
) -> None:
    url = prefix + sqlite_url.removeprefix("sqlite://")
    assert open_backend(f"postgresql-{face}", url).rate_limit("k", 1, 60).allowed


@pytest.mark.postgres
@pytest.mark.parametrize(
    ("face", "scheme"),
    [
        ("sync", "postgres"),
        ("sync", "postgresql+psycopg"),
        ("async", "postgres"),
        ("async", "postgresql+asyncpg"),
    ],
)
def test_every_postgresql_url_form_connects(
    pg_clean_url: str, face: str, scheme: str, open_backend: OpenBackend
) -> None:
    url = scheme + pg_clean_url[pg_clean_url.index("://") :]
    first = open_backend(f"postgresql-{face}", url).rate_limit("k", 1, 60)
    assert first.allowed
    # The same table as the plain URL's: the second hit is denied.
    assert not open_backend(f"postgresql-{face}", pg_clean_url).rate_limit("k", 1, 60).allowed


def test_a_relative_sqlite_path_is_relative_to_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, open_backend: OpenBackend
) -> None:
    monkeypatch.chdir(tmp_path)
    quota.migrate("sqlite:///relative.db")

    assert (tmp_path / "relative.db").exists()
    assert open_backend("sqlite-sync", "sqlite:///relative.db").rate_limit("k", 1, 60).allowed


# --- passwords stay out of messages -----------------------------------------------------

SECRET = "s3cr3t-pw"
#: Port 1 on localhost refuses connections, so these fail without any server.
REFUSED_WITH_PASSWORD = f"postgresql://root:{SECRET}@127.0.0.1:1/db"


@pytest.mark.parametrize(
    "operation",
    [
        pytest.param("connect", id="connect"),
        pytest.param("connect_async", id="connect_async"),
        pytest.param("migrate", id="migrate", marks=()),
        pytest.param("current_revision", id="current_revision", marks=()),
    ],
)
def test_an_unreachable_server_is_a_storage_error_without_the_password(
    operation: str, open_backend: OpenBackend
) -> None:
    url = REFUSED_WITH_PASSWORD
    with pytest.raises(quota.StorageError) as info:
        if operation == "connect":
            open_backend("postgresql-sync", url, timeout=2).rate_limit("k", 1, 60)
        elif operation == "connect_async":
            open_backend("postgresql-async", url, timeout=2).rate_limit("k", 1, 60)
        else:
            getattr(quota, operation)(url)

    assert not isinstance(info.value, quota.SchemaError)
    assert SECRET not in str(info.value)
    assert "127.0.0.1" in str(info.value)
    assert info.value.__cause__ is not None


@pytest.mark.postgres
@pytest.mark.parametrize("face", ["sync", "async"])
def test_a_schema_error_does_not_show_the_password(
    pg_make_database: Callable[[], str], face: str, open_backend: OpenBackend
) -> None:
    url = pg_make_database()  # trust authentication: the password is ignored by the server
    with_password = url.replace("://root@", f"://root:{SECRET}@", 1)
    assert SECRET in with_password

    with pytest.raises(quota.SchemaError) as info:
        open_backend(f"postgresql-{face}", with_password).rate_limit("k", 1, 60)

    assert "quota migrate" in str(info.value)
    assert SECRET not in str(info.value)


def test_the_remembered_plain_keys_give_the_stored_form_and_stay_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`hit_params` remembers plain keys' stored form; a key passed twice, a key that
    needs a digest, a str subclass and a bad key come out as `stored_key` says, and the
    memory starts afresh once it holds `_PLAIN_KEYS_KEPT` keys."""
    from quota._core import decision

    class Name(str):
        pass

    monkeypatch.setattr(decision, "_plain_keys", {})
    monkeypatch.setattr(decision, "_PLAIN_KEYS_KEPT", 3)
    for key in ["a", "a", "x" * 51, "é", "nul\x00", Name("a"), "b", "c", "d", "a"]:
        params = decision.hit_params(key, 5, 60, 1000.0)
        assert params[1] == decision.stored_key(key), repr(key)
        assert params[0] == f"60:960:{decision.stored_key(key)}"
        assert len(decision._plain_keys) <= 3
    assert set(decision._plain_keys) <= {"a", "b", "c", "d"}
    for bad in [["a"], None, ""]:
        with pytest.raises(quota.ConfigurationError, match="key"):
            decision.hit_params(bad, 5, 60, 1000.0)
