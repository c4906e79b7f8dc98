"""Views of the example project: one limited by the middleware, one by the decorator."""

import os

from django.http import HttpRequest, HttpResponse, JsonResponse

from quota.contrib.django import ratelimit

DECORATOR_RATE = os.environ.get("QUOTA_EXAMPLE_DECORATOR_RATE", "3/m")


def hello(request: HttpRequest) -> JsonResponse:
    """Limited by ``QuotaMiddleware`` (the ``api`` route class of the settings)."""
    return JsonResponse({"hello": "world"})


@ratelimit(key="ip", rate=DECORATOR_RATE, block=True)
def limited(request: HttpRequest) -> JsonResponse:
    """Limited by the decorator alone: the middleware's route classes do not cover it."""
    return JsonResponse({"limited": True})


def health(request: HttpRequest) -> HttpResponse:
    """Never limited (``exclude`` in the settings)."""
    return HttpResponse("ok", content_type="text/plain")
