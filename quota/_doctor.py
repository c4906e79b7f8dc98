"""``quota doctor``: check a database the way the limiter will use it, and say what to fix.

`diagnose` connects to a store URL, changes nothing, and returns a list
of `Finding`: connectivity, the schema revision against what this code
needs, SQLite's version and journal mode, the PostgreSQL settings of the
hot tables (UNLOGGED or logged, fillfactor, the share of HOT updates), and
the skew between this host's clock and the database's. Database failures
become findings, never exceptions, so a broken setup still gets a full
report. The assessments are pure functions of the numbers read, so each
threshold is tested without a database.

Severities: ``ok``; ``warn`` (works, but slower or riskier than it should
be); ``error`` (the limiter will fail or misbehave). Every finding that is
not ``ok`` carries a ``fix``.
"""

from __future__ import annotations

import functools
import os
import sqlite3
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from quota._errors import ConfigurationError
from quota._schema import REQUIRED, REVISIONS
from quota._sql import DB_NOW, SCHEMA_VERSION
from quota._url import StoreURL, default_url, parse_url, redact

OK = "ok"
WARN = "warn"
ERROR = "error"
SEVERITIES = (OK, WARN, ERROR)

#: Tables updated on every decision, so their PostgreSQL settings matter.
HOT_TABLES = ("quota_counters", "quota_state")
#: Below this many updates the HOT ratio says nothing yet.
MIN_UPDATES_FOR_HOT = 1000
#: A HOT ratio under this gets a warning.
MIN_HOT_RATIO = 0.8
#: Fillfactors above this leave too little room on a page for HOT updates.
MAX_FILLFACTOR = 90
#: Clock skew (seconds, beyond the measurement's own uncertainty) that gets a warning.
SKEW_WARN = 1.0
#: Clock skew that is an error: a cleanup on this host with the default
#: grace (60 s) could delete windows that are still running.
SKEW_ERROR = 60.0

Clock = Callable[[], float]
Query = Callable[[str], Sequence[Sequence[Any]]]


@dataclass(frozen=True, slots=True)
class Finding:
    """One result of `diagnose`."""

    check: str
    """What was checked: ``url``, ``connectivity``, ``schema``, ``sqlite_version``,
    ``journal_mode``, ``standby``, ``persistence``, ``fillfactor``,
    ``hot_updates`` or ``clock_skew``."""
    severity: str
    """``ok``, ``warn`` or ``error``."""
    message: str
    """What was found, in a sentence."""
    fix: str = ""
    """What to do about it; empty when the severity is ``ok``."""

    def as_dict(self) -> dict[str, str]:
        return asdict(self)


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
    if parsed.dialect == "sqlite":
        return _diagnose_sqlite(parsed, clock, timeout)
    if parsed.dialect == "postgresql":
        return _diagnose_postgres(parsed, clock, timeout)
    if parsed.dialect == "memory":
        return [Finding("url", OK, "a memory store keeps nothing outside this process to check")]
    return [
        Finding(
            "url", WARN,
            f"doctor checks SQLite and PostgreSQL databases; this {parsed.dialect} store was"
            " not checked",
            "check it with its own tools (for Redis: `redis-cli -u URL ping`)",
        )
    ]  # fmt: skip


def display_url(url: str) -> str:
    """`url` without its password, for output."""
    return redact(url)


def migrate_command(url: str) -> str:
    """The command that creates or upgrades the tables at `url`, as the CLI takes it."""
    return f"quota --url '{url}' migrate"


def _checked(check: str, run: Callable[[], list[Finding]]) -> list[Finding]:
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


# -- SQLite -----------------------------------------------------------------------------


def _diagnose_sqlite(parsed: StoreURL, clock: Clock, timeout: float) -> list[Finding]:
    findings = [sqlite_version_finding(sqlite3.sqlite_version_info, sqlite3.sqlite_version)]
    path = Path(parsed.target).absolute()
    shown = display_url(parsed.url)
    if not path.exists():
        findings.append(
            Finding(
                "connectivity", ERROR, f"no SQLite database at {path}",
                f"create it with `{migrate_command(shown)}` (check the path if one was expected)",
            )
        )  # fmt: skip
        return findings
    try:
        # mode=rw: never create the file; open it as the limiter would, for writing.
        conn = sqlite3.connect(
            f"{path.as_uri()}?mode=rw", uri=True, timeout=timeout, isolation_level=None
        )
        conn.execute("SELECT count(*) FROM sqlite_master").fetchall()
    except sqlite3.Error as exc:
        findings.append(
            Finding(
                "connectivity", ERROR, f"cannot open {path} for writing: {exc}",
                "check that the file is a SQLite database and that this user may write the file"
                " and its directory (SQLite creates -wal and -shm files beside it)",
            )
        )  # fmt: skip
        return findings
    try:

        def query(sql: str) -> Sequence[Sequence[Any]]:
            return conn.execute(sql).fetchall()

        if os.access(path, os.W_OK) and os.access(path.parent, os.W_OK):
            findings.append(Finding("connectivity", OK, f"opened {path}"))
        else:
            findings.append(
                Finding(
                    "connectivity", ERROR, f"{path} or its directory is read-only for this user",
                    "let the app's user write the file and its directory; every decision writes",
                )
            )  # fmt: skip
        findings += _checked("schema", lambda: [schema_finding(_version(query), shown)])
        findings += _checked(
            "journal_mode",
            lambda: [journal_mode_finding(str(query("PRAGMA journal_mode")[0][0]), path)],
        )
        findings += _checked("clock_skew", lambda: [_skew(query, DB_NOW["sqlite"], clock)])
    finally:
        conn.close()
    return findings


