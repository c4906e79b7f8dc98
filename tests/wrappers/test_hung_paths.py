"""A network path that stops forwarding, its sockets still open: calls with a fallback
return within twice their budget (plus scheduling), on both faces, fresh or warm.

The faults are made by a TCP proxy of the test's own between the limiter and the shared
PostgreSQL, never by touching the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import selectors
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest

import quota
from quota import Fallback

pytestmark = pytest.mark.postgres

BUDGET = 0.1
#: Twice the budget (the store's own timeout, then the hung-path cut), plus what a busy
#: 2-core machine adds in scheduling.
BOUND = 2 * BUDGET + 0.4


class Proxy:
    """Forwards 127.0.0.1:port to the PostgreSQL server until `freeze`: from then on it
    keeps every socket open and forwards nothing (a path that hangs). `hold_answers` holds
    the server's answers back (requests still pass); `release_then_freeze` forwards the
    answers held, then freezes."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.frozen = threading.Event()
        self.holding = threading.Event()
        self._release = threading.Event()
        self._stop = threading.Event()
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._server.getsockname()[1])
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        selector = selectors.DefaultSelector()
        self._server.setblocking(False)
        selector.register(self._server, selectors.EVENT_READ)
        peers: dict[socket.socket, socket.socket] = {}
        upstreams: set[socket.socket] = set()
        while not self._stop.is_set():
            if self._release.is_set():
                for upstream in upstreams:
                    with contextlib.suppress(OSError):
                        while data := upstream.recv(65536):  # until BlockingIOError
                            peers[upstream].sendall(data)
                self.frozen.set()
                self.holding.clear()
                self._release.clear()
            for key, _ in selector.select(0.02):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                if sock is self._server:
                    client, _ = self._server.accept()
                    upstream = socket.create_connection(self.target)
                    self._pairs.append((client, upstream))
                    peers[client], peers[upstream] = upstream, client
                    upstreams.add(upstream)
                    for end in (client, upstream):
                        end.setblocking(False)
                        selector.register(end, selectors.EVENT_READ)
                    continue
                if self.frozen.is_set() or (self.holding.is_set() and sock in upstreams):
                    continue  # read nothing, forward nothing: the data waits in the kernel
                with contextlib.suppress(OSError):
                    data = sock.recv(65536)
                    if data:
                        peers[sock].sendall(data)
                    else:
                        selector.unregister(sock)
            if self.frozen.is_set() or self.holding.is_set():
                time.sleep(0.01)  # level-triggered: don't spin on unread data
        selector.close()

    def freeze(self) -> None:
        self.frozen.set()

    def hold_answers(self) -> None:
        self.holding.set()

    def release_then_freeze(self) -> None:
        self._release.set()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for client, upstream in self._pairs:
            client.close()
            upstream.close()
        self._server.close()


@contextlib.contextmanager
def proxied(pg_url: str) -> Iterator[tuple[Proxy, str]]:
    parts = urlsplit(pg_url)
    proxy = Proxy((parts.hostname or "127.0.0.1", parts.port or 5432))
    try:
        netloc = f"{parts.username}@127.0.0.1:{proxy.port}"
        yield proxy, parts._replace(netloc=netloc).geturl()
    finally:
        proxy.close()


def test_async_calls_on_a_path_that_hangs_return_within_the_budget(pg_url: str) -> None:
    key = f"hang-{uuid.uuid4().hex}"

    async def main(proxy: Proxy, url: str) -> list[float]:
        fallback = Fallback(timeout=BUDGET, probe_interval=0.2)
        async with quota.connect_async(url, fallback=fallback, pool_size=4) as limiter:
            for _ in range(20):  # warm: the pool open and deciding through the proxy
                await limiter.rate_limit(key, 10**6, 3600)
            assert limiter.store.up  # type: ignore[attr-defined]
            proxy.freeze()

            async def timed() -> float:
                started = time.monotonic()
                decision = await limiter.rate_limit(key, 10**6, 3600)
                assert decision.allowed
                return time.monotonic() - started

            # Ten at once (more than the pool), then ten more one after another.
            times = list(await asyncio.gather(*(timed() for _ in range(10))))
            times += [await timed() for _ in range(10)]
            assert not limiter.store.up  # type: ignore[attr-defined]
            return times

    with proxied(pg_url) as (proxy, url):
        times = asyncio.run(asyncio.wait_for(main(proxy, url), 30))
    assert max(times) < BOUND, times


