"""What every check shares: `Finding`, the severities, the open `Session` and the wrapper
that turns a failing check into a finding."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from quota._core.redaction import redact

OK = "ok"
WARN = "warn"
ERROR = "error"
SEVERITIES = (OK, WARN, ERROR)

Clock = Callable[[], float]
Query = Callable[[str], Sequence[Sequence[Any]]]


@dataclass(frozen=True, slots=True)
class Finding:
    """One result of `diagnose`."""

    check: str
    """What was checked: ``url``, ``connectivity``, ``schema``, ``schema_drift``,
    ``sqlite_version``, ``journal_mode``, ``standby``, ``read_only``, ``persistence``,
    ``fillfactor``, ``hot_updates``, ``route_classes`` (an override of a route class no
    middleware serves), ``clock_skew`` or ``eviction`` (Redis).

    ``schema_drift`` compares the live tables with what the migrations make at the
    recorded revision: tables, columns (type, collation, NULL or NOT NULL), indexes
    and unique constraints (columns, expressions, predicates, validity), primary
    keys, the version table, a durable table made UNLOGGED, a partitioned table's
    DEFAULT partition, and SQLite's WITHOUT ROWID. What breaks the limiter (a
    missing table, column, unique index or primary key) is an error; what only
    slows it (a missing cleanup index, an extra index on a table updated in place)
    is a warning. Its fix is the statement the migration ran, or ``quota migrate``
    when the schema is behind. UNLOGGED or logged counters are not drift: the
    ``persistence`` finding says which."""
    severity: str
    """``ok``, ``warn`` or ``error``."""
    message: str
    """What was found, in a sentence."""
    fix: str = ""
    """What to do about it; empty when the severity is ``ok``."""

    def as_dict(self) -> dict[str, str]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class Session:
    """An open SQL connection, as the checks of `quota._tools.doctor.runner` use it."""

    dialect: str
    """``sqlite`` or ``postgresql``."""
    url: str
    """The URL without its password, for fixes."""
    query: Callable[..., Sequence[Sequence[Any]]]
    """Runs one statement (PostgreSQL: with its parameters) and returns its rows."""
    clock: Clock
    """The app clock compared with the database's."""
    path: Path | None = None
    """The SQLite file; None on PostgreSQL."""


def display_url(url: str) -> str:
    """`url` without its password, for output."""
    return redact(url)


def migrate_command(url: str) -> str:
    """The command that creates or upgrades the tables at `url`, as the CLI takes it."""
    return f"quota --url '{redact(url)}' migrate"


def checked(check: str, run: Callable[[], list[Finding]]) -> list[Finding]:
    """`run()`, or one error finding when it raises: one broken check never hides the others."""
    try:
        return run()
    except Exception as exc:
        return [
            Finding(
                check, ERROR, f"could not check: {type(exc).__name__}: {exc}",
                "see the error; the other findings may point at the cause",
            )
        ]  # fmt: skip


def quoted(statements: Sequence[str]) -> str:
    return "`" + "; ".join(statements) + "`"
