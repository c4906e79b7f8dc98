"""The ``schema`` check (the recorded revision against what this code needs) and the
``schema_drift`` one (the live tables against what the migrations made)."""

from __future__ import annotations

import functools
import sqlite3
from collections.abc import Callable, Sequence

from quota._sql.schema import REQUIRED, REVISIONS, TABLES, TableShape, expected_schema
from quota._sql.statements import SCHEMA_VERSION, VERSION_TABLE
from quota._tools.doctor.base import (
    ERROR,
    OK,
    WARN,
    Finding,
    Query,
    Session,
    checked,
    migrate_command,
)
from quota._tools.doctor.drift import drift_findings
from quota._tools.doctor.live_schema import postgres_schema, sqlite_schema


def schema(session: Session) -> list[Finding]:
    """The ``schema`` finding, then the ``schema_drift`` ones (when the revision was read)."""
    query = session.query
    if session.dialect == "sqlite":
        return _schema_checks(
            lambda: _version(query), lambda: sqlite_schema(query, TABLES), "sqlite", session.url
        )
    return _schema_checks(
        lambda: _pg_version(query),
        lambda: postgres_schema(query, TABLES),
        "postgresql",
        session.url,
    )


def _version(query: Query) -> str | None:
    """The schema revision in the version table; None when the table does not exist."""
    try:
        rows = query(SCHEMA_VERSION)
    except sqlite3.OperationalError as exc:
        if "no such table" in str(exc):
            return None
        raise
    return str(rows[0][0]) if rows else None


def _pg_version(query: Query) -> str | None:
    if not query("SELECT to_regclass('quota_alembic_version') IS NOT NULL")[0][0]:
        return None
    rows = query(SCHEMA_VERSION)
    return str(rows[0][0]) if rows else None


def _schema_checks(
    version: Callable[[], str | None],
    read: Callable[[], dict[str, TableShape]],
    dialect: str,
    url: str,
) -> list[Finding]:
    """The ``schema`` finding, then the ``schema_drift`` ones (when the revision was read)."""
    read_once = functools.cache(read)
    revision: list[str | None] = []

    def schema() -> list[Finding]:
        revision.append(version())
        present: list[str] = []
        if revision[0] is None:  # no revision: are there tables all the same?
            try:
                present = [t for t in read_once() if t != VERSION_TABLE]
            except Exception:
                present = []  # the schema_drift check reports why
        return [schema_finding(revision[0], url, present)]

    findings = checked("schema", schema)
    if revision:
        findings += checked("schema_drift", lambda: _drift(read_once, dialect, revision[0], url))
    return findings


def _drift(
    read: Callable[[], dict[str, TableShape]], dialect: str, revision: str | None, url: str
) -> list[Finding]:
    live = read()
    counters = live.get("quota_counters")
    expected = expected_schema(
        dialect, partitioned_counters=counters is not None and counters.partitioned
    )
    return drift_findings(expected, live, dialect=dialect, revision=revision, url=url)


def schema_finding(revision: str | None, url: str, present: Sequence[str] = ()) -> Finding:
    """The database's revision against `REQUIRED`, judged as the stores judge it.

    `present`: the quota tables found when no revision is recorded (then migrating
    would try to create them again).
    """
    fix = f"run `{migrate_command(url)}`"
    if revision is None and present:
        return Finding(
            "schema", ERROR,
            f"no revision is recorded in {VERSION_TABLE}, yet quota tables are here"
            f" ({', '.join(sorted(present))})",
            "record the revision they match (the schema_drift finding gives the statements);"
            " `quota migrate` would try to create them again",
        )  # fmt: skip
    if revision is None:
        return Finding("schema", ERROR, "the quota tables are missing from this database", fix)
    if revision not in REVISIONS:
        return Finding(
            "schema", WARN,
            f"the schema is at revision {revision}, which this version of quota does not know"
            " (newer code migrated it?)",
            "upgrade quota on this host to the version that migrated the database",
        )  # fmt: skip
    if REVISIONS.index(revision) < REVISIONS.index(REQUIRED):
        return Finding(
            "schema",
            ERROR,
            f"the schema is at revision {revision}; this code needs {REQUIRED}",
            fix,
        )
    return Finding(
        "schema", OK, f"the schema is at revision {revision} (this code needs {REQUIRED})"
    )
