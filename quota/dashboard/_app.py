"""The dashboard's Starlette app: routes, authentication, CSRF, and the calls to the admin API."""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import jinja2
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import (
    HTMLResponse,
    JSONResponse,
    RedirectResponse,
    Response,
)
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import quota
from quota.admin import Admin, AsyncAdmin, PolicyRow
from quota.dashboard import _auth
from quota.dashboard._plots import bars_svg, rates_svg, usage_svg
from quota.dashboard._rates import RateTracker

log = logging.getLogger("quota.dashboard")

_HERE = Path(__file__).parent
#: The busiest keys the overview and the keys page list.
TOP_OVERVIEW = 10
TOP_KEYS = 200
#: The concurrency keys the keys page lists.
TOP_LEASES = 50
ALGORITHMS = ("fixed_window", "sliding_window", "token_bucket", "gcra")
#: The ``fail_open`` field: as ``--fail-open``/``--fail-closed``, or the class's.
_FAIL: dict[str, bool | None] = {"": None, "open": True, "closed": False}
_FIELDS = "rates (with algorithm), cost, fail_open, exempt"

Handler = Callable[[Request], Awaitable[Response]]


class _Admin:
    """The admin API of a limiter given or opened on first use, behind coroutines.

    A sync `quota.Limiter` runs in Starlette's thread pool; an async one on the
    server's loop. The dashboard opens a URL's limiter itself on the first
    request (a mounted app sees no lifespan events) and never closes one given.
    """

    def __init__(self, target: str | quota.Limiter | quota.AsyncLimiter) -> None:
        if not isinstance(target, (str, quota.Limiter, quota.AsyncLimiter)):
            raise quota.ConfigurationError(
                "limiter_or_url must be a database URL, a quota.Limiter or a quota.AsyncLimiter,"
                f" got {target!r}"
            )
        self._target = target
        self._admin: Admin | AsyncAdmin | None = None
        self._opened: quota.Limiter | None = None

    def _get(self) -> Admin | AsyncAdmin:
        # Called on the event loop's thread only: no two requests open the limiter twice.
        if self._admin is None:
            target = self._target
            if isinstance(target, str):
                # Sync: thread-safe, and tied to no event loop.
                self._opened = quota.connect(target, pool_size=2)
                self._admin = Admin(self._opened)
            elif isinstance(target, quota.AsyncLimiter):
                self._admin = AsyncAdmin(target)
            else:
                self._admin = Admin(target)
        return self._admin

    async def call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """`name` of the admin (or of its limiter, for ``limiter.<name>``) called with the arguments."""
        admin = self._get()
        owner: Any = admin
        if name.startswith("limiter."):
            owner, name = admin.limiter, name.removeprefix("limiter.")
        method = getattr(owner, name)
        if isinstance(admin, AsyncAdmin):
            return await method(*args, **kwargs)
        return await run_in_threadpool(method, *args, **kwargs)

    def close(self) -> None:
        if self._opened is not None:
            self._opened.close()
            self._opened = None
            self._admin = None


