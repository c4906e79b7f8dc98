"""quota for Django: an app keeping quota's tables in the project's own database.

Add ``"quota.contrib.django"`` to ``INSTALLED_APPS`` and run ``manage.py
migrate``; quota then uses the ``default`` database (see
`quota.contrib.django.conf` for the ``QUOTA`` setting). The decorator is
django-ratelimit's::

    from quota.contrib.django import ratelimit

    @ratelimit(key="ip", rate="5/m", block=True)
    def login(request): ...
"""

from __future__ import annotations

from quota.contrib.django.conf import get_async_limiter, get_limiter
from quota.contrib.django.decorators import ALL, UNSAFE, ratelimit
from quota.contrib.django.exceptions import Ratelimited

__all__ = ["ALL", "UNSAFE", "Ratelimited", "get_async_limiter", "get_limiter", "ratelimit"]
