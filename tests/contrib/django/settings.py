"""Django settings of the tests in this directory (see conftest.py).

``default`` is a SQLite file (quota needs a file); ``pg`` and ``pgscratch``
are PostgreSQL databases when a server is there (``$QUOTA_TEST_POSTGRES_URL``,
else 127.0.0.1:5432), each with a test database named for this run, which
Django drops at the end. ``scratch`` (SQLite) and ``pgscratch`` hold no quota
tables until a test migrates them.
"""

from __future__ import annotations

import os
import socket
import tempfile
import uuid
from urllib.parse import unquote, urlsplit

from tests._support import Clock

#: The clock of quota's limiters in these tests; each test moves it to a fresh window.
CLOCK = Clock(86400 * 12_000.0)
RUN = uuid.uuid4().hex[:10]
_TMP = tempfile.gettempdir()


def _sqlite(name: str) -> dict[str, object]:
    return {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.path.join(_TMP, f"quota-django-{name}-{RUN}.sqlite3"),
        "TEST": {"NAME": os.path.join(_TMP, f"quota-django-test-{name}-{RUN}.sqlite3")},
    }


def _postgres_url() -> str | None:
    url = os.environ.get("QUOTA_TEST_POSTGRES_URL")
    if url:
        return url
    try:
        socket.create_connection(("127.0.0.1", 5432), timeout=1).close()
    except OSError:
        return None
    return "postgresql://root@127.0.0.1:5432/test"


def _postgres(url: str, name: str) -> dict[str, object]:
    parts = urlsplit(url)
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": parts.path.lstrip("/") or "postgres",
        "USER": unquote(parts.username or ""),
        "PASSWORD": unquote(parts.password or ""),
        "HOST": parts.hostname or "",
        "PORT": str(parts.port or ""),
        "TEST": {"NAME": f"test_quota_django_{name}_{RUN}"},
    }


POSTGRES_URL = _postgres_url()
if POSTGRES_URL is None and os.environ.get("QUOTA_TEST_REQUIRE_POSTGRES") == "1":
    # CI requires PostgreSQL: its absence fails the Django tests instead of skipping them.
    raise RuntimeError("QUOTA_TEST_REQUIRE_POSTGRES=1 but no PostgreSQL answers on 127.0.0.1:5432")
DATABASES = {"default": _sqlite("default"), "scratch": _sqlite("scratch")}
if POSTGRES_URL is not None:
    DATABASES["pg"] = _postgres(POSTGRES_URL, "pg")
    DATABASES["pgscratch"] = _postgres(POSTGRES_URL, "scratch")

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.contenttypes",
    "django.contrib.auth",
    "django.contrib.sessions",
    "django.contrib.messages",
    "quota.contrib.django",
]
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]
MIDDLEWARE = [
    "tests.contrib.django.views.FakeAuthMiddleware",
    "quota.contrib.django.ratelimiting.RatelimitMiddleware",
]
ROOT_URLCONF = "tests.contrib.django.urls"
SECRET_KEY = "quota-tests"
ALLOWED_HOSTS = ["*"]
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
QUOTA = {"OPTIONS": {"clock": CLOCK, "pool_size": 1}}
