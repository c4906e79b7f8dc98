"""The dramatiq app of the worker-process tests (tests/contrib/test_dramatiq.py).

Run by ``dramatiq tests.contrib._dramatiq_app``; configured by the environment:
``QUOTA_TEST_DRAMATIQ_REDIS_PORT`` (the private broker on 127.0.0.1),
``QUOTA_TEST_DRAMATIQ_STORE`` (the limiter's URL, opened with one connection) and
``QUOTA_TEST_DRAMATIQ_JOURNAL`` (the journal, `tests.contrib._jobs_support`).

Each actor is ``@dramatiq.actor`` over `journaled` over `rate_limited`: `journaled`
writes a ``run`` line for every entry into the limited call (admitted or deferred,
with the ``seconds`` spent in it and the ``delay`` of a deferral), the body a
``start`` line. Each worker process writes a ``boot`` line once it consumes.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from typing import Any

import dramatiq
from dramatiq.brokers.redis import RedisBroker
from dramatiq.middleware import CurrentMessage, Middleware

import quota
from quota.contrib.dramatiq import Deferred, rate_limited
from tests.contrib._jobs_support import record

PORT = int(os.environ["QUOTA_TEST_DRAMATIQ_REDIS_PORT"])
STORE = os.environ["QUOTA_TEST_DRAMATIQ_STORE"]
JOURNAL = os.environ["QUOTA_TEST_DRAMATIQ_JOURNAL"]

#: Opened in each worker process on first use (connections open lazily).
limiter = quota.connect(STORE, pool_size=1)


class Booted(Middleware):  # type: ignore[misc]
    """Writes a ``boot`` line when a worker process is ready to consume."""

    def after_worker_boot(self, broker: Any, worker: Any) -> None:
        record(JOURNAL, event="boot", pid=os.getpid(), at=time.time())


broker = RedisBroker(host="127.0.0.1", port=PORT)
broker.add_middleware(CurrentMessage())
broker.add_middleware(Booted())
dramatiq.set_broker(broker)


def journaled(func: Callable[..., Any]) -> Callable[..., Any]:
    """A ``run`` line for each entry into `func` (the limited call)."""

    @functools.wraps(func)
    def run(ident: int, *args: Any) -> Any:
        message = CurrentMessage.get_current_message()
        retries = None if message is None else message.options.get("retries", 0)
        began = time.monotonic()
        fields: dict[str, Any] = {"outcome": "ran"}
        try:
            return func(ident, *args)
        except Deferred as exc:
            fields = {"outcome": "deferred", "delay": exc.delay, "reason": exc.reason}
            raise
        finally:
            record(
                JOURNAL, id=ident, event="run", at=time.time(), pid=os.getpid(),
                seconds=time.monotonic() - began,
                retries=retries,
                **fields,
            )  # fmt: skip

    return run


@dramatiq.actor(max_retries=0)
@journaled
@rate_limited("5/second", key="paced", limiter=limiter)
def paced(ident: int) -> None:
    """Test 1: 60 of these on one key; no retry allowed, yet most are deferred."""
    record(JOURNAL, id=ident, event="start", at=time.time(), pid=os.getpid())


@dramatiq.actor(max_retries=0)
@journaled
@rate_limited("100/second", key="held", limiter=limiter, concurrency=1, lease=2)
def held(ident: int) -> None:
    """Test 3: holds the one slot of ``held`` until its worker is killed."""
    record(JOURNAL, id=ident, event="start", at=time.time(), pid=os.getpid())
    time.sleep(600)
