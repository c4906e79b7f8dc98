"""`quota.contrib.django.middleware.QuotaMiddleware` through Django's test clients, sync and async.

Every test runs four ways: SQLite and PostgreSQL, each through the sync
test client (the middleware calls `conf.get_limiter()`) and through
`AsyncClient` (it calls `conf.get_async_limiter()`; the other getter is
replaced by one that fails the request, so a middleware using the wrong one
cannot pass). The limiter's clock is frozen: counts never straddle a window
and the reset times are exact. This module is also the URLconf of the tests.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from asgiref.sync import iscoroutinefunction
from django.http import HttpRequest, HttpResponse
from django.test import AsyncClient, Client
from django.urls import path

import quota
from quota.contrib.django import conf
from quota.contrib.django.middleware import QuotaMiddleware
from quota.http import RoutePolicy, sign

NOW = 1_800_000_030.0  # 30 s into a minute
WINDOW_END = 1_800_000_060
SECRET = "django-middleware-test-secret"
HMAC_SECRET = "hmac-secret-of-key-k1-0123456789"


def frozen() -> float:
    return NOW


# -- the URLconf -----------------------------------------------------------------------------

VIEW_CALLS: list[str] = []


def view(request: HttpRequest) -> HttpResponse:
    VIEW_CALLS.append(request.path)
    response = HttpResponse("ok", content_type="text/plain")
    response["Access-Control-Expose-Headers"] = "X-App"
    return response


urlpatterns = [
    path("api/items", view),
    path("api/pay", view),
    path("api/search", view),
    path("other", view),
    path("health", view),
]


class FakeUser:
    is_authenticated = True
    is_superuser = False
    pk = 7


class NotLoaded:
    """``request.user`` before it is loaded: reading it from the event loop is an error."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"request.user.{name} read before `await request.auser()`")


def fake_auth(get_response: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """Signs in user 7 when ``X-Test-User`` is sent, as AuthenticationMiddleware would.

    Under ASGI the user is only reachable through ``await request.auser()``.
    """

    def middleware(request: Any) -> Any:
        signed_in = "HTTP_X_TEST_USER" in request.META
        if hasattr(request, "scope"):
            request.user = NotLoaded()

            async def auser() -> object:
                return FakeUser() if signed_in else None

            request.auser = auser
        elif signed_in:
            request.user = FakeUser()
        return get_response(request)

    return middleware


# -- fixtures --------------------------------------------------------------------------------


@dataclass
class Observed:
    """A callable observer: every metric event the middleware emits."""

    events: list[tuple[str, dict[str, str]]] = field(default_factory=list)

    def __call__(self, name: str, labels: Mapping[str, str]) -> None:
        self.events.append((name, dict(labels)))

    def count(self, name: str, **labels: str) -> int:
        return sum(
            1
            for n, seen in self.events
            if n == "ratelimit." + name and all(seen.get(k) == v for k, v in labels.items())
        )


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path}/quota.sqlite3"
        quota.migrate(url)
        return url
    url: str = request.getfixturevalue("pg_clean_url")
    return url


