"""Delivering usage threshold events to a webhook: the worker behind ``quota notify``.

A quota's thresholds write a `quota.ThresholdEvent` into the outbox table
``quota_events`` in the same transaction as the charge that crossed them (see
``consume_quota(..., thresholds=...)``). A `Notifier` takes them from there and
POSTs each, as JSON, to one URL:

    {"id": 42, "subject": "acct_1", "quota": "llm_calls", "period_start": 1767225600,
     "threshold": 0.8, "used": 800, "limit": 1000, "at": 1767300000.25}

``period_start`` and ``at`` are epoch seconds; ``limit`` is the period's limit with
its grants (what ``threshold`` is a fraction of). With a secret, the request carries
``Quota-Signature: sha256=<hex>``, the HMAC-SHA256 of the exact body under the secret;
receivers check it with `verify`.

Delivery is at least once. A worker claims a batch of events with a lease (so several
workers share the outbox, and the claims of a worker that died come back when its
lease runs out), POSTs them one by one, and marks each delivered on a 2xx answer. Any
other answer, or none within the timeout, is tried again after an exponential backoff
with jitter (1 s, 2 s, 4 s, … up to `max_backoff`, each drawn between half and all of
that); an event is never dropped. A receiver may get an event twice (a worker killed
after the POST, before marking it): de-duplicate by ``id``.

Everything here but the HTTP call runs through the limiter's public `run`, so the
worker works wherever the limiter does (SQLite, PostgreSQL).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import random
import socket
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from quota._core.errors import ConfigurationError, SchemaError, StorageError
from quota._limiter import Limiter, connect
from quota._limiter import thresholds as _thresholds
from quota._limiter.quota_types import ThresholdEvent

__all__ = [
    "DEFAULT_BATCH",
    "DEFAULT_LEASE",
    "DEFAULT_MAX_BACKOFF",
    "DEFAULT_TIMEOUT",
    "SIGNATURE_HEADER",
    "Notifier",
    "Round",
    "backoff",
    "body_of",
    "sign",
    "verify",
]

log = logging.getLogger("quota.notify")

#: The request header carrying the body's signature when a secret is set.
SIGNATURE_HEADER = "Quota-Signature"
#: Seconds a worker holds the events it claimed before others may take them.
DEFAULT_LEASE = 60.0
#: Seconds to wait for the receiver's answer to one POST.
DEFAULT_TIMEOUT = 10.0
#: The longest wait before a failed event is tried again, in seconds.
DEFAULT_MAX_BACKOFF = 60.0
#: Events claimed at once.
DEFAULT_BATCH = 100
#: Seconds an idle worker waits before looking for new events.
DEFAULT_POLL = 1.0

#: A POST: (url, body, headers, timeout) -> the HTTP status. Raises for no answer.
Post = Callable[[str, bytes, Mapping[str, str], float], int]


def sign(body: bytes, secret: str) -> str:
    """The ``Quota-Signature`` value of `body`: ``sha256=`` and the hex HMAC-SHA256 under `secret`."""
    digest = hmac.new(secret.encode("utf-8"), body, hashlib.sha256).hexdigest()
    return f"sha256={digest}"


def verify(body: bytes, header: str | None, secret: str) -> bool:
    """Whether `header` (the request's ``Quota-Signature``) signs `body` under `secret`.

    For receivers: pass the raw body as received, before parsing it. Compares in
    constant time; a missing or malformed header is False.
    """
    if not header:
        return False
    return hmac.compare_digest(header.strip(), sign(body, secret))


def body_of(event: ThresholdEvent) -> bytes:
    """The JSON body POSTed for `event` (compact, keys sorted)."""
    return json.dumps(event.payload(), separators=(",", ":"), sort_keys=True).encode("utf-8")


def backoff(attempts: int, max_backoff: float, draw: Callable[[], float] = random.random) -> float:
    """Seconds before the next try of an event that failed `attempts` times (1 or more).

    Doubles from 1 s with each failure, capped at `max_backoff`, and jittered to between
    half and all of that, so that events failed together spread out.
    """
    ceiling = min(max_backoff, 2.0 ** min(max(attempts, 1) - 1, 62))
    return ceiling * (0.5 + draw() / 2)


def urllib_post(url: str, body: bytes, headers: Mapping[str, str], timeout: float) -> int:
    """POST with the standard library; the status, whatever it is (raises for no answer)."""
    request = urllib.request.Request(url, data=body, headers=dict(headers), method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            response.read()
            return int(response.status)
    except urllib.error.HTTPError as exc:
        exc.close()
        return int(exc.code)


@dataclass(frozen=True, slots=True)
class Round:
    """What one claim of a batch came to."""

    claimed: int
    delivered: int
    failed: int


def _seconds(name: str, value: object, *, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low < value <= high:
        raise ConfigurationError(f"{name} must be seconds in ({low:g}, {high:g}], got {value!r}")
    return float(value)


class Notifier:
    """Delivers the outbox's threshold events to `webhook`; see the module docstring.

    `limiter` is a `quota.Limiter` (or a database URL, for one opened here and closed
    by `close`). `lease` must exceed `timeout`: a claim runs out while its POST may
    still be waiting. `clock`, `sleep` (called between polls, should advance the
    clock), `post` and `draw` (the backoff's jitter, in [0, 1)) are for tests.

    Raises `ConfigurationError` naming a bad argument (a webhook that is not an
    http(s) URL, seconds out of range, a batch not in 1..10000).
    """

    def __init__(
        self, limiter: Limiter | str, webhook: str, *, secret: str | None = None,
        lease: float = DEFAULT_LEASE, timeout: float = DEFAULT_TIMEOUT,
        max_backoff: float = DEFAULT_MAX_BACKOFF, batch: int = DEFAULT_BATCH,
        poll: float = DEFAULT_POLL, clock: Callable[[], float] = time.time,
        sleep: Callable[[float], object] | None = None, post: Post = urllib_post,
        draw: Callable[[], float] = random.random,
    ) -> None:  # fmt: skip
        parts = urlsplit(webhook) if isinstance(webhook, str) else None
        if parts is None or parts.scheme not in ("http", "https") or not parts.netloc:
            raise ConfigurationError(f"webhook must be an http:// or https:// URL, got {webhook!r}")
        if secret is not None and (not isinstance(secret, str) or not secret):
            raise ConfigurationError("secret must be a non-empty string, or None")
        self.timeout = _seconds("timeout", timeout, low=0, high=3600)
        self.lease = _seconds("lease", lease, low=0, high=86400)
        if self.lease <= self.timeout:
            raise ConfigurationError(
                f"lease must be longer than timeout (a claim would run out while its POST"
                f" waits), got lease={lease!r}, timeout={timeout!r}"
            )
        self.max_backoff = _seconds("max_backoff", max_backoff, low=0, high=86400)
        self.poll = _seconds("poll", poll, low=0, high=3600)
        if isinstance(batch, bool) or not isinstance(batch, int) or not 1 <= batch <= 10_000:
            raise ConfigurationError(f"batch must be an int in 1..10000, got {batch!r}")
        self.batch = batch
        self.webhook = webhook
        self._secret = secret
        self._owned = isinstance(limiter, str)
        self.limiter = _limiter_of(limiter)
        self._clock = clock
        self._sleep = sleep
        self._post = post
        self._draw = draw
        self.holder = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"

    def headers(self, body: bytes) -> dict[str, str]:
        """The request headers of `body`."""
        headers = {"Content-Type": "application/json", "User-Agent": "quota-notify"}
        if self._secret is not None:
            headers[SIGNATURE_HEADER] = sign(body, self._secret)
        return headers

    def deliver_round(self) -> Round:
        """Claim up to `batch` events due now and POST each; what came of it.

        Raises `quota.StorageError` when the database fails, `quota.SchemaError` before
        ``quota migrate`` made the outbox.
        """
        claimed_at = self._clock()
        claimed = self.limiter.run(
            _thresholds.claim(self.holder, claimed_at, self.lease, self.batch)
        )
        delivered = failed = 0
        for event, attempts in claimed:
            if self._clock() + self.timeout >= claimed_at + self.lease:
                # The claim could run out mid-POST: leave the rest to the next claim.
                break
            if self._deliver(event, attempts):
                delivered += 1
            else:
                failed += 1
        return Round(len(claimed), delivered, failed)

    def _deliver(self, event: ThresholdEvent, attempts: int) -> bool:
        body = body_of(event)
        try:
            status = self._post(self.webhook, body, self.headers(body), self.timeout)
            error = None if 200 <= status < 300 else f"HTTP {status}"
        except Exception as exc:  # no answer: refused, reset, timed out
            error = f"{type(exc).__name__}: {exc}"
        if error is None:
            self.limiter.run(_thresholds.delivered(event.id, self._clock()))
            log.info("quota notify: delivered event %d", event.id)
            return True
        wait = backoff(attempts, self.max_backoff, self._draw)
        self.limiter.run(_thresholds.failed(event.id, self.holder, self._clock() + wait, error))
        log.warning(
            "quota notify: event %d not delivered (%s, attempt %d); trying again in %.1fs",
            event.id, error, attempts, wait,
        )  # fmt: skip
        return False

    def drain(self) -> Round:
        """Deliver every event due now, batch after batch, and return the totals.

        Events whose delivery failed wait out their backoff: they are left for a later
        drain or `run` (so a receiver that is down never keeps this from returning).
        """
        claimed = delivered = failed = 0
        while True:
            done = self.deliver_round()
            claimed, delivered, failed = (
                claimed + done.claimed, delivered + done.delivered, failed + done.failed,
            )  # fmt: skip
            if done.claimed < self.batch:
                return Round(claimed, delivered, failed)

    def pending(self) -> tuple[int, float | None]:
        """How many events are undelivered, and when the earliest is due (None: none)."""
        return self.limiter.run(_thresholds.pending())

    def run(self, stop: threading.Event | None = None) -> None:
        """Deliver until `stop` is set: drain, then wait `poll` seconds, and again.

        Checks `stop` between two POSTs: an event being delivered is finished first.
        A database error is logged and tried again after `poll` (a worker outlives a
        database restart); a `quota.SchemaError` or `quota.ConfigurationError` is raised.
        """
        stop = stop if stop is not None else threading.Event()
        while not stop.is_set():
            try:
                while not stop.is_set() and self.deliver_round().claimed:
                    pass
            except SchemaError:
                raise
            except StorageError:
                log.exception("quota notify: the database failed; trying again")
            if stop.is_set():
                return
            if self._sleep is not None:
                self._sleep(self.poll)
            else:
                stop.wait(self.poll)

    def close(self) -> None:
        """Close the limiter, if this notifier opened it from a URL."""
        if self._owned:
            self.limiter.close()

    def __enter__(self) -> Notifier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _limiter_of(limiter: Limiter | str) -> Limiter:
    if isinstance(limiter, Limiter):
        return limiter
    if isinstance(limiter, str):
        return connect(limiter, pool_size=2)
    raise ConfigurationError(f"limiter must be a quota.Limiter or a database URL, got {limiter!r}")
