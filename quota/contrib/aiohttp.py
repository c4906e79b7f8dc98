"""An aiohttp client middleware that keeps every process calling an API under one limit.

``aiohttp.ClientSession(middlewares=[rate_limit_middleware(limiter, "10/second")])``
(aiohttp 3.12 or later) makes each request wait for a slot under the rates, counted
in `limiter`'s store (so shared by every process and host using it), and for any
pause of its key; a provider's ``Retry-After`` (429, 503) or a rate-limit header
saying nothing is left pauses the key for all of them. Needs the ``aiohttp`` extra.

See `quota.contrib._outbound` for the flow, and the documentation's "Outbound" page.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import ClientHandlerType, ClientRequest, ClientResponse, payload

from quota._core.algorithms import Rate
from quota._limiter.async_face import AsyncLimiter
from quota.contrib._outbound import AsyncCall, Outbound

__all__ = ["origin", "rate_limit_middleware"]

Middleware = Callable[[ClientRequest, ClientHandlerType], Awaitable[ClientResponse]]


def origin(request: ClientRequest) -> str:
    """The default key: the request's origin, ``scheme://host:port`` (port always written)."""
    url = request.url
    return f"{url.scheme}://{url.host}:{url.port}"


def _replayable(request: ClientRequest) -> bool:
    """Whether the body can be sent again: none, or bytes, text or JSON in memory."""
    body = request.body
    return body == b"" or isinstance(body, payload.BytesPayload)


def _seen(response: ClientResponse) -> tuple[int, Any]:
    return response.status, response.headers


async def _discard(response: ClientResponse) -> None:
    response.release()


def rate_limit_middleware(
    limiter: AsyncLimiter, rates: Rate | str | list[Rate], *,
    key: str | Callable[[ClientRequest], str] | None = None, timeout: float = 30.0,
    max_retries: int = 2, max_pause: float = 3600.0,
) -> Middleware:  # fmt: skip
    """A client middleware: each request waits for its slot under `rates` on `limiter`.

    `limiter` is a `quota.AsyncLimiter`; `rates` as for `AsyncLimiter.hit`.
    `key` is a string, a callable of the ``aiohttp.ClientRequest``, or None for
    the request's origin (`origin`). `timeout` covers the whole call (slots,
    pauses and retries): past it `quota.RateLimitTimeout` is raised, the request
    unsent. A 429 or 503 with a ``Retry-After`` pauses the key in the store,
    capped at `max_pause` seconds, and an idempotent request whose body is in
    memory is sent again after it, at most `max_retries` times. A bad argument
    raises `quota.ConfigurationError` naming it.
    """
    outbound: Outbound[ClientRequest] = Outbound(
        limiter, rates, key=key, timeout=timeout, max_retries=max_retries,
        max_pause=max_pause, origin=origin, face=AsyncLimiter,
    )  # fmt: skip
    call: AsyncCall[ClientResponse] = AsyncCall(outbound)

    async def rate_limited(request: ClientRequest, handler: ClientHandlerType) -> ClientResponse:
        flow = outbound.flow(outbound.key_of(request), request.method, _replayable(request))
        return await call.run(flow, lambda: handler(request), _seen, _discard)

    return rate_limited
