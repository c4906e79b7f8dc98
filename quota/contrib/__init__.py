"""Bridges from `quota` to other libraries; each module is optional and imported on its own.

- `quota.contrib.limits`: `quota` as a storage backend for the `limits` library
  (and so for flask-limiter and slowapi). Extra ``limits``.
- `quota.contrib.django`: the Django app (migrations, ``@ratelimit``, middlewares,
  management commands). Extra ``django``.
- `quota.contrib.httpx`, `quota.contrib.requests`, `quota.contrib.aiohttp`: outbound
  HTTP clients under one limit across processes. Extras ``httpx``, ``requests``, ``aiohttp``.
- `quota.contrib.celery`, `quota.contrib.arq`, `quota.contrib.dramatiq`: task limits
  across every worker, a denied task deferred by its framework. Extras ``celery``,
  ``arq``, ``dramatiq``.
"""
