"""A recording HTTP server for the outbound (client-side) rate-limiting tests.

`RecordingServer` is a `ThreadingHTTPServer` on 127.0.0.1, a free port, served from a
thread: a context manager, and `recording_server` wraps it as a pytest fixture. It
answers every request 200 with a tiny body (HTTP/1.1, keep-alive) and records each
one: when it arrived (``time.time()`` once its head is read), the method, the path,
and the ``X-Worker`` and ``X-Attempt`` headers the client sent, if any.

`RecordingServer.arm` makes it answer ONE request 429 with ``Retry-After``: the first
request that arrives at or after a given instant. The handler holds that request for
`delay` seconds before it answers, so that the requests already sent in the same
second arrive first and nothing is in flight when the 429 reaches the client; the
instant the 429 was sent (its last byte written) is recorded.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType

import pytest

BODY = b'{"ok":true}'


@dataclass(frozen=True)
class Arrival:
    """One request as the server saw it."""

    at: float
    method: str
    path: str
    worker: str | None
    attempt: str | None
    status: int


@dataclass(frozen=True)
class Rejection:
    """The one request answered 429, and when the answer left the server."""

    arrival: Arrival
    sent_at: float


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: clients reuse their connections
    disable_nagle_algorithm = True  # the head and the body go out at once: no 40 ms stalls
    timeout = 30  # an idle keep-alive connection's thread ends after this
    server: _Server

    def _handle(self) -> None:
        at = time.time()
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        owner = self.server.owner
        hold = owner._claim(at)
        status = 200 if hold is None else 429
        arrival = Arrival(
            at, self.command, self.path, self.headers.get("X-Worker"),
            self.headers.get("X-Attempt"), status,
        )  # fmt: skip
        owner._record(arrival)
        if hold is not None:
            delay, retry_after = hold
            time.sleep(delay)
            body = b'{"error":"rate limited"}'
            self.send_response(429)
            self.send_header("Retry-After", str(retry_after))
        else:
            body = BODY
            self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
        self.wfile.flush()
        if hold is not None:
            owner._rejected(Rejection(arrival, time.time()))

    do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = do_PATCH = _handle

    def log_message(self, format: str, *args: object) -> None:
        pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # keep-alive handlers never hold up shutdown
    owner: RecordingServer

    def handle_error(self, request: object, client_address: object) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):  # a client that went away
            super().handle_error(request, client_address)  # type: ignore[arg-type]


class RecordingServer:
    """Records every request; answers 200, or 429 once when armed (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._arrivals: list[Arrival] = []
        self._armed: tuple[float, float, int] | None = None
        self._claimed = False
        self._rejection: Rejection | None = None
        self._done = threading.Event()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT``, no trailing slash."""
        assert self._server is not None, "the server is not running"
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> RecordingServer:
        server = _Server(("127.0.0.1", 0), _Handler)
        server.owner = self
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def __enter__(self) -> RecordingServer:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def arm(self, at: float, *, delay: float = 0.2, retry_after: int = 2) -> None:
        """Answer 429 with ``Retry-After: retry_after`` to the first request arriving at or
        after `at` (epoch seconds), held `delay` seconds first. Once per server."""
        with self._lock:
            assert not self._claimed and self._armed is None, "armed once only"
            self._armed = (at, delay, retry_after)

    @property
    def arrivals(self) -> list[Arrival]:
        """Every request so far, in the order they arrived."""
        with self._lock:
            return list(self._arrivals)

    @property
    def rejection(self) -> Rejection | None:
        """The request answered 429 and when the answer was sent, once it has been."""
        with self._lock:
            return self._rejection

    def wait_rejected(self, timeout: float) -> Rejection | None:
        """Wait (at most `timeout` s) until the 429 has been sent; return it (None if not)."""
        self._done.wait(timeout)
        return self.rejection

    def _claim(self, at: float) -> tuple[float, int] | None:
        with self._lock:
            if self._armed is None or self._claimed or at < self._armed[0]:
                return None
            self._claimed = True
            return self._armed[1], self._armed[2]

    def _record(self, arrival: Arrival) -> None:
        with self._lock:
            self._arrivals.append(arrival)

    def _rejected(self, rejection: Rejection) -> None:
        with self._lock:
            self._rejection = rejection
        self._done.set()


@pytest.fixture
def recording_server() -> Iterator[RecordingServer]:
    """A running `RecordingServer`, stopped after the test."""
    with RecordingServer() as server:
        yield server
