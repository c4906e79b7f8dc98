"""WSGI middleware (Flask, Django, any WSGI app): a thin driver of `quota.http._core`.


    from quota.http import HttpConfig, RoutePolicy
    from quota.http.wsgi import QuotaWSGIMiddleware

    app.wsgi_app = QuotaWSGIMiddleware(app.wsgi_app, config=HttpConfig.from_env(...))

Imports no web framework.
"""

from __future__ import annotations

import http
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from quota._core.url import default_url, parse_url
from quota._limiter import Limiter, connect
from quota.http._config import HttpConfig
from quota.http._core import (
    GuardOptions,
    Verdict,
    build_guard,
    drive_sync,
    own_limiter_settings,
    sync_effects,
)
from quota.http._identity import RequestInfo
from quota.http._responses import CorsOrigins, expose

if TYPE_CHECKING:
    from typing_extensions import Unpack

StartResponse = Callable[..., Any]
WSGIApp = Callable[[dict[str, Any], StartResponse], Iterable[bytes]]

_EXPOSE = "access-control-expose-headers"


def _text(value: str) -> str:
    # PEP 3333 hands bytes over as latin-1 text; paths are UTF-8 on the wire.
    try:
        return value.encode("latin-1").decode("utf-8")
    except (UnicodeEncodeError, UnicodeDecodeError):
        return value


def wsgi_request(environ: dict[str, Any]) -> RequestInfo:
    """The `RequestInfo` of a WSGI environ."""
    headers: dict[str, str] = {
        name[5:].replace("_", "-").lower(): value
        for name, value in environ.items()
        if name[:5] == "HTTP_"
    }
    path = _text(environ.get("SCRIPT_NAME", "") + environ.get("PATH_INFO", "")) or "/"
    raw = environ.get("RAW_URI") or environ.get("REQUEST_URI")
    raw_path = raw.split("?", 1)[0] if raw else quote(path)
    return RequestInfo(
        environ.get("REQUEST_METHOD", "GET").upper(), path, raw_path, headers,
        environ.get("REMOTE_ADDR") or None, environ,
    )  # fmt: skip


def status_line(status: int) -> str:
    try:
        return f"{status} {http.HTTPStatus(status).phrase}"
    except ValueError:
        return f"{status} Unknown"


def add_headers(headers: list[tuple[str, str]], verdict: Verdict) -> list[tuple[str, str]]:
    """The app's response headers with the verdict's added (merging CORS exposure)."""
    out = [*headers, *verdict.headers]
    if verdict.expose:
        existing = [v for k, v in out if k.lower() == _EXPOSE]
        out = [(k, v) for k, v in out if k.lower() != _EXPOSE]
        out.append(
            ("Access-Control-Expose-Headers", expose(verdict.headers, ", ".join(existing) or None))
        )
    return out


class QuotaWSGIMiddleware:
    """Rate-limit every request a WSGI app receives; see `quota.asgi.QuotaMiddleware` for the options.

    `limiter` is a sync `quota.Limiter`; without one, the middleware opens
    one with group commit (``batching=True``) on `url` (default
    ``$QUOTA_DATABASE_URL``, else the embedded SQLite file), on PostgreSQL
    with a fallback (``Fallback(timeout=0.25)``). Thread-safe.

    CORS preflights pass through uncounted (flask-cors or the app answers
    them); a CORS extension runs inside the app, so quota's own 429/503 only
    carry ``Access-Control-Allow-Origin`` for the origins in `cors_origins`
    (``"*"`` or a list; default None: no grant).
    """

    def __init__(
        self,
        app: WSGIApp,
        *,
        limiter: Limiter | None = None,
        url: str | None = None,
        config: HttpConfig | None = None,
        cors_origins: str | Sequence[str] | None = None,
        **hooks: Unpack[GuardOptions],
    ) -> None:
        self.app = app
        self.cors = CorsOrigins.of(cors_origins)
        if limiter is None:
            url = url or default_url()
            dialect = parse_url(url).dialect
            # Group commit between the server's threads; a lone request goes out at once.
            limiter = connect(url, **own_limiter_settings(dialect))
        self.limiter = limiter
        self.guard = build_guard(
            config,
            hooks,
            dialect=limiter.store.dialect,
            app_clock=limiter.options.app_clock,
            where="QuotaWSGIMiddleware",
        )
        self.metrics = self.guard.metrics
        self._effects = sync_effects(limiter, self.guard.route_names)

    def __call__(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        if not self.guard.config.enabled:
            return self.app(environ, start_response)
        if (
            environ.get("REQUEST_METHOD", "").upper() == "OPTIONS"
            and "HTTP_ORIGIN" in environ
            and "HTTP_ACCESS_CONTROL_REQUEST_METHOD" in environ
        ):  # a CORS preflight: flask-cors or the app answers it, uncounted
            return self.app(environ, start_response)
        request = wsgi_request(environ)
        verdict = drive_sync(self.guard.flow(request), *self._effects)
        response = verdict.response
        if response is not None:
            response = self.guard.answer(response, request, self.cors)
            start_response(status_line(response.status), list(response.headers))
            return [response.body]
        if not verdict.headers:
            return self.app(environ, start_response)

        def start(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
            return start_response(status, add_headers(headers, verdict), exc_info)

        return self.app(environ, start)


__all__ = ["QuotaWSGIMiddleware", "wsgi_request"]
