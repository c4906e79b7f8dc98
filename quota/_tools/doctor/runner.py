"""`diagnose`: open the store the URL names, then run its checks, listed in `PLANS`."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from quota._core.errors import ConfigurationError
from quota._core.url import StoreURL, default_url, parse_url
from quota._tools.doctor import connection, postgres, redis, schema, sqlite
from quota._tools.doctor.base import ERROR, OK, Clock, Finding, checked
from quota._tools.doctor.clock import clock_skew
from quota._tools.doctor.routes import route_classes

S = TypeVar("S")


@dataclass(frozen=True, slots=True)
class Plan(Generic[S]):
    """How to check one kind of store."""

    connect: Callable[
        [StoreURL, Clock, float], AbstractContextManager[tuple[list[Finding], S | None]]
    ]
    """Opens it: the connectivity findings, and the session the checks run on (None when
    it cannot be opened); closes it on exit."""
    checks: tuple[tuple[str, Callable[[S], list[Finding]]], ...]
    """(the finding a failure of the check becomes, the check), in the order they report."""


#: Per URL dialect, what `diagnose` checks. A check that raises becomes one error finding
#: under its name: one broken check never hides the others.
PLANS: dict[str, Plan[Any]] = {
    "sqlite": Plan(
        connection.connect_sqlite,
        (
            ("schema", schema.schema),
            ("route_classes", route_classes),
            ("journal_mode", sqlite.journal_mode),
            ("clock_skew", clock_skew),
        ),
    ),
    "postgresql": Plan(
        connection.connect_postgres,
        (
            ("schema", schema.schema),
            ("route_classes", route_classes),
            *(
                ("persistence", functools.partial(postgres.table_settings, table=table))
                for table in postgres.HOT_TABLES
            ),
            ("clock_skew", clock_skew),
        ),
    ),
    "redis": Plan(redis.connect, (("eviction", redis.eviction),)),
    "redis-cluster": Plan(redis.connect, (("eviction", redis.eviction),)),
}


def diagnose(
    url: str | None = None, *, clock: Clock = time.time, timeout: float = 5.0
) -> list[Finding]:
    """Check the database at `url` (default: ``$QUOTA_DATABASE_URL`` or the embedded file).

    Changes nothing: a missing SQLite file is reported, not created. `clock` is
    the app clock compared with the database's; `timeout` bounds the
    connection and each query, in seconds. Never raises for a database
    problem; raises `ConfigurationError` only for a bad `timeout`.
    """
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 600:
        raise ConfigurationError(f"timeout must be seconds in (0, 600], got {timeout!r}")
    target = default_url() if url is None else url
    try:
        parsed = parse_url(target)
    except ConfigurationError as exc:
        return [
            Finding(
                "url", ERROR, str(exc),
                "use sqlite:///path/to/file.db or postgresql://user@host:5432/dbname",
            )
        ]  # fmt: skip
    plan = PLANS.get(parsed.dialect)
    if plan is None:
        return [Finding("url", OK, "a memory store keeps nothing outside this process to check")]
    with plan.connect(parsed, clock, timeout) as (findings, session):
        if session is not None:
            for name, check in plan.checks:
                findings += checked(name, functools.partial(check, session))
    return findings
