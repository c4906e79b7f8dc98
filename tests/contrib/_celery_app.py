"""The Celery app the worker-process tests run: ``celery -A tests.contrib._celery_app worker``.

Configured from the environment the test sets for its workers:

- ``QUOTA_CELERY_BROKER``: the broker (the test's private redis-server), no result backend;
- ``QUOTA_CELERY_STORE``: the store of the limiter the tasks name (``pool_size=1``);
- ``QUOTA_DATABASE_URL``: the store of the default limiter (the tasks naming none);
- ``QUOTA_CELERY_JOURNAL``: the journal (`tests.contrib._jobs_support`) the tasks write.

Each task writes a ``run`` line for each entry into its decorated call, admitted or
deferred (``seconds`` spent in it, ``outcome`` ``"ran"``/``"deferred"``/``"failed"``), from
a wrapper between ``@app.task`` and ``@rate_limited``, and a ``start`` line when its
body begins (with ``retries``, the ``quota_deferrals`` header and the worker's ``node``).
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from typing import Any

from celery import Celery
from celery._state import get_current_task
from celery.exceptions import Retry
from celery.signals import worker_init

import quota
from quota.contrib import _jobs
from quota.contrib.celery import DEFERRALS_HEADER, rate_limited
from tests.contrib._jobs_support import record

BROKER = os.environ.get("QUOTA_CELERY_BROKER", "memory://")
JOURNAL = os.environ.get("QUOTA_CELERY_JOURNAL", os.devnull)
STORE = os.environ.get("QUOTA_CELERY_STORE")

app = Celery("quota_celery_tests", broker=BROKER, set_as_current=True)
app.conf.update(
    result_backend=None,
    task_ignore_result=True,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=True,
)

#: The limiter the tasks name: opened on first use, in the worker (solo pool: no fork).
LIMITER = quota.connect(STORE, pool_size=1) if STORE else None


@worker_init.connect
def _open_connections(**_: Any) -> None:
    """Opens the limiters' connections before the worker takes a task.

    A limiter's first statement opens its connection after reading its clock: on a
    cold worker the first admission is counted at the instant before a connection
    was made, which may be in the second before its body starts.
    """
    if LIMITER is not None:
        LIMITER.peek("warm-up", 1, 1)
    if os.environ.get("QUOTA_DATABASE_URL"):
        _jobs.default_limiter().peek("warm-up", 1, 1)
    record(JOURNAL, event="warm", at=time.time(), pid=os.getpid())


def _line(event: str, **fields: Any) -> None:
    task = get_current_task()
    request = task.request
    record(
        JOURNAL, event=event, id=request.id, task=task.name, at=time.time(), pid=os.getpid(),
        node=request.hostname, **fields,
    )  # fmt: skip


def journaled(func: Callable[..., Any]) -> Callable[..., Any]:
    """Writes a ``run`` line for each entry into `func` (the decorated call)."""

    @functools.wraps(func)
    def run(*args: Any, **kwargs: Any) -> Any:
        began = time.monotonic()
        outcome = "failed"
        try:
            result = func(*args, **kwargs)
            outcome = "ran"
            return result
        except Retry:
            outcome = "deferred"
            raise
        finally:
            _line("run", seconds=time.monotonic() - began, outcome=outcome)

    return run


def _start(**fields: Any) -> None:
    request = get_current_task().request
    deferrals = getattr(request, DEFERRALS_HEADER, None)
    _line("start", retries=request.retries, deferrals=deferrals, **fields)


@app.task(bind=True, name="paced")
@journaled
@rate_limited("5/second", limiter=LIMITER)
def paced(self: Any, index: int) -> int:
    _start(index=index)
    return index


@app.task(name="celery_paced", rate_limit="5/s")
@journaled
def celery_paced(index: int) -> int:
    _start(index=index)
    return index


@app.task(name="export")
@journaled
@rate_limited("5/second", key=lambda tenant, *a, **k: f"export:{tenant}")
def export(tenant: str, index: int) -> int:
    _start(tenant=tenant, index=index)
    return index


@app.task(bind=True, name="hold")
@journaled
@rate_limited("100/second", key="hold", limiter=LIMITER, concurrency=1, lease=2)
def hold(self: Any, seconds: float) -> None:
    _start()
    time.sleep(seconds)


@app.task(bind=True, name="patient", max_retries=1)
@journaled
@rate_limited("100/second", key="patient", limiter=LIMITER, concurrency=1, lease=5)
def patient(self: Any) -> None:
    _start()
