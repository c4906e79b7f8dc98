"""Concurrency blocks: ``with limiter.concurrency(key, limit)`` and its ``async with`` twin.

Both drive the pure steps of `quota._core.leases` over a store; they differ where waiting
differs, so they are written twice, small: the sync block sleeps with `time.sleep` and is
renewed by one daemon thread per process (`_Renewer`, started when the first block is
entered and gone a few seconds after the last one leaves); the async block sleeps with
`asyncio.sleep` and renews from a task of its own.

Entering takes a slot with one statement (`LEASE_ACQUIRE`), trying again while every slot
is held (`quota._core.leases.Backoff`: a waiter holds no connection while it sleeps);
leaving frees it with one (`LEASE_RELEASE`). Every statement goes through the store's
``execute_strict``: under a fallback, a store that is down raises `quota.StoreDown`
rather than hand out slots from this process's memory, which no other process sees.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from quota._core import leases as _leases
from quota._core.errors import ConfigurationError, QuotaError, RateLimitTimeout, StorageError
from quota._core.leases import LeaseRequest
from quota._sql import statements as _sql
from quota._stores.base import AsyncStore, SyncStore
from quota._wrappers.fallback import StoreDown

log = logging.getLogger("quota")
Clock = Callable[[], float]
S = TypeVar("S", SyncStore, AsyncStore)

#: Seconds the renewer thread stays after the last block left (a block entered in that
#: time reuses it).
RENEWER_IDLE = 5.0


def _entered_twice(request: LeaseRequest) -> ConfigurationError:
    return ConfigurationError(
        f"this concurrency block of {request.key!r} is already entered; call"
        " limiter.concurrency() again for another slot"
    )


def _may_have_taken(exc: BaseException) -> bool:
    """Whether a take that raised `exc` may have taken a slot all the same: failed or
    interrupted (Ctrl-C) mid-statement; not refused by the database (a missing table),
    nor by a fallback before it was sent (the store known to be down)."""
    if isinstance(exc, StoreDown) and exc.__cause__ is None:
        return False
    return not (isinstance(exc, StorageError) and not exc.outage)


def _starting(store: SyncStore | AsyncStore, exc: StoreDown) -> bool:
    """Whether a fallback refused a take only because its store is not connected yet
    (it is not down): worth trying again while the wait lasts. The store's `up` is
    False while it connects, so its health (not marked down) tells."""
    health = getattr(store, "health", None)
    return exc.__cause__ is None and health is not None and health.up


def _lost(request: LeaseRequest, holder: str) -> None:
    log.warning(
        "quota: the concurrency lease %s of %r ran out before it was renewed (the process"
        " stalled longer than lease=%gs, or the store was unreachable); its slot may be"
        " another's now",
        holder, request.key, request.lease,
    )  # fmt: skip


def _not_freed(request: LeaseRequest) -> None:
    """Log a release that failed (from an ``except`` block): the block's own outcome
    stands; the lease runs out by itself."""
    log.warning(
        "quota: could not free the concurrency slot of %r; it frees itself in %gs",
        request.key, request.lease, exc_info=True,
    )  # fmt: skip


def _not_abandoned(request: LeaseRequest, exc: Exception) -> None:
    """Log a failed take's slot that could not be freed: one line, since the take's own
    error, raised to the caller, says the rest."""
    log.warning(
        "quota: could not free a concurrency slot a failed take of %r may hold"
        " (%s); it frees itself in %gs",
        request.key, exc, request.lease,
    )  # fmt: skip


class _Block(Generic[S]):
    """What both faces' blocks hold: the request, the slot and holder once entered, and
    the store and clock they take it with."""

    def __init__(self, store: S, clock: Clock, request: LeaseRequest) -> None:
        self.request = request
        self.slot: int | None = None
        self.holder: str | None = None
        self._store: S = store
        self._clock = clock


class Concurrency(_Block[SyncStore]):
    """One slot of a key's `limit`, held for a ``with`` block (`Limiter.concurrency`).

    ``__enter__`` raises `RateLimitTimeout` when no slot came free within `timeout`,
    `StorageError` when the store fails (a slot the failed statement may have taken is
    freed first), `ConfigurationError` when this object is already inside its block.
    ``slot`` and ``holder`` say what is held, inside the block.
    """

    def __enter__(self) -> Concurrency:
        request = self.request
        if self.holder is not None:
            raise _entered_twice(request)
        store, holder = self._store, _leases.new_holder()
        backoff = _leases.Backoff(time.monotonic() + request.timeout)
        while True:
            params = _leases.acquire_params(request, holder, self._clock())
            try:
                rows = store.execute_strict(_sql.LEASE_ACQUIRE, params)
            except StoreDown as exc:
                if _may_have_taken(exc):
                    self._abandon(holder)
                if not _starting(store, exc):
                    raise
                rows = ()  # a fallback's store still connecting: wait for it as for a slot
            except BaseException as exc:
                if _may_have_taken(exc):
                    self._abandon(holder)
                raise
            if rows:
                break
            delay = backoff.next(time.monotonic())
            if delay is None:
                raise RateLimitTimeout(_leases.timeout_message(request))
            time.sleep(delay)
        try:
            self.slot, self.holder = int(rows[0][0]), holder
            _renewer().add(self)
        except BaseException:  # Ctrl-C between the take and the block: give the slot back
            _renewer().remove(self)
            self.slot = self.holder = None
            self._abandon(holder)
            raise
        return self

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        slot, holder = self.slot, self.holder
        if slot is None or holder is None:
            return
        _renewer().remove(self)
        self.slot = self.holder = None
        try:
            self._store.execute_strict(
                _sql.LEASE_RELEASE, _leases.release_params(self.request, slot, holder)
            )
        except QuotaError:
            _not_freed(self.request)

    def _abandon(self, holder: str) -> None:
        try:
            self._store.execute_strict(
                _sql.LEASE_ABANDON, _leases.abandon_params(self.request, holder)
            )
        except Exception as exc:
            _not_abandoned(self.request, exc)

    def _renew(self, slot: int, holder: str) -> bool | None:
        """Move the lease on: True, False when it is no longer this holder's, None on an error."""
        params = _leases.renew_params(self.request, slot, holder, self._clock())
        try:
            return bool(self._store.execute_strict(_sql.LEASE_RENEW, params))
        except Exception:
            log.warning("quota: renewing a concurrency lease failed", exc_info=True)
            return None


