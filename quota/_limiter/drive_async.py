"""Driving a durable quota operation (`quota._limiter.quotas`) in one transaction.

quota/_limiter/drive_sync.py is generated from quota/_limiter/drive_async.py by unasyncd
([tool.unasyncd] in pyproject.toml): edit the async file, then run `unasyncd`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from quota._core.errors import StorageError
from quota._limiter.quota_types import ATTEMPTS, Abort, retryable
from quota._sql.steps import Op
from quota._stores.base import AsyncStore

T = TypeVar("T")


async def arun(store: AsyncStore, op: Op[T], again: Callable[[], Op[T]] | None = None) -> T:
    """Drive `op` in one transaction on `store`; see `quota._limiter.quota_types.Abort`. A
    transaction the database rolled back to let another through is run again (`again`
    makes the op anew)."""
    for _ in range(ATTEMPTS):
        try:
            return await store.run(op, transaction=True)
        except Abort as abort:
            if abort.then is None:
                result: T = abort.result
                return result
            op = abort.then
        except StorageError as exc:
            if again is None or not retryable(exc):
                raise
            op = again()
    raise StorageError(f"gave up after {ATTEMPTS} attempts raced concurrent transactions")
