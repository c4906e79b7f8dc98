"""quota's DRF throttles in one process: counting at the timer, wait(), settings, headers.

Each test runs on SQLite and PostgreSQL (`quota_url`). DRF's own throttling
tests run in `test_drf_suite`; the exactness across processes in
`test_gunicorn`.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.core.exceptions import ImproperlyConfigured
from django.test import override_settings
from rest_framework import throttling as drf_throttling
from rest_framework.renderers import JSONRenderer
from rest_framework.response import Response
from rest_framework.settings import api_settings
from rest_framework.test import APIRequestFactory
from rest_framework.views import APIView

from quota.contrib import drf
from quota.contrib.django import conf

#: A moment at the start of a minute (and an hour): the windows the tests count in.
T0 = 1_800_000_000.0

pytestmark = pytest.mark.usefixtures("quota_url")


class ThreePerMinute(drf.QuotaThrottle):
    rate = "3/min"
    now_at = T0

    def get_cache_key(self, request: Any, view: Any) -> str:
        return f"three_{self.get_ident(request)}"

    def timer(self) -> float:
        return self.now_at


def _view(*throttles: type, renderer: type = JSONRenderer) -> Callable[..., Any]:
    class View(APIView):
        throttle_classes = throttles
        renderer_classes = (renderer,)

        def get(self, request: Any) -> Response:
            return Response({"ok": True})

    return View.as_view()


def _throttle(cls: type[drf.QuotaThrottle], now: float, ident: str = "1.2.3.4") -> Any:
    request = APIRequestFactory().get("/", REMOTE_ADDR=ident)
    throttle = cls()
    throttle.timer = lambda: now
    return throttle, request


def test_the_classes_are_drfs() -> None:
    assert issubclass(drf.QuotaThrottle, drf_throttling.SimpleRateThrottle)
    for name in ("AnonRateThrottle", "UserRateThrottle", "ScopedRateThrottle"):
        assert issubclass(getattr(drf, name), getattr(drf_throttling, name))
        assert issubclass(getattr(drf, name), drf.QuotaThrottle)


def test_counts_in_the_window_of_the_timer() -> None:
    allowed = []
    for _ in range(4):
        throttle, request = _throttle(ThreePerMinute, T0 + 20)
        allowed.append(throttle.allow_request(request, None))
    assert allowed == [True, True, True, False]
    assert throttle.decision.reset_at == T0 + 60  # the window of the timer, not of the clock
    assert throttle.wait() == pytest.approx(40.0)
    assert throttle.history == [T0 + 20] * 3
    assert throttle.key == "three_1.2.3.4"

    throttle, request = _throttle(ThreePerMinute, T0 + 60)
    assert throttle.allow_request(request, None) is True
    assert throttle.wait() == 0.0
    assert throttle.history == [T0 + 60]


def test_wait_after_the_last_allowed_request_is_the_windows_end() -> None:
    for _ in range(3):
        throttle, request = _throttle(ThreePerMinute, T0 + 45)
        assert throttle.allow_request(request, None)
    assert throttle.wait() == pytest.approx(15.0)
    assert drf.QuotaThrottle.wait(ThreePerMinute()) is None  # nothing decided yet


def test_the_timer_stays_with_the_throttle() -> None:
    throttle, request = _throttle(ThreePerMinute, T0)
    assert throttle.allow_request(request, None)
    # The same limiter, called by others afterwards, keeps its own clock.
    before = time.time()
    decision = conf.get_limiter().rate_limit("not-drf", 5, 60)
    assert before - 60 < decision.reset_at - 60 <= time.time()


def test_each_thread_decides_at_its_own_timer() -> None:
    errors: list[BaseException] = []
    start = threading.Barrier(4, timeout=30)

    def run(index: int) -> None:
        try:
            start.wait()
            for step in range(15):
                now = T0 + 3600 * (index + 1) + step
                throttle, request = _throttle(ThreePerMinute, now, ident=f"10.0.0.{index}")
                allowed = throttle.allow_request(request, None)
                assert throttle.decision.reset_at == T0 + 3600 * (index + 1) + 60
                assert allowed is (step < 3)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    assert not any(thread.is_alive() for thread in threads)


def test_a_zero_rate_denies_every_request() -> None:
    class Closed(ThreePerMinute):
        rate = "0/min"

    throttle, request = _throttle(Closed, T0 + 10)
    assert throttle.allow_request(request, None) is False
    assert throttle.wait() == pytest.approx(50.0)


def test_a_view_answers_429_with_drfs_retry_after() -> None:
    ThreePerMinute.now_at = T0 + 1.5
    view = _view(ThreePerMinute)
    request = APIRequestFactory().get("/")
    statuses = [view(request).status_code for _ in range(3)]
    denied = view(request)
    assert statuses == [200] * 3
    assert denied.status_code == 429
    assert denied["Retry-After"] == str(math.ceil(60 - 1.5))


def test_rates_and_classes_come_from_drfs_settings() -> None:
    rest = {
        "DEFAULT_THROTTLE_CLASSES": ["quota.contrib.drf.AnonRateThrottle"],
        "DEFAULT_THROTTLE_RATES": {"anon": "2/hour", "user": None},
    }
    with override_settings(REST_FRAMEWORK=rest):
        assert list(api_settings.DEFAULT_THROTTLE_CLASSES) == [drf.AnonRateThrottle]
        throttle = drf.AnonRateThrottle()
        assert (throttle.rate, throttle.num_requests, throttle.duration) == ("2/hour", 2, 3600)
        throttle.timer = lambda: T0
        request = APIRequestFactory().get("/", REMOTE_ADDR="5.6.7.8")
        view = APIView()
        drf_request = view.initialize_request(request)
        assert [throttle.allow_request(drf_request, view) for _ in range(3)] == [True, True, False]
        assert throttle.key == "throttle_anon_5.6.7.8"
    assert drf.AnonRateThrottle().rate is None  # the default settings again


def test_a_scoped_view_without_a_scope_is_not_counted() -> None:
    throttle = drf.ScopedRateThrottle()
    request = APIRequestFactory().get("/")
    assert throttle.allow_request(request, APIView()) is True
    assert throttle.decision is None
    assert throttle.wait() is None


# --- headers -------------------------------------------------------------------------


def _headed(style: str | None, *, use_async: bool = False) -> list[Any]:
    ThreePerMinute.now_at = T0 + 30
    view = _view(ThreePerMinute)
    middleware = drf.RateLimitHeadersMiddleware(view)
    request_factory = APIRequestFactory()
    settings_ = {} if style is None else {"QUOTA_DRF_HEADERS": style}
    with override_settings(**settings_):
        if not use_async:
            return [middleware(request_factory.get("/")) for _ in range(4)]

        async def get_response(request: Any) -> Any:
            return await sync_to_async(view)(request)

        amiddleware = drf.RateLimitHeadersMiddleware(get_response)

        async def run() -> list[Any]:
            return [await amiddleware(request_factory.get("/")) for _ in range(4)]

        import asyncio

        return asyncio.run(run())


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_headers_on_allowed_and_throttled_responses(use_async: bool) -> None:
    responses = _headed("both", use_async=use_async)
    assert [r.status_code for r in responses] == [200, 200, 200, 429]
    assert [r["X-RateLimit-Remaining"] for r in responses] == ["2", "1", "0", "0"]
    assert {r["X-RateLimit-Limit"] for r in responses} == {"3"}
    assert {r["X-RateLimit-Reset"] for r in responses} == {str(int(T0 + 60))}
    assert responses[0]["RateLimit-Policy"] == '"ThreePerMinute";q=3;w=60'
    assert responses[0]["RateLimit"] == '"ThreePerMinute";r=2;t=30'
    assert responses[3]["Retry-After"] == "30"
    assert responses[3]["RateLimit"] == '"ThreePerMinute";r=0;t=30'


def test_header_styles() -> None:
    legacy = _headed("legacy")[0]
    assert "X-RateLimit-Remaining" in legacy and "RateLimit" not in legacy
    ietf = _headed("ietf")[0]
    assert "RateLimit" in ietf and "X-RateLimit-Remaining" not in ietf


@pytest.mark.parametrize("style", [None, "none"])
def test_no_headers_unless_asked(style: str | None) -> None:
    responses = _headed(style)
    assert responses[3].status_code == 429
    assert not any(
        name.lower().startswith(("x-ratelimit", "ratelimit")) for name in responses[0].headers
    )


def test_a_bad_header_style_is_refused() -> None:
    with override_settings(QUOTA_DRF_HEADERS="loud"), pytest.raises(ImproperlyConfigured) as info:
        drf.headers_style()
    assert "QUOTA_DRF_HEADERS" in str(info.value) and "'loud'" in str(info.value)
