"""Celery tasks under one limit across every worker: ``@rate_limited("10/second")``.

Placed beneath ``@app.task``, the decorator admits each run of the task before its
body starts: a concurrency slot when `concurrency` is set, then a hit under every
rate, counted in the limiter's store (so shared by every worker process and host
using it). A run that is not admitted is deferred: the task is sent again to its
queue with a countdown until its turn (the same task id, arguments and options,
as ``Task.retry`` would send it) and the worker marks this run ``RETRY`` and
takes its next message. No worker sleeps while a task waits for its turn, and a
deferral is not a retry: ``request.retries`` stays as it was, so deferrals never
use up ``max_retries``. Needs the ``celery`` extra.

See `quota.contrib._jobs` for how admission works and how long a deferral is.
"""

from __future__ import annotations

import copy
import functools
import logging
import time
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, TypeVar, cast

from celery import Task
from celery._state import get_current_task
from celery.exceptions import Retry

from quota._core.algorithms import Rate
from quota._limiter.sync_face import Limiter
from quota.contrib._jobs import JobLimit, Key, check_sync

__all__ = ["DEFERRALS_HEADER", "WAIT_TIMEOUT", "rate_limited"]

log = logging.getLogger("quota")

F = TypeVar("F", bound=Callable[..., Any])

#: Seconds a run called directly or eagerly waits for its turn (then `RateLimitTimeout`).
WAIT_TIMEOUT = 30.0
#: The message header counting how many times a task was deferred.
DEFERRALS_HEADER = "quota_deferrals"


def rate_limited(
    rates: Rate | str | Iterable[Rate], *, key: Key = None, limiter: Limiter | None = None,
    concurrency: int | None = None, lease: float = 30.0,
) -> Callable[[F], F]:  # fmt: skip
    """Limit a Celery task across every worker: place it beneath ``@app.task``.

    ::

        @app.task(bind=True)
        @rate_limited("10/second;1000/hour", key=lambda tenant, *a, **k: f"export:{tenant}")
        def export(self, tenant, day): ...

    `rates` as for `quota.Limiter.hit`. `key` the key the runs count on: a
    non-empty string, a callable receiving the task's own arguments (without the
    bound task ``self``) and returning one, or None for the task's name. `limiter`
    a `quota.Limiter`, or None for this process's default one, opened on first use
    from ``$QUOTA_DATABASE_URL`` (else the embedded SQLite file). With the prefork
    pool, do not use a limiter of your own in the parent before the workers fork:
    it opens its connections on first use, and each child must open its own. The
    default limiter opens a fresh one in each child. `concurrency` None, or the
    most runs of a key at once across every worker: each run holds a slot, with a
    lease of `lease` seconds renewed while it runs, freed when the body ends; a
    worker killed mid-run stops renewing and its slot frees itself `lease`
    seconds later.

    In a worker, a run that is not admitted is deferred (the task sent again with
    a countdown, this run marked ``RETRY``): ``request.retries`` is left as it
    was, so deferrals never count against ``max_retries``, and the message header
    ``quota_deferrals`` counts them. If the task cannot be sent again (the broker
    failing), the run waits for its turn in the worker instead, trying to send it
    again after each wait: it is never dropped.

    Called directly (``task(...)``) or eagerly (``task.apply()``,
    ``task_always_eager``) there is no worker to hand the run to, so the caller
    waits for its turn: up to `WAIT_TIMEOUT` seconds for a concurrency slot, then
    as long for the rates (`quota.Limiter.acquire`), raising
    `quota.RateLimitTimeout` when the wait runs out.

    Works beneath ``@app.task(bind=True)`` and beneath a plain ``@app.task``; a
    coroutine function is refused. Raises `quota.ConfigurationError` naming the
    argument for a bad one, when the task is decorated.
    """
    limit = JobLimit(
        rates, key=key, limiter=limiter, concurrency=concurrency, lease=lease, name="",
        face=Limiter,
    )  # fmt: skip

    def decorate(func: F) -> F:
        check_sync(func, "Celery")
        fallback_name = f"{func.__module__}.{func.__qualname__}"
        limits: dict[str, JobLimit] = {}

        def named(name: str) -> JobLimit:
            """The limit of the task called `name` (its default key)."""
            found = limits.get(name)
            if found is None:
                found = copy.copy(limit)
                found.name = name
                limits[name] = found
            return found

        @functools.wraps(func)
        def run(*args: Any, **kwargs: Any) -> Any:
            task, current = _task_of(run, args)
            own = args[1:] if task is not None and args and args[0] is task else args
            job = named(task.name if task is not None else fallback_name)
            key = job.key_of(own, kwargs)
            request = task.request if current and task is not None else None
            if request is None or request.called_directly or request.is_eager:
                return _wait_and_run(job, key, func, args, kwargs)
            admission = job.admit(key)
            while admission.delay is not None:
                delay = admission.delay
                sent = _defer(task, request, delay, job, key)
                if sent is not None:
                    raise Retry(exc=None, when=delay, sig=sent)
                _sleep(job)(delay)
                admission = job.admit(key)
            try:
                return func(*args, **kwargs)
            finally:
                admission.release()

        return cast(F, run)

    return decorate