class _Renewer:
    """The thread that renews every sync block's lease, each every ``lease / RENEWALS`` s."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._due: dict[Concurrency, float] = {}
        self._thread: threading.Thread | None = None

    def add(self, block: Concurrency) -> None:
        with self._cond:
            self._due[block] = time.monotonic() + block.request.lease / _leases.RENEWALS
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="quota-lease-renewer", daemon=True
                )
                self._thread.start()
            self._cond.notify()

    def remove(self, block: Concurrency) -> None:
        with self._cond:
            self._due.pop(block, None)

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    if not self._due:
                        self._cond.wait(RENEWER_IDLE)
                        if not self._due:
                            self._thread = None
                            return
                        continue
                    now = time.monotonic()
                    block, due = min(self._due.items(), key=lambda item: item[1])
                    if due <= now:
                        break
                    self._cond.wait(due - now)
                period = block.request.lease / _leases.RENEWALS
                self._due[block] = now + period
                slot, holder = block.slot, block.holder
            if slot is None or holder is None:
                continue
            renewed = block._renew(slot, holder)
            with self._cond:
                if block not in self._due:
                    continue  # left its block meanwhile: nothing to say
                if renewed is False:
                    del self._due[block]
                    _lost(block.request, holder)
                elif renewed is None:  # try again sooner: two more tries before it runs out
                    self._due[block] = time.monotonic() + period / 2


_renewers: dict[int, _Renewer] = {}
_renewers_lock = threading.Lock()


def _renewer() -> _Renewer:
    """This process's renewer (a forked child gets its own: threads do not survive fork)."""
    pid = os.getpid()
    renewer = _renewers.get(pid)
    if renewer is None:
        with _renewers_lock:
            renewer = _renewers.get(pid)
            if renewer is None:
                _renewers.clear()
                renewer = _renewers[pid] = _Renewer()
    return renewer


