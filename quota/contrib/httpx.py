"""httpx transports that keep every process calling an API under one limit.

``httpx.Client(transport=RateLimitedTransport(limiter, "10/second"))`` makes each
request wait for a slot under the rates, counted in `limiter`'s store (so shared by
every process and host using it), and for any pause of its key; a provider's
``Retry-After`` (429, 503) or a rate-limit header saying nothing is left pauses the
key for all of them. `AsyncRateLimitedTransport` is the same for
``httpx.AsyncClient`` with a `quota.AsyncLimiter`. Needs the ``httpx`` extra.

See `quota.contrib._outbound` for the flow, and the documentation's "Outbound" page.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx

from quota._core.algorithms import Rate
from quota._limiter.async_face import AsyncLimiter
from quota._limiter.sync_face import Limiter
from quota.contrib._outbound import AsyncCall, Outbound, SyncCall

__all__ = ["AsyncRateLimitedTransport", "RateLimitedTransport", "origin"]

_DEFAULT_PORTS = {"http": 80, "https": 443}


def origin(request: httpx.Request) -> str:
    """The default key: the request's origin, ``scheme://host:port`` (port always written)."""
    url = request.url
    port = url.port or _DEFAULT_PORTS.get(url.scheme, 0)
    return f"{url.scheme}://{url.host}:{port}"


def _replayable(request: httpx.Request) -> bool:
    """Whether the body can be sent again: bytes in memory, not a stream read once."""
    return isinstance(request.stream, httpx.ByteStream)


def _seen(response: httpx.Response) -> tuple[int, httpx.Headers]:
    return response.status_code, response.headers


class RateLimitedTransport(httpx.BaseTransport):
    """An ``httpx.Client`` transport: each request waits for its slot under `rates` on `limiter`.

    `limiter` is a `quota.Limiter`; `rates` as for `Limiter.hit`
    (``"10/second;500/minute"``). `key` is a string, a callable of the
    ``httpx.Request``, or None for the request's origin (`origin`). `timeout`
    covers the whole call (slots, pauses and retries): past it
    `quota.RateLimitTimeout` is raised, the request unsent, its ``decision``
    saying how long is left to wait. `transport` is the transport that sends
    (default: ``httpx.HTTPTransport()``). A 429 or 503 with a ``Retry-After``
    pauses the key in the store, capped at `max_pause` seconds, and an
    idempotent request (GET, HEAD, OPTIONS, PUT, DELETE) whose body is in memory
    is sent again after it, at most `max_retries` times; otherwise that response
    is returned. A bad argument raises `quota.ConfigurationError` naming it.
    """

    def __init__(
        self, limiter: Any, rates: Rate | str | list[Rate], *,
        key: str | Callable[[httpx.Request], str] | None = None, timeout: float = 30.0,
        transport: httpx.BaseTransport | None = None, max_retries: int = 2,
        max_pause: float = 3600.0,
    ) -> None:  # fmt: skip
        self._outbound: Outbound[httpx.Request] = Outbound(
            limiter, rates, key=key, timeout=timeout, max_retries=max_retries,
            max_pause=max_pause, origin=origin, face=Limiter,
        )  # fmt: skip
        self._call: SyncCall[httpx.Response] = SyncCall(self._outbound)
        self._transport = transport if transport is not None else httpx.HTTPTransport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        outbound = self._outbound
        flow = outbound.flow(outbound.key_of(request), request.method, _replayable(request))
        return self._call.run(
            flow, lambda: self._transport.handle_request(request), _seen, httpx.Response.close
        )

    def close(self) -> None:
        self._transport.close()


async def _discard(response: httpx.Response) -> None:
    await response.aclose()


class AsyncRateLimitedTransport(httpx.AsyncBaseTransport):
    """`RateLimitedTransport` for ``httpx.AsyncClient``, with a `quota.AsyncLimiter`
    (`transport` default: ``httpx.AsyncHTTPTransport()``)."""

    def __init__(
        self, limiter: Any, rates: Rate | str | list[Rate], *,
        key: str | Callable[[httpx.Request], str] | None = None, timeout: float = 30.0,
        transport: httpx.AsyncBaseTransport | None = None, max_retries: int = 2,
        max_pause: float = 3600.0,
    ) -> None:  # fmt: skip
        self._outbound: Outbound[httpx.Request] = Outbound(
            limiter, rates, key=key, timeout=timeout, max_retries=max_retries,
            max_pause=max_pause, origin=origin, face=AsyncLimiter,
        )  # fmt: skip
        self._call: AsyncCall[httpx.Response] = AsyncCall(self._outbound)
        self._transport = transport if transport is not None else httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        outbound = self._outbound
        flow = outbound.flow(outbound.key_of(request), request.method, _replayable(request))
        return await self._call.run(
            flow, lambda: self._transport.handle_async_request(request), _seen, _discard
        )

    async def aclose(self) -> None:
        await self._transport.aclose()
