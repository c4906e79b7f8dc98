"""ASGI middleware (Starlette, FastAPI, any ASGI app): a thin driver of `quota.http._core`.


    from quota.http import HttpConfig, RoutePolicy
    from quota.http.asgi import QuotaMiddleware

    app.add_middleware(
        QuotaMiddleware,
        config=HttpConfig.from_env(policies=[RoutePolicy(name="api", paths=["/api"], rates="100/minute")]),
    )

Imports no web framework. Only HTTP requests are limited; WebSocket and
lifespan traffic passes through (the middleware closes the limiters it opened
itself at lifespan shutdown). At lifespan startup, once the app's own startup
is complete, the middleware reads the store's schema version: a database
without quota's tables fails the startup with `quota.SchemaError` (the
server exits, naming ``quota migrate``) instead of serving unlimited.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import (
    Awaitable,
    Callable,
    Iterable,
    Iterator,
    Mapping,
    MutableMapping,
    Sequence,
)
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from quota._core.errors import SchemaError
from quota._core.url import SCHEMALESS, default_url, parse_url
from quota._limiter import AsyncLimiter, Limiter, connect_async
from quota._sql.statements import SCHEMA_VERSION
from quota._sql.steps import Op, Rows
from quota.http._config import HttpConfig
from quota.http._core import (
    Guard,
    GuardOptions,
    Verdict,
    async_effects,
    build_guard,
    drive_async,
    drive_sync,
    own_limiter_settings,
    sync_effects,
)
from quota.http._identity import RequestInfo
from quota.http._responses import (
    CorsOrigins,
    HttpResponse,
    expose,
    is_preflight,
)

if TYPE_CHECKING:
    from typing_extensions import Unpack

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

log = logging.getLogger("quota.http")

_EXPOSE = b"access-control-expose-headers"
#: Header names as ASGI sends them (lower-case bytes), encoded once.
_NAMES: dict[str, bytes] = {}
#: The names deciding reads (lower case already), encoded once.
_READ: dict[str, bytes] = {}


def _read_name(name: str) -> bytes:
    raw = _READ.get(name)
    if raw is None:
        raw = name.encode("latin-1")
        if len(_READ) < 1024:
            _READ[name] = raw
    return raw


class AsgiHeaders(Mapping[str, str]):
    """An ASGI scope's headers as a read-only mapping, decoded only when read.

    Names are lower case (as ASGI sends them); a repeated header's values
    are joined with ``,``. Deciding reads a handful of headers, so decoding
    them all up front would be wasted work on every request.
    """

    __slots__ = ("_raw",)

    def __init__(self, pairs: Iterable[tuple[bytes, bytes]]) -> None:
        if not isinstance(pairs, (list, tuple)):
            pairs = list(pairs)
        raw: dict[bytes, bytes] = dict(pairs)
        if len(raw) != len(pairs):  # a repeated header: join its values
            raw = {}
            for name, value in pairs:
                raw[name] = raw[name] + b"," + value if name in raw else value
        self._raw = raw

    def get(self, name: str, default: Any = None) -> Any:
        value = self._raw.get(_READ.get(name) or _read_name(name))
        return default if value is None else value.decode("latin-1")

    def __getitem__(self, name: str) -> str:
        value = self._raw.get(_READ.get(name) or _read_name(name))
        if value is None:
            raise KeyError(name)
        return value.decode("latin-1")

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and _read_name(name) in self._raw

    def __iter__(self) -> Iterator[str]:
        return (name.decode("latin-1") for name in self._raw)

    def __len__(self) -> int:
        return len(self._raw)


def asgi_request(scope: Scope) -> RequestInfo:
    """The `RequestInfo` of an ASGI HTTP scope."""
    path: str = scope.get("path") or "/"
    raw = scope.get("raw_path")
    raw_path = raw.decode("latin-1").split("?", 1)[0] if raw else quote(path)
    client = scope.get("client")
    return RequestInfo(
        scope.get("method", "GET").upper(), path, raw_path, AsgiHeaders(scope.get("headers") or ()),
        client[0] if client else None, scope,
    )  # fmt: skip


class Limiters:
    """The limiter a driver uses: the one it was given, or one per event loop opened from a URL.

    An `AsyncLimiter` belongs to the loop that first used it; a server (or a
    test client) may run more than one loop over an app's life.
    """

    def __init__(self, limiter: AsyncLimiter | Limiter | None, url: str | None) -> None:
        self.given = limiter
        self.url = url or default_url()
        self.dialect = limiter.store.dialect if limiter is not None else parse_url(self.url).dialect
        self._owned: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AsyncLimiter] = (
            weakref.WeakKeyDictionary()
        )
        #: The effect functions of each limiter in use, made once.
        self.effects: dict[int, tuple[Any, Any, Any]] = {}
        #: The route classes served, recorded in the database with the runtime policies' read.
        self.routes: tuple[str, ...] = ()
        # The last loop served (weakly, as `_owned` holds it) and its limiter: a server
        # runs one loop, so a request finds its limiter without a lookup in `_owned`.
        self._last: tuple[weakref.ref[asyncio.AbstractEventLoop], AsyncLimiter] | None = None

    def get(self) -> AsyncLimiter | Limiter:
        if self.given is not None:
            return self.given
        loop = asyncio.get_running_loop()
        last = self._last
        if last is not None and last[0]() is loop:
            return last[1]
        limiter = self._owned.get(loop)
        if limiter is None:
            # Group commit: the hits of concurrent requests share one statement
            # (counts stay exact), far fewer round trips under load.
            limiter = self._owned[loop] = connect_async(
                self.url, **own_limiter_settings(self.dialect)
            )
        self._last = (weakref.ref(loop), limiter)
        return limiter

    def clock(self) -> Callable[[], float] | None:
        return self.given.options.app_clock if self.given is not None else None

    def effects_of(self, limiter: AsyncLimiter | Limiter) -> tuple[Any, Any]:
        """`limiter`'s ``hit`` and ``load`` for `drive_sync` or `drive_async`, made once per limiter."""
        effects = self.effects.get(id(limiter))
        if effects is None or effects[0] is not limiter:
            made = (
                sync_effects(limiter, self.routes)
                if isinstance(limiter, Limiter)
                else async_effects(limiter, self.routes)
            )
            if len(self.effects) >= 64:  # limiters of loops (or settings) long gone
                self.effects.clear()
            effects = self.effects[id(limiter)] = (limiter, *made)
        return effects[1], effects[2]

    async def check_schema(self) -> None:
        """Read the store's schema version: `SchemaError` when quota's tables are missing or old.

        Any other failure (the database not reachable yet) is logged and left
        to the request path, where it is an outage like any other.
        """
        if self.dialect in SCHEMALESS:
            return
        limiter = self.get()
        try:
            if isinstance(limiter, Limiter):
                limiter.run(_schema_version(), strict=True)
            else:
                await limiter.run(_schema_version(), strict=True)
        except SchemaError:
            raise
        except Exception as exc:
            log.warning(
                "quota: could not read the schema version at startup (%s: %s); serving anyway",
                type(exc).__name__, exc,
            )  # fmt: skip

    async def aclose(self) -> None:
        """Close the limiters opened here (never the one given)."""
        loop = asyncio.get_running_loop()
        if self._last is not None and self._last[0]() is loop:
            self._last = None
        limiter = self._owned.pop(loop, None)
        if limiter is not None:
            await limiter.aclose()


