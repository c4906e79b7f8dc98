"""Views of the decorator tests, and a stand-in for authentication."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.http import HttpResponse, JsonResponse
from django.utils.decorators import method_decorator
from django.views import View

from quota.contrib.django import ratelimit
from quota.contrib.django.decorators import ALL, UNSAFE


class FakeAuthMiddleware:
    """``request.user`` from the ``X-Test-User`` header (a user with that pk), else anonymous."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response: Any) -> None:
        self.get_response = get_response
        self.is_async = iscoroutinefunction(get_response)
        if self.is_async:
            markcoroutinefunction(self)

    def _authenticate(self, request: Any) -> None:
        pk = request.headers.get("X-Test-User")
        user = SimpleNamespace(pk=pk, is_authenticated=pk is not None)
        request.user = user

        async def auser() -> Any:
            return user

        request.auser = auser

    def __call__(self, request: Any) -> Any:
        self._authenticate(request)
        return self.get_response(request)  # a coroutine under ASGI


def answer(request: Any) -> JsonResponse:
    return JsonResponse({"limited": getattr(request, "limited", None)})


def api_key(group: str, request: Any) -> str:
    return request.headers.get("X-Tenant", "none")


def rate_for(group: str, request: Any) -> str | None:
    """No limit for ``?vip=1``, else 2 per minute."""
    return None if request.GET.get("vip") else "2/m"


@ratelimit(key="ip", rate="2/m")
def by_ip(request: Any) -> JsonResponse:
    return answer(request)


@ratelimit(key="user", rate="2/m")
def by_user(request: Any) -> JsonResponse:
    return answer(request)


@ratelimit(key="user_or_ip", rate="2/m")
def by_user_or_ip(request: Any) -> JsonResponse:
    return answer(request)


@ratelimit(key="header:x-api-key", rate="2/m")
def by_header(request: Any) -> JsonResponse:
    return answer(request)


@ratelimit(key="get:q", rate="2/m")
def by_get(request: Any) -> JsonResponse:
    return answer(request)


@ratelimit(key="post:f", rate="2/m", method="POST")
def by_post(request: Any) -> JsonResponse:
    return answer(request)


@ratelimit(key=api_key, rate="2/m")
def by_callable(request: Any) -> JsonResponse:
    return answer(request)


@ratelimit(key="tests.contrib.django.views.api_key", rate="2/m")
def by_dotted(request: Any) -> JsonResponse:
    return answer(request)


@ratelimit(key="ip", rate="3/10s")
def every_ten_seconds(request: Any) -> JsonResponse:
    return answer(request)


@ratelimit(key="ip", rate=(2, 3600))
def tuple_rate(request: Any) -> JsonResponse:
    return answer(request)


@ratelimit(key="ip", rate=rate_for)
def callable_rate(request: Any) -> JsonResponse:
    return answer(request)


@ratelimit(key="ip", rate="tests.contrib.django.views.rate_for")
def dotted_rate(request: Any) -> JsonResponse:
    return answer(request)


@ratelimit(key="ip", rate="0/m")
def closed(request: Any) -> JsonResponse:
    return answer(request)


@ratelimit(key="ip", rate="1/m", method="POST")
def post_only(request: Any) -> JsonResponse:
    return answer(request)


@ratelimit(key="ip", rate="1/m", method=UNSAFE)
def unsafe_only(request: Any) -> JsonResponse:
    return answer(request)


@ratelimit(key="ip", rate="1/m", method=["GET", "put"])
def listed_methods(request: Any) -> JsonResponse:
    return answer(request)


@ratelimit(key="ip", rate="1/m", method=ALL, block=False)
def not_blocking(request: Any) -> JsonResponse:
    return answer(request)


@ratelimit(key="ip", rate="1/m", block=False)
@ratelimit(key="ip", rate="100/m", block=False)
def stacked(request: Any) -> JsonResponse:
    return answer(request)


@ratelimit(key="ip", rate="100/m", block=False)
@ratelimit(key="ip", rate="1/m", block=False)
def stacked_inner_limits(request: Any) -> JsonResponse:
    return answer(request)


@ratelimit(group="shared", key="ip", rate="2/m")
def shared_one(request: Any) -> JsonResponse:
    return answer(request)


@ratelimit(group="shared", key="ip", rate="2/m")
def shared_two(request: Any) -> JsonResponse:
    return answer(request)


@ratelimit(key="ip", rate="2/m")
async def async_by_ip(request: Any) -> JsonResponse:
    return answer(request)


@ratelimit(key="user_or_ip", rate="2/m", block=False)
async def async_by_user(request: Any) -> JsonResponse:
    return answer(request)


@ratelimit(key="ip", rate="100/m")
def many(request: Any) -> HttpResponse:
    return HttpResponse("ok")


class ClassView(View):
    @method_decorator(ratelimit(key="ip", rate="2/m"))
    def get(self, request: Any) -> JsonResponse:
        return answer(request)

    @method_decorator(ratelimit(key="ip", rate="1/m", block=False))
    def post(self, request: Any) -> JsonResponse:
        return answer(request)


@method_decorator(ratelimit(key="ip", rate="2/m"), name="get")
class AsyncClassView(View):
    async def get(self, request: Any) -> JsonResponse:
        return answer(request)


def custom_ratelimited(request: Any, exception: Exception) -> HttpResponse:
    """A ``RATELIMIT_VIEW``."""
    return HttpResponse("slow down", status=429)