def test_sync_threads_on_a_path_that_hangs_return_within_the_budget(pg_url: str) -> None:
    key = f"hang-{uuid.uuid4().hex}"
    with proxied(pg_url) as (proxy, url):
        fallback = Fallback(timeout=BUDGET, probe_interval=0.2)
        limiter = quota.connect(url, fallback=fallback, pool_size=4)
        try:
            for _ in range(20):
                limiter.rate_limit(key, 10**6, 3600)
            assert limiter.store.up  # type: ignore[attr-defined]
            proxy.freeze()
            times: list[float] = []

            def call() -> None:
                started = time.monotonic()
                assert limiter.rate_limit(key, 10**6, 3600).allowed
                times.append(time.monotonic() - started)

            threads = [threading.Thread(target=call) for _ in range(16)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(30)
            assert len(times) == 16
            assert max(times) < BOUND, times
            assert not limiter.store.up  # type: ignore[attr-defined]
        finally:
            limiter.close()


def test_sync_batching_threads_on_a_path_that_hangs_return_within_the_budget(
    pg_url: str,
) -> None:
    """Threads queued behind the batch in flight give up with it, instead of sending their
    own batch down the same path (main: about four budgets)."""
    budget = 0.6  # long enough for the extra budgets to stand out from the scheduling noise
    key = f"hang-{uuid.uuid4().hex}"
    with proxied(pg_url) as (proxy, url):
        fallback = Fallback(timeout=budget, probe_interval=5)
        limiter = quota.connect(url, fallback=fallback, pool_size=4, batching=True)
        try:
            for _ in range(20):
                limiter.rate_limit(key, 10**6, 3600)
            assert limiter.store.up  # type: ignore[attr-defined]
            proxy.freeze()
            times: list[float] = []
            start = threading.Barrier(16)

            def call() -> None:
                start.wait(10)
                started = time.monotonic()
                assert limiter.rate_limit(key, 10**6, 3600).allowed
                times.append(time.monotonic() - started)

            threads = [threading.Thread(target=call) for _ in range(16)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(30)
            assert len(times) == 16
            assert max(times) < 2 * budget + 0.4, sorted(times)
            assert not limiter.store.up  # type: ignore[attr-defined]
        finally:
            limiter.close()


@pytest.mark.parametrize("face", ["sync", "async"])
def test_batching_calls_queued_behind_a_slow_answer_keep_their_own_budget(
    pg_url: str, face: str
) -> None:
    """The statement in flight answers just under one budget, then the path hangs: the
    calls queued meanwhile are decided within twice the budget of their own call, not after
    the statement in flight and then two budgets more for their own batch (main, sync:
    about three budgets)."""
    budget = 0.8  # long enough for a third budget to stand out from the scheduling noise
    # The sync face cuts a hung connection on a watchdog tick (a quarter budget late at
    # most); the rest is what a busy 2-core machine adds.
    bound = 2 * budget + budget / 4 + 0.3
    key = f"hang-{uuid.uuid4().hex}"
    fallback = Fallback(timeout=budget, probe_interval=5)
    calls = 9  # the first goes out alone; two waves of four queue behind it

    def timed_sync(limiter: quota.Limiter, times: list[float]) -> None:
        started = time.monotonic()
        assert limiter.rate_limit(key, 10**6, 3600).allowed
        times.append(time.monotonic() - started)

    def run_sync(proxy: Proxy, url: str) -> tuple[list[float], bool]:
        limiter = quota.connect(url, fallback=fallback, pool_size=4, batching=True)
        try:
            for _ in range(20):
                limiter.rate_limit(key, 10**6, 3600)
            assert limiter.store.up  # type: ignore[attr-defined]
            proxy.hold_answers()
            times: list[float] = []
            threads = [threading.Thread(target=timed_sync, args=(limiter, times))]
            first = time.monotonic()
            threads[0].start()
            for _ in range(2):
                time.sleep(0.05)
                wave = [
                    threading.Thread(target=timed_sync, args=(limiter, times)) for _ in range(4)
                ]
                for thread in wave:
                    thread.start()
                threads += wave
            time.sleep(max(0.0, first + 0.95 * budget - time.monotonic()))
            proxy.release_then_freeze()
            for thread in threads:
                thread.join(30)
            return times, limiter.store.up  # type: ignore[attr-defined]
        finally:
            limiter.close()

    async def run_async(proxy: Proxy, url: str) -> tuple[list[float], bool]:
        async with quota.connect_async(
            url, fallback=fallback, pool_size=4, batching=True
        ) as limiter:
            for _ in range(20):
                await limiter.rate_limit(key, 10**6, 3600)
            assert limiter.store.up  # type: ignore[attr-defined]
            proxy.hold_answers()

            async def timed() -> float:
                started = time.monotonic()
                assert (await limiter.rate_limit(key, 10**6, 3600)).allowed
                return time.monotonic() - started

            tasks = [asyncio.create_task(timed())]
            first = time.monotonic()
            for _ in range(2):
                await asyncio.sleep(0.05)
                tasks += [asyncio.create_task(timed()) for _ in range(4)]
            await asyncio.sleep(max(0.0, first + 0.95 * budget - time.monotonic()))
            proxy.release_then_freeze()
            times = list(await asyncio.gather(*tasks))
            up = limiter.store.up  # type: ignore[attr-defined]
            # The hung batch is still in flight and `aclose` waits for it: end the path.
            proxy.close()
            return times, up

    with proxied(pg_url) as (proxy, url):
        if face == "sync":
            times, up = run_sync(proxy, url)
        else:
            times, up = asyncio.run(asyncio.wait_for(run_async(proxy, url), 30))
    assert len(times) == calls, times
    assert max(times) < bound, sorted(times)
    assert not up  # the hung batch marked the store down


def _silent_port() -> tuple[socket.socket, int]:
    server = socket.create_server(("127.0.0.1", 0), backlog=64)  # accepts (backlog), says nothing
    return server, int(server.getsockname()[1])


def test_a_fresh_sync_limiter_on_a_listener_that_never_answers() -> None:
    server, port = _silent_port()
    try:
        url = f"postgresql://root@127.0.0.1:{port}/x"
        with quota.connect(url, fallback=Fallback(timeout=BUDGET, probe_interval=5)) as limiter:
            times = []
            for _ in range(3):
                started = time.monotonic()
                assert limiter.rate_limit("fresh", 10, 60).allowed
                times.append(time.monotonic() - started)
    finally:
        server.close()
    assert max(times) < BUDGET + 0.4, times  # main: 10 s each (the connect timeout)


def test_a_fresh_async_fail_closed_call_on_a_listener_that_never_answers() -> None:
    server, port = _silent_port()

    async def main() -> tuple[float, quota.Decision]:
        url = f"postgresql://root@127.0.0.1:{port}/x"
        fallback = Fallback(timeout=BUDGET, probe_interval=5)
        async with quota.connect_async(url, fallback=fallback) as limiter:
            started = time.monotonic()
            decision = await limiter.rate_limit("fresh", 10, 60, fail_closed=True)
            return time.monotonic() - started, decision

    try:
        took, decision = asyncio.run(asyncio.wait_for(main(), 30))
    finally:
        server.close()
    assert not decision.allowed  # fail closed: denied while the store cannot answer
    assert took < BUDGET + 0.4, took  # main: 10 s


@pytest.mark.parametrize("framework", ["flask", "starlette"])
def test_http_policy_reads_hold_the_budget_on_a_path_that_hangs(
    pg_url: str, framework: str
) -> None:
    """The middleware's read of the runtime policies goes through the fallback's budget too
    (main: every limited request took 10-40 s on an unresponsive database)."""
    from quota.http import HttpConfig, RoutePolicy
    from tests._http_support import make_client
    from tests._support import Clock

    clock = Clock()
    config = HttpConfig(
        policies=[RoutePolicy(name="api", paths=["/api"], rates="1000/minute")],
        hash_secret="s" * 32,
        runtime_policies=True,
        policy_cache_seconds=1,
    )
    with proxied(pg_url) as (proxy, url):
        fallback = Fallback(timeout=BUDGET, probe_interval=0.2)
        connect = quota.connect_async if framework == "starlette" else quota.connect
        limiter = connect(url, clock=clock, fallback=fallback, pool_size=2)
        client = make_client(framework, url, clock, config, limiter=limiter)
        try:
            for _ in range(3):
                assert client.get("/api/items").status == 200  # warm, policies read
            proxy.freeze()
            times = []
            for _ in range(6):
                clock.advance(2)  # the cached policies are stale: each request reads again
                started = time.monotonic()
                assert client.get("/api/items").status == 200
                times.append(time.monotonic() - started)
        finally:
            client.close()
    assert max(times) < BOUND, times


#: Route classes of the middleware tests below: a fail-closed one (asked first, while the
#: first connection is still being made), a fail-open class with one rate (the limiter's
#: hot path) and one with two rates (``hit``).
_CLASSES = (("closed", "/closed", "100/minute", False), ("open", "/open", "100/minute", True),
            ("multi", "/multi", "100/minute;1000/hour", True))  # fmt: skip


def _own_limiter_config(runtime_policies: bool) -> Any:
    from quota.http import HttpConfig, RoutePolicy

    return HttpConfig(
        runtime_policies=runtime_policies,
        policies=[
            RoutePolicy(name=name, paths=[path], rates=rates, fail_open=fail_open)
            for name, path, rates, fail_open in _CLASSES
        ],
        hash_secret="s" * 32,
    )


def _asgi_times(url: str, runtime_policies: bool) -> list[tuple[str, int, float]]:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    from quota.http.asgi import QuotaMiddleware

    async def ok(_request: Request) -> PlainTextResponse:
        return PlainTextResponse("ok")

    routes = [Route(path, ok) for _, path, _, _ in _CLASSES]
    app = Starlette(routes=routes)
    app.add_middleware(QuotaMiddleware, url=url, config=_own_limiter_config(runtime_policies))

    async def run() -> list[tuple[str, int, float]]:
        import httpx

        times = []
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            for _ in range(2):
                for _, path, _, _ in _CLASSES:
                    started = time.monotonic()
                    status = (await client.get(path)).status_code
                    times.append((path, status, time.monotonic() - started))
        return times

    return asyncio.run(asyncio.wait_for(run(), 30))


def _wsgi_times(url: str, runtime_policies: bool) -> list[tuple[str, int, float]]:
    from flask import Flask

    from quota.http.wsgi import QuotaWSGIMiddleware

    app = Flask(__name__)
    for name, path, _, _ in _CLASSES:
        app.add_url_rule(path, name, lambda: "ok")
    config = _own_limiter_config(runtime_policies)
    middleware = QuotaWSGIMiddleware(app.wsgi_app, url=url, config=config)
    app.wsgi_app = middleware  # type: ignore[method-assign]
    client = app.test_client()
    times = []
    try:
        for _ in range(2):
            for _, path, _, _ in _CLASSES:
                started = time.monotonic()
                status = client.get(path).status_code
                times.append((path, status, time.monotonic() - started))
    finally:
        middleware.limiter.close()
    return times


@pytest.mark.parametrize("runtime_policies", [True, False], ids=["policies", "no-policies"])
@pytest.mark.parametrize("drive", [_asgi_times, _wsgi_times], ids=["asgi", "wsgi"])
def test_a_middleware_of_its_own_on_a_listener_that_never_answers(
    drive: Any, runtime_policies: bool
) -> None:
    """The middleware's own limiter answers every request at once, not only the first
    (main: 20 s a request, every request, on both faces)."""
    server, port = _silent_port()
    try:
        times = drive(f"postgresql://root@127.0.0.1:{port}/x", runtime_policies)
    finally:
        server.close()
    assert len(times) == 6
    assert max(took for _, _, took in times) < 1.0, times
    # The first request finds the store down; the others do not wait for it again.
    assert sum(took for _, _, took in times) < 1.5, times
    for path, status, _ in times:
        # The store cannot decide: fail-open classes pass, the fail-closed one is refused.
        assert status == (503 if path == "/closed" else 200), times


def test_a_sync_call_without_a_fallback_waits_its_timeout_once() -> None:
    """Without a fallback the call raises after `timeout`, not once per connection attempt
    (main: 2 s for a 1 s timeout, libpq trying with and without TLS)."""
    server, port = _silent_port()
    try:
        with quota.connect(f"postgresql://root@127.0.0.1:{port}/x", timeout=1) as limiter:
            started = time.monotonic()
            with pytest.raises(quota.StorageError):
                limiter.rate_limit("plain", 10, 60)
            took = time.monotonic() - started
    finally:
        server.close()
    assert took < 1.5, took


def _unaccepted_port() -> tuple[list[socket.socket], int]:
    """A listener whose accept queue is full: a TCP connect to it never completes."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(0)
    port = int(server.getsockname()[1])
    held = [server]
    for _ in range(4):
        filler = socket.socket()
        filler.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            filler.connect(("127.0.0.1", port))
        held.append(filler)
    return held, port


@pytest.mark.parametrize("face", ["sync", "async"])
@pytest.mark.parametrize("listener", ["tcp-connect", "startup"])
def test_later_calls_do_not_wait_again_for_a_connection_that_hangs(
    face: str, listener: str
) -> None:
    """Whichever step of the connect hangs, the first calls wait for it at most twice the
    budget in all, and later ones go straight to memory, or are refused when fail-closed
    (main, async: every call waited one more budget until the connect timeout, 10 s)."""
    budget = 0.25
    if listener == "startup":
        server, port = _silent_port()
        held = [server]
    else:
        held, port = _unaccepted_port()
    url = f"postgresql://root@127.0.0.1:{port}/x"
    fallback = Fallback(timeout=budget, probe_interval=5)
    calls = [False, True, False, True, False, True]  # fail_closed of each call

    async def run_async() -> list[tuple[bool, float]]:
        async with quota.connect_async(url, fallback=fallback) as limiter:
            out = []
            for fail_closed in calls:
                started = time.monotonic()
                decision = await limiter.rate_limit("c", 10, 60, fail_closed=fail_closed)
                out.append((decision.allowed, time.monotonic() - started))
            return out

    try:
        if face == "async":
            results = asyncio.run(asyncio.wait_for(run_async(), 60))
        else:
            with quota.connect(url, fallback=fallback) as limiter:
                results = []
                for fail_closed in calls:
                    started = time.monotonic()
                    decision = limiter.rate_limit("c", 10, 60, fail_closed=fail_closed)
                    results.append((decision.allowed, time.monotonic() - started))
    finally:
        for sock in held:
            sock.close()
    assert [allowed for allowed, _ in results] == [not closed for closed in calls], results
    times = [took for _, took in results]
    assert max(times) < budget + 0.4, times
    assert sum(times) < 2 * budget + 0.6, times
