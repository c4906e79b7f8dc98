"""The module-level `quota.rate_limit` and its async twin, on a default limiter.

The default limiter is built on first use from ``$QUOTA_DATABASE_URL``, else
the embedded SQLite file ``./quota.sqlite3``. The async one is kept per event
loop, since its connections belong to the loop that opened them.
"""

from __future__ import annotations

import asyncio
import threading
import weakref

from quota._core.decision import Decision, Duration
from quota._core.url import default_url
from quota._limiter import AsyncLimiter, Limiter, connect, connect_async

_lock = threading.Lock()
_sync: Limiter | None = None
_async: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AsyncLimiter] = (
    weakref.WeakKeyDictionary()
)


def default_limiter() -> Limiter:
    """The process-wide sync limiter on the default URL."""
    global _sync
    with _lock:
        if _sync is None:
            _sync = connect(default_url())
        return _sync


def default_async_limiter() -> AsyncLimiter:
    """The async limiter on the default URL for the running event loop."""
    loop = asyncio.get_running_loop()
    limiter = _async.get(loop)
    if limiter is None:
        limiter = _async[loop] = connect_async(default_url())
    return limiter


def rate_limit(key: str, limit: int, window: Duration, *, cost: int = 1) -> Decision:
    """`Limiter.rate_limit` on the default limiter."""
    return default_limiter().rate_limit(key, limit, window, cost=cost)


async def rate_limit_async(key: str, limit: int, window: Duration, *, cost: int = 1) -> Decision:
    """`AsyncLimiter.rate_limit` on the default async limiter."""
    return await default_async_limiter().rate_limit(key, limit, window, cost=cost)
