"""What both admin faces share: the health report and the argument checks."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from quota._core.errors import ConfigurationError
from quota._core.url import SCHEMALESS
from quota._sql.statements import SCHEMA_VERSION
from quota._sql.steps import Op, Rows
from quota._wrappers.fallback import AsyncResilientStore, ResilientStore

#: The longest key, route or subject an admin call accepts.
MAX_NAME = 4096


@dataclass(frozen=True, kw_only=True)
class Health:
    """The state of a limiter's store, as `Admin.health` reports it."""

    dialect: str
    """The store's dialect (``sqlite``, ``postgresql``, ``memory``, ``redis``, ...)."""
    up: bool
    """True while the store decides; False while it is down and the memory fallback decides."""
    fallback: bool
    """Whether the limiter has a memory fallback (``fallback=`` of `quota.connect`)."""
    down_for: float | None = None
    """Seconds since the store went down; None while it is up."""
    owed: int = 0
    """Fixed windows counted in memory during an outage and not yet written back to the store."""
    dropped: int = 0
    """Owed windows dropped since start to keep within ``Fallback.max_keys``."""
    last_error: str | None = None
    """The last error the fallback saw from the store (type and message); None if none."""
    reachable: bool | None = None
    """Whether the probe's statement was answered by the store; None: not probed."""
    latency: float | None = None
    """Seconds the probe's statement took; None when not probed or it failed."""
    probe_error: str | None = None
    """Why the probe failed (type and message); None if it did not."""


def health(store: object) -> Health:
    """The `Health` of `store`, a limiter's store with its wrappers."""
    dialect = str(getattr(store, "dialect", "?"))
    up = bool(getattr(store, "up", True))
    resilient = _resilient(store)
    if resilient is None:
        return Health(dialect=dialect, up=up, fallback=False)
    state = resilient.health
    error = state.last_error
    return Health(
        dialect=dialect, up=up, fallback=True,
        down_for=None if state.up else max(0.0, time.monotonic() - state.since),
        owed=state.owed, dropped=state.dropped,
        last_error=None if error is None else f"{type(error).__name__}: {error}",
    )  # fmt: skip


def probe_op() -> Op[Rows]:
    """The health probe: one cheap statement every store answers (the schema version read)."""
    rows = yield SCHEMA_VERSION, ()
    return rows


def _resilient(store: object) -> ResilientStore | AsyncResilientStore | None:
    """The fallback wrapper among `store`'s wrappers (each keeps the one it wraps as ``store``)."""
    seen: Any = store
    for _ in range(8):
        if isinstance(seen, (ResilientStore, AsyncResilientStore)):
            return seen
        seen = getattr(seen, "store", None)
        if seen is None:
            return None
    return None


def check_name(name: str, value: object) -> str:
    """`value` if it is a non-empty string of at most `MAX_NAME` characters; else
    `ConfigurationError` naming `name` and the value."""
    if not isinstance(value, str) or not value or len(value) > MAX_NAME:
        raise ConfigurationError(
            f"{name} must be a non-empty string of at most {MAX_NAME} characters, got {value!r}"
        )
    return value


def check_tables(dialect: str, table: str) -> None:
    """`ConfigurationError` on a store of `dialect` that keeps no tables (memory, Redis)."""
    if dialect in SCHEMALESS:
        raise ConfigurationError(
            f"the {dialect} store keeps no {table} table: runtime policies need a database"
            " (sqlite:// or postgresql://)"
        )
