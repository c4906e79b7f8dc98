"""Outbound limits: httpx (sync and async), requests and aiohttp against a local server.

Each client sends through its quota integration to a threaded HTTP server on
127.0.0.1 that answers as a test scripts it and records what arrived. The limiter
runs on an injected clock whose injected sleep advances it, so pauses of seconds
take no time; the cross-process behaviour on the real clock is in
``test_outbound_processes.py``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import aiohttp
import httpx
import pytest
import requests

import quota
from quota.contrib.aiohttp import rate_limit_middleware
from quota.contrib.httpx import AsyncRateLimitedTransport, RateLimitedTransport
from quota.contrib.requests import RateLimitedAdapter
from tests._support import Clock

# -- the server ---------------------------------------------------------------------------


@dataclass
class Answer:
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)


class _Quiet(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client closing its keep-alive connection is no error here


class Server:
    """Answers each path from a script (`answers`, consumed in order, then 200) and records
    every request as (method, path, body)."""

    def __init__(self) -> None:
        self.answers: dict[str, list[Answer]] = {}
        self.seen: list[tuple[str, str, bytes]] = []
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _answer(self) -> None:
                body = self._body()
                with server.lock:
                    server.seen.append((self.command, self.path, body))
                    script = server.answers.get(self.path)
                    answer = script.pop(0) if script else Answer()
                self.send_response(answer.status)
                for name, value in answer.headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() != "chunked":
                    length = int(self.headers.get("Content-Length") or 0)
                    return self.rfile.read(length) if length else b""
                chunks = []
                while size := int(self.rfile.readline().split(b";")[0], 16):
                    chunks.append(self.rfile.read(size))
                    self.rfile.readline()
                self.rfile.readline()  # the blank line after the last chunk
                return b"".join(chunks)

            do_GET = do_POST = do_PUT = do_DELETE = _answer

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.httpd = _Quiet(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self.thread.start()

    def paths(self) -> list[str]:
        with self.lock:
            return [path for _, path, _ in self.seen]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(5)


@pytest.fixture
def server() -> Iterator[Server]:
    made = Server()
    try:
        yield made
    finally:
        made.close()


# -- the clients: one way to send through each integration --------------------------------


class Sleeps:
    """An injected sleep that advances the clock, and the sleeps it was asked for."""

    def __init__(self, clock: Clock) -> None:
        self.clock, self.slept = clock, []  # type: tuple[Clock, list[float]]

    def __call__(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.clock.advance(seconds)


@dataclass
class Reply:
    status: int
    headers: dict[str, str]


class Client:
    """One integration over a limiter of its face; `send` returns (status, headers)."""

    def __init__(self, kind: str, url: str, clock: Clock, **options: Any) -> None:
        self.kind = kind
        self.sleeps = Sleeps(clock)
        settings = {"clock": clock, "sleep": self.sleeps}
        self.is_async = kind in ("httpx-async", "aiohttp")
        connect = quota.connect_async if self.is_async else quota.connect
        self.limiter = connect(url, **settings)
        self.options = options
        self.loop = asyncio.new_event_loop() if self.is_async else None

    def run(self, value: Any) -> Any:
        return self.loop.run_until_complete(value) if self.loop is not None else value

    def paused(self, key: str) -> float:
        return float(self.run(self.limiter.paused(key)))

    def send(
        self, url: str, rates: str = "100/second", *, method: str = "GET",
        content: Any = None, **options: Any,
    ) -> Reply:  # fmt: skip
        options = {**self.options, **options}
        if self.kind == "httpx":
            transport = RateLimitedTransport(self.limiter, rates, **options)
            with httpx.Client(transport=transport) as client:
                response = client.request(method, url, content=content)
                return Reply(response.status_code, dict(response.headers))
        if self.kind == "requests":
            with requests.Session() as session:
                session.mount("http://", RateLimitedAdapter(self.limiter, rates, **options))
                got = session.request(method, url, data=content)
                return Reply(got.status_code, dict(got.headers))
        return self.run(self._send_async(url, rates, method, content, options))  # type: ignore[no-any-return]

    async def _send_async(
        self, url: str, rates: str, method: str, content: Any, options: dict[str, Any]
    ) -> Reply:
        if self.kind == "httpx-async":
            transport = AsyncRateLimitedTransport(self.limiter, rates, **options)
            async with httpx.AsyncClient(transport=transport) as client:
                response = await client.request(method, url, content=content)
                return Reply(response.status_code, dict(response.headers))
        middleware = rate_limit_middleware(self.limiter, rates, **options)
        async with (
            aiohttp.ClientSession(middlewares=[middleware]) as session,
            session.request(method, url, data=content) as got,
        ):
            await got.read()
            return Reply(got.status, dict(got.headers))

    def close(self) -> None:
        if self.loop is None:
            self.limiter.close()
            return
        self.loop.run_until_complete(self.limiter.aclose())
        self.loop.close()


KINDS = ("httpx", "httpx-async", "requests", "aiohttp")


@pytest.fixture(params=KINDS)
def make_client(request: pytest.FixtureRequest, sqlite_url: str) -> Iterator[Callable[..., Client]]:
    """Clients of one integration on one migrated SQLite file, sharing one injected clock."""
    clock = Clock()
    made: list[Client] = []

    def make(**options: Any) -> Client:
        made.append(Client(request.param, sqlite_url, clock, **options))
        return made[-1]

    yield make
    for client in made:
        client.close()


# -- slots ----------------------------------------------------------------------------------


def test_requests_wait_for_their_slot_and_time_out_unsent(
    make_client: Callable[..., Client], server: Server
) -> None:
    client = make_client()
    for n in range(3):
        assert client.send(f"{server.url}/n{n}", "3/minute").status == 200
    with pytest.raises(quota.RateLimitTimeout) as raised:
        client.send(f"{server.url}/late", "3/minute", timeout=0)
    assert raised.value.decision is not None and not raised.value.decision.allowed
    assert server.paths() == ["/n0", "/n1", "/n2"]
    # With time to wait, the fourth waits out the minute (on the injected clock) and goes.
    assert client.send(f"{server.url}/waited", "3/minute", timeout=120).status == 200
    assert sum(client.sleeps.slept) >= 1
    assert server.paths()[-1] == "/waited"


def test_the_default_key_is_the_origin(make_client: Callable[..., Client]) -> None:
    first, second = Server(), Server()
    try:
        client = make_client()
        assert client.send(f"{first.url}/a", "1/minute").status == 200
        # Another origin has a limit of its own; the same origin, another path, does not.
        assert client.send(f"{second.url}/a", "1/minute").status == 200
        with pytest.raises(quota.RateLimitTimeout):
            client.send(f"{first.url}/b", "1/minute", timeout=0)
        # A key of one's own puts both origins under one limit.
        shared = make_client(key="provider")
        assert shared.send(f"{first.url}/c", "1/minute").status == 200
        with pytest.raises(quota.RateLimitTimeout):
            shared.send(f"{second.url}/c", "1/minute", timeout=0)
    finally:
        first.close()
        second.close()


# -- the provider says slow down -----------------------------------------------------------


def test_a_429_pauses_the_key_for_every_client_and_a_get_is_sent_again(
    make_client: Callable[..., Client], server: Server
) -> None:
    client, other = make_client(), make_client()
    server.answers["/busy"] = [Answer(429, {"Retry-After": "5"})]
    start = client.sleeps.clock()
    reply = client.send(f"{server.url}/busy")
    assert reply.status == 200
    assert server.paths() == ["/busy", "/busy"]
    # The client waited out the pause before sending again.
    assert client.sleeps.clock() - start >= 5
    # A pause another client saw holds this one back too.
    server.answers["/again"] = [Answer(429, {"Retry-After": "30"})]
    assert other.send(f"{server.url}/again", max_retries=0).status == 429
    assert client.paused(server.url) == pytest.approx(30, abs=1)
    before = client.sleeps.clock()
    assert client.send(f"{server.url}/after").status == 200
    assert client.sleeps.clock() - before >= 29


@pytest.mark.parametrize("method", ["POST"])
def test_a_429_to_a_request_that_is_not_idempotent_comes_back(
    make_client: Callable[..., Client], server: Server, method: str
) -> None:
    client = make_client()
    server.answers["/pay"] = [Answer(429, {"Retry-After": "7"})]
    assert client.send(f"{server.url}/pay", method=method, content=b"{}").status == 429
    assert server.paths() == ["/pay"]
    assert client.paused(server.url) == pytest.approx(7, abs=0.01)


def test_retries_stop_at_max_retries(make_client: Callable[..., Client], server: Server) -> None:
    client = make_client(max_retries=2)
    server.answers["/busy"] = [Answer(429, {"Retry-After": "1"}) for _ in range(5)]
    assert client.send(f"{server.url}/busy").status == 429
    assert server.paths() == ["/busy"] * 3
    none = make_client(max_retries=0)
    server.answers["/once"] = [Answer(503, {"Retry-After": "1"})]
    assert none.send(f"{server.url}/once").status == 503
    assert server.paths().count("/once") == 1


def test_a_pause_past_the_timeout_raises_before_sending(
    make_client: Callable[..., Client], server: Server
) -> None:
    client = make_client()
    server.answers["/busy"] = [Answer(429, {"Retry-After": "60"})]
    with pytest.raises(quota.RateLimitTimeout) as raised:
        client.send(f"{server.url}/busy", timeout=10)
    decision = raised.value.decision
    assert decision is not None and not decision.allowed
    assert decision.retry_after_exact == pytest.approx(60, abs=0.5)
    assert decision.retry_after == 60
    assert server.paths() == ["/busy"]  # the retry was never sent


@pytest.mark.parametrize("value", ["-1", "abc", ""])
def test_a_retry_after_that_does_not_parse_pauses_nothing(
    make_client: Callable[..., Client], server: Server, value: str,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    client = make_client()
    server.answers["/busy"] = [Answer(429, {"Retry-After": value})]
    with caplog.at_level(logging.WARNING, logger="quota"):
        assert client.send(f"{server.url}/busy").status == 429
    assert server.paths() == ["/busy"]
    assert client.paused(server.url) == 0.0
    assert client.sleeps.slept == []
    if value:
        assert any("Retry-After" in record.getMessage() for record in caplog.records)


def test_a_retry_after_date_in_the_past_pauses_nothing(
    make_client: Callable[..., Client], server: Server
) -> None:
    client = make_client()
    past = formatdate(client.sleeps.clock() - 60, usegmt=True)
    server.answers["/busy"] = [Answer(429, {"Retry-After": past})]
    assert client.send(f"{server.url}/busy").status == 429
    assert client.paused(server.url) == 0.0


def test_a_huge_retry_after_is_held_to_max_pause(
    make_client: Callable[..., Client], server: Server
) -> None:
    client = make_client(max_pause=7)
    server.answers["/busy"] = [Answer(429, {"Retry-After": str(10**12)})]
    start = client.sleeps.clock()
    assert client.send(f"{server.url}/busy").status == 200
    assert 7 <= client.sleeps.clock() - start < 8
    default = make_client(max_retries=0)
    server.answers["/busy"] = [Answer(429, {"Retry-After": str(10**12)})]
    default.send(f"{server.url}/busy")
    assert default.paused(server.url) <= 3600


def test_a_provider_saying_nothing_is_left_pauses_without_a_429(
    make_client: Callable[..., Client], server: Server
) -> None:
    client = make_client()
    server.answers["/last"] = [
        Answer(200, {"X-RateLimit-Remaining": "0", "X-RateLimit-Reset": "4"})
    ]
    assert client.send(f"{server.url}/last").status == 200
    assert server.paths() == ["/last"]  # a success is not sent again
    assert client.paused(server.url) == pytest.approx(4, abs=0.01)
    server.answers["/ietf"] = [Answer(200, {"RateLimit": '"default";r=0;t=9'})]
    client.send(f"{server.url}/ietf")
    assert client.paused(server.url) == pytest.approx(9, abs=0.01)


def test_a_body_that_cannot_be_sent_again_is_not(
    make_client: Callable[..., Client], server: Server
) -> None:
    client = make_client()
    if client.is_async:

        async def chunks() -> Any:
            yield b"part"

        body: Any = chunks()
    else:
        body = iter([b"part"])
    server.answers["/upload"] = [Answer(429, {"Retry-After": "2"})]
    assert client.send(f"{server.url}/upload", method="PUT", content=body).status == 429
    assert server.paths() == ["/upload"]
    # In memory, the same PUT is sent again.
    server.answers["/put"] = [Answer(429, {"Retry-After": "2"})]
    assert client.send(f"{server.url}/put", method="PUT", content=b"whole").status == 200
    assert [body for _, path, body in server.seen if path == "/put"] == [b"whole", b"whole"]


# -- bad input --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("option", "value", "named"),
    [
        ("rates", "ten per second", "rate"),
        ("timeout", -1, "timeout"),
        ("max_retries", -1, "max_retries"),
        ("max_retries", 2.5, "max_retries"),
        ("max_pause", 0, "max_pause"),
        ("max_pause", float("nan"), "max_pause"),
        ("key", 5, "key"),
        ("key", "", "key"),
    ],
)
def test_bad_arguments_are_named(
    make_client: Callable[..., Client], server: Server, option: str, value: Any, named: str
) -> None:
    client = make_client()
    rates = value if option == "rates" else "10/second"
    options = {} if option == "rates" else {option: value}
    with pytest.raises(quota.ConfigurationError, match=named):
        client.send(f"{server.url}/x", rates, **options)
    assert server.paths() == []


def test_a_limiter_of_the_other_face_is_refused(sqlite_url: str) -> None:
    limiter = quota.connect(sqlite_url)
    try:
        with pytest.raises(quota.ConfigurationError, match="AsyncLimiter"):
            AsyncRateLimitedTransport(limiter, "1/second")
        with pytest.raises(quota.ConfigurationError, match="AsyncLimiter"):
            rate_limit_middleware(limiter, "1/second")  # type: ignore[arg-type]
    finally:
        limiter.close()
    with pytest.raises(quota.ConfigurationError, match=r"quota\.Limiter"):
        RateLimitedAdapter(object(), "1/second")


def test_a_paused_key_takes_no_slot_it_cannot_use(
    make_client: Callable[..., Client], server: Server
) -> None:
    client = make_client()
    client.run(client.limiter.pause(server.url, 5))  # the default key: the origin
    start = client.sleeps.clock()
    # One slot a minute: a slot taken while paused would leave none for after the pause.
    assert client.send(f"{server.url}/after", "1/minute", timeout=30).status == 200
    assert 5 <= client.sleeps.clock() - start < 6
    assert server.paths() == ["/after"]
