"""A FastAPI dependency limiting one route (needs the ``fastapi`` extra).


    from fastapi import Depends, FastAPI
    from quota.http.fastapi import RateLimit, install

    app = FastAPI()
    install(app)                         # 429s as application/problem+json
    search_limit = RateLimit("10/minute", name="search")

    @app.get("/search", dependencies=[Depends(search_limit)])
    async def search(q: str): ...

The dependency runs the same core as the middleware (tiers, HMAC, runtime
overrides, headers); its route class covers exactly the routes it is added
to. Allowed requests get the rate-limit headers on the endpoint's response
(when it returns data, not a `Response` of its own); denied ones raise
`RateLimited`, which `install` renders as the middleware's 429 (without it,
FastAPI's default handler still answers 429 with the headers).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from quota._core.algorithms import Rate
from quota._limiter import AsyncLimiter, Limiter
from quota.http._config import HttpConfig
from quota.http._core import GuardOptions, build_guard
from quota.http._responses import HttpResponse
from quota.http._routes import RoutePolicy
from quota.http.asgi import Limiters, asgi_request, decide

if TYPE_CHECKING:
    from typing_extensions import Unpack


class RateLimited(HTTPException):
    """Raised by `RateLimit` for a denied (or fail-closed) request; carries the full answer."""

    def __init__(self, response: HttpResponse) -> None:
        headers = {
            k: v for k, v in response.headers if k.lower() not in ("content-length", "content-type")
        }
        super().__init__(
            status_code=response.status, detail=response.body.decode(), headers=headers
        )
        self.response = response


async def _render(_request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RateLimited)
    answer = exc.response
    media = dict((k.lower(), v) for k, v in answer.headers).get("content-type")
    headers = {
        k: v for k, v in answer.headers if k.lower() not in ("content-length", "content-type")
    }
    return Response(answer.body, status_code=answer.status, headers=headers, media_type=media)


def install(app: Any) -> None:
    """Render `RateLimited` exactly as the middleware would (problem+json or the factory's answer)."""
    app.add_exception_handler(RateLimited, _render)


class RateLimit:
    """A dependency limiting the routes it is added to: ``Depends(RateLimit("10/minute", name="search"))``.

    `rates`, `name`, `cost`, `algorithm`, `fail_open`, `tier_rates` and
    `mutations_only` define its route class; `config` supplies everything
    else (tiers, HMAC keys, headers; default `HttpConfig.from_env()`); the
    limiter and hooks are as for `quota.http.asgi.QuotaMiddleware`.
    """

    def __init__(
        self,
        rates: str | Rate | Sequence[Rate],
        *,
        name: str,
        cost: int = 1,
        algorithm: str | None = None,
        fail_open: bool = True,
        tier_rates: dict[str, str | Rate | Sequence[Rate]] | None = None,
        mutations_only: bool = False,
        limiter: AsyncLimiter | Limiter | None = None,
        url: str | None = None,
        config: HttpConfig | None = None,
        **hooks: Unpack[GuardOptions],
    ) -> None:
        policy = RoutePolicy(
            name=name, rates=rates, cost=cost, algorithm=algorithm, fail_open=fail_open,
            tier_rates=tier_rates or {}, mutations_only=mutations_only,
        )  # fmt: skip
        base = config if config is not None else HttpConfig.from_env()
        self.limiters = Limiters(limiter, url)
        self.guard = build_guard(
            replace(base, policies=(), default=policy),
            hooks,
            dialect=self.limiters.dialect,
            app_clock=self.limiters.clock(),
            where="RateLimit",
        )
        self.metrics = self.guard.metrics

    async def aclose(self) -> None:
        """Close the limiter this dependency opened itself on this loop (never one it was given).

        Call it from the app's lifespan shutdown when no `limiter` was passed.
        """
        await self.limiters.aclose()

    async def __call__(self, request: Request, response: Response) -> None:
        verdict = await decide(self.guard, self.limiters, asgi_request(request.scope))
        if verdict.response is not None:
            raise RateLimited(verdict.response)
        for name, value in verdict.headers:
            response.headers.append(name, value)
        if verdict.expose:
            from quota.http._responses import expose

            response.headers["Access-Control-Expose-Headers"] = expose(
                verdict.headers, response.headers.get("Access-Control-Expose-Headers")
            )


__all__ = ["RateLimit", "RateLimited", "install"]