class _Dashboard:
    def __init__(
        self, admin: _Admin, token: str, read_only: bool, metrics: quota.Metrics | None
    ) -> None:
        self.admin = admin
        self.token = token
        self.read_only = read_only
        self.rates = None if metrics is None else RateTracker(metrics)
        self.env = jinja2.Environment(
            loader=jinja2.FileSystemLoader(_HERE / "templates"),
            autoescape=True,
            undefined=jinja2.StrictUndefined,
        )
        self.env.filters["utc"] = _utc
        self.env.filters["per_s"] = _per_s
        self.env.filters["interval"] = _interval

    # -- who is asking -------------------------------------------------------------------

    def who(self, request: Request) -> str | None:
        """``bearer`` or ``session <id>`` for an authenticated request; None otherwise."""
        given = _auth.bearer(request.headers.get("authorization"))
        if given is not None:
            return "bearer" if _auth.same(given, self.token) else None
        session = _auth.session_id(self.token, request.cookies.get(_auth.SESSION_COOKIE))
        return None if session is None else f"session {session[:8]}"

    def csrf(self, request: Request) -> str:
        session = _auth.session_id(self.token, request.cookies.get(_auth.SESSION_COOKIE))
        return "" if session is None else _auth.csrf_token(self.token, session)

    def guard(
        self, handler: Handler, *, change: bool = False, csrf: bool = False, api: bool = False
    ) -> Handler:
        """`handler` behind the token; with `csrf`, a browser session's POST needs its CSRF
        token; with `change` (a change to the store), that and not being read-only."""

        async def guarded(request: Request) -> Response:
            who = self.who(request)
            if who is None:
                wants_html = "text/html" in request.headers.get("accept", "")
                if api or "authorization" in request.headers or not wants_html:
                    return JSONResponse(
                        {"error": "authentication required"},
                        status_code=401,
                        headers={"WWW-Authenticate": 'Bearer realm="quota dashboard"'},
                    )
                target = request.url.path.removeprefix(_base(request)) or "/"
                if request.url.query:
                    target += "?" + request.url.query
                return RedirectResponse(
                    f"{_base(request)}/login?{urlencode({'next': target})}", status_code=303
                )
            request.state.who = who
            if change and self.read_only:
                log.warning("%s: refused %s: read-only", who, request.url.path)
                return self.refuse(request, 403, "the dashboard is read-only")
            # A bearer request carries its credential itself: no browser sends one on its own.
            if (change or csrf) and who != "bearer":
                form = await request.form()
                if not _auth.same(_str(form.get("csrf_token")), self.csrf(request)):
                    log.warning("%s: refused %s without a valid CSRF token", who, request.url.path)
                    return self.refuse(request, 403, "missing or invalid CSRF token")
            try:
                return await handler(request)
            except quota.ConfigurationError as exc:
                return self.refuse(request, 400, str(exc))

        return guarded

    def refuse(self, request: Request, status: int, message: str) -> Response:
        if getattr(
            request.state, "who", None
        ) == "bearer" or "text/html" not in request.headers.get("accept", ""):
            return JSONResponse({"error": message}, status_code=status)
        return self.page(request, "error.html", status=status, message=message, code=status)

    def page(self, request: Request, name: str, *, status: int = 200, **context: Any) -> Response:
        html = self.env.get_template(name).render(
            base=_base(request),
            csrf_token=self.csrf(request),
            read_only=self.read_only,
            who=getattr(request.state, "who", None),
            page=name.removesuffix(".html"),
            **context,
        )
        return HTMLResponse(html, status_code=status)

    def done(self, request: Request, path: str, message: str, **fields: Any) -> Response:
        """After a change: JSON for a bearer client, a redirect back (with `message`) for a browser."""
        log.info("%s: %s", request.state.who, message)
        if request.state.who == "bearer":
            return JSONResponse({"ok": True, "message": message, **fields})
        sep = "&" if "?" in path else "?"
        return RedirectResponse(
            f"{_base(request)}{path}{sep}done={quote(message)}", status_code=303
        )

    # -- login ---------------------------------------------------------------------------

    async def login_page(self, request: Request) -> Response:
        nonce = secrets.token_urlsafe(18)
        response = self.page(
            request,
            "login.html",
            login_csrf=nonce,
            next=_next(request.query_params.get("next")),
            error=None,
        )
        self._cookie(request, response, _auth.LOGIN_COOKIE, nonce, 600)
        return response

    async def login(self, request: Request) -> Response:
        form = await request.form()
        given = _str(form.get("csrf_token"))
        if not given or not _auth.same(given, request.cookies.get(_auth.LOGIN_COOKIE) or ""):
            return self.page(
                request,
                "error.html",
                status=403,
                code=403,
                message="missing or invalid CSRF token: reload the login page",
            )
        target = _next(_str(form.get("next")))
        if not _auth.same(_str(form.get("token")), self.token):
            log.warning("login refused: wrong token")
            nonce = secrets.token_urlsafe(18)
            response = self.page(
                request,
                "login.html",
                status=401,
                login_csrf=nonce,
                next=target,
                error="wrong token",
            )
            self._cookie(request, response, _auth.LOGIN_COOKIE, nonce, 600)
            return response
        cookie = _auth.new_session(self.token)
        log.info("session %s: logged in", cookie.split(".")[1][:8])
        response = RedirectResponse(f"{_base(request)}{target}", status_code=303)
        self._cookie(request, response, _auth.SESSION_COOKIE, cookie, _auth.SESSION_TTL)
        response.delete_cookie(_auth.LOGIN_COOKIE, path=_base(request) or "/")
        return response

    async def logout(self, request: Request) -> Response:
        log.info("%s: logged out", request.state.who)
        response = RedirectResponse(f"{_base(request)}/login", status_code=303)
        response.delete_cookie(_auth.SESSION_COOKIE, path=_base(request) or "/")
        return response

    def _cookie(
        self, request: Request, response: Response, name: str, value: str, age: int
    ) -> None:
        response.set_cookie(
            name,
            value,
            max_age=age,
            path=_base(request) or "/",
            httponly=True,
            samesite="strict",
            secure=request.url.scheme == "https",
        )

    # -- pages ---------------------------------------------------------------------------

    async def health_check(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def overview(self, request: Request) -> Response:
        data = await self._overview_data()
        return self.page(
            request,
            "overview.html",
            data=data,
            plot=bars_svg([(u["key"], u["count"]) for u in data["top"]]),
            rates_plot=None if self.rates is None else _rates_plot(self.rates),
        )

    async def rates_plot(self, request: Request) -> Response:
        """The overview's rates plot as of the last poll (the script redraws it from this):
        an SVG element, or 404 without metrics. It does not poll: the figures stay those
        of ``/api/overview``."""
        if self.rates is None:
            return JSONResponse({"error": "no metrics: no rates to plot"}, status_code=404)
        return Response(_rates_plot(self.rates), media_type="image/svg+xml")

    async def overview_api(self, request: Request) -> Response:
        return JSONResponse(await self._overview_data())

    async def _overview_data(self) -> dict[str, Any]:
        health = await self.admin.call("health")
        top = await self.admin.call("top", TOP_OVERVIEW)
        return {
            "time": time.time(),
            "health": asdict(health),
            "top": [asdict(u) for u in top],
            "rates": None if self.rates is None else self.rates.poll(),
        }

    async def keys(self, request: Request) -> Response:
        search = request.query_params.get("q", "")
        key = request.query_params.get("key")
        rows = await self.admin.call("top", TOP_KEYS)
        if search:
            rows = [u for u in rows if search.lower() in u.key.lower()]
        windows = await self.admin.call("windows", key) if key else None
        leases = await self.admin.call("top_leases", TOP_LEASES)
        holders = await self.admin.call("leases", key) if key else None
        if _wants_json(request):
            return JSONResponse(
                {
                    "top": [asdict(u) for u in rows],
                    "windows": None if windows is None else [asdict(u) for u in windows],
                    "leases": [asdict(u) for u in leases],
                    "holders": None if holders is None else asdict(holders),
                }
            )
        return self.page(
            request,
            "keys.html",
            rows=rows,
            q=search,
            key=key,
            windows=windows,
            leases=leases,
            holders=holders,
            done=request.query_params.get("done"),
            now=time.time(),
        )

    async def reset_confirm(self, request: Request) -> Response:
        key = request.query_params.get("key", "")
        window = request.query_params.get("window", "")
        windows = await self.admin.call("windows", key) if key else []
        return self.page(request, "reset.html", key=key, window=window, windows=windows)

    async def reset(self, request: Request) -> Response:
        form = await request.form()
        key = _str(form.get("key"))
        if not key:
            raise quota.ConfigurationError("key must be given")
        window_text = _str(form.get("window"))
        window = _int("window", window_text) if window_text else None
        deleted = await self.admin.call("reset", key, window)
        what = f"window {window}s of " if window else ""
        return self.done(
            request, "/keys", f"reset {what}key {key!r}: {deleted} rows deleted", deleted=deleted
        )

    async def quotas(self, request: Request) -> Response:
        subject = request.query_params.get("subject", "")
        usage = ledger = None
        if subject:
            usage = await self.admin.call("usage", subject, include_ended=True)
            ledger = await self.admin.call("ledger", subject)
        if _wants_json(request):
            return JSONResponse(
                {
                    "usage": None if usage is None else [asdict(u) for u in usage],
                    "ledger": None if ledger is None else [asdict(e) for e in ledger],
                }
            )
        plot = usage_svg(
            [
                (f"{u.name} ({u.period})", u.used, None if u.limit is None else u.limit + u.granted)
                for u in usage or []
                if u.resets_at > time.time()
            ]
        )
        return self.page(
            request,
            "quotas.html",
            plot=plot,
            subject=subject,
            usage=usage,
            ledger=ledger,
            done=request.query_params.get("done"),
        )

    async def grant(self, request: Request) -> Response:
        form = await request.form()
        subject, name = _required(form, "subject"), _required(form, "name")
        amount = _int("amount", _str(form.get("amount")))
        period: str | int = _required(form, "period")
        if str(period).isdigit():
            period = int(period)
        tz = _str(form.get("tz")) or None
        u = await self.admin.call("limiter.grant_quota", subject, name, amount, period, tz)
        return self.done(
            request,
            f"/quotas?{urlencode({'subject': subject})}",
            f"granted {amount} to {subject!r} {name!r}",
            usage=asdict(u),
        )

    async def refund(self, request: Request) -> Response:
        form = await request.form()
        subject, name = _required(form, "subject"), _required(form, "name")
        key = _required(form, "idempotency_key")
        result = await self.admin.call("limiter.refund_quota", subject, name, key)
        return self.done(
            request,
            f"/quotas?{urlencode({'subject': subject})}",
            f"refund of {key!r} on {subject!r} {name!r}: {result.status}",
            result=asdict(result),
        )

    async def policies(self, request: Request) -> Response:
        rows = await self.admin.call("policies")
        settings = await self.admin.call("settings")
        served = await self.admin.call("served_routes")
        if _wants_json(request):
            return JSONResponse(
                {
                    "policies": [asdict(r) for r in rows],
                    "settings": [asdict(s) for s in settings],
                    "served_routes": served,
                }
            )
        return self.page(
            request,
            "policies.html",
            rows=rows,
            settings=settings,
            served=served,
            algorithms=ALGORITHMS,
            done=request.query_params.get("done"),
            warning=request.query_params.get("warning"),
        )

    async def set_policy(self, request: Request) -> Response:
        form = await request.form()
        route = _required(form, "route")
        subject = _str(form.get("subject")) or None
        tier = _str(form.get("tier")) or None
        if subject and tier:
            raise quota.ConfigurationError("give at most one of subject, tier")
        who = f"tier:{tier}" if tier else (subject or "*")
        rates = _str(form.get("rates")) or None
        algorithm = _str(form.get("algorithm")) or None
        cost_text = _str(form.get("cost"))
        cost = _int("cost", cost_text) if cost_text else None
        fail = _str(form.get("fail_open"))
        if fail not in _FAIL:
            raise quota.ConfigurationError(f"fail_open must be open, closed or empty, got {fail!r}")
        fail_open = _FAIL[fail]
        exempt = _str(form.get("exempt")) in ("1", "on", "true", "yes")
        if rates is None and cost is None and fail_open is None and not exempt:
            raise quota.ConfigurationError(
                f"nothing to override: give at least one of {_FIELDS}"
                " (to remove an override, delete it)"
            )
        if algorithm is not None and rates is None:
            raise quota.ConfigurationError(
                "algorithm applies to the override's rates: give rates with it"
            )
        row = PolicyRow(
            route=route,
            subject=who,
            rates=rates,
            algorithm=algorithm,
            cost=cost,
            fail_open=fail_open,
            exempt=exempt,
            note=_str(form.get("note")) or None,
        )
        stored = await self.admin.call("set_policy", row)
        warning = await self.admin.call("unserved_route", route)
        path = "/policies" + (f"?{urlencode({'warning': warning})}" if warning else "")
        return self.done(
            request,
            path,
            f"set policy {route!r} for {who!r}: {_describe(stored)}",
            policy=asdict(stored),
            warning=warning,
        )

    async def delete_policy(self, request: Request) -> Response:
        form = await request.form()
        route = _required(form, "route")
        subject = _str(form.get("subject")) or "*"
        found = await self.admin.call("delete_policy", route, subject)
        what = "deleted" if found else "no such"
        return self.done(
            request, "/policies", f"{what} policy {route!r} for {subject!r}", deleted=found
        )

    async def set_multiplier(self, request: Request) -> Response:
        form = await request.form()
        tier = _required(form, "tier")
        value = _float("multiplier", _required(form, "multiplier"))
        note = _str(form.get("note")) or None
        await self.admin.call("set_tier_multiplier", tier, value, note=note)
        return self.done(request, "/policies", f"set tier multiplier {tier!r} to {value:g}")

    async def set_abuse_threshold(self, request: Request) -> Response:
        form = await request.form()
        threshold = _int("threshold", _required(form, "threshold"))
        note = _str(form.get("note")) or None
        await self.admin.call("set_abuse_threshold", threshold, note=note)
        return self.done(request, "/policies", f"set abuse threshold to {threshold}")

    async def unset(self, request: Request) -> Response:
        form = await request.form()
        name = _required(form, "name")
        found = await self.admin.call("delete_setting", name)
        what = "unset" if found else "no such setting"
        return self.done(request, "/policies", f"{what} {name!r}", deleted=found)


def create_app(
    limiter_or_url: str | quota.Limiter | quota.AsyncLimiter,
    *,
    token: str,
    read_only: bool = False,
    metrics: quota.Metrics | None = None,
) -> Starlette:
    """The dashboard as an ASGI app, over `limiter_or_url` (a database URL or a limiter).

    `token` is the secret every request must show (as ``Authorization: Bearer``
    or through the login form); with `read_only` every change is refused (403).
    A URL's limiter opens on the first request that needs it; a limiter given
    stays the caller's to close. `metrics` is the `quota.Metrics` whose
    decisions and shed requests the overview shows per second (default: the
    given limiter's ``metrics=``, if any). Raises `quota.ConfigurationError`
    for an empty token, a target that is neither a URL nor a limiter, or
    `metrics` that is not a `quota.Metrics`.
    """
    if not isinstance(token, str) or not token:
        raise quota.ConfigurationError(f"token must be a non-empty string, got {token!r}")
    if not isinstance(read_only, bool):
        raise quota.ConfigurationError(f"read_only must be a bool, got {read_only!r}")
    if metrics is not None and not isinstance(metrics, quota.Metrics):
        raise quota.ConfigurationError(f"metrics must be a quota.Metrics, got {metrics!r}")
    admin = _Admin(limiter_or_url)
    if metrics is None and isinstance(limiter_or_url, (quota.Limiter, quota.AsyncLimiter)):
        metrics = limiter_or_url.options.metrics
    d = _Dashboard(admin, token, read_only, metrics)
    g = d.guard

    def change(handler: Handler) -> Handler:
        return g(handler, change=True)

    routes = [
        Route("/health", d.health_check, name="health"),
        Route("/login", d.login_page, methods=["GET"], name="login_page"),
        Route("/login", d.login, methods=["POST"], name="login"),
        Route("/logout", g(d.logout, csrf=True), methods=["POST"], name="logout"),
        Route("/", g(d.overview), name="overview"),
        Route("/api/overview", g(d.overview_api, api=True), name="overview_api"),
        Route("/api/overview/rates.svg", g(d.rates_plot, api=True), name="rates_plot"),
        Route("/keys", g(d.keys), name="keys"),
        Route("/keys/reset", g(d.reset_confirm), methods=["GET"], name="reset_confirm"),
        Route("/keys/reset", change(d.reset), methods=["POST"], name="reset"),
        Route("/quotas", g(d.quotas), name="quotas"),
        Route("/quotas/grant", change(d.grant), methods=["POST"], name="grant"),
        Route("/quotas/refund", change(d.refund), methods=["POST"], name="refund"),
        Route("/policies", g(d.policies), name="policies"),
        Route("/policies/set", change(d.set_policy), methods=["POST"], name="policy_set"),
        Route("/policies/delete", change(d.delete_policy), methods=["POST"], name="policy_delete"),
        Route(
            "/policies/multiplier", change(d.set_multiplier), methods=["POST"], name="multiplier"
        ),
        Route(
            "/policies/abuse-threshold",
            change(d.set_abuse_threshold),
            methods=["POST"],
            name="abuse_threshold",
        ),
        Route("/policies/unset", change(d.unset), methods=["POST"], name="unset"),
        # Stylesheet and script only, no data: open, so that the login page has its style.
        Mount("/static", app=StaticFiles(directory=_HERE / "static"), name="static"),
    ]
    app = Starlette(routes=routes, middleware=[Middleware(_SecurityHeaders)])
    app.state.dashboard = d
    return app


#: Sent with every response: scripts and styles from this app only (no inline script can
#: run, should a value ever slip through unescaped), never framed, no referrer, no caching.
SECURITY_HEADERS = [
    (
        b"content-security-policy",
        b"default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:;"
        b" object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'",
    ),
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"no-referrer"),
    (b"cache-control", b"no-store"),
]