def sqlite_version_finding(version: tuple[int, int, int], text: str) -> Finding:
    """The SQLite library this Python links against, against the oldest quota runs on."""
    from quota._sqlite import MIN_SQLITE  # imports aiosqlite: not at `import quota` time

    needed = ".".join(map(str, MIN_SQLITE))
    if version >= MIN_SQLITE:
        return Finding("sqlite_version", OK, f"SQLite {text} (quota needs {needed} or newer)")
    return Finding(
        "sqlite_version", ERROR,
        f"SQLite {text} is too old: quota needs {needed} or newer (for INSERT … RETURNING)",
        "use a Python linked against a newer SQLite (e.g. a current python.org or"
        " distribution build), or pysqlite3-binary",
    )  # fmt: skip


def journal_mode_finding(mode: str, path: Path) -> Finding:
    """WAL lets readers and the writer work at once; quota sets it when a limiter connects."""
    if mode.lower() == "wal":
        return Finding("journal_mode", OK, "journal_mode is WAL")
    return Finding(
        "journal_mode", WARN,
        f"journal_mode is {mode!r}, not WAL: readers and the writer block each other."
        " A limiter switches the file to WAL when it first connects, so this is expected"
        " right after `quota migrate`; if it stays after the app has run, something switches"
        " it back, or the file system cannot do WAL (network file systems cannot)",
        f"run `sqlite3 '{path}' 'PRAGMA journal_mode=WAL'` and keep the file on a local disk",
    )  # fmt: skip


# -- PostgreSQL -------------------------------------------------------------------------


def _diagnose_postgres(parsed: StoreURL, clock: Clock, timeout: float) -> list[Finding]:
    shown = display_url(parsed.url)
    try:
        import psycopg
    except ImportError:
        return [
            Finding(
                "connectivity", ERROR, "psycopg 3 is not installed (the sync PostgreSQL driver)",
                "pip install 'quota[postgres]'",
            )
        ]  # fmt: skip
    try:
        # One transaction for every check, its time budget SET LOCAL: nothing is sent
        # at startup or left on the session (a transaction pooler refuses the one and
        # would hand the other to its next client); no statement is prepared by name.
        conn = psycopg.connect(
            parsed.target, autocommit=False, connect_timeout=max(1, round(timeout)),
            prepare_threshold=None,
        )  # fmt: skip
        conn.execute(
            "SELECT set_config('statement_timeout', %s, true)", (str(int(timeout * 1000)),)
        )
    except Exception as exc:
        return [
            Finding(
                "connectivity", ERROR, f"cannot connect to {shown}: {' '.join(str(exc).split())}",
                "check host, port, database name and credentials, and that the server is up"
                " (`pg_isready -h HOST -p PORT`)",
            )
        ]  # fmt: skip
    findings: list[Finding] = []
    try:

        def query(sql: str, params: Sequence[Any] = ()) -> Sequence[Sequence[Any]]:
            with conn.transaction():  # a savepoint: a failing check leaves the others be
                return conn.execute(sql, params).fetchall()

        version, user, database, standby = query(
            "SELECT current_setting('server_version'), current_user, current_database(),"
            " pg_is_in_recovery()"
        )[0]
        findings.append(
            Finding(
                "connectivity", OK,
                f"connected to PostgreSQL {version} as {user}, database {database}",
            )
        )  # fmt: skip
        if standby:
            findings.append(
                Finding(
                    "standby", ERROR, "this server is a read-only standby; every decision writes",
                    "point the URL at the primary",
                )
            )  # fmt: skip
        findings += _checked("schema", lambda: [schema_finding(_pg_version(query), shown)])
        for table in HOT_TABLES:
            findings += _checked("persistence", functools.partial(_pg_table, query, table))
        findings += _checked("clock_skew", lambda: [_skew(query, DB_NOW["postgresql"], clock)])
    finally:
        conn.close()
    return findings


