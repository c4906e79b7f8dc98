"""HTTP integration: rate limits for ASGI and WSGI apps, a FastAPI dependency, runtime policies.


    from quota.http import HttpConfig, RoutePolicy
    from quota.http.asgi import QuotaMiddleware        # Starlette, FastAPI, any ASGI app
    from quota.http.wsgi import QuotaWSGIMiddleware    # Flask, any WSGI app
    from quota.http.fastapi import RateLimit           # one FastAPI route (needs fastapi)

Importing this package (or `quota.http.asgi`, `quota.http.wsgi`) imports no
web framework. One pure core (`quota.http._core`) decides; the middlewares
only translate requests and responses. See docs/http.md.
"""

from __future__ import annotations

from quota.http._capacity import Plans, SystemPressure
from quota.http._config import HttpConfig
from quota.http._core import HttpMetrics
from quota.http._env import ENV_VARS
from quota.http._identity import Identity, RequestInfo, hashed_subject, sign
from quota.http._responses import EXPOSE_HEADERS, Denial, HttpResponse
from quota.http._routes import RoutePolicy
from quota.http._runtime import (
    PolicyRow,
    SettingRow,
    delete_policy,
    delete_setting,
    list_policies,
    list_settings,
    set_policy,
    set_setting,
)
from quota.http._signals import PredictivePressure, Velocity

__all__ = [
    "ENV_VARS",
    "EXPOSE_HEADERS",
    "Denial",
    "HttpConfig",
    "HttpMetrics",
    "HttpResponse",
    "Identity",
    "Plans",
    "PolicyRow",
    "PredictivePressure",
    "RequestInfo",
    "RoutePolicy",
    "SettingRow",
    "SystemPressure",
    "Velocity",
    "delete_policy",
    "delete_setting",
    "hashed_subject",
    "list_policies",
    "list_settings",
    "set_policy",
    "set_setting",
    "sign",
]
