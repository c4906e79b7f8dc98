#!/usr/bin/env python
"""A small Django project rate-limited by quota, on the embedded SQLite default.

Run it from this directory (with quota and Django installed,
``pip install 'quota[django]'``)::

    python manage.py migrate && python manage.py runserver

``migrate`` creates Django's tables and quota's in ``db.sqlite3`` here.
Then:

- ``/api/hello`` is a plain view limited by ``QuotaMiddleware``: 5 requests
  a minute per client IP (``QUOTA_POLICY_API_RATES=20/minute`` changes it),
  25 a minute with a bearer token, an ``X-API-Key`` header or as a
  signed-in user; every answer carries the rate-limit headers.
- ``/limited`` is limited by the ``@ratelimit`` decorator alone: 3 requests a
  minute per client IP (``QUOTA_EXAMPLE_DECORATOR_RATE``).
- ``/health`` is never limited.
- With Django REST framework installed (``pip install 'quota[drf]'``),
  ``/drf/hello`` is a DRF view throttled by ``quota.contrib.drf``'s
  ``AnonRateThrottle``: 10 requests a minute per client IP
  (``QUOTA_EXAMPLE_DRF_RATE``), with the rate-limit headers;
  ``/drf/hello-drf-cache`` is the same view under DRF's own throttle.

``curl -i http://127.0.0.1:8000/api/hello`` six times shows the 429 and its
``Retry-After``. ``QUOTA_SHADOW=true`` decides and sends the headers without
ever blocking.

With ``QUOTA_EXAMPLE_POSTGRES=postgresql://user@host:5432/dbname`` the project
(Django's tables and quota's) lives in that PostgreSQL database instead; set
``QUOTA_HASH_SECRET`` (16 bytes or more, the same on every instance) too, as
quota requires with PostgreSQL. Under several processes::

    gunicorn --workers 4 example.wsgi       # or: uvicorn example.asgi:application
"""

import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "example.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)