_TABLE_FACTS = (
    "SELECT c.relpersistence, c.reloptions, s.n_tup_upd, s.n_tup_hot_upd"
    " FROM pg_class c LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid"
    " WHERE c.oid = to_regclass(%s)"
)


def _pg_table(query: Callable[..., Sequence[Sequence[Any]]], table: str) -> list[Finding]:
    rows = query(_TABLE_FACTS, (table,))
    if not rows:
        return []  # not created (yet): the schema finding says so
    persistence, options, updates, hot = rows[0]
    return [
        persistence_finding(table, str(persistence)),
        fillfactor_finding(table, fillfactor(options)),
        hot_finding(table, int(updates or 0), int(hot or 0)),
    ]


def fillfactor(reloptions: Sequence[str] | None) -> int:
    """The fillfactor in a table's ``pg_class.reloptions`` (100 when not set)."""
    for option in reloptions or ():
        name, _, value = option.partition("=")
        if name == "fillfactor":
            return int(value)
    return 100


def persistence_finding(table: str, relpersistence: str) -> Finding:
    """UNLOGGED (the default) or logged: both are deliberate choices, so both are ok."""
    if relpersistence == "u":
        return Finding(
            "persistence", OK,
            f"{table} is UNLOGGED: writes skip the WAL (about twice the write rate); a crash"
            " empties it and standbys do not have it",
        )  # fmt: skip
    return Finding(
        "persistence", OK,
        f"{table} is a logged table (created with --logged-counters): it survives a crash and"
        " is replicated, at about half the write rate of UNLOGGED",
    )  # fmt: skip


def fillfactor_finding(table: str, value: int) -> Finding:
    """A fillfactor leaving room on each page, so count updates can stay HOT."""
    if value <= MAX_FILLFACTOR:
        return Finding("fillfactor", OK, f"{table} fillfactor is {value}")
    return Finding(
        "fillfactor", WARN,
        f"{table} fillfactor is {value}: pages fill up, so count updates stop being HOT"
        " and write every index",
        f"ALTER TABLE {table} SET (fillfactor = 70); new pages use it at once, existing"
        f" ones after VACUUM FULL {table} (locks the table) or pg_repack",
    )  # fmt: skip


def hot_finding(table: str, updates: int, hot: int) -> Finding:
    """The share of updates PostgreSQL made HOT (no index write), from pg_stat_user_tables."""
    if updates < MIN_UPDATES_FOR_HOT:
        return Finding(
            "hot_updates", OK,
            f"{table}: {updates} updates so far, too few to judge the HOT ratio",
        )  # fmt: skip
    ratio = hot / updates
    if ratio >= MIN_HOT_RATIO:
        return Finding("hot_updates", OK, f"{table}: {ratio:.0%} of {updates} updates were HOT")
    return Finding(
        "hot_updates", WARN,
        f"{table}: only {ratio:.0%} of {updates} updates were HOT; the rest wrote every index",
        f"lower the fillfactor (ALTER TABLE {table} SET (fillfactor = 70)), schedule"
        " `quota cleanup` so pages keep free room, and check that no index was added on"
        " a column the updates change",
    )  # fmt: skip


# -- shared -----------------------------------------------------------------------------


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


def schema_finding(revision: str | None, url: str) -> Finding:
    """The database's revision against `REQUIRED`, judged as the stores judge it."""
    fix = f"run `{migrate_command(url)}`"
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


def _skew(query: Query, db_now: str, clock: Clock) -> Finding:
    before = clock()
    db_time = float(query(f"SELECT {db_now}")[0][0])
    after = clock()
    return skew_finding(((before + after) / 2) - db_time, (after - before) / 2)


def skew_finding(skew: float, uncertainty: float) -> Finding:
    """The app clock minus the database clock, in seconds, measured to ± `uncertainty`."""
    way = "ahead of" if skew > 0 else "behind"
    said = f"the app clock is {abs(skew):.3f}s {way} the database clock (±{uncertainty:.3f}s)"
    beyond = abs(skew) - uncertainty
    if beyond <= SKEW_WARN:
        return Finding("clock_skew", OK, said)
    fix = (
        "synchronise this host's clock (chrony or systemd-timesyncd), or connect with"
        " clock='database' so every decision takes the database's time"
    )
    if beyond < SKEW_ERROR:
        return Finding(
            "clock_skew", WARN,
            f"{said}: app servers whose clocks disagree count hits in different windows", fix,
        )  # fmt: skip
    return Finding(
        "clock_skew", ERROR,
        f"{said}: more than cleanup's default grace of {SKEW_ERROR:.0f}s, so a cleanup run"
        " from a host this far ahead deletes windows that are still running",
        fix,
    )  # fmt: skip