class _SecurityHeaders:
    """ASGI middleware adding `SECURITY_HEADERS` to every HTTP response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                names = {name for name, _ in SECURITY_HEADERS}
                kept = [(k, v) for k, v in message.get("headers", []) if k.lower() not in names]
                message = {**message, "headers": [*kept, *SECURITY_HEADERS]}
            await send(message)

        await self.app(scope, receive, send_with_headers)


def _base(request: Request) -> str:
    """The path the app is mounted at ('' at the root): every link starts with it."""
    return str(request.scope.get("root_path", "")).rstrip("/")


def _str(value: object) -> str:
    """A form field as text ('' when missing; an uploaded file is not a field)."""
    return value.strip() if isinstance(value, str) else ""


def _required(form: Any, name: str) -> str:
    value = _str(form.get(name))
    if not value:
        raise quota.ConfigurationError(f"{name} must be given")
    return value


def _int(name: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise quota.ConfigurationError(f"{name} must be a whole number, got {text!r}") from None


def _float(name: str, text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise quota.ConfigurationError(f"{name} must be a number, got {text!r}") from None


def _next(target: str | None) -> str:
    """Where to go after logging in: a path of this app, never another site."""
    if not target or not target.startswith("/") or target.startswith("//") or "\\" in target:
        return "/"
    return target


def _wants_json(request: Request) -> bool:
    accept = request.headers.get("accept", "")
    return "application/json" in accept and "text/html" not in accept


def _describe(row: PolicyRow) -> str:
    parts = [
        f"{k}={v!r}"
        for k, v in asdict(row).items()
        if k in ("rates", "algorithm", "cost", "fail_open", "note") and v is not None
    ]
    if row.exempt:
        parts.append("exempt")
    return ", ".join(parts)


def _rates_plot(tracker: RateTracker) -> str:
    return rates_svg(tracker.history(), span=tracker.history_seconds)


def _utc(epoch: float | None) -> str:
    if epoch is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(epoch))


def _per_s(rate: float | None) -> str:
    """A per-second figure as the overview shows it (the script formats it alike)."""
    return "-" if rate is None else f"{rate:.2f}"


def _interval(seconds: float | None) -> str:
    return (
        "the next update (the first poll has no interval)"
        if seconds is None
        else f"the last {seconds:.1f} s"
    )