class Caller:
    """Sends requests through the sync or the async test client."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.loop: asyncio.AbstractEventLoop | None = None
        self.client: Client | AsyncClient | None = None

    def get(self, url: str, headers: Mapping[str, str] | None = None) -> Any:
        if self.client is None:  # built on first use, after the settings are in place
            if self.mode == "sync":
                self.client = Client()
            else:
                self.loop = asyncio.new_event_loop()
                self.client = AsyncClient()
        if isinstance(self.client, AsyncClient):
            assert self.loop is not None
            return self.loop.run_until_complete(self.client.get(url, headers=dict(headers or {})))
        return self.client.get(url, headers=dict(headers or {}))

    def close(self) -> None:
        if self.loop is not None:
            # Closes the loop's limiter (conf ties it to the loop's async generators).
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()


@pytest.fixture(params=["sync", "async"])
def caller(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Caller]:
    mode = request.param

    def wrong(*_args: object) -> Any:
        raise AssertionError(f"the {mode} middleware used the other limiter")

    monkeypatch.setattr(conf, "get_async_limiter" if mode == "sync" else "get_limiter", wrong)
    made = Caller(mode)
    try:
        yield made
    finally:
        made.close()


@pytest.fixture
def configure(
    settings: Any, store_url: str, monkeypatch: pytest.MonkeyPatch
) -> Callable[..., Observed]:
    """Installs the middleware with ``QUOTA["HTTP"]`` = `http` on `store_url` (or `url`)."""
    for name in ("QUOTA_HASH_SECRET", "RATE_LIMIT_SECRET", "QUOTA_SHADOW", "QUOTA_ENABLED"):
        monkeypatch.delenv(name, raising=False)
    VIEW_CALLS.clear()

    def install(
        url: str | None = None, hooks: Mapping[str, Any] | None = None, **http: Any
    ) -> Observed:
        observed = Observed()
        settings.ROOT_URLCONF = __name__
        settings.MIDDLEWARE = [
            f"{__name__}.fake_auth",
            "quota.contrib.django.middleware.QuotaMiddleware",
        ]
        settings.QUOTA = {
            "URL": url or store_url,
            "OPTIONS": {"clock": frozen, "pool_size": 2, "timeout": 2},
            "HTTP": {
                "hash_secret": SECRET,
                **http,
                "hooks": {"observer": observed, **(hooks or {})},
            },
        }
        return observed

    return install


ITEMS = RoutePolicy(name="items", paths=["/api/items"], rates="2/minute")


# -- route classes, headers ----------------------------------------------------------------


def test_route_classes_count_apart_and_other_paths_pass(
    configure: Callable[..., Observed], caller: Caller
) -> None:
    configure(
        policies=[ITEMS, {"name": "search", "paths": ["/api/search"], "rates": "3/minute"}],
        exclude=["/health"],
    )
    items = [caller.get("/api/items").status_code for _ in range(3)]
    search = [caller.get("/api/search").status_code for _ in range(4)]
    other = [caller.get(p) for p in ("/other", "/other", "/other", "/health")]

    assert items == [200, 200, 429]
    assert search == [200, 200, 200, 429]
    assert [r.status_code for r in other] == [200] * 4
    assert all("X-RateLimit-Limit" not in r.headers for r in other), "no class, no headers"
    # A denied request never reaches the view.
    assert VIEW_CALLS == ["/api/items"] * 2 + ["/api/search"] * 3 + ["/other"] * 3 + ["/health"]


def test_headers_on_allow_and_the_429_problem_on_deny(
    configure: Callable[..., Observed], caller: Caller
) -> None:
    observed = configure(policies=[ITEMS])
    first = caller.get("/api/items")
    second = caller.get("/api/items", headers={"Origin": "https://app.example"})
    denied = caller.get("/api/items")

    assert first.status_code == 200 and first.content == b"ok"
    assert first["X-RateLimit-Limit"] == "2"
    assert first["X-RateLimit-Remaining"] == "1"
    assert first["X-RateLimit-Reset"] == str(WINDOW_END)
    assert first["X-RateLimit-Lane"] == "anon"
    assert first["RateLimit-Policy"] == '"items";q=2;w=60'
    assert first["RateLimit"] == '"items";r=1;t=30'
    assert first["Access-Control-Expose-Headers"] == "X-App", "same origin: untouched"
    assert second["X-RateLimit-Remaining"] == "0"
    # Cross-origin: the view's exposed header stays, quota's are added.
    exposed = [n.strip() for n in second["Access-Control-Expose-Headers"].split(",")]
    assert exposed[0] == "X-App" and "X-RateLimit-Remaining" in exposed

    assert denied.status_code == 429
    assert denied["Content-Type"] == "application/problem+json"
    assert denied["Retry-After"] == "30"
    assert denied["X-RateLimit-Remaining"] == "0"
    assert denied["RateLimit"] == '"items";r=0;t=30'
    body = json.loads(denied.content)
    assert body["code"] == "RATE_LIMITED" and body["status"] == 429
    assert body["violated-policies"] == ["items"]
    assert body["retry_after"] == 30
    assert observed.count("blocked", route="items", tier="anon") == 1
    assert VIEW_CALLS == ["/api/items"] * 2


def test_the_environment_tunes_the_settings(
    configure: Callable[..., Observed], caller: Caller, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("QUOTA_POLICY_ITEMS_RATES", "3/minute")
    configure(policies=[ITEMS])
    assert [caller.get("/api/items").status_code for _ in range(4)] == [200, 200, 200, 429]


# -- tiers ---------------------------------------------------------------------------------


def test_tiers_anon_token_user_and_signed(
    configure: Callable[..., Observed], caller: Caller
) -> None:
    observed = configure(
        policies=[ITEMS],
        hmac_keys={"k1": HMAC_SECRET},
        hooks={"identify": "quota.contrib.django.middleware.user_identity"},
    )
    anon = caller.get("/api/items")
    token = caller.get("/api/items", headers={"X-API-Key": "key-1"})
    user = caller.get("/api/items", headers={"X-Test-User": "1"})
    signed = caller.get("/api/items", headers=sign("k1", HMAC_SECRET, "GET", "/api/items", NOW))
    forged = caller.get(
        "/api/items", headers=sign("k1", "not-the-secret-0123456789", "GET", "/api/items", NOW)
    )

    seen = {
        name: (r.status_code, r["X-RateLimit-Lane"], r["X-RateLimit-Limit"], r["X-RateLimit-Remaining"])
        for name, r in [("anon", anon), ("token", token), ("user", user), ("signed", signed), ("forged", forged)]
    }  # fmt: skip
    assert seen == {
        "anon": (200, "anon", "2", "1"),
        "token": (200, "auth", "10", "9"),  # 5x
        "user": (200, "auth", "10", "9"),  # its own bucket, not the token's
        "signed": (200, "trusted", "20", "19"),  # 10x
        "forged": (200, "anon", "2", "0"),  # back to the anon bucket
    }
    assert observed.count("hmac_rejected", reason="bad_signature") == 1
    assert caller.get("/api/items").status_code == 429  # the anon bucket is spent
    assert caller.get("/api/items", headers={"X-Test-User": "1"}).status_code == 200


# -- shadow mode and failures ----------------------------------------------------------------


@pytest.mark.parametrize("where", ["config", "class", "environment"])
def test_shadow_mode_never_blocks_but_counts_and_sends_headers(
    configure: Callable[..., Observed],
    caller: Caller,
    where: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if where == "environment":
        monkeypatch.setenv("QUOTA_SHADOW", "true")
    policy = RoutePolicy(
        name="items", paths=["/api/items"], rates="2/minute", shadow=where == "class"
    )
    observed = configure(policies=[policy], shadow=where == "config")
    replies = [caller.get("/api/items") for _ in range(4)]

    assert [r.status_code for r in replies] == [200] * 4
    assert [r["X-RateLimit-Remaining"] for r in replies] == ["1", "0", "0", "0"]
    assert all("Retry-After" not in r for r in replies)
    assert observed.count("shadow_blocked", route="items", tier="anon") == 2
    assert observed.count("blocked") == 0
    assert VIEW_CALLS == ["/api/items"] * 4


def _down_url(store_url: str, tmp_path: Path) -> str:
    if store_url.startswith("sqlite"):
        (tmp_path / "a-directory").mkdir()
        return f"sqlite:///{tmp_path}/a-directory"  # a directory: it cannot be opened
    import socket

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"postgresql://root@127.0.0.1:{port}/nowhere"


@pytest.mark.parametrize("shadow", [False, True])
def test_a_store_that_is_down_fails_open_or_closed_per_class(
    configure: Callable[..., Observed],
    caller: Caller,
    store_url: str,
    tmp_path: Path,
    shadow: bool,
) -> None:
    closed = RoutePolicy(name="pay", paths=["/api/pay"], rates="2/minute", fail_open=False)
    observed = configure(
        url=_down_url(store_url, tmp_path), policies=[ITEMS, closed], shadow=shadow
    )
    opened = caller.get("/api/items")
    refused = caller.get("/api/pay")

    assert opened.status_code == 200 and opened.content == b"ok"
    assert "X-RateLimit-Limit" not in opened, "fail open: no rate-limit headers"
    assert observed.count("errors", route="items", mode="open") == 1
    if shadow:  # shadow mode never blocks, a failure neither
        assert refused.status_code == 200
        assert observed.count("errors", route="pay", mode="open") == 1
        assert VIEW_CALLS == ["/api/items", "/api/pay"]
    else:
        assert refused.status_code == 503
        assert refused["Retry-After"] == "5"
        assert json.loads(refused.content)["code"] == "RATE_LIMIT_UNAVAILABLE"
        assert observed.count("errors", route="pay", mode="closed") == 1
        assert VIEW_CALLS == ["/api/items"]


def _unmigrated_url(store_url: str, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    """A database of the same kind as `store_url` without quota's tables."""
    if store_url.startswith("sqlite"):
        return f"sqlite:///{tmp_path}/unmigrated.sqlite3"
    make: Callable[[], str] = request.getfixturevalue("pg_make_database")
    return make()


