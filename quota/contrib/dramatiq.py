"""dramatiq actors under a limit shared by every worker.

::

    @dramatiq.actor(max_retries=3)
    @rate_limited("5/second", key=lambda tenant, *_: f"reports:{tenant}")
    def build_report(tenant: str, month: str) -> None: ...

Each run of the actor is admitted first (see `quota.contrib._jobs`): a concurrency slot
when `concurrency` is set, then a hit under every rate, counted in the limiter's store
and so shared by every worker process and host using it. A run that is not admitted
raises `Deferred`, a ``dramatiq.Retry`` with the delay in milliseconds: dramatiq's
``Retries`` middleware sends the message again after that delay (the broker's delay
queue holds it meanwhile, no worker thread waits for it) and logs one INFO line,
``Retrying message '…' in N milliseconds.``, no error. A worker process polls its
delay queues about once a second (``dramatiq_worker_timeout`` in the environment, in
milliseconds, sets how often), so a deferred message comes back up to that much after
its delay. Needs the extra ``dramatiq``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable
from contextvars import ContextVar
from typing import Any, ParamSpec, TypeVar

import dramatiq
from dramatiq.middleware import CurrentMessage

from quota._core.algorithms import Rate
from quota._core.errors import ConfigurationError
from quota._limiter.sync_face import Limiter
from quota.contrib._jobs import Admission, JobLimit, Key, check_sync

__all__ = ["Deferred", "rate_limited"]

#: The message whose limited run is under way in this context, if any.
_running: ContextVar[Any] = ContextVar("quota_dramatiq_running", default=None)

P = ParamSpec("P")
R = TypeVar("R")


class Deferred(dramatiq.Retry):
    """A run of a limited actor that was not admitted, to run again after `delay`
    milliseconds; `reason` is ``"rate"``, ``"busy"`` (no concurrency slot free) or
    ``"store"`` (the limiter's store failed). A ``retry_when`` predicate sees it as the
    exception of a deferral and must let it be retried."""

    def __init__(self, message: str, *, delay: int, reason: str) -> None:
        super().__init__(message, delay=delay)
        self.reason = reason


def rate_limited(
    rates: Rate | str | Iterable[Rate], *, key: Key = None, limiter: Limiter | None = None,
    concurrency: int | None = None, lease: float = 30.0,
) -> Callable[[Callable[P, R]], Callable[P, R]]:  # fmt: skip
    """Limits the runs of a dramatiq actor; goes beneath ``@dramatiq.actor``.

    `rates` as for `quota.Limiter.hit` (``"5/second"``, a `quota.Rate` or several, all
    enforced). `key` names what the runs count on: a non-empty string, a callable given
    the actor's own arguments and returning one, or None for the actor's name (read
    from the current message when dramatiq's ``CurrentMessage`` middleware is installed,
    else the function's ``__name__``, which is the actor's name unless ``actor_name=``
    gives another). `limiter` a `quota.Limiter`, or None for this process's default
    (opened on first use from ``$QUOTA_DATABASE_URL``, else the embedded SQLite file;
    a forked worker process opens its own). `concurrency` None or the most runs at once
    across every worker, each holding a lease of `lease` seconds renewed while it runs
    and given back when it ends, or when its lease runs out if its worker dies.

    A run not admitted raises `Deferred` (a ``dramatiq.Retry``) with the delay after
    which the message runs again: when the rate's next slot opens, plus a little jitter;
    about a second when no concurrency slot is free. It needs dramatiq's ``Retries``
    middleware (in the default set). The Retries middleware counts every retry against
    the actor's ``max_retries``; with the ``CurrentMessage`` middleware installed
    (``broker.add_middleware(CurrentMessage())``) a deferral is not counted: the count
    is lowered by one before the deferral and Retries raises it back, so ``max_retries``
    and the backoff of failures see only the runs that failed. Without it every
    deferral is one retry, and a message is failed once its deferrals and failures
    together exceed ``max_retries``: set it well above the deferrals a backlog may
    cause (about the messages waiting on a key divided by what the rates let through
    in one window: 60 messages at ``"5/second"`` defer the last ones 11 times), or
    install ``CurrentMessage``. A ``retry_when`` predicate is asked about deferrals too (the
    exception a `Deferred`, the count one below that of the failures so far).
    A limited function called from the body of a limited actor counts on its own key
    (its ``__name__`` by default); its deferral, raised through the actor's body, is
    a retry of that actor like any exception, and counted.

    Raises `quota.ConfigurationError` naming the argument for a bad one, for a
    coroutine function (dramatiq's async actors are not supported) and for an actor
    (put ``@rate_limited`` beneath ``@dramatiq.actor``).
    """

    def decorate(func: Callable[P, R]) -> Callable[P, R]:
        if isinstance(func, dramatiq.Actor):
            raise ConfigurationError(
                f"rate_limited goes beneath @dramatiq.actor, got the actor {func.actor_name!r}"
            )
        check_sync(func, "dramatiq")
        limit = JobLimit(
            rates, key=key, limiter=limiter, concurrency=concurrency, lease=lease,
            name=func.__name__, face=Limiter,
        )  # fmt: skip

        @functools.wraps(func)
        def run(*args: P.args, **kwargs: P.kwargs) -> R:
            message = CurrentMessage.get_current_message()
            if message is not None and _running.get() is message:
                message = None  # called from a limited run of the message: not its actor
            if key is None and message is not None:
                chosen = str(message.actor_name)
            else:
                chosen = limit.key_of(args, kwargs)
            admission = limit.admit(chosen)
            if admission.delay is not None:
                raise _defer(message, chosen, admission)
            token = _running.set(message)
            try:
                return func(*args, **kwargs)
            finally:
                _running.reset(token)
                admission.release()

        return run

    return decorate


def _defer(message: Any, key: str, admission: Admission) -> Deferred:
    """The `Deferred` to raise for a run not admitted; with the current message known,
    its retry count lowered by one, which the Retries middleware raises back."""
    assert admission.delay is not None
    delay = max(1, math.ceil(admission.delay * 1000))
    if message is not None:
        message.options["retries"] = message.options.get("retries", 0) - 1
    return Deferred(
        f"deferred by {delay} ms: {admission.reason} limit of key {key!r}",
        delay=delay, reason=admission.reason,
    )  # fmt: skip