#: Frees of slots that a cancelled take may hold, running after it: kept from the GC.
_late: set[asyncio.Future[Any]] = set()


class AsyncConcurrency(_Block[AsyncStore]):
    """One slot of a key's `limit`, held for an ``async with`` block (`AsyncLimiter.concurrency`).

    Raises as `Concurrency` does. Cancelled while waiting, it frees whatever the
    statement in flight took, once that statement ends, and the cancellation goes on at
    once.
    """

    _renewal: asyncio.Task[None] | None = None

    async def __aenter__(self) -> AsyncConcurrency:
        request = self.request
        if self.holder is not None:
            raise _entered_twice(request)
        loop = asyncio.get_running_loop()
        holder = _leases.new_holder()
        backoff = _leases.Backoff(loop.time() + request.timeout)
        while True:
            try:
                rows = await self._take(holder)
            except StoreDown as exc:
                if not _starting(self._store, exc):
                    raise
                rows = ()  # a fallback's store still connecting: wait for it as for a slot
            if rows:
                break
            delay = backoff.next(loop.time())
            if delay is None:
                raise RateLimitTimeout(_leases.timeout_message(request))
            await asyncio.sleep(delay)
        slot = int(rows[0][0])
        self.slot, self.holder = slot, holder
        self._renewal = loop.create_task(self._renew(slot, holder))
        return self

    async def _take(self, holder: str) -> Any:
        params = _leases.acquire_params(self.request, holder, self._clock())
        take = asyncio.ensure_future(self._store.execute_strict(_sql.LEASE_ACQUIRE, params))
        try:
            return await asyncio.shield(take)
        except asyncio.CancelledError:
            # The statement runs on to its end; what it took is freed then.
            take.add_done_callback(lambda _: self._abandon_later(holder))
            raise
        except BaseException as exc:
            if _may_have_taken(exc):
                await self._abandon(holder)
            raise

    def _abandon_later(self, holder: str) -> None:
        task = asyncio.ensure_future(self._abandon(holder))
        _late.add(task)
        task.add_done_callback(_late.discard)

    async def _abandon(self, holder: str) -> None:
        try:
            await self._store.execute_strict(
                _sql.LEASE_ABANDON, _leases.abandon_params(self.request, holder)
            )
        except Exception as exc:
            _not_abandoned(self.request, exc)

    async def _renew(self, slot: int, holder: str) -> None:
        period = self.request.lease / _leases.RENEWALS
        delay = period
        while True:
            await asyncio.sleep(delay)
            params = _leases.renew_params(self.request, slot, holder, self._clock())
            try:
                rows = await self._store.execute_strict(_sql.LEASE_RENEW, params)
            except Exception:
                log.warning("quota: renewing a concurrency lease failed", exc_info=True)
                delay = period / 2
                continue
            if not rows:
                _lost(self.request, holder)
                return
            delay = period

    async def __aexit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        slot, holder, renewal = self.slot, self.holder, self._renewal
        if slot is None or holder is None:
            return
        self.slot = self.holder = self._renewal = None
        if renewal is not None:
            renewal.cancel()
        release = asyncio.ensure_future(self._release(slot, holder))
        try:
            await asyncio.shield(release)
        except asyncio.CancelledError:
            _late.add(release)  # it frees the slot all the same
            release.add_done_callback(_late.discard)
            raise

    async def _release(self, slot: int, holder: str) -> None:
        try:
            await self._store.execute_strict(
                _sql.LEASE_RELEASE, _leases.release_params(self.request, slot, holder)
            )
        except QuotaError:
            _not_freed(self.request)
