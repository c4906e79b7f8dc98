"""HTTP integration: rate limits for ASGI and WSGI apps, a FastAPI dependency, runtime policies.


    from quota.http import HttpConfig, RoutePolicy
    from quota.http.asgi import QuotaMiddleware        # Starlette, FastAPI, any ASGI app
    from quota.http.wsgi import QuotaWSGIMiddleware    # Flask, any WSGI app
    from quota.http.fastapi import RateLimit           # one FastAPI route (needs fastapi)

Importing this package (or `quota.http.asgi`, `quota.http.wsgi`) imports no
web framework. One pure core (`quota.http._core`) decides; the middlewares
only translate requests and responses. See docs/http.md. The runtime
overrides and settings the middlewares apply are edited through
`quota.admin`.

For another framework's integration (``quota.contrib.django`` is one), the
core's entry points are public too: `build_guard` makes the decision core
from a config and the `GuardOptions` hooks, `drive_sync` runs its flow for
one request into a `Verdict`; `is_preflight` and `with_cors` handle CORS,
and `PolicyShape`, `rate_limit_headers`, `too_many_requests`, `problem`
(with `PROBLEM_JSON`, `RATE_LIMITED`) answer a `quota.Decision` the way the
middlewares do. `AUTH` is the tier of an authenticated caller.
"""

from __future__ import annotations

from quota.http._capacity import Plans, SystemPressure
from quota.http._config import HttpConfig
from quota.http._core import GuardOptions, HttpMetrics, Verdict, build_guard, drive_sync
from quota.http._env import ENV_VARS
from quota.http._identity import AUTH, Identity, RequestInfo, hashed_subject, sign
from quota.http._responses import (
    EXPOSE_HEADERS,
    PROBLEM_JSON,
    RATE_LIMITED,
    Denial,
    HttpResponse,
    PolicyShape,
    is_preflight,
    problem,
    rate_limit_headers,
    too_many_requests,
    with_cors,
)
from quota.http._routes import RoutePolicy
from quota.http._signals import PredictivePressure, Velocity
from quota.http._subjects import hash_secret_from_env, ip_subject, token_subject

__all__ = [
    "AUTH",
    "ENV_VARS",
    "EXPOSE_HEADERS",
    "PROBLEM_JSON",
    "RATE_LIMITED",
    "Denial",
    "GuardOptions",
    "HttpConfig",
    "HttpMetrics",
    "HttpResponse",
    "Identity",
    "Plans",
    "PolicyShape",
    "PredictivePressure",
    "RequestInfo",
    "RoutePolicy",
    "SystemPressure",
    "Velocity",
    "Verdict",
    "build_guard",
    "drive_sync",
    "hash_secret_from_env",
    "hashed_subject",
    "ip_subject",
    "is_preflight",
    "problem",
    "rate_limit_headers",
    "sign",
    "token_subject",
    "too_many_requests",
    "with_cors",
]
