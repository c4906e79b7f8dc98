"""Operations: generators of statements that a sync and an async store both drive.

An *operation* (`Op`) yields ``(statement, params)`` steps and receives each
statement's rows back (the shape of httpx's ``auth_flow``). It decides what to
run next from the rows; it never does I/O itself. The same generator is driven
by `drive` on a sync store and by `adrive` on an async one, so no logic is
written twice (`quota._sql.ops`, `quota._sql.partitions` and the limiter's
operations are written so).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Generator, Sequence
from typing import Any, TypeVar

from quota._sql.statements import Statement

Row = Sequence[Any]
Rows = Sequence[Row]
#: One statement of an operation and its parameters.
Step = tuple[Statement, Sequence[Any]]

T = TypeVar("T")
S = TypeVar("S")
P = TypeVar("P")

#: An operation: yields steps, receives their rows, returns its result.
Op = Generator[Step, Rows, T]


async def adrive(
    op: Generator[tuple[S, P], Rows, T], execute: Callable[[S, P], Awaitable[Rows]]
) -> T:
    """Run `op` to completion, awaiting `execute` of each statement it yields.

    A failing statement is thrown into the generator, so its ``finally``
    blocks may still issue statements (releasing a lock, say) before the
    error propagates.
    """
    value: Any = None  # a generator's first send must be None
    error: BaseException | None = None
    while True:
        try:
            statement, params = op.send(value) if error is None else op.throw(error)
        except StopIteration as stop:
            result: T = stop.value
            return result
        try:
            value, error = await execute(statement, params), None
        except BaseException as exc:
            value, error = (), exc


def drive(op: Generator[tuple[S, P], Rows, T], execute: Callable[[S, P], Rows]) -> T:
    """`adrive` with a sync `execute`: the loop is written once.

    Nothing in it waits, so the coroutine finishes in its first step, on
    this thread, without an event loop.
    """

    async def now(statement: S, params: P) -> Rows:
        return execute(statement, params)

    coroutine = adrive(op, now)
    try:
        coroutine.send(None)
    except StopIteration as stop:
        result: T = stop.value
        return result
    coroutine.close()  # pragma: no cover - `now` never suspends
    raise RuntimeError("drive: a statement was awaited")  # pragma: no cover
