"""Settings of the example project: SQLite by default, PostgreSQL with ``QUOTA_EXAMPLE_POSTGRES``.

See ``manage.py`` for how to run it.
"""

import importlib.util
import os
from pathlib import Path
from urllib.parse import unquote, urlsplit

from quota.http import RoutePolicy

BASE_DIR = Path(__file__).resolve().parent.parent

SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "example-only-not-a-secret")
DEBUG = os.environ.get("DJANGO_DEBUG", "") == "1"
ALLOWED_HOSTS = ["127.0.0.1", "localhost", "[::1]", "testserver"]

INSTALLED_APPS = [
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "quota.contrib.django",
]

MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    # After AuthenticationMiddleware: its identify hook reads request.user.
    "quota.contrib.django.middleware.QuotaMiddleware",
    # Answers the @ratelimit decorator's denials with a 429 (else Django's 403).
    "quota.contrib.django.ratelimiting.RatelimitMiddleware",
]

ROOT_URLCONF = "example.urls"
WSGI_APPLICATION = "example.wsgi.application"


def _postgres(url: str) -> dict[str, object]:
    """A DATABASES entry for a postgresql:// URL."""
    parts = urlsplit(url)
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": unquote(parts.path.lstrip("/")),
        "USER": unquote(parts.username or ""),
        "PASSWORD": unquote(parts.password or ""),
        "HOST": parts.hostname or "",
        "PORT": str(parts.port or ""),
        # Behind PgBouncer in transaction mode (QUOTA_EXAMPLE_PGBOUNCER=1):
        # no server-side cursors, no persistent connections.
        "DISABLE_SERVER_SIDE_CURSORS": os.environ.get("QUOTA_EXAMPLE_PGBOUNCER") == "1",
        "CONN_MAX_AGE": 0,
    }


POSTGRES = os.environ.get("QUOTA_EXAMPLE_POSTGRES")
DATABASES = {
    "default": _postgres(POSTGRES)
    if POSTGRES
    else {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.environ.get("QUOTA_EXAMPLE_SQLITE", str(BASE_DIR / "db.sqlite3")),
    }
}

QUOTA = {
    # quota keeps its counters in the database of this alias, through a
    # small pool of its own.
    "DATABASE": "default",
    "OPTIONS": {"pool_size": 2},
    "HTTP": {
        # Route classes give the anonymous rate (per client IP); a bearer
        # token, an API key or a signed-in user gets 5x, a superuser 10x.
        # QUOTA_POLICY_API_RATES (or QUOTA_SHADOW, ...) tunes it per deployment.
        "policies": [RoutePolicy(name="api", paths=["/api"], rates="5/minute")],
        "exclude": ["/health"],
        "hooks": {"identify": "quota.contrib.django.middleware.user_identity"},
    },
}

USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# Django REST framework (``pip install 'quota[drf]'``): the views of example/api.py, throttled
# by quota's drop-in classes (one counter per client in quota's tables) and, for comparison,
# by DRF's own (a history in Django's cache).
DRF = importlib.util.find_spec("rest_framework") is not None
if DRF:
    INSTALLED_APPS.append("rest_framework")
    # The X-RateLimit-* and RateLimit fields on the DRF views' responses (QUOTA_DRF_HEADERS).
    MIDDLEWARE.append("quota.contrib.drf.RateLimitHeadersMiddleware")
    QUOTA_DRF_HEADERS = "both"
    REST_FRAMEWORK = {
        "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
        "DEFAULT_THROTTLE_RATES": {
            "anon": os.environ.get("QUOTA_EXAMPLE_DRF_RATE", "10/minute"),
            "user": "100/minute",
        },
    }
    # DRF's own throttles keep their history in this cache: with several processes it must
    # be one they share (a directory here, QUOTA_EXAMPLE_CACHE_DIR), else each has its own.
    if os.environ.get("QUOTA_EXAMPLE_CACHE_DIR"):
        CACHES = {
            "default": {
                "BACKEND": "django.core.cache.backends.filebased.FileBasedCache",
                "LOCATION": os.environ["QUOTA_EXAMPLE_CACHE_DIR"],
            }
        }
