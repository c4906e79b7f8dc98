"""One process of the outbound rate-limiting test: a client sending GETs through quota's transport.

``python -m tests.contrib._outbound_workers KIND STORE_URL SERVER_URL START_AT STOP_AT WORKER_ID``

KIND is ``httpx`` (``httpx.Client`` over `RateLimitedTransport`), ``httpx-async``
(``httpx.AsyncClient`` over `AsyncRateLimitedTransport`), ``requests`` (a
``requests.Session`` with `RateLimitedAdapter` mounted on ``http://``) or ``aiohttp``
(an ``aiohttp.ClientSession`` with `rate_limit_middleware`), each limited to
`RATE` in the store at STORE_URL (one connection to PostgreSQL). The worker sends one
warm-up GET (it opens the store's connection and the HTTP connection), waits until
START_AT (epoch seconds), then sends GETs one after the other until STOP_AT, each to
its own path (``/w{WORKER_ID}/n{seq}``, the warm-up is ``n0``) with the header
``X-Worker: WORKER_ID``. START_AT and STOP_AT may both be ``-``: the worker then prints
``ready`` after its warm-up and reads ``START STOP`` from a line of stdin.

It prints one JSON line (the worker, its kind, the GETs sent, the warm-up included) and
exits 0; an exception, or an answer other than 200, is printed and exits 1.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import traceback
from collections.abc import Awaitable, Callable
from typing import Any

import quota

RATE = "10/second"
KINDS = ("httpx", "httpx-async", "requests", "aiohttp")


def _settings(url: str) -> dict[str, Any]:
    """One connection to PostgreSQL: 24 processes stay far below the server's cap."""
    return {"pool_size": 1} if url.startswith(("postgresql", "postgres:")) else {}


def _when(start_at: str, stop_at: str) -> Callable[[], tuple[float, float]]:
    def when() -> tuple[float, float]:
        if start_at == "-":
            print("ready", flush=True)
            start, stop = (float(x) for x in sys.stdin.readline().split())
            return start, stop
        return float(start_at), float(stop_at)

    return when


def _check(response: Any, path: str) -> None:
    status = getattr(response, "status_code", None)
    if status != 200:
        raise RuntimeError(f"GET {path} answered {status}")


def _send_sync(
    get: Callable[[str, dict[str, str]], Any], server: str, worker: str,
    when: Callable[[], tuple[float, float]],
) -> int:  # fmt: skip
    headers = {"X-Worker": worker}
    sent = 0

    def send() -> None:
        nonlocal sent
        path = f"/w{worker}/n{sent}"
        sent += 1
        _check(get(server + path, headers), path)

    send()  # warm-up
    start, stop = when()
    time.sleep(max(0.0, start - time.time()))
    while time.time() < stop:
        send()
    return sent


def run_httpx(url: str, server: str, worker: str, when: Callable[[], tuple[float, float]]) -> int:
    import httpx

    from quota.contrib.httpx import RateLimitedTransport

    limiter = quota.connect(url, **_settings(url))
    try:
        transport = RateLimitedTransport(limiter, RATE)
        with httpx.Client(transport=transport) as client:
            return _send_sync(lambda u, h: client.get(u, headers=h), server, worker, when)
    finally:
        limiter.close()


def run_requests(
    url: str, server: str, worker: str, when: Callable[[], tuple[float, float]]
) -> int:
    import requests

    from quota.contrib.requests import RateLimitedAdapter

    limiter = quota.connect(url, **_settings(url))
    try:
        with requests.Session() as session:
            session.mount("http://", RateLimitedAdapter(limiter, RATE))
            return _send_sync(
                lambda u, h: session.get(u, headers=h, timeout=60), server, worker, when
            )
    finally:
        limiter.close()


async def _send_async(
    get: Callable[[str, dict[str, str]], Awaitable[int]], server: str, worker: str,
    when: Callable[[], tuple[float, float]],
) -> int:  # fmt: skip
    headers = {"X-Worker": worker}
    sent = 0

    async def send() -> None:
        nonlocal sent
        path = f"/w{worker}/n{sent}"
        sent += 1
        status = await get(server + path, headers)
        if status != 200:
            raise RuntimeError(f"GET {path} answered {status}")

    await send()  # warm-up
    start, stop = when()  # blocks the loop, on purpose: nothing else runs yet
    await asyncio.sleep(max(0.0, start - time.time()))
    while time.time() < stop:
        await send()
    return sent


async def run_httpx_async(
    url: str, server: str, worker: str, when: Callable[[], tuple[float, float]]
) -> int:
    import httpx

    from quota.contrib.httpx import AsyncRateLimitedTransport

    async with quota.connect_async(url, **_settings(url)) as limiter:
        transport = AsyncRateLimitedTransport(limiter, RATE)
        async with httpx.AsyncClient(transport=transport) as client:

            async def get(u: str, h: dict[str, str]) -> int:
                return (await client.get(u, headers=h)).status_code

            return await _send_async(get, server, worker, when)


async def run_aiohttp(
    url: str, server: str, worker: str, when: Callable[[], tuple[float, float]]
) -> int:
    import aiohttp

    from quota.contrib.aiohttp import rate_limit_middleware

    async with quota.connect_async(url, **_settings(url)) as limiter:
        middleware = rate_limit_middleware(limiter, RATE)
        async with aiohttp.ClientSession(middlewares=[middleware]) as session:

            async def get(u: str, h: dict[str, str]) -> int:
                async with session.get(u, headers=h) as response:
                    await response.read()
                    return response.status

            return await _send_async(get, server, worker, when)


def main(argv: list[str]) -> int:
    if len(argv) != 6 or argv[0] not in KINDS:
        print(__doc__, file=sys.stderr)
        return 2
    kind, url, server, start_at, stop_at, worker = argv
    when = _when(start_at, stop_at)
    server = server.rstrip("/")
    try:
        if kind == "httpx":
            sent = run_httpx(url, server, worker, when)
        elif kind == "requests":
            sent = run_requests(url, server, worker, when)
        elif kind == "aiohttp":
            sent = asyncio.run(run_aiohttp(url, server, worker, when))
        else:
            sent = asyncio.run(run_httpx_async(url, server, worker, when))
    except BaseException:
        traceback.print_exc()
        return 1
    print(json.dumps({"worker": worker, "kind": kind, "sent": sent}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
