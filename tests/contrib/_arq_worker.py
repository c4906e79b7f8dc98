"""An arq worker process for tests/contrib/test_arq.py: ``python -m tests.contrib._arq_worker``.

Settings from the environment: ``ARQ_TEST_REDIS_PORT`` (the private broker on
127.0.0.1), ``ARQ_TEST_STORE`` (the quota store URL; one `quota.AsyncLimiter` with
``pool_size=1`` for the whole worker), ``ARQ_TEST_JOURNAL`` (the journal file of
tests/contrib/_jobs_support.py), ``ARQ_TEST_POLL_DELAY`` and ``ARQ_TEST_MAX_JOBS``.

The jobs, each `quota.contrib.arq.rate_limited`:

- ``paced(n)``: ``"5/second"`` on its default key (``"paced"``);
- ``tight(n)``: ``"1/second"`` on ``"tight"``, registered with ``max_tries=1``;
- ``hold(n, seconds)``: ``concurrency=1, lease=2`` on ``"hold"``; sleeps `seconds`.

Each registered job is an outer wrapper around the limited one: it writes a ``run``
line for every entry into the limited call (``outcome`` ``"ran"``, ``"deferred"``
with the ``defer`` asked, or ``"failed"``; the ``seconds`` spent in the call,
``job_try``), and the body a ``start`` line. On startup the worker writes a ``ready``
line with its pid.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

from arq.connections import RedisSettings
from arq.worker import Function, Retry, func, run_worker

import quota
from quota.contrib.arq import rate_limited
from tests.contrib._jobs_support import record

JOURNAL = os.environ["ARQ_TEST_JOURNAL"]
LIMITER = quota.connect_async(os.environ["ARQ_TEST_STORE"], pool_size=1)


def _start(ctx: dict[str, Any], name: str, n: int) -> None:
    record(JOURNAL, id=n, job=name, event="start", at=time.time(), pid=os.getpid(),
           job_try=ctx["job_try"])  # fmt: skip


@rate_limited("5/second", limiter=LIMITER)
async def paced(ctx: dict[str, Any], n: int) -> None:
    _start(ctx, "paced", n)


@rate_limited("1/second", key="tight", limiter=LIMITER)
async def tight(ctx: dict[str, Any], n: int) -> None:
    _start(ctx, "tight", n)


@rate_limited("100/second", key="hold", limiter=LIMITER, concurrency=1, lease=2)
async def hold(ctx: dict[str, Any], n: int, seconds: float) -> None:
    _start(ctx, "hold", n)
    await asyncio.sleep(seconds)


def _journaled(name: str, limited: Callable[..., Awaitable[None]]) -> Callable[..., Any]:
    async def outer(ctx: dict[str, Any], n: int, *args: Any) -> None:
        at, began = time.time(), time.perf_counter()
        fields: dict[str, Any] = {"outcome": "ran"}
        try:
            await limited(ctx, n, *args)
        except Retry as exc:
            fields = {"outcome": "deferred", "defer": (exc.defer_score or 0) / 1000}
            raise
        except BaseException as exc:
            fields = {"outcome": "failed", "error": repr(exc)}
            raise
        finally:
            record(JOURNAL, id=n, job=name, event="run", at=at, pid=os.getpid(),
                   seconds=time.perf_counter() - began, job_try=ctx["job_try"], **fields)  # fmt: skip

    outer.__qualname__ = outer.__name__ = name
    return outer


async def _ready(ctx: dict[str, Any]) -> None:
    record(JOURNAL, event="ready", at=time.time(), pid=os.getpid())


async def _closed(ctx: dict[str, Any]) -> None:
    await LIMITER.aclose()


class WorkerSettings:
    functions: list[Function] = [  # noqa: RUF012 - arq reads class attributes
        func(_journaled("paced", paced), name="paced"),
        func(_journaled("tight", tight), name="tight", max_tries=1),
        func(_journaled("hold", hold), name="hold"),
    ]
    redis_settings = RedisSettings(host="127.0.0.1", port=int(os.environ["ARQ_TEST_REDIS_PORT"]))
    poll_delay = float(os.environ.get("ARQ_TEST_POLL_DELAY", "0.5"))
    max_jobs = int(os.environ.get("ARQ_TEST_MAX_JOBS", "10"))
    on_startup = _ready
    on_shutdown = _closed
    keep_result = 0


if __name__ == "__main__":
    run_worker(WorkerSettings)  # type: ignore[arg-type]