def test_an_unmigrated_database_is_refused_with_503_never_passed(
    configure: Callable[..., Observed],
    caller: Caller,
    store_url: str,
    tmp_path: Path,
    request: pytest.FixtureRequest,
    caplog: Any,
) -> None:
    """A missing schema is a deployment error: every limited request gets a 503 (even in
    a fail-open class), and an ERROR line names `quota migrate`, not once per request."""
    opened = RoutePolicy(name="items", paths=["/api/items"], rates="2/minute", fail_open=True)
    observed = configure(url=_unmigrated_url(store_url, tmp_path, request), policies=[opened])
    with caplog.at_level(logging.WARNING, logger="quota"):
        codes = [caller.get("/api/items").status_code for _ in range(5)]
        other = caller.get("/other")
    assert codes == [503] * 5
    assert other.status_code == 200
    assert VIEW_CALLS == ["/other"]
    assert observed.count("errors", route="items", mode="closed") == 5
    logged = [
        r
        for r in caplog.records
        if r.levelno >= logging.ERROR and "quota migrate" in r.getMessage()
    ]
    assert len(logged) == 1


def test_the_master_switch_passes_everything_untouched(
    configure: Callable[..., Observed], caller: Caller, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("QUOTA_ENABLED", "false")
    observed = configure(policies=[ITEMS])
    replies = [caller.get("/api/items") for _ in range(3)]
    assert [r.status_code for r in replies] == [200] * 3
    assert all("X-RateLimit-Limit" not in r for r in replies)
    assert observed.events == []


# -- construction ----------------------------------------------------------------------------


def test_it_follows_the_mode_of_the_handler_it_wraps(configure: Callable[..., Observed]) -> None:
    configure(policies=[ITEMS])

    async def async_view(request: object) -> HttpResponse:
        return HttpResponse()

    assert iscoroutinefunction(QuotaMiddleware(async_view))
    assert not iscoroutinefunction(QuotaMiddleware(view))
    assert QuotaMiddleware.sync_capable and QuotaMiddleware.async_capable


@pytest.mark.parametrize(
    ("http", "message"),
    [
        ({"polices": []}, "polices"),
        ({"headers": "some"}, "headers must be one of"),
        ({"policies": [{"name": "x", "rates": "many"}]}, "policies'][0]"),
        ({"hooks": {"identity": "quota.contrib.django.middleware.user_identity"}}, "identity"),
        ({"hooks": {"identify": "no.such.module.hook"}}, "no.such.module"),
    ],
)
def test_a_bad_setting_fails_at_startup_naming_it(
    configure: Callable[..., Observed], http: dict[str, Any], message: str
) -> None:
    from django.conf import settings
    from django.core.exceptions import ImproperlyConfigured

    configure()
    settings.QUOTA = {**settings.QUOTA, "HTTP": http}
    with pytest.raises(ImproperlyConfigured, match=message.replace("[", r"\[")):
        QuotaMiddleware(view)


def test_postgresql_needs_the_hash_secret(configure: Callable[..., Observed]) -> None:
    from django.conf import settings
    from django.core.exceptions import ImproperlyConfigured

    configure(url="postgresql://root@127.0.0.1:1/never-connected")
    settings.QUOTA = {**settings.QUOTA, "HTTP": {"policies": [ITEMS]}}
    with pytest.raises(ImproperlyConfigured, match="QUOTA_HASH_SECRET"):
        QuotaMiddleware(view)
