"""A requests adapter that keeps every process calling an API under one limit.

``session.mount("https://api.example.com", RateLimitedAdapter(limiter, "10/second"))``
makes each request through that prefix wait for a slot under the rates, counted in
`limiter`'s store (so shared by every process and host using it), and for any pause
of its key; a provider's ``Retry-After`` (429, 503) or a rate-limit header saying
nothing is left pauses the key for all of them. Needs the ``requests`` extra.

See `quota.contrib._outbound` for the flow, and the documentation's "Outbound" page.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlsplit

import requests
from requests.adapters import HTTPAdapter

from quota._core.algorithms import Rate
from quota._limiter.sync_face import Limiter
from quota.contrib._outbound import Outbound, SyncCall

__all__ = ["RateLimitedAdapter", "origin"]

_DEFAULT_PORTS = {"http": 80, "https": 443}


def origin(request: requests.PreparedRequest) -> str:
    """The default key: the request's origin, ``scheme://host:port`` (port always written)."""
    parts = urlsplit(request.url or "")
    scheme = parts.scheme.lower()
    return f"{scheme}://{parts.hostname or ''}:{parts.port or _DEFAULT_PORTS.get(scheme, 0)}"


def _replayable(request: requests.PreparedRequest) -> bool:
    """Whether the body can be sent again: none, bytes or text, not a file or a generator."""
    return request.body is None or isinstance(request.body, (bytes, str))


def _seen(response: requests.Response) -> tuple[int, Mapping[str, str]]:
    return response.status_code, response.headers


class RateLimitedAdapter(HTTPAdapter):
    """A transport adapter: each request waits for its slot under `rates` on `limiter`.

    `limiter` is a `quota.Limiter`; `rates` as for `Limiter.hit`. `key` is a
    string, a callable of the ``requests.PreparedRequest``, or None for the
    request's origin (`origin`). `timeout` covers the whole call (slots, pauses
    and retries; the ``timeout`` of ``session.get`` is still the connection's):
    past it `quota.RateLimitTimeout` is raised, the request unsent. A 429 or 503
    with a ``Retry-After`` pauses the key in the store, capped at `max_pause`
    seconds, and an idempotent request whose body is bytes or text is sent
    again after it, at most `max_retries` times. The other keywords go to
    ``HTTPAdapter`` (``pool_connections``, ``pool_maxsize``, ``pool_block``);
    its own ``max_retries`` (urllib3's, for connection errors) stays at
    requests' default. A bad argument raises `quota.ConfigurationError` naming it.
    """

    def __init__(
        self, limiter: Any, rates: Rate | str | list[Rate], *,
        key: str | Callable[[requests.PreparedRequest], str] | None = None,
        timeout: float = 30.0, max_retries: int = 2, max_pause: float = 3600.0,
        **adapter: Any,
    ) -> None:  # fmt: skip
        self._outbound: Outbound[requests.PreparedRequest] = Outbound(
            limiter, rates, key=key, timeout=timeout, max_retries=max_retries,
            max_pause=max_pause, origin=origin, face=Limiter,
        )  # fmt: skip
        self._call: SyncCall[requests.Response] = SyncCall(self._outbound)
        super().__init__(**adapter)

    def send(  # type: ignore[override,unused-ignore]
        self, request: requests.PreparedRequest, **kwargs: Any
    ) -> requests.Response:
        outbound = self._outbound
        flow = outbound.flow(
            outbound.key_of(request), request.method or "GET", _replayable(request)
        )
        send = super().send
        return self._call.run(flow, lambda: send(request, **kwargs), _seen, requests.Response.close)
