"""Django REST framework views of the example project (when DRF is installed).

``/drf/hello`` is throttled by quota's ``AnonRateThrottle``: 10 requests a
minute per client IP (``QUOTA_EXAMPLE_DRF_RATE``), exact however many
processes serve it. ``/drf/hello-drf-cache`` is the same view throttled by
DRF's own ``AnonRateThrottle``, whose history in Django's cache is read,
checked and written back without a lock: under concurrent requests it lets
more through.
"""

from rest_framework import throttling
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from quota.contrib.drf import AnonRateThrottle


class Hello(APIView):
    """Throttled by quota (``DEFAULT_THROTTLE_CLASSES`` could name it for every view)."""

    throttle_classes = (AnonRateThrottle,)

    def get(self, request: Request) -> Response:
        return Response({"hello": "drf"})


class HelloDrfCache(APIView):
    """The same view throttled by DRF's own class, for comparison."""

    throttle_classes = (throttling.AnonRateThrottle,)

    def get(self, request: Request) -> Response:
        return Response({"hello": "drf", "throttle": "django cache"})