def _schema_version() -> Op[Rows]:
    rows: Rows = yield SCHEMA_VERSION, ()
    return rows


async def decide(guard: Guard, limiters: Limiters, request: RequestInfo) -> Verdict:
    """Run the core's flow for `request` on the right limiter."""
    limiter = limiters.get()
    hit, load = limiters.effects_of(limiter)
    if isinstance(limiter, Limiter):
        # A sync limiter runs inline on the loop: for SQLite a decision is a
        # few tens of microseconds, less than a hop to a worker thread.
        return drive_sync(guard.flow(request), hit, load)
    return await drive_async(guard.flow(request), hit, load)


def find_cors(app: Any) -> CorsOrigins | None:
    """The origins of a CORS middleware inside `app`'s chain of ``.app`` wrappers (Starlette's)."""
    for _ in range(32):
        if app is None:
            return None
        if callable(getattr(app, "is_allowed_origin", None)) and hasattr(app, "allow_all_origins"):
            return CorsOrigins.of(app)
        app = getattr(app, "app", None)
    return None


def _pairs(response: HttpResponse) -> list[tuple[bytes, bytes]]:
    return [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in response.headers]


async def send_response(send: Send, response: HttpResponse) -> None:
    await send({"type": "http.response.start", "status": response.status,
                "headers": _pairs(response)})  # fmt: skip
    await send({"type": "http.response.body", "body": response.body})


