"""arq jobs under one limit across every worker: `rate_limited`.

``@rate_limited("5/second")`` on an ``async def job(ctx, ...)`` admits each run of
the job before its body: a concurrency slot first when `concurrency` is set, then a
hit under every rate, counted in the limiter's store (so shared by every worker
and host using it). A run that is not admitted is not run: it raises
``arq.worker.Retry(defer=...)``, and the worker puts the job back in its queue to
run again when its turn comes, so no worker sleeps while a job waits. Needs the
``arq`` extra.

See `quota.contrib._jobs` for the admission and the deferral delays.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

from arq.constants import retry_key_prefix
from arq.worker import Retry

from quota._core.algorithms import Rate
from quota._core.errors import ConfigurationError
from quota._limiter.async_face import AsyncLimiter
from quota.contrib._jobs import JobLimit, Key

__all__ = ["rate_limited"]

log = logging.getLogger("quota")

R = TypeVar("R")
Job = Callable[..., Awaitable[R]]


def rate_limited(
    rates: Rate | str | Iterable[Rate], *, key: Key = None, limiter: AsyncLimiter | None = None,
    concurrency: int | None = None, lease: float = 30.0,
) -> Callable[[Job[R]], Job[R]]:  # fmt: skip
    """Limits an arq job (``async def job(ctx, ...)``) across every worker.

    `rates` as for `quota.AsyncLimiter.hit` (``"5/second"``, ``"100/minute;1000/day"``,
    `quota.Rate` objects). `key` is the key the runs count on: a non-empty string,
    a callable receiving the job's own arguments (without ``ctx``) and returning one
    (``key=lambda tenant, *_: f"export:{tenant}"``), or None for the job's name, its
    ``__qualname__`` (the name arq gives it unless it is registered with
    ``arq.worker.func(job, name=...)``: give `key` then to count under that name).
    `limiter` is a `quota.AsyncLimiter`, or None for the default one, opened on
    first use in each worker's event loop from ``$QUOTA_DATABASE_URL`` (else the
    embedded SQLite file). With `concurrency`, at most that many runs of a key at
    once across every worker: each holds a lease of `lease` seconds, renewed while
    the body runs and given back when it ends; a worker that dies holding one frees
    it within `lease` seconds.

    A run admitted runs the body. A run denied raises ``arq.worker.Retry`` with
    ``defer`` the seconds until the rate's slot opens plus a jitter of up to one
    slot's share of the window (between 50 ms and 1 s); a run finding every
    concurrency slot taken is deferred by 1 to 2 seconds; a store failure by 5 to
    10 seconds (logged), the job never being run unchecked.

    A deferral does not count as a try: arq counts a try at the start of each run
    (the ``arq:retry:<job_id>`` counter that ``ctx["job_try"]`` reads and ``max_tries``
    bounds), and a deferred run takes its try back before raising ``Retry``, so a job
    may be deferred any number of times and still has all of its ``max_tries`` for
    its own failures, and ``ctx["job_try"]`` in the body counts the runs of the body
    only. (If Redis fails to take the try back, that deferral costs one try; it is
    logged.) The worker must retry jobs (``retry_jobs=True``, arq's default): with
    ``retry_jobs=False`` a deferred job fails.

    A deferred job runs again at the first poll of a worker after its time comes:
    workers look for due jobs every ``poll_delay`` seconds (arq's default 0.5), so a
    deferral lasts up to ``poll_delay`` longer than asked. That never lets a key
    exceed its rates, but a run may start up to ``poll_delay`` after its slot opens:
    a lower ``poll_delay`` keeps a busy key closer to its rate. Each deferral is a
    run of the job in a worker (one store call and a Redis round trip, no sleep),
    and the jobs deferred on one key come back together when its slot opens (spread
    by the jitter), so a backlog of `n` jobs waiting on one key costs about `n` runs
    each time a slot opens.

    Raises `quota.ConfigurationError` for a bad argument or a function that is not
    a coroutine function.
    """

    def decorate(func: Job[R]) -> Job[R]:
        if not inspect.iscoroutinefunction(func):
            raise ConfigurationError(
                f"arq jobs are coroutine functions (async def job(ctx, ...)), got {func!r}"
            )
        limit = JobLimit(
            rates, key=key, limiter=limiter, concurrency=concurrency, lease=lease,
            name=func.__qualname__, face=AsyncLimiter,
        )  # fmt: skip

        @functools.wraps(func)
        async def job(ctx: dict[str, Any], *args: Any, **kwargs: Any) -> R:
            admission = await limit.admit_async(limit.key_of(args, kwargs))
            if admission.delay is not None:
                await _give_try_back(ctx, limit.name)
                raise Retry(defer=admission.delay)
            try:
                return await func(ctx, *args, **kwargs)
            finally:
                await admission.release_async()

        return job

    return decorate


async def _give_try_back(ctx: Any, name: str) -> None:
    """Takes back the try arq counted for this run (its worker increments the job's retry
    counter before each run), so that a deferral is not a try."""
    if not isinstance(ctx, dict):
        return
    redis, job_id = ctx.get("redis"), ctx.get("job_id")
    if redis is None or not isinstance(job_id, str):
        return
    try:
        await redis.decr(retry_key_prefix + job_id)
    except Exception as exc:  # the deferral then costs one try; the job is still deferred
        log.warning(
            "quota: the try of job %s (id %s) could not be taken back (%s);"
            " this deferral counts as a try",
            name, job_id, exc,
        )  # fmt: skip
