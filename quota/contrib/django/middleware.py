"""`QuotaMiddleware`: the HTTP layer of `quota.http` as a Django middleware, sync and async.

    # settings.py
    from quota.http import RoutePolicy

    MIDDLEWARE = [
        ...,
        "quota.contrib.django.middleware.QuotaMiddleware",
    ]
    QUOTA = {
        "HTTP": {
            "policies": [RoutePolicy(name="api", paths=["/api"], rates="100/minute")],
            "exclude": ["/health"],
            "hooks": {"identify": "quota.contrib.django.middleware.user_identity"},
        },
    }

``QUOTA["HTTP"]`` holds the keywords of `quota.http.HttpConfig` (route
classes, tiers, proxies, HMAC keys, headers, shadow mode…); the ``QUOTA_*``
environment variables are laid over them, as `HttpConfig.from_env` does for
the other middlewares. A route class may also be written as a dict of
`RoutePolicy`'s keywords. Without ``QUOTA["HTTP"]`` every path is limited by
a default class of 60/minute per client. ``QUOTA["HTTP"]["hooks"]`` names
the hooks (``identify``, ``token_validator``, ``response_factory``,
``plans``, ``pressure``, ``clock``, ``observer``, ``on_abuse``) by dotted
path, or gives the objects themselves.

The middleware counts on the limiter of ``quota.contrib.django.conf``: the
process-wide `get_limiter()` when Django calls it synchronously (WSGI), the
event loop's `get_async_limiter()` when it calls it asynchronously (ASGI).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, cast

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.http import HttpResponse as DjangoResponse
from django.utils.module_loading import import_string

from quota._core.errors import ConfigurationError
from quota._core.url import parse_url
from quota._limiter import AsyncLimiter, Limiter
from quota.contrib.django import conf
from quota.contrib.django.conf import ImproperlyConfigured
from quota.http import (
    AUTH,
    GuardOptions,
    HttpConfig,
    HttpResponse,
    Identity,
    RequestInfo,
    RoutePolicy,
    Verdict,
    build_guard,
    drive_sync,
    is_preflight,
)
from quota.http.asgi import Limiters, asgi_request, decide
from quota.http.wsgi import add_headers, wsgi_request

#: The hooks ``QUOTA["HTTP"]["hooks"]`` may name: the keywords of `quota.http.asgi.QuotaMiddleware`.
HOOKS = tuple(GuardOptions.__annotations__)
_EXPOSE = "access-control-expose-headers"


def user_identity(request: RequestInfo) -> Identity | None:
    """An ``identify`` hook: tiers from the Django user (``AuthenticationMiddleware`` first).

    A signed-in user is ``auth`` (a superuser ``admin``), counted under
    ``user:<primary key>``: one user has one bucket whatever the device or
    address. Anyone else gets the built-in tiers (a bearer token or API key,
    else the client IP). Name it in ``QUOTA["HTTP"]["hooks"]["identify"]``;
    write your own for other tiers (``staff``, a tenant's plan).
    """
    user = getattr(request.raw, "user", None)
    if user is None or not getattr(user, "is_authenticated", False):
        return None
    tier = "admin" if getattr(user, "is_superuser", False) else AUTH
    return Identity(tier, f"user:{user.pk}")


def _policy(where: str, value: object) -> object:
    if isinstance(value, Mapping):
        try:
            return RoutePolicy(**value)
        except (TypeError, ConfigurationError) as exc:
            raise ImproperlyConfigured(f"{where}: {exc}") from exc
    return value


def http_config(http: Mapping[str, Any]) -> HttpConfig | None:
    """`HttpConfig.from_env` over the settings of ``QUOTA["HTTP"]`` (its ``hooks`` left out).

    None when there are none: the middleware's default, a 60/minute class on
    every path. Route classes (``policies`` and ``default``) may be
    `RoutePolicy` objects or dicts of its keywords. A bad setting or
    environment variable raises `ImproperlyConfigured` naming it.
    """
    settings = {k: v for k, v in http.items() if k != "hooks"}
    if not settings:
        return None
    policies = settings.get("policies")
    if policies is not None:
        if not isinstance(policies, (list, tuple)):
            raise ImproperlyConfigured(
                f"QUOTA['HTTP']['policies'] must be a list of route classes, got {policies!r}"
            )
        settings["policies"] = [
            _policy(f"QUOTA['HTTP']['policies'][{i}]", p) for i, p in enumerate(policies)
        ]
    if settings.get("default") is not None:
        settings["default"] = _policy("QUOTA['HTTP']['default']", settings["default"])
    try:
        return HttpConfig.from_env(**settings)
    except (TypeError, ConfigurationError) as exc:  # TypeError: an unknown setting
        raise ImproperlyConfigured(f"QUOTA['HTTP']: {exc}") from exc


def guard_options(hooks: object) -> GuardOptions:
    """The hooks of ``QUOTA["HTTP"]["hooks"]``, dotted paths imported."""
    if hooks is None:
        hooks = {}
    if not isinstance(hooks, Mapping):
        raise ImproperlyConfigured(f"QUOTA['HTTP']['hooks'] must be a dict, got {hooks!r}")
    unknown = sorted(str(k) for k in hooks if k not in HOOKS)
    if unknown:
        raise ImproperlyConfigured(
            f"QUOTA['HTTP']['hooks']: unknown hook {', '.join(map(repr, unknown))};"
            f" the hooks are {', '.join(HOOKS)}"
        )
    found: dict[str, Any] = dict.fromkeys(HOOKS)
    for name, value in hooks.items():
        if isinstance(value, str):
            try:
                value = import_string(value)
            except ImportError as exc:
                raise ImproperlyConfigured(
                    f"QUOTA['HTTP']['hooks'][{name!r}]: cannot import {value!r}: {exc}"
                ) from exc
        found[name] = value
    return cast(GuardOptions, found)


class _SettingsLimiters(Limiters):
    """The limiters of ``quota.contrib.django.conf``, never one of the middleware's own."""

    def __init__(self, url: str, clock: Callable[[], float] | None) -> None:
        super().__init__(None, url)
        self._clock = clock

    def get(self) -> AsyncLimiter | Limiter:
        limiter: AsyncLimiter = conf.get_async_limiter()
        return limiter

    def clock(self) -> Callable[[], float] | None:
        return self._clock

    async def aclose(self) -> None:  # the settings' limiters are closed by their owner
        return None


def to_django(response: HttpResponse) -> DjangoResponse:
    """A `quota.http.HttpResponse` (a 429 or 503 quota answers itself) as a Django response."""
    out = DjangoResponse(response.body, status=response.status)
    joined: dict[str, list[str]] = {}
    for name, value in response.headers:
        joined.setdefault(name, []).append(value)
    for name, values in joined.items():
        out[name] = ", ".join(values)
    return out


class QuotaMiddleware:
    """Rate-limit every request a Django project serves; see the module docstring for the settings.

    Reads ``settings.QUOTA`` once, when Django builds its middleware chain:
    a bad setting raises ``ImproperlyConfigured`` (also a
    `quota.ConfigurationError`) naming it, at startup. Each request is
    decided as `quota.http` decides it: an allowed one reaches the view and
    its response gets the rate-limit headers; a denied one is answered here
    with the 429 (``application/problem+json``, ``Retry-After``), or the 503
    of a fail-closed class whose limiter failed, and never reaches the view.
    Shadow mode decides, counts and sends the headers but never blocks; a
    limiter that fails lets a ``fail_open`` class's requests through without
    headers. CORS preflights pass uncounted.

    Sync and async: under WSGI (or a sync middleware chain) it counts with
    the process-wide `conf.get_limiter()`, under ASGI with the event loop's
    `conf.get_async_limiter()`, never blocking the loop. With an
    ``identify`` hook, an async request's user is loaded first
    (``await request.auser()``, into ``request.user``), so a hook such as
    `user_identity` may read ``request.user`` in either mode.

    ``middleware.guard`` is the decision core and ``middleware.metrics`` its
    counters (``ratelimit.hits``, ``ratelimit.blocked``, …), as on the other
    middlewares.
    """

    sync_capable = True
    async_capable = True

    def __init__(self, get_response: Callable[[Any], Any]) -> None:
        self.get_response = get_response
        self.async_mode = iscoroutinefunction(get_response)
        if self.async_mode:
            markcoroutinefunction(self)
        configured = conf.quota_settings()
        options = guard_options(configured.http.get("hooks"))
        url = conf.database_url()
        self.limiters = _SettingsLimiters(url, configured.limiter_options().app_clock)
        try:
            self.guard = build_guard(
                http_config(configured.http), options,
                dialect=parse_url(url).dialect, app_clock=self.limiters.clock(),
            )  # fmt: skip
        except ImproperlyConfigured:
            raise
        except ConfigurationError as exc:
            raise ImproperlyConfigured(str(exc)) from exc
        self.limiters.routes = self.guard.route_names
        self.metrics = self.guard.metrics
        self._load_user = options["identify"] is not None

    def _info(self, request: Any) -> RequestInfo | None:
        """The request as the core sees it; None when it passes untouched."""
        if not self.guard.config.enabled:
            return None
        scope = getattr(request, "scope", None)
        info = asgi_request(scope) if isinstance(scope, dict) else wsgi_request(request.META)
        if is_preflight(info.method, info.headers):
            return None
        info.raw = request
        return info

    def __call__(self, request: Any) -> Any:
        if self.async_mode:
            return self.__acall__(request)
        info = self._info(request)
        if info is None:
            return self.get_response(request)
        limiter = conf.get_limiter()
        verdict = drive_sync(self.guard.flow(info), *self.limiters.effects_of(limiter))
        if verdict.response is not None:
            return self._denied(info, verdict.response)
        return self._allowed(self.get_response(request), verdict)

    async def __acall__(self, request: Any) -> Any:
        info = self._info(request)
        if info is None:
            return await self.get_response(request)
        if self._load_user and callable(getattr(request, "auser", None)):
            request.user = await request.auser()
        verdict = await decide(self.guard, self.limiters, info)
        if verdict.response is not None:
            return self._denied(info, verdict.response)
        return self._allowed(await self.get_response(request), verdict)

    def _denied(self, info: RequestInfo, response: HttpResponse) -> DjangoResponse:
        # A CORS middleware above this one (django-cors-headers) grants the origin.
        return to_django(self.guard.answer(response, info, None))

    @staticmethod
    def _allowed(response: Any, verdict: Verdict) -> Any:
        if not verdict.headers:
            return response
        if verdict.expose:  # merged with the Access-Control-Expose-Headers already set
            existing = [(k, v) for k, v in response.items() if k.lower() == _EXPOSE]
            headers = add_headers(existing, verdict)
        else:
            headers = verdict.headers
        for name, value in headers:
            response[name] = value
        return response


__all__ = ["QuotaMiddleware", "user_identity"]