def add_headers(headers: list[tuple[bytes, bytes]], verdict: Verdict) -> list[tuple[bytes, bytes]]:
    """The app's response headers with the verdict's added (merging CORS exposure)."""
    out = list(headers)
    for name, value in verdict.headers:
        raw = _NAMES.get(name)
        if raw is None:
            raw = _NAMES[name] = name.lower().encode("latin-1")
        out.append((raw, value.encode("latin-1")))
    if verdict.expose:
        existing = [v.decode("latin-1") for k, v in out if k.lower() == _EXPOSE]
        out = [(k, v) for k, v in out if k.lower() != _EXPOSE]
        out.append(
            (_EXPOSE, expose(verdict.headers, ", ".join(existing) or None).encode("latin-1"))
        )
    return out


class QuotaMiddleware:
    """Rate-limit every HTTP request an ASGI app receives; see `quota.http.HttpConfig`.

    `limiter` is an `AsyncLimiter` (or a sync `Limiter`, run inline on the
    loop); without one, the middleware opens an async limiter with group
    commit (``batching=True``) on `url` (default ``$QUOTA_DATABASE_URL``,
    else the embedded SQLite file), on PostgreSQL with a fallback
    (``Fallback(timeout=0.25)``). Pass your own built with
    ``quota.connect_async(url, batching=True)`` to share it or set options. `config`
    defaults to `HttpConfig.from_env` with a default class of 60/minute.
    Hooks: `identify` (the app's own tier), `token_validator`,
    `response_factory`, `plans` (tenant plan cache), `pressure` (adaptive
    capacity source), `clock`, `observer` (metrics events), `on_abuse`
    (``on_abuse(key, count)`` once per key per ``abuse_interval`` when one key
    draws over ``abuse_threshold`` 429s within ``abuse_window``; the key is
    the hashed key counted). Raises `ConfigurationError` at construction for
    bad settings.

    CORS works in either order: preflights (``OPTIONS`` with ``Origin`` and
    ``Access-Control-Request-Method``) pass through uncounted, and a 429/503
    quota answers itself carries ``Access-Control-Allow-Origin`` for the
    origins in `cors_origins` (``"*"`` or a list). With the default None the
    middleware follows a CORS middleware it wraps (Starlette's
    ``CORSMiddleware`` added *before* quota), else adds no grant; ``()`` never
    grants.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        limiter: AsyncLimiter | Limiter | None = None,
        url: str | None = None,
        config: HttpConfig | None = None,
        cors_origins: str | Sequence[str] | None = None,
        **hooks: Unpack[GuardOptions],
    ) -> None:
        self.app = app
        self.cors = find_cors(app) if cors_origins is None else CorsOrigins.of(cors_origins)
        self.limiters = Limiters(limiter, url)
        self.guard = build_guard(
            config,
            hooks,
            dialect=self.limiters.dialect,
            app_clock=self.limiters.clock(),
            where="QuotaMiddleware",
        )
        self.limiters.routes = self.guard.route_names
        self.metrics = self.guard.metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "lifespan":
            await self._lifespan(scope, receive, send)
            return
        if kind != "http" or not self.guard.config.enabled:
            await self.app(scope, receive, send)
            return
        request = asgi_request(scope)
        if is_preflight(request.method, request.headers):
            # The CORS middleware (or the app) answers it; a browser's own check costs nothing.
            await self.app(scope, receive, send)
            return
        verdict = await decide(self.guard, self.limiters, request)
        response = verdict.response
        if response is not None:
            await send_response(send, self.guard.answer(response, request, self.cors))
            return
        if not verdict.headers:
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = dict(message)
                message["headers"] = add_headers(message.get("headers") or [], verdict)
            await send(message)

        await self.app(scope, receive, send_with_headers)

    async def _lifespan(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Pass the lifespan through; check the schema when the app says its startup is done.

        A `SchemaError` is raised out of the app's ``send`` of
        ``lifespan.startup.complete``: a framework reports it as
        ``lifespan.startup.failed`` (with the message) and the server exits;
        for an app that does not, the middleware sends that message itself.
        """
        reported = False

        async def checking_send(message: Message) -> None:
            nonlocal reported
            kind = message.get("type")
            if kind == "lifespan.startup.complete" and self.guard.config.enabled:
                await self.limiters.check_schema()
            elif kind == "lifespan.startup.failed":
                reported = True
            await send(message)

        try:
            await self.app(scope, self._closing_receive(receive), checking_send)
        except SchemaError as exc:
            if not reported:
                await send({"type": "lifespan.startup.failed", "message": str(exc)})
            raise

    def _closing_receive(self, receive: Receive) -> Receive:
        async def wrapped() -> Message:
            message = await receive()
            if message.get("type") == "lifespan.shutdown":
                await self.limiters.aclose()
            return message

        return wrapped


__all__ = ["QuotaMiddleware", "asgi_request"]
