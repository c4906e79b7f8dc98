"""The ``ratelimit`` decorator, option by option, through Django's test client.

Every test runs on SQLite and on PostgreSQL (`quota_db`); the limiters' clock
is the injected `django_clock`, at a fresh day for each test.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured, PermissionDenied
from django.test import Client, RequestFactory, override_settings

from quota._core.errors import StorageError
from quota.contrib.django import Ratelimited, get_limiter, ratelimit
from quota.contrib.django import decorators as decorators_module
from quota.contrib.django.core import get_usage, is_ratelimited, split_rate

pytestmark = pytest.mark.usefixtures("quota_db")


def statuses(client: Client, url: str, n: int, **extra: Any) -> list[int]:
    return [client.get(url, **extra).status_code for _ in range(n)]


def test_key_ip_limits_each_address_apart() -> None:
    client = Client()
    assert statuses(client, "/by_ip/", 3, REMOTE_ADDR="10.0.0.1") == [200, 200, 429]
    assert statuses(client, "/by_ip/", 2, REMOTE_ADDR="10.0.0.2") == [200, 200]


def test_ipv4_mask_groups_a_network() -> None:
    client = Client()
    with override_settings(RATELIMIT_IPV4_MASK=24):
        assert statuses(client, "/by_ip/", 2, REMOTE_ADDR="10.1.1.1") == [200, 200]
        assert statuses(client, "/by_ip/", 1, REMOTE_ADDR="10.1.1.200") == [429]
        assert statuses(client, "/by_ip/", 1, REMOTE_ADDR="10.1.2.1") == [200]


def test_ipv6_addresses_share_their_64() -> None:
    client = Client()
    assert statuses(client, "/by_ip/", 2, REMOTE_ADDR="2001:db8::1") == [200, 200]
    assert statuses(client, "/by_ip/", 1, REMOTE_ADDR="2001:db8::ffff") == [429]
    with override_settings(RATELIMIT_IPV6_MASK=128):
        assert statuses(client, "/by_ip/", 1, REMOTE_ADDR="2001:db8::2") == [200]


def test_ip_meta_key_setting() -> None:
    client = Client()
    with override_settings(RATELIMIT_IP_META_KEY="HTTP_X_REAL_IP"):
        assert statuses(client, "/by_ip/", 3, HTTP_X_REAL_IP="192.0.2.7") == [200, 200, 429]
        assert statuses(client, "/by_ip/", 1, HTTP_X_REAL_IP="192.0.2.8") == [200]


def test_key_user_and_user_or_ip() -> None:
    client = Client()
    assert statuses(client, "/by_user/", 3, HTTP_X_TEST_USER="7") == [200, 200, 429]
    assert statuses(client, "/by_user/", 1, HTTP_X_TEST_USER="8") == [200]
    # user_or_ip: anonymous requests count per address, users per user.
    assert statuses(client, "/by_user_or_ip/", 3, REMOTE_ADDR="10.9.9.9") == [200, 200, 429]
    assert statuses(client, "/by_user_or_ip/", 2, REMOTE_ADDR="10.9.9.9", HTTP_X_TEST_USER="7") == [
        200,
        200,
    ]


@pytest.mark.parametrize(
    ("url", "first", "second"),
    [
        ("/by_header/", {"HTTP_X_API_KEY": "a"}, {"HTTP_X_API_KEY": "b"}),
        ("/by_get/?q=a", {}, None),
        ("/by_callable/", {"HTTP_X_TENANT": "a"}, {"HTTP_X_TENANT": "b"}),
        ("/by_dotted/", {"HTTP_X_TENANT": "a"}, {"HTTP_X_TENANT": "b"}),
    ],
)
def test_other_keys(url: str, first: dict[str, str], second: dict[str, str] | None) -> None:
    client = Client()
    assert statuses(client, url, 3, **first) == [200, 200, 429]
    if second is not None:
        assert statuses(client, url, 1, **second) == [200]
    else:
        assert client.get("/by_get/?q=b").status_code == 200


def test_key_post_counts_the_posted_field() -> None:
    client = Client()
    codes = [client.post("/by_post/", {"f": "x"}).status_code for _ in range(3)]
    assert codes == [200, 200, 429]
    assert client.post("/by_post/", {"f": "y"}).status_code == 200


def test_client_values_are_stored_hashed() -> None:
    Client().get("/by_header/", HTTP_X_API_KEY="secret-token")
    keys = [usage.key for usage in get_limiter().top(100)]
    assert keys and not any("secret-token" in key for key in keys)


def test_rate_with_a_window_count_and_the_window_turning(django_clock: Any) -> None:
    client = Client()
    assert statuses(client, "/every_ten_seconds/", 4) == [200, 200, 200, 429]
    django_clock.advance(10)
    assert statuses(client, "/every_ten_seconds/", 1) == [200]


def test_tuple_rate() -> None:
    assert statuses(Client(), "/tuple_rate/", 3) == [200, 200, 429]


@pytest.mark.parametrize("url", ["/callable_rate/", "/dotted_rate/"])
def test_rate_callable_none_means_no_limit(url: str) -> None:
    client = Client()
    assert statuses(client, url + "?vip=1", 5) == [200] * 5
    assert statuses(client, url, 3) == [200, 200, 429]


def test_zero_rate_denies_everything() -> None:
    assert statuses(Client(), "/closed/", 2) == [429, 429]


@pytest.mark.parametrize(
    ("text", "expected"),
    [("5/m", (5, 60)), ("100/5m", (100, 300)), ("10/s", (10, 1)), ("1/d", (1, 86400)),
     ("3/h", (3, 3600)), ("7/2hour", (7, 7200)), ("4/minute", (4, 60)), ("2/", (2, 1)),
     ((9, 30), (9, 30))],
)  # fmt: skip
def test_split_rate(text: Any, expected: tuple[int, int]) -> None:
    assert split_rate(text) == expected


@pytest.mark.parametrize("text", ["5", "5/x", "m/5", "5/0m", "-1/m", "5/mo"])
def test_bad_rates_are_improperly_configured(text: str) -> None:
    with pytest.raises(ImproperlyConfigured):
        split_rate(text)


def test_method_filters() -> None:
    client = Client()
    assert statuses(client, "/post_only/", 3) == [200, 200, 200]  # GET is not counted
    assert [client.post("/post_only/").status_code for _ in range(2)] == [200, 429]
    assert statuses(client, "/unsafe_only/", 2) == [200, 200]
    assert [client.delete("/unsafe_only/").status_code for _ in range(2)] == [200, 429]
    assert [client.post("/listed_methods/").status_code for _ in range(2)] == [200, 200]
    assert [client.put("/listed_methods/").status_code for _ in range(2)] == [200, 429]


def test_block_false_sets_request_limited() -> None:
    client = Client()
    assert [client.get("/not_blocking/").json()["limited"] for _ in range(3)] == [
        False,
        True,
        True,
    ]


def test_an_earlier_limit_keeps_request_limited() -> None:
    client = Client()
    # The outer decorator (1/m) runs first: its limit marks the request even
    # though the inner one (100/m) lets it through.
    assert [client.get("/stacked/").json()["limited"] for _ in range(2)] == [False, True]
    # And an inner limit marks it too.
    assert [client.get("/stacked_inner_limits/").json()["limited"] for _ in range(2)] == [
        False,
        True,
    ]


def test_views_sharing_a_group_share_the_counter() -> None:
    client = Client()
    assert client.get("/shared_one/").status_code == 200
    assert client.get("/shared_two/").status_code == 200
    assert client.get("/shared_one/").status_code == 429


def test_default_group_is_the_views_dotted_name() -> None:
    client = Client()
    client.get("/by_ip/")
    request = RequestFactory().get("/by_ip/")
    found = get_usage(request, group="tests.contrib.django.views.by_ip", key="ip", rate="2/m")
    assert found is not None and found["count"] == 1


def test_async_function_view() -> None:
    client = Client()
    assert statuses(client, "/async_by_ip/", 3) == [200, 200, 429]
    user = [client.get("/async_by_user/", HTTP_X_TEST_USER="5").json()["limited"] for _ in range(3)]
    assert user == [False, False, True]
    assert client.get("/async_by_user/", HTTP_X_TEST_USER="6").json()["limited"] is False


def test_async_view_through_the_async_client() -> None:
    from asgiref.sync import async_to_sync
    from django.test import AsyncClient

    async def run() -> list[int]:
        client = AsyncClient()
        return [(await client.get("/async_by_ip/")).status_code for _ in range(3)]

    assert async_to_sync(run)() == [200, 200, 429]


def test_class_based_views() -> None:
    client = Client()
    assert statuses(client, "/class/", 3) == [200, 200, 429]
    assert [client.post("/class/").json()["limited"] for _ in range(2)] == [False, True]
    assert statuses(client, "/async-class/", 3) == [200, 200, 429]


def test_429_carries_the_rate_limit_headers(django_clock: Any) -> None:
    client = Client()
    allowed = client.get("/by_ip/")
    assert allowed["X-RateLimit-Limit"] == "2"
    assert allowed["X-RateLimit-Remaining"] == "1"
    assert "Retry-After" not in allowed
    client.get("/by_ip/")
    denied = client.get("/by_ip/")
    assert denied.status_code == 429
    assert denied["Content-Type"] == "application/problem+json"
    assert denied["Retry-After"] == "60"
    assert denied["X-RateLimit-Remaining"] == "0"
    assert denied["X-RateLimit-Reset"] == str(int(django_clock.now) + 60)
    assert denied["RateLimit-Policy"] == '"tests.contrib.django.views.by_ip";q=2;w=60'
    assert denied["RateLimit"] == '"tests.contrib.django.views.by_ip";r=0;t=60'
    assert denied.json()["code"] == "RATE_LIMITED"


def test_without_the_middleware_django_answers_403() -> None:
    with override_settings(MIDDLEWARE=["tests.contrib.django.views.FakeAuthMiddleware"]):
        assert statuses(Client(raise_request_exception=False), "/by_ip/", 3) == [200, 200, 403]


def test_ratelimit_view_setting_answers_instead() -> None:
    with override_settings(RATELIMIT_VIEW="tests.contrib.django.views.custom_ratelimited"):
        client = Client()
        statuses(client, "/by_ip/", 2)
        denied = client.get("/by_ip/")
    assert denied.status_code == 429 and denied.content == b"slow down"
    assert denied["Retry-After"] == "60"


def test_ratelimit_enable_false_turns_it_off() -> None:
    with override_settings(RATELIMIT_ENABLE=False):
        assert statuses(Client(), "/by_ip/", 4) == [200] * 4


def test_ratelimited_is_permission_denied() -> None:
    assert issubclass(Ratelimited, PermissionDenied)


def test_exception_class_setting() -> None:
    class Mine(Exception):
        pass

    @ratelimit(key="ip", rate="0/m")
    def view(request: Any) -> None:
        raise AssertionError("not reached")

    request = RequestFactory().get("/")
    with override_settings(RATELIMIT_EXCEPTION_CLASS=Mine), pytest.raises(Mine) as caught:
        view(request)
    assert caught.value.decision is not None  # type: ignore[attr-defined]


def test_is_ratelimited_and_get_usage() -> None:
    request = RequestFactory().get("/", REMOTE_ADDR="10.2.2.2")
    args = {"group": "helpers", "key": "ip", "rate": "2/m"}
    assert not is_ratelimited(request, **args)  # increment=False counts nothing
    assert get_usage(request, **args)["count"] == 0  # type: ignore[index]
    assert [is_ratelimited(request, increment=True, **args) for _ in range(3)] == [
        False,
        False,
        True,
    ]
    usage = get_usage(request, **args)
    assert usage is not None
    assert (usage["count"], usage["limit"], usage["should_limit"]) == (3, 2, True)
    assert usage["time_left"] == 60
    assert get_usage(request, method="POST", **args) is None
    with pytest.raises(ImproperlyConfigured):
        get_usage(request, key="ip", rate="2/m")  # neither group nor fn
    with pytest.raises(ImproperlyConfigured):
        get_usage(request, group="g", key="nonsense", rate="2/m")


@pytest.mark.parametrize(("fail_open", "expected"), [(True, 200), (False, 429)])
def test_store_failure_follows_ratelimit_fail_open(
    monkeypatch: pytest.MonkeyPatch, fail_open: bool, expected: int
) -> None:
    limiter = get_limiter()

    def broken(*args: Any, **kwargs: Any) -> None:
        raise StorageError("database down")

    monkeypatch.setattr(limiter, "rate_limit", broken)
    with override_settings(RATELIMIT_FAIL_OPEN=fail_open):
        assert Client().get("/by_ip/").status_code == expected


@pytest.mark.parametrize("fail_open", [True, False])
def test_a_check_that_counts_nothing_is_not_limited_while_the_store_is_down(
    monkeypatch: pytest.MonkeyPatch, fail_open: bool
) -> None:
    # As django-ratelimit: only a failed count answers limited (or None with
    # RATELIMIT_FAIL_OPEN); a check without increment reads 0, whatever the setting.
    limiter = get_limiter()

    def broken(*args: Any, **kwargs: Any) -> None:
        raise StorageError("database down")

    monkeypatch.setattr(limiter, "rate_limit", broken)
    monkeypatch.setattr(limiter, "peek", broken)
    request = RequestFactory().get("/", REMOTE_ADDR="10.2.9.9")
    args = {"group": "helpers", "key": "ip", "rate": "2/m"}
    with override_settings(RATELIMIT_FAIL_OPEN=fail_open):
        assert not is_ratelimited(request, **args)
        usage = get_usage(request, **args)
        assert usage is not None
        assert (usage["count"], usage["limit"], usage["should_limit"]) == (0, 2, False)
        assert 0 < usage["time_left"] <= 60
        counted = get_usage(request, increment=True, **args)
        if fail_open:
            assert counted is None
            assert not is_ratelimited(request, increment=True, **args)
        else:
            assert counted == {"count": 0, "limit": 0, "should_limit": True, "time_left": -1}
            assert is_ratelimited(request, increment=True, **args)


def test_counts_stay_exact_across_threads() -> None:
    results: list[int] = []
    lock = threading.Lock()

    def worker() -> None:
        client = Client()
        mine = statuses(client, "/many/", 25)
        with lock:
            results.extend(mine)

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results.count(200) == 100 and results.count(429) == 50


def test_settings_read_once_still_follow_override_settings() -> None:
    # The RATELIMIT_* settings and a view's parsed rate are kept between requests:
    # a setting changed later (override_settings) applies from the next request on.
    client = Client()
    assert statuses(client, "/by_ip/", 1, REMOTE_ADDR="10.5.0.1") == [200]
    with override_settings(RATELIMIT_ENABLE=False):
        assert statuses(client, "/by_ip/", 3, REMOTE_ADDR="10.5.0.1") == [200] * 3
    assert statuses(client, "/by_ip/", 2, REMOTE_ADDR="10.5.0.1") == [200, 429]
    assert statuses(client, "/by_ip/", 1, REMOTE_ADDR="10.5.0.2") == [200]  # apart under /32
    with override_settings(RATELIMIT_IPV4_MASK=24):  # now 10.5.0.0/24: one counter
        assert statuses(client, "/by_ip/", 3, REMOTE_ADDR="10.5.0.3") == [200, 200, 429]
    assert statuses(client, "/by_ip/", 1, REMOTE_ADDR="10.5.0.2") == [200]


def test_a_decorated_view_follows_a_quota_setting_change() -> None:
    @ratelimit(key="ip", rate="1/m")
    def view(request: Any) -> str:
        return "ok"

    request = RequestFactory().get("/", REMOTE_ADDR="10.6.0.1")
    assert view(request) == "ok"
    with override_settings(QUOTA={"URL": "memory://"}):  # a fresh store: counts from 0
        assert view(request) == "ok"
        with pytest.raises(Ratelimited):
            view(request)
    with pytest.raises(Ratelimited):  # back on the database, its count kept
        view(request)


def test_module_exports() -> None:
    assert decorators_module.ratelimit is ratelimit
    assert ratelimit.ALL == (None,)  # type: ignore[attr-defined]
