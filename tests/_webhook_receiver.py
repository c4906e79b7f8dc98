"""A webhook receiver for the tests of ``quota notify``: a standard-library HTTP server on a
free loopback port, in a thread, that records each body and whether its signature checks.

`statuses` answers the requests in turn (the last one repeated; default 200); `hold`,
when set, keeps every request waiting (before it is recorded as answered) until it is
released or `hold_timeout` passes, so a test can kill the worker mid-delivery.
"""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from quota.notify import verify


class Receiver:
    def __init__(self, secret: str | None = None, statuses: list[int] | None = None) -> None:
        self.secret = secret
        self.statuses = list(statuses or [200])
        self.lock = threading.Lock()
        self.received: list[dict[str, Any]] = []  # every request, in order
        self.signed: list[bool] = []
        self.answered: list[tuple[dict[str, Any], int]] = []
        self.held = threading.Event()  # set when a held request arrived
        self.release = threading.Event()
        self.hold = False
        self.hold_timeout = 30.0
        self.url = ""

    def ids(self) -> list[int]:
        with self.lock:
            return [int(body["id"]) for body in self.received]

    def delivered_ids(self) -> list[int]:
        """Ids of the requests answered 2xx."""
        with self.lock:
            return [int(body["id"]) for body, status in self.answered if 200 <= status < 300]

    def _handle(self, raw: bytes, signature: str | None) -> int:
        body = json.loads(raw)
        with self.lock:
            self.received.append(body)
            self.signed.append(self.secret is not None and verify(raw, signature, self.secret))
            status = self.statuses.pop(0) if len(self.statuses) > 1 else self.statuses[0]
        if self.hold:
            self.held.set()
            self.release.wait(self.hold_timeout)
        with self.lock:
            self.answered.append((body, status))
        return status


@contextmanager
def running(secret: str | None = None, statuses: list[int] | None = None) -> Iterator[Receiver]:
    receiver = Receiver(secret, statuses)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            raw = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            status = receiver._handle(raw, self.headers.get("Quota-Signature"))
            try:
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()
            except OSError:
                pass  # the worker is gone (killed mid-delivery)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    receiver.url = f"http://127.0.0.1:{server.server_address[1]}/hooks/quota"
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        yield receiver
    finally:
        receiver.release.set()
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
