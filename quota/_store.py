"""What a store is, and how operations run on one.

A store talks to one database and nothing else: it renders SQL into its
driver's placeholder style, runs it, and hands rows back. It never decides.

Two kinds of work reach a store:

* the hot path calls ``execute(sql, params)`` directly: one statement, one
  round trip, autocommit;
* everything else is an *operation*: a generator that yields
  ``(sql, params)`` pairs and receives each statement's rows back (the shape
  of httpx's ``auth_flow``). The same generator is driven by `drive` for the
  sync stores and by `adrive` for the async ones, so no logic is written
  twice. ``run(op, transaction=True)`` wraps the whole operation in one
  transaction; with ``transaction=False`` each statement commits on its own,
  but all run on one connection (a session lock taken by the first statement
  is released by the last).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Generator, Mapping, Sequence
from typing import Any, Protocol, TypeVar

from quota._sql import Named

Row = Sequence[Any]
Rows = Sequence[Row]
Statement = tuple[str, Sequence[Any]]
Op = Generator[Statement, Rows, "T"]

T = TypeVar("T")


class SyncStore(Protocol):
    """A store driven from synchronous code. Safe to share between threads."""

    dialect: str

    def execute(self, sql: str | Named, params: Sequence[Any] | Mapping[str, Any]) -> Rows:
        """Run one statement in its own transaction; raise `StorageError` on failure.

        `sql` is a statement of `quota._sql`: text with ``?`` and positional
        `params`, or a `Named` one with a mapping.
        """
        ...

    def run(self, op: Generator[Statement, Rows, T], *, transaction: bool) -> T:
        """Drive `op` on one connection, in one transaction if `transaction`."""
        ...

    def close(self) -> None:
        """Close every connection the store opened."""
        ...


class AsyncStore(Protocol):
    """A store driven from asyncio code. Safe to share between tasks of one loop."""

    dialect: str

    async def execute(self, sql: str | Named, params: Sequence[Any] | Mapping[str, Any]) -> Rows:
        """Run one statement in its own transaction; see `SyncStore.execute`."""
        ...

    async def run(self, op: Generator[Statement, Rows, T], *, transaction: bool) -> T:
        """Drive `op` on one connection, in one transaction if `transaction`."""
        ...

    async def aclose(self) -> None:
        """Close every connection the store opened."""
        ...


def drive(op: Generator[Statement, Rows, T], execute: Callable[[str, Sequence[Any]], Rows]) -> T:
    """Run `op` to completion, executing each statement it yields with `execute`.

    A failing statement is thrown into the generator, so its ``finally``
    blocks may still issue statements (releasing a lock, say) before the
    error propagates.
    """
    value: Any = None  # a generator's first send must be None
    error: BaseException | None = None
    while True:
        try:
            sql, params = op.send(value) if error is None else op.throw(error)
        except StopIteration as stop:
            result: T = stop.value
            return result
        try:
            value, error = execute(sql, params), None
        except BaseException as exc:
            value, error = (), exc


async def adrive(
    op: Generator[Statement, Rows, T], execute: Callable[[str, Sequence[Any]], Awaitable[Rows]]
) -> T:
    """`drive`, awaiting each statement."""
    value: Any = None  # a generator's first send must be None
    error: BaseException | None = None
    while True:
        try:
            sql, params = op.send(value) if error is None else op.throw(error)
        except StopIteration as stop:
            result: T = stop.value
            return result
        try:
            value, error = await execute(sql, params), None
        except BaseException as exc:
            value, error = (), exc