def _task_of(run: Callable[..., Any], args: tuple[Any, ...]) -> tuple[Task | None, bool]:
    """The task whose body `run` is, and whether it is the task running now.

    The running task (``celery._state.get_current_task``) when its ``run`` leads to
    `run`, else a task given as the first argument (``some_task.run(...)`` of a bound
    task, called from the body of another), else None (a plain call of the function).
    """
    current = get_current_task()
    if current is not None and _leads_to(current, run):
        return current, True
    if args and isinstance(args[0], Task) and _leads_to(args[0], run):
        return args[0], False
    return None, False


def _leads_to(task: Task, run: Callable[..., Any]) -> bool:
    """Whether `task`'s ``run`` is `run`, or wraps it (``functools.wraps``)."""
    found: Any = getattr(task, "run", None)
    for _ in range(100):
        found = getattr(found, "__func__", found)
        if found is run:
            return True
        found = getattr(found, "__wrapped__", None)
        if found is None:
            return False
    return False


def _wait_and_run(
    job: JobLimit, key: str, func: Callable[..., Any], args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:  # fmt: skip
    """A run with no worker to defer to: wait in the caller for a slot, then the rates."""
    limiter = job.limiter()
    block: AbstractContextManager[Any] = nullcontext()
    if job.concurrency is not None:
        block = limiter.concurrency(key, job.concurrency, lease=job.lease, timeout=WAIT_TIMEOUT)
    with block:
        limiter.acquire(key, job.rates, timeout=WAIT_TIMEOUT)
        return func(*args, **kwargs)


def _defer(task: Task, request: Any, delay: float, job: JobLimit, key: str) -> Any:
    """Sends the task again to run in `delay` seconds, its retries unchanged, and returns
    the signature sent; None when the broker would not take it (the caller then waits in
    the worker)."""
    deferrals = int(getattr(request, DEFERRALS_HEADER, None) or 0) + 1
    signature = task.signature_from_request(
        request, None, None, countdown=delay, retries=request.retries
    )
    options = signature.options
    options["headers"] = {**(options.get("headers") or {}), DEFERRALS_HEADER: deferrals}
    try:
        signature.apply_async()
    except Exception as exc:
        log.warning(
            "quota: task %s[%s] (key %r) could not be deferred (%s); it waits %.1fs in the worker",
            job.name, request.id, key, exc, delay,
        )  # fmt: skip
        return None
    return signature


def _sleep(job: JobLimit) -> Callable[[float], Any]:
    sleep = job.limiter().options.sleep
    return sleep if sleep is not None else time.sleep
