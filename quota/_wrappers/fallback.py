"""Never break the request path: a store wrapper that falls back to memory.

`ResilientStore` (sync) and `AsyncResilientStore` wrap the database store and
an in-memory store with the same algorithms. While the database answers,
every statement goes to it. The first failure (an error, a timeout, a
refused connection) marks it down, logs one line, and from then on every
statement goes straight to memory: no per-request connection attempts pile
up. A background probe (a daemon thread for the sync face, a task for the
async one) retries the database every `probe_interval` seconds; when it
answers, decisions come from the database again at once, and the
fixed-window hits counted in memory during the outage (at most `max_keys`
windows of them; the window owed least recently is dropped first) are added
to the same windows in the database (those still running) behind them, in
batches of one statement each. Each transition is logged once.

The limiter above this wrapper turns any error that still escapes (memory
failing too) into an allowed decision, and answers fail-closed calls with a
denial while the store is down; see `quota._limiter`. A `SchemaError` (the
tables missing: ``quota migrate`` never run) is neither: it is raised to the
caller, never decided from memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import threading
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from quota._core.errors import ConfigurationError, QuotaError, SchemaError, StorageError
from quota._core.redaction import redact
from quota._sql import statements as _sql
from quota._sql.statements import Statement
from quota._sql.steps import Op, Rows, Step, adrive, drive
from quota._stores.base import AsyncStore, SyncStore, call_deadline
from quota._wrappers.batching import batch_statement, most_per_batch
from quota._wrappers.metrics import Metrics

T = TypeVar("T")
S = TypeVar("S", SyncStore, AsyncStore)
log = logging.getLogger("quota")


@dataclass(frozen=True, kw_only=True)
class Fallback:
    """Fail-open settings; pass ``fallback=Fallback(...)`` (or ``True``) to `quota.connect`."""

    timeout: float = 0.05
    """Seconds one store call may take before memory decides instead (a store that gives
    no answer at all is given up at twice this)."""
    probe_interval: float = 1.0
    """Seconds between attempts to reach a store that is down."""
    max_keys: int = 100_000
    """Most keys the in-memory fallback holds (least recently used go first), and most
    windows of outage hits it owes the database (the one owed least recently is dropped,
    counted in the metrics' ``quota_fallback_debt_dropped_total``)."""

    def __post_init__(self) -> None:
        for name in ("timeout", "probe_interval"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not 0 < value <= 600
            ):
                raise ConfigurationError(f"{name} must be seconds in (0, 600], got {value!r}")
        if type(self.max_keys) is not int or self.max_keys < 1:
            raise ConfigurationError(f"max_keys must be a positive integer, got {self.max_keys!r}")


def _is_outage(exc: QuotaError) -> bool:
    """True for a `StorageError` that says the database is unreachable or too slow; False
    for one about the statement itself. A `ConfigurationError` or `SchemaError` is raised
    again."""
    if isinstance(exc, (ConfigurationError, SchemaError)):
        # The caller's own mistake, or a database never migrated: a deployment
        # error that `quota migrate` fixes, never an outage decided from memory.
        raise exc
    return isinstance(exc, StorageError) and exc.outage


class StoreDown(StorageError):
    """The store is down and this call may not fall back (a fail-closed limit)."""


#: The statements whose hits memory keeps for the database while it is down, by name,
#: and whether a hit counted only if it returned a row (a capped hit denied did not).
_OWED_HITS = {_sql.HIT.name: False, _sql.HIT_CAPPED.name: True}

#: Owed windows one write-back statement carries at most, and at least; between the two,
#: as many as take about a fifth of the fallback's budget at ~20 µs a row (PostgreSQL on
#: a busy machine), since the statement is held to the budget like any other.
WRITE_BACK_MAX_ROWS = 2000
WRITE_BACK_MIN_ROWS = 100


def write_back_rows(dialect: str, settings: Fallback) -> int:
    """Owed windows per write-back statement for a store of `dialect` under `settings`."""
    rows = min(WRITE_BACK_MAX_ROWS, max(WRITE_BACK_MIN_ROWS, int(settings.timeout * 10_000)))
    return most_per_batch(dialect, rows)


def _drop_counter(metrics: Metrics | None) -> Callable[[int], None] | None:
    return None if metrics is None else metrics.record_debt_dropped


class _Health:
    """Up/down state, the transition log lines, and hits owed to the database."""

    def __init__(
        self, url: str, settings: Fallback, on_drop: Callable[[int], None] | None = None
    ) -> None:
        """`on_drop` is told how many debts were dropped each time some are (see `owe`)."""
        self.url = redact(url)  # for log lines and messages
        self.settings = settings
        self.up = True
        self.since = time.monotonic()
        self.last_error: BaseException | None = None
        self._lock = threading.Lock()
        # bucket_key -> [client_key, window_start, window, cost, window_end], owed least
        # recently first; at most `settings.max_keys`.
        self._owed: dict[str, list[Any]] = {}
        #: Windows taken by a write-back and not yet written (or owed again).
        self._writing = 0
        #: Debts dropped since start, the oldest first, to keep at most `max_keys`.
        self.dropped = 0
        # None: nothing dropped this outage; False: dropped, not logged yet; True: logged.
        self._drop_logged: bool | None = None
        self._on_drop = on_drop
        self._failed_statements = 0
        self._next_statement_log = 0.0

    @property
    def owed(self) -> int:
        """Windows owed to the database: counted in memory and not yet written back."""
        with self._lock:
            return len(self._owed) + self._writing

    def mark_down(self, exc: BaseException) -> bool:
        """Record a failure; True if this call flipped the state (start a probe)."""
        with self._lock:
            self.last_error = exc
            if not self.up:
                return False
            self.up = False
            self.since = time.monotonic()
        log.warning(
            "quota: store %s is down (%s: %s); deciding from memory until it answers",
            self.url, type(exc).__name__, exc,
        )  # fmt: skip
        return True

    def statement_failed(self, exc: QuotaError) -> None:
        """Log a statement error that is no outage: loudly, at most once a probe interval.

        Such an error (a pooler that lost a prepared statement, a permission
        missing) would fail every call alike; taking it for an outage would
        quietly make every process decide from its own memory. The store stays
        up, this call is decided from memory, and the log says what is wrong.
        """
        now = time.monotonic()
        with self._lock:
            self.last_error = exc
            self._failed_statements += 1
            if now < self._next_statement_log:
                return
            self._next_statement_log = now + self.settings.probe_interval
            failed, self._failed_statements = self._failed_statements, 0
        log.error(
            "quota: store %s rejected %d statement(s), deciding them from memory (the store is"
            " not down, so nothing is shared between processes for these calls): %s",
            self.url, failed, exc,
        )  # fmt: skip

    def mark_up(self) -> None:
        with self._lock:
            self.up = True
            down_for = time.monotonic() - self.since
            self.since = time.monotonic()
            owed = len(self._owed)
        log.warning(
            "quota: store %s is back after %.1fs; deciding from it again, %d window(s) of"
            " outage hits being written back",
            self.url, down_for, owed,
        )  # fmt: skip

    def owe(self, statement: Statement, params: Sequence[Any], rows: Rows) -> None:
        """Remember a fixed-window hit memory counted, to add it to the database later.

        At most `Fallback.max_keys` windows are owed: past that, the debt of the
        window owed least recently is dropped (`dropped`, and the metrics' count).
        """
        needs_row = _OWED_HITS.get(statement.name)
        if needs_row is None or (needs_row and not rows):
            if statement.name == _sql.UNDO_FIXED_WINDOW.name and rows:
                self._forgive(*params)
            return
        bucket_key, client_key, start, window, cost, _now = params[:6]
        with self._lock:
            owed = self._owed
            entry = owed.pop(bucket_key, None)  # owed again: now the most recent
            if entry is None:
                owed[bucket_key] = [client_key, start, window, cost, start + window]
                if len(owed) > self.settings.max_keys:
                    self._drop_oldest()
            else:
                entry[3] += cost
                owed[bucket_key] = entry
        if self._drop_logged is False:
            self._log_dropped()

    def _drop_oldest(self) -> None:
        """Drop the debts owed least recently down to `max_keys` (the lock is held)."""
        owed = self._owed
        excess = len(owed) - self.settings.max_keys
        for bucket_key in list(itertools.islice(owed, excess)):
            del owed[bucket_key]
        self.dropped += excess
        if self._drop_logged is None:
            self._drop_logged = False  # log it, once this outage, outside the lock
        if self._on_drop is not None:
            self._on_drop(excess)

    def _log_dropped(self) -> None:
        self._drop_logged = True
        log.warning(
            "quota: more than %d windows of outage hits owed to store %s; the debts owed"
            " least recently are dropped, not written back (Fallback.max_keys)",
            self.settings.max_keys, self.url,
        )  # fmt: skip

    def _forgive(self, bucket_key: str, cost: int) -> None:
        """Owe `cost` less on `bucket_key`: memory gave back a hit it counted (a multi-rate
        `acquire` attempt a later rate denied)."""
        with self._lock:
            entry = self._owed.get(bucket_key)
            if entry is not None:
                entry[3] -= cost
                if entry[3] <= 0:
                    del self._owed[bucket_key]

    def owes(self) -> bool:
        """True while hits counted in memory wait to be written back."""
        return bool(self._owed) or self._writing > 0

    def owe_again(self, hits: Sequence[Sequence[Any]]) -> None:
        """Owe again `hits` (a batch of `take_owed`) whose write-back failed."""
        with self._lock:
            owed = self._owed
            self._writing -= len(hits)
            for bucket_key, client_key, start, window, cost, _now in hits:
                entry = owed.get(bucket_key)
                if entry is None:
                    owed[bucket_key] = [client_key, start, window, cost, start + window]
                else:
                    entry[3] += cost  # owed meanwhile too (the store went down again)
            if len(owed) > self.settings.max_keys:
                self._drop_oldest()

    @staticmethod
    def rejects(exc: Exception) -> bool:
        """True for an error about the statement, not the store being unreachable: a
        write-back failing so would fail every time. A deadlock or serialization failure
        (SQLSTATE class 40) is not one: it is tried again."""
        if not isinstance(exc, StorageError) or exc.outage:
            return False
        return not str(getattr(exc.__cause__, "sqlstate", None) or "").startswith("40")

    def drops(self, exc: Exception, params: Sequence[Any]) -> bool:
        """True if the write-back of owed hits `params` that failed with `exc` is given up:
        a statement error (the key holding another type, a permission missing, `rejects`)
        is dropped with an ``ERROR`` line instead of kept owed forever."""
        if not self.rejects(exc):
            return False
        self._log_dropped_hit(params, exc)
        return True

    def _log_dropped_hit(self, params: Sequence[Any], exc: BaseException) -> None:
        log.error(
            "quota: store %s rejected the write-back of %d hit(s) of %r counted in memory"
            " during an outage; they are dropped: %s",
            self.url, params[4], params[1], exc,
        )  # fmt: skip

    def dropped_in(self, hits: Sequence[Sequence[Any]], rows: Rows) -> int:
        """How many of a written batch's `hits` the store rejected one by one (on Redis a
        hit whose script failed with a statement error has that error as its row); each
        is logged, and none is owed again."""
        dropped = 0
        for hit, row in zip(hits, rows, strict=False):  # SQL rows are per key, not per hit
            if row and isinstance(row[0], Exception):
                self._log_dropped_hit(hit, row[0])
                dropped += 1
        return dropped

    def take_owed(self, now: float, most: int) -> list[tuple[Any, ...]]:
        """Take at most `most` owed windows still running (owed longest first) as the
        parameters of `quota._sql.statements.HIT`; those of ended windows are forgotten.

        The caller writes them back and then calls `written` with them, or `owe_again`.
        """
        hits: list[tuple[Any, ...]] = []
        with self._lock:
            owed = self._owed
            while owed and len(hits) < most:
                # One pass over the front of the dict per round, not one per window:
                # each fresh iterator walks past every slot popped before it.
                for bucket_key in list(itertools.islice(owed, most - len(hits))):
                    client_key, start, window, cost, end = owed.pop(bucket_key)
                    if end > now:
                        hits.append((bucket_key, client_key, start, window, cost, now))
            self._writing += len(hits)
            if not owed:
                self._drop_logged = None  # the next outage logs its drops afresh
        return hits

    def written(self, hits: Sequence[Sequence[Any]]) -> None:
        """`hits` (a batch of `take_owed`) are in the database."""
        with self._lock:
            self._writing -= len(hits)


def _write_back(
    health: _Health, dialect: str, rows: int, closed: Callable[[], bool]
) -> Generator[Step, Rows, int | None]:
    """Write owed hits back, one statement a batch of `rows` windows, until none is left or
    `closed()`: how many windows, or None if a batch failed (it and the rest stay owed).

    A batch the store rejects with a statement error is written again hit by hit, and
    only the hits rejected so are dropped (`_Health.drops`). Both faces drive it.
    """
    written = 0
    while not closed():
        hits = health.take_owed(time.time(), rows)
        if not hits:
            break
        try:
            answer = yield batch_statement(dialect, hits)
        except BaseException as exc:  # a cancellation (aclose) included
            if isinstance(exc, Exception) and health.rejects(exc):
                done = yield from _write_one_by_one(health, hits)
                if done is None:
                    return None
                written += done
                continue
            health.owe_again(hits)
            if not isinstance(exc, Exception):
                raise
            health.last_error = exc
            return None
        health.written(hits)
        written += len(hits) - health.dropped_in(hits, answer)
    return written


def _write_one_by_one(
    health: _Health, hits: Sequence[Sequence[Any]]
) -> Generator[Step, Rows, int | None]:
    """`hits` one statement each: how many were written, or None at an outage (the hits not
    yet written stay owed)."""
    written = 0
    for done, hit in enumerate(hits):
        try:
            yield _sql.HIT, hit
        except BaseException as exc:  # a cancellation (aclose) included
            if isinstance(exc, Exception) and health.drops(exc, hit):
                continue
            health.written(hits[:done])
            health.owe_again(hits[done:])
            if not isinstance(exc, Exception):
                raise
            health.last_error = exc
            return None
        written += 1
    health.written(hits)
    return written


class _Resilient(Generic[S]):
    """What both faces share: the store, its memory stand-in, their health, the size of
    the write-back batches and how long a call may run."""

    def __init__(
        self, primary: S, memory: S, settings: Fallback, url: str, metrics: Metrics | None = None
    ) -> None:
        self.primary: S = primary
        self.memory: S = memory
        self.dialect: str = primary.dialect
        self.health = _Health(url, settings, _drop_counter(metrics))
        self._batch_rows = write_back_rows(primary.dialect, settings)
        self._hung_after = HUNG_AFTER_BUDGETS * settings.timeout
        self._closed = threading.Event()


class ResilientStore(_Resilient[SyncStore]):
    """A sync store that never raises `StorageError`: memory decides while the database is down."""

    _probe: threading.Thread | None = None

    @property
    def up(self) -> bool:
        return self.health.up

    def execute(self, statement: Statement, params: Sequence[Any]) -> Rows:
        if self.health.up:
            # The call's own deadline, from now: a batch it queues for, then the batch
            # itself, share it (`quota._stores.base.call_deadline`).
            deadline = call_deadline.set(time.monotonic() + self._hung_after)
            try:
                return self.primary.execute(statement, params)
            except QuotaError as exc:
                if not _is_outage(exc):
                    self.health.statement_failed(exc)
                    return self.memory.execute(statement, params)
                self._down(exc)
            finally:
                call_deadline.reset(deadline)
        rows = self.memory.execute(statement, params)
        self.health.owe(statement, params, rows)
        return rows

    def execute_strict(self, statement: Statement, params: Sequence[Any]) -> Rows:
        """`execute` without the fallback: raise `StoreDown` while the store is down."""
        if not self.health.up:
            raise StoreDown(f"store {self.health.url} is down")
        deadline = call_deadline.set(time.monotonic() + self._hung_after)
        try:
            return self.primary.execute(statement, params)
        except QuotaError as exc:
            if not _is_outage(exc):
                raise
            self._down(exc)
            raise StoreDown(f"store {self.health.url} is down: {exc}") from exc
        finally:
            call_deadline.reset(deadline)

    def run(self, op: Op[T], *, transaction: bool, maintenance: bool = False) -> T:
        # Multi-statement operations (cleanup, reset, durable quotas) are not
        # request-path decisions: they go to the database and may raise.
        return self.primary.run(op, transaction=transaction, maintenance=maintenance)

    def _down(self, exc: BaseException) -> None:
        if self.health.mark_down(exc) and not self._closed.is_set():
            self._probe = threading.Thread(target=self._probe_loop, name="quota-probe", daemon=True)
            self._probe.start()

    def _probe_loop(self) -> None:
        """Probe until the store answers, switch to it, then write the outage's hits back.

        Decisions come from the store again as soon as it answers; the owed
        hits follow in batches (`_write_owed`). Owed hits whose write-back fails
        stay owed and are tried again every probe interval until written or
        their window has ended; the loop ends once nothing is owed.
        """
        while not self._closed.wait(self.health.settings.probe_interval):
            if threading.current_thread() is not self._probe:
                return  # a newer outage has a probe of its own
            if not self.health.up:
                try:
                    self.primary.execute(_sql.SCHEMA_VERSION, ())
                except Exception as exc:
                    self.health.last_error = exc
                    continue
                self.health.mark_up()
            if self._write_owed() is not None and not self.health.owes():
                return

    def _write_owed(self) -> int | None:
        """Write owed hits back (`_write_back`): how many windows, or None if a batch failed."""
        return drive(
            _write_back(self.health, self.dialect, self._batch_rows, self._closed.is_set),
            self.primary.execute,
        )

    def close(self) -> None:
        self._closed.set()
        self.primary.close()
        self.memory.close()


#: A store call under a fallback is given up at this many times the budget: the store's own
#: timeouts (the server's statement and lock timeouts, SQLite's busy timeout) answer within
#: one budget; only a store that stopped answering altogether (a network path that hangs
#: with its sockets open) runs on, and the caller must not wait for it.
HUNG_AFTER_BUDGETS = 2


class _Deadlines:
    """Cancels store calls of tasks still waiting at their deadline; one timer for all.

    A call registers its task (`enter`) and leaves in a ``finally`` (`leave`); the timer
    cancels only tasks registered, which are then suspended inside that call, so the
    cancellation always lands there, where `AsyncResilientStore.execute` takes it back.
    """

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._due: dict[asyncio.Task[Any], float] = {}
        self.expired: set[asyncio.Task[Any]] = set()
        self._timer: asyncio.TimerHandle | None = None

    def enter(self) -> asyncio.Task[Any] | None:
        task = asyncio.current_task()
        if task is not None:
            loop = task.get_loop()
            self._due[task] = loop.time() + self.seconds
            if self._timer is None:
                self._timer = loop.call_later(self.seconds, self._check, loop)
        return task

    def leave(self, task: asyncio.Task[Any]) -> None:
        self._due.pop(task, None)

    def _check(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        now = loop.time()
        for task, due in list(self._due.items()):
            if due <= now:
                del self._due[task]
                self.expired.add(task)
                task.cancel()
        if self._due:
            self._timer = loop.call_at(min(self._due.values()), self._check, loop)

    def taken_back(self, task: asyncio.Task[Any] | None) -> bool:
        """True if `task`'s cancellation was this deadline's (and now undone), not a caller's."""
        if task is None or task not in self.expired:
            return False
        self.expired.discard(task)
        uncancel = getattr(task, "uncancel", None)  # Python 3.11+
        return uncancel is None or uncancel() == 0

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class AsyncResilientStore(_Resilient[AsyncStore]):
    """`ResilientStore` for an async store; its probe is a task on the running loop."""

    def __init__(
        self, primary: AsyncStore, memory: AsyncStore, settings: Fallback, url: str,
        metrics: Metrics | None = None,
    ) -> None:  # fmt: skip
        super().__init__(primary, memory, settings, url, metrics)
        self._probe: asyncio.Task[None] | None = None
        self._warm: asyncio.Task[Rows] | None = None
        self._warm_due = 0.0  # the loop's time by which the first connection must be up
        self._deadlines = _Deadlines(self._hung_after)

    @property
    def up(self) -> bool:
        """True while the store decides: False while it is down, and while its first
        connection is being made (memory decides meanwhile)."""
        warm = self._warm
        return self.health.up and (warm is None or warm.done())

    async def execute(self, statement: Statement, params: Sequence[Any]) -> Rows:
        if self.health.up:
            warming = self._warm is None or not self._warm.done()
            if warming and not await self._warmed():
                return await self._memory(statement, params)
            # The store's own timeouts (the server's statement and lock timeouts,
            # the SQLite busy timeout) hold each call to the budget; `_deadlines`
            # gives up on one that does not answer at all.
            task = self._deadlines.enter()
            try:
                return await self.primary.execute(statement, params)
            except QuotaError as exc:
                if not _is_outage(exc):
                    self.health.statement_failed(exc)
                    return await self.memory.execute(statement, params)
                self._down(exc)
            except asyncio.CancelledError:
                if not self._deadlines.taken_back(task):
                    raise
                self._down(self._hung())
            finally:
                if task is not None:
                    self._deadlines.leave(task)
        return await self._memory(statement, params)

    def _hung(self) -> StorageError:
        return StorageError(
            f"store {self.health.url} did not answer within {self._deadlines.seconds:g}s"
        )

    async def _memory(self, statement: Statement, params: Sequence[Any]) -> Rows:
        rows = await self.memory.execute(statement, params)
        self.health.owe(statement, params, rows)
        return rows

    async def _warmed(self) -> bool:
        """Start the store (its first connection) without making a request wait past the budget.

        The first call starts the connection in a task; each call waits for
        it at most one budget, memory deciding meanwhile. A start that fails,
        or is still not done `HUNG_AFTER_BUDGETS` budgets after it began (a
        server that accepts and never answers), marks the store down like
        any other failure: later calls do not wait for it again, and the
        probe switches back once the store answers.
        """
        loop = asyncio.get_running_loop()
        budget = self.health.settings.timeout
        if self._warm is None:
            self._warm = loop.create_task(self.primary.execute(_sql.SCHEMA_VERSION, ()))
            self._warm.add_done_callback(_retrieved)
            self._warm_due = loop.time() + HUNG_AFTER_BUDGETS * budget
        left = self._warm_due - loop.time()
        try:
            await asyncio.wait_for(asyncio.shield(self._warm), max(0.0, min(budget, left)))
        except asyncio.TimeoutError:
            if left <= budget:  # waited out the start's own deadline
                seconds = HUNG_AFTER_BUDGETS * budget
                self._down(StorageError(f"store {self.health.url} did not connect in {seconds:g}s"))
            return False
        except SchemaError:
            raise  # never migrated: not an outage (see `_is_outage`)
        except Exception as exc:
            self._down(exc)
            return False
        return True

    async def execute_strict(self, statement: Statement, params: Sequence[Any]) -> Rows:
        """`execute` without the fallback: raise `StoreDown` while the store is down, or
        when it cannot answer within the budget (a fresh store still connecting, one that
        stopped answering)."""
        if not self.health.up:
            raise StoreDown(f"store {self.health.url} is down")
        warming = self._warm is None or not self._warm.done()
        if warming and not await self._warmed():
            raise StoreDown(f"store {self.health.url} is not connected yet")
        task = self._deadlines.enter()
        try:
            return await self.primary.execute(statement, params)
        except QuotaError as exc:
            if not _is_outage(exc):
                raise
            self._down(exc)
            raise StoreDown(f"store {self.health.url} is down: {exc}") from exc
        except asyncio.CancelledError:
            if not self._deadlines.taken_back(task):
                raise
            hung = self._hung()
            self._down(hung)
            raise StoreDown(str(hung)) from None
        finally:
            if task is not None:
                self._deadlines.leave(task)

    async def run(self, op: Op[T], *, transaction: bool, maintenance: bool = False) -> T:
        return await self.primary.run(op, transaction=transaction, maintenance=maintenance)

    def _down(self, exc: BaseException) -> None:
        if self.health.mark_down(exc) and not self._closed.is_set():
            self._probe = asyncio.get_running_loop().create_task(self._probe_loop())

    async def _probe_loop(self) -> None:
        """`ResilientStore._probe_loop`, as a task."""
        while not self._closed.is_set():
            await asyncio.sleep(self.health.settings.probe_interval)
            if asyncio.current_task() is not self._probe:
                return  # a newer outage has a probe of its own
            if not self.health.up:
                try:
                    await self.primary.execute(_sql.SCHEMA_VERSION, ())
                except Exception as exc:
                    self.health.last_error = exc
                    continue
                self.health.mark_up()
            if await self._write_owed() is not None and not self.health.owes():
                return

    async def _write_owed(self) -> int | None:
        """`ResilientStore._write_owed`."""
        return await adrive(
            _write_back(self.health, self.dialect, self._batch_rows, self._closed.is_set),
            self.primary.execute,
        )

    async def aclose(self) -> None:
        self._closed.set()
        self._deadlines.close()
        for task in (self._probe, self._warm):
            if task is not None and not task.done():
                task.cancel()
            if task is not None:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        await self.primary.aclose()
        await self.memory.aclose()


def _retrieved(task: asyncio.Task[Any]) -> None:
    """Read a finished task's error: a start that failed after its callers stopped waiting
    is reported by the probe, not as an error never retrieved."""
    if not task.cancelled():
        task.exception()


def retry_after_down(settings: Fallback) -> int:
    """The Retry-After a fail-closed denial gives while the store is down: the next probe."""
    return max(1, math.ceil(settings.probe_interval))
