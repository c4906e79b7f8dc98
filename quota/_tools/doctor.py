"""``quota doctor``: check a database the way the limiter will use it, and say what to fix.

`diagnose` connects to a store URL, changes nothing, and returns a list
of `Finding`: connectivity, the schema revision against what this code
needs, drift of the live schema from what the migrations made (a dropped
table, column, index or primary key, with the statement that restores it),
SQLite's version and journal mode, the PostgreSQL settings of the hot
tables (UNLOGGED or logged, fillfactor, the share of HOT updates; read from
the partitions of a partitioned table), a PostgreSQL session that is
read-only, the skew between this host's clock and the database's; on Redis
(every master of a cluster), connectivity and the ``maxmemory-policy`` (any
but ``noeviction`` can evict counters). Database failures become findings, never
exceptions, so a broken setup still gets a full report. The assessments are pure functions of the numbers read, so each
threshold is tested without a database.

Severities: ``ok``; ``warn`` (works, but slower or riskier than it should
be); ``error`` (the limiter will fail or misbehave). Every finding that is
not ``ok`` carries a ``fix``.
"""

from __future__ import annotations

import functools
import io
import os
import re
import sqlite3
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from quota._core.errors import ConfigurationError
from quota._core.url import StoreURL, default_url, parse_url, redact
from quota._sql.partitions import DEFAULT_PARTITION
from quota._sql.schema import (
    EPHEMERAL_TABLES,
    REQUIRED,
    REVISIONS,
    TABLE_REVISIONS,
    TABLES,
    ColumnShape,
    IndexShape,
    TableShape,
    expected_schema,
    normalize_sql,
)
from quota._sql.statements import DB_NOW, SCHEMA_VERSION, VERSION_TABLE
from quota.http._runtime import ANY, ROUTE_CLASS, unserved_route

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
    if parsed.dialect in ("redis", "redis-cluster"):
        return _diagnose_redis(parsed, timeout)
    return [Finding("url", OK, "a memory store keeps nothing outside this process to check")]


def display_url(url: str) -> str:
    """`url` without its password, for output."""
    return redact(url)


def migrate_command(url: str) -> str:
    """The command that creates or upgrades the tables at `url`, as the CLI takes it."""
    return f"quota --url '{redact(url)}' migrate"


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


# -- Redis ------------------------------------------------------------------------------

#: The one ``maxmemory-policy`` that never evicts quota's keys: a full Redis refuses
#: writes instead (each decision is then a statement error, logged and decided from memory).
SAFE_EVICTION = "noeviction"


def _diagnose_redis(parsed: StoreURL, timeout: float) -> list[Finding]:
    """Connectivity and the eviction policy of the Redis server (of every master of a
    cluster)."""
    shown = display_url(parsed.url)
    try:
        import redis
    except ImportError:
        return [
            Finding(
                "connectivity", ERROR, "redis-py is not installed", "pip install 'quota[redis]'"
            )
        ]  # fmt: skip
    cluster: Any = None
    try:
        options = {"socket_timeout": timeout, "socket_connect_timeout": timeout}
        if parsed.dialect == "redis":
            from quota._stores.redis import _checked_url

            target, _prefix = _checked_url(parsed.url)
            nodes = [(shown, redis.Redis.from_url(target, **options))]
        else:
            from redis.cluster import ClusterNode, RedisCluster

            from quota._stores.redis_cluster import parse_cluster_url

            found = parse_cluster_url(parsed.url)
            node: Any = ClusterNode  # redis-py leaves it unannotated
            cluster = RedisCluster(
                startup_nodes=[node(host, port) for host, port in found.nodes],
                **{**options, **found.options},
            )
            nodes = [(n.name, cluster.get_redis_connection(n)) for n in cluster.get_primaries()]
        for _, client in nodes:
            client.ping()
        versions = sorted({_redis_version(client) for _, client in nodes})
    except Exception as exc:
        if cluster is not None:
            cluster.close()
        return [
            Finding(
                "connectivity", ERROR, f"cannot connect to {shown}: {' '.join(str(exc).split())}",
                "check host, port and credentials, and that the server is up"
                " (`redis-cli -u URL ping`; a cluster: `redis-cli -c -h HOST -p PORT cluster info`)",
            )
        ]  # fmt: skip
    try:
        masters = f", {len(nodes)} masters" if cluster is not None else ""
        findings = [
            Finding("connectivity", OK, f"connected to Redis {', '.join(versions)}{masters}")
        ]
        for name, client in nodes:
            findings.append(eviction_finding(name, *_eviction_policy(client)))
        return findings
    finally:
        for _, client in nodes:
            client.close()
        if cluster is not None:
            cluster.close()


def _redis_version(client: Any) -> str:
    try:
        return str(client.info("server")["redis_version"])
    except Exception:  # INFO refused (an ACL): the version is only shown
        return "(version not readable)"


def _eviction_policy(client: Any) -> tuple[str | None, str]:
    """(``maxmemory-policy``, how it was read or why it could not be): ``CONFIG GET`` where
    the user may run it, else the ``maxmemory_policy`` of ``INFO memory``."""
    try:
        reply = client.config_get("maxmemory-policy")
        return str(reply["maxmemory-policy"]), ""
    except Exception as exc:
        refused = f"CONFIG GET was refused ({exc})"
    try:
        policy = client.info("memory")["maxmemory_policy"]
    except Exception as exc:
        return None, f"{refused}, and INFO memory too ({exc})"
    return str(policy), f"read from INFO memory: {refused}"


def eviction_finding(node: str, policy: str | None, how: str = "") -> Finding:
    """The finding of a Redis node's ``maxmemory-policy`` (None: it could not be read)."""
    fix = (
        "give quota a Redis of its own (not the app's cache) with maxmemory-policy noeviction"
        " (`CONFIG SET maxmemory-policy noeviction`, or the provider's parameter group)"
        " and enough memory for its keys; see Databases and URLs, Redis"
    )
    if policy is None:
        return Finding(
            "eviction", WARN, f"could not read the maxmemory-policy of {node}: {how}",
            f"make sure it is noeviction: {fix}",
        )  # fmt: skip
    note = f" ({how})" if how else ""
    if policy == SAFE_EVICTION:
        return Finding(
            "eviction", OK,
            f"{node} has maxmemory-policy noeviction: a full Redis refuses writes, it never"
            f" drops a counter{note}",
        )  # fmt: skip
    takes = (
        "evicts quota's keys as readily as any other's"
        if policy.startswith("allkeys")
        else "evicts keys with a TTL, and every quota key has one"
        + (", nearest expiry first: quota's go first" if policy == "volatile-ttl" else "")
    )
    return Finding(
        "eviction", WARN,
        f"{node} has maxmemory-policy {policy}: once Redis reaches maxmemory it {takes}, and a"
        f" caller at its limit whose counter is evicted is admitted again{note}",
        fix,
    )  # fmt: skip


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
        findings += _schema_checks(
            lambda: _version(query), lambda: sqlite_schema(query, TABLES), "sqlite", shown
        )
        findings += _route_classes(query)
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
    from quota._stores.sqlite import MIN_SQLITE  # imports aiosqlite: not at `import quota` time

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
        if parsed.schema:  # ?schema=NAME: look where the stores look
            conn.execute("SELECT set_config('search_path', %s, true)", (f'"{parsed.schema}"',))
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

        version, user, database, standby, read_only = query(
            "SELECT current_setting('server_version'), current_user, current_database(),"
            " pg_is_in_recovery(), current_setting('transaction_read_only')"
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
        elif read_only == "on":
            findings.append(read_only_finding(user, database))
        findings += _schema_checks(
            lambda: _pg_version(query), lambda: postgres_schema(query, TABLES), "postgresql", shown
        )
        findings += _route_classes(query)
        for table in HOT_TABLES:
            findings += _checked("persistence", functools.partial(_pg_table, query, table))
        findings += _checked("clock_skew", lambda: [_skew(query, DB_NOW["postgresql"], clock)])
    finally:
        conn.close()
    return findings


def read_only_finding(user: str, database: str) -> Finding:
    """The error of a session that starts read-only on a primary (the role's or the
    database's ``default_transaction_read_only``): every decision writes."""
    return Finding(
        "read_only", ERROR,
        f"sessions of role {user} on database {database} are read-only"
        " (default_transaction_read_only is on); every decision writes, so each one fails",
        f'ALTER ROLE "{user}" SET default_transaction_read_only = off (or ALTER DATABASE'
        f' "{database}" RESET default_transaction_read_only, wherever it was set), or connect'
        " as a role that may write",
    )  # fmt: skip


_TABLE_FACTS = (
    "SELECT c.relkind, c.relpersistence, c.reloptions, s.n_tup_upd, s.n_tup_hot_upd"
    " FROM pg_class c LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid"
    " WHERE c.oid = to_regclass(%s)"
)
#: The partitions of a partitioned table: the rows, and so the settings that matter, are theirs.
_PARTITION_FACTS = (
    "SELECT p.relname, pg_get_expr(p.relpartbound, p.oid) = 'DEFAULT', p.relpersistence,"
    " p.reloptions, s.n_tup_upd, s.n_tup_hot_upd"
    " FROM pg_inherits i JOIN pg_class p ON p.oid = i.inhrelid"
    " LEFT JOIN pg_stat_user_tables s ON s.relid = p.oid"
    " WHERE i.inhparent = to_regclass(%s) ORDER BY p.relname"
)


@dataclass(frozen=True, slots=True)
class Partition:
    """One partition of a partitioned table, as `partitioned_findings` judges it."""

    name: str
    default: bool
    relpersistence: str
    fillfactor: int
    updates: int = 0
    hot: int = 0


def _pg_table(query: Callable[..., Sequence[Sequence[Any]]], table: str) -> list[Finding]:
    rows = query(_TABLE_FACTS, (table,))
    if not rows:
        return []  # not created (yet): the schema finding says so
    relkind, persistence, options, updates, hot = rows[0]
    if relkind == "p":
        partitions = [
            Partition(
                str(name), bool(default), str(kind), fillfactor(opts), int(upd or 0), int(h or 0)
            )
            for name, default, kind, opts, upd, h in query(_PARTITION_FACTS, (table,))
        ]
        return partitioned_findings(table, partitions)
    return [
        persistence_finding(table, str(persistence)),
        fillfactor_finding(table, fillfactor(options)),
        hot_finding(table, int(updates or 0), int(hot or 0)),
    ]


#: At most this many partitions are named in one finding.
_NAMED = 5


def _names(partitions: Sequence[Partition]) -> str:
    names = [p.name for p in partitions[:_NAMED]]
    return ", ".join(names) + (
        f" and {len(partitions) - _NAMED} more" if partitions[_NAMED:] else ""
    )


def partitioned_findings(table: str, partitions: Sequence[Partition]) -> list[Finding]:
    """Persistence, fillfactor and HOT updates of a partitioned table, read from its partitions.

    The parent holds no rows and takes no storage settings (PostgreSQL refuses a
    fillfactor on it); new partitions take the DEFAULT partition's persistence and
    `quota._sql.partitions.STORAGE`. No partitions at all: the schema_drift check says so.
    """
    if not partitions:
        return []
    reference = next((p for p in partitions if p.default), partitions[0])
    odd = [p for p in partitions if p.relpersistence != reference.relpersistence]
    if odd:
        wanted = "UNLOGGED" if reference.relpersistence == "u" else "LOGGED"
        persistence = Finding(
            "persistence", WARN,
            f"the partitions of {table} disagree: {_names(odd)} are not {wanted} like"
            f" {reference.name}, whose kind new partitions take",
            _statements([f"ALTER TABLE {p.name} SET {wanted}" for p in odd]),
        )  # fmt: skip
    else:
        persistence = persistence_finding(table, reference.relpersistence, len(partitions))
    full = [p for p in partitions if p.fillfactor > MAX_FILLFACTOR]
    if full:
        fill = Finding(
            "fillfactor", WARN,
            f"{table}: fillfactor {', '.join(sorted({str(p.fillfactor) for p in full}))} in"
            f" {_names(full)}: pages fill up, so count updates stop being HOT and write every"
            " index",
            _statements([f"ALTER TABLE {p.name} SET (fillfactor = 70)" for p in full])
            + "; new pages use it at once (new partitions get 70 from `quota cleanup`)",
        )  # fmt: skip
    else:
        values = sorted({p.fillfactor for p in partitions})
        spread = str(values[0]) if len(values) == 1 else f"{values[0]} to {values[-1]}"
        fill = Finding(
            "fillfactor", OK, f"{table} fillfactor is {spread} in its {len(partitions)} partitions"
        )
    updates = sum(p.updates for p in partitions)
    return [persistence, fill, hot_finding(table, updates, sum(p.hot for p in partitions))]


def fillfactor(reloptions: Sequence[str] | None) -> int:
    """The fillfactor in a table's ``pg_class.reloptions`` (100 when not set)."""
    for option in reloptions or ():
        name, _, value = option.partition("=")
        if name == "fillfactor":
            return int(value)
    return 100


def persistence_finding(table: str, relpersistence: str, partitions: int = 0) -> Finding:
    """UNLOGGED (the default) or logged: both are deliberate choices, so both are ok.

    `partitions`: how many partitions of a partitioned `table` share that persistence.
    """
    where = f" (all {partitions} of its partitions)" if partitions else ""
    if relpersistence == "u":
        return Finding(
            "persistence", OK,
            f"{table} is UNLOGGED{where}: writes skip the WAL (about twice the write rate); a crash"
            " empties it and standbys do not have it",
        )  # fmt: skip
    return Finding(
        "persistence", OK,
        f"{table} is a logged table{where} (created with --logged-counters): it survives a crash and"
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


# -- schema drift -------------------------------------------------------------------------
#
# The revision in the version table says which migrations ran, not that what they made
# is still there: a dropped index, column or table (a hand-run "cleanup", a restore that
# skipped UNLOGGED tables, a host app's migration that touched ours) leaves the revision
# at head. `schema_drift` compares the live tables with what the migrations make
# (`quota._sql.schema.expected_schema`, from the metadata the tests hold to the
# migrations) and takes every fix it offers from the migrations' own SQL, rendered
# offline (`migration_ddl`).

#: Tables updated in place on every decision or charge: an index on them that quota does
#: not make costs every update (and HOT updates), so one is worth a warning.
UPDATED_IN_PLACE = ("quota_counters", "quota_state", "quota_usage")
#: Tables that hold money or configuration: they must survive a crash.
DURABLE_TABLES = (
    "quota_usage", "quota_ledger", "quota_policies", "quota_settings", VERSION_TABLE,
)  # fmt: skip

#: What breaks without a table.
_TABLE_ROLE = {
    "quota_counters": "fixed-window decisions fail",
    "quota_state": "sliding-window, token-bucket and GCRA decisions fail",
    "quota_usage": "durable quotas fail",
    "quota_ledger": "durable quotas fail",
    "quota_policies": "runtime policy overrides (`quota policy`, the HTTP middlewares) fail",
    "quota_settings": (
        "the HTTP middlewares keep their configured tier multipliers and abuse threshold"
        " (`quota policy multiplier`, `quota policy abuse-threshold` fail)"
    ),
    "quota_leases": "concurrency blocks (`limiter.concurrency`) fail",
    VERSION_TABLE: "quota cannot tell which migrations ran",
}
#: What breaks without an index.
_INDEX_ROLE = {
    "uq_quota_ledger_idempotency": (
        "charges with an idempotency key fail (their INSERT … ON CONFLICT has no unique"
        " index to infer), and nothing stops a key from being charged twice"
    ),
    "ix_quota_counters_window_end": "cleanup scans the whole counters table",
    "ix_quota_state_expires_at": "cleanup scans the whole state table",
    "ix_quota_ledger_subject_at": "`quota ledger SUBJECT --since` scans the whole ledger",
    "ix_quota_ledger_at": "ledger retention by age scans the whole ledger",
    "ix_quota_leases_expires_at": "cleanup scans the whole leases table",
}
#: Tables whose primary key is an upsert's ON CONFLICT target.
_UPSERTED = (
    "quota_counters", "quota_state", "quota_usage", "quota_policies", "quota_settings",
    "quota_leases",
)  # fmt: skip

_SQLITE_REBUILD = "https://www.sqlite.org/lang_altertable.html#otheralter"


@dataclass(frozen=True, slots=True)
class MigrationDdl:
    """The statements the migrations run on one dialect, each with its revision."""

    statements: tuple[tuple[str, str], ...]
    """(revision, statement) in the order the migrations run them, on one line each."""

    @classmethod
    def parse(cls, script: str) -> MigrationDdl:
        """Split the SQL `quota migrate --sql` writes into statements tagged by revision."""
        revision = REVISIONS[0]
        statements = []
        for chunk in script.split(";\n"):
            lines = []
            for line in chunk.splitlines():
                running = re.match(r"-- Running upgrade \S* -> (\S+)", line.strip())
                if running:
                    revision = running[1]
                elif not line.strip().startswith("--"):
                    lines.append(line)
            text = " ".join(" ".join(lines).split())
            text = text.replace("( ", "(").replace(" )", ")")
            if text and text.upper() not in ("BEGIN", "COMMIT"):
                statements.append((revision, text))
        return cls(tuple(statements))

    def index(self, name: str) -> tuple[str, str] | None:
        """(revision, ``CREATE INDEX``) of the index `name`."""
        pattern = re.compile(rf"CREATE (UNIQUE )?INDEX {re.escape(name)} ON ")
        return next(((r, s) for r, s in self.statements if pattern.match(s)), None)

    def table(self, name: str) -> tuple[str, list[str]]:
        """(revision, statements) that make the table `name`: ``CREATE TABLE``, its
        indexes, its storage settings and its DEFAULT partition."""
        create = re.compile(rf"CREATE (UNLOGGED )?TABLE {re.escape(name)} \(")
        revision = ""
        found = []
        for rev, statement in self.statements:
            if create.match(statement):
                revision = rev
                found.append(statement)
            elif revision and (
                re.match(rf"CREATE (UNIQUE )?INDEX \w+ ON {re.escape(name)} ", statement)
                or statement.startswith(f"ALTER TABLE {name} SET (")
                or re.match(rf"CREATE (UNLOGGED )?TABLE \w+ PARTITION OF {name} DEFAULT", statement)
            ):
                found.append(statement)
        return revision, found


@functools.cache
def migration_ddl(dialect: str, *, logged: bool = False, partitioned: bool = False) -> MigrationDdl:
    """What ``quota migrate --sql`` writes for `dialect`, parsed (no database is touched)."""
    from quota._sql.migrate import migrate  # alembic: only when a fix needs the statements

    url = (
        "sqlite:///quota-offline.db" if dialect == "sqlite" else "postgresql://quota@offline/quota"
    )
    output = io.StringIO()
    migrate(url, sql=True, output=output, counters_logged=logged, counters_partitioned=partitioned)
    return MigrationDdl.parse(output.getvalue())


def _statements(statements: Sequence[str]) -> str:
    return "`" + "; ".join(statements) + "`"


def _behind(revision: str | None, created_in: str) -> bool:
    """True when the migration `created_in` has not run yet on a database at `revision`."""
    if revision is None or revision not in REVISIONS or created_in not in REVISIONS:
        return False
    return REVISIONS.index(created_in) > REVISIONS.index(revision)


@dataclass(frozen=True)
class _Drift:
    """Builds the findings of one comparison: the fixes need the dialect and the DDL."""

    dialect: str
    logged: bool
    """Whether the ephemeral tables that are there are logged (--logged-counters)."""
    ddl: Callable[[], MigrationDdl]

    @property
    def postgres(self) -> bool:
        return self.dialect == "postgresql"

    def error(self, message: str, fix: str) -> Finding:
        return Finding("schema_drift", ERROR, message, fix)

    def warn(self, message: str, fix: str) -> Finding:
        return Finding("schema_drift", WARN, message, fix)

    def recreate(self, table: str) -> str:
        """The fix that drops a table and makes it again, for a table whose rows may go."""
        revision, statements = self.ddl().table(table)
        partitioned = any(" PARTITION OF " in s for s in statements)
        return (
            f"its rows are ephemeral (every client gets a fresh window once), so recreate it"
            f" as migration {revision} made it: {_statements([f'DROP TABLE {table}', *statements])}"
            + ("; then `quota cleanup` makes the partitions ahead" if partitioned else "")
        )

    def rebuild(self, table: str) -> str:
        """The fix for a durable table SQLite cannot alter in place."""
        revision, statements = self.ddl().table(table)
        if table in EPHEMERAL_TABLES:
            return self.recreate(table)
        return (
            f"rebuild it as migration {revision} made it, keeping its rows ({_SQLITE_REBUILD}):"
            f" create it under a new name from {_statements(statements[:1])}, copy the rows"
            " over, drop the old table, rename the new one"
            + (f", then run {_statements(statements[1:])}" if statements[1:] else "")
        )

    def table_missing(self, table: str, revision: str) -> Finding:
        created_in, statements = self.ddl().table(table)
        unlogged = self.postgres and table in EPHEMERAL_TABLES and not self.logged
        return self.error(
            f"table {table} is missing although the schema is at revision {revision}:"
            f" {_TABLE_ROLE.get(table, 'quota cannot use it')}",
            f"restore it as migration {created_in} made it: {_statements(statements)}"
            + (" (without UNLOGGED if it was migrated with --logged-counters)" if unlogged else ""),
        )

    def version_table_missing(self, present: Sequence[str], empty: bool) -> Finding:
        _, statements = self.ddl().table(VERSION_TABLE)
        stamp = REVISIONS[0]
        for revision in REVISIONS:
            if all(
                t in present
                for t, r in TABLE_REVISIONS.items()
                if r == revision and t != VERSION_TABLE
            ):
                stamp = revision
        insert = f"INSERT INTO {VERSION_TABLE} (version_num) VALUES ('{stamp}')"
        said = "is empty" if empty else "is missing"
        return self.error(
            f"the version table {VERSION_TABLE} {said}, yet quota tables are here"
            f" ({', '.join(sorted(present))}): `quota migrate` would try to create them again",
            f"record the revision those tables match ({stamp}):"
            f" {_statements([insert] if empty else [*statements, insert])}; then run"
            " `quota doctor` again",
        )

    def columns(self, want: TableShape, have: TableShape) -> list[Finding]:
        findings = []
        table = want.name
        for column in want.columns:
            live = have.column(column.name)
            if live is None:
                findings.append(self.column_missing(want, column))
                continue
            spelled = f"{column.type}" + (
                f' COLLATE "{column.collation}"' if column.collation else ""
            )
            if live.type != column.type:
                fix = (
                    f"`ALTER TABLE {table} ALTER COLUMN {column.name} TYPE {spelled}`"
                    " (rewrites the table under a lock)"
                    if self.postgres
                    else self.rebuild(table)
                )
                findings.append(
                    self.error(
                        f"column {table}.{column.name} is {live.type}; the migrations make it"
                        f" {column.type}",
                        fix,
                    )
                )
            elif live.collation != column.collation:
                findings.append(
                    self.warn(
                        f"column {table}.{column.name} has collation"
                        f" {live.collation or 'default'}; the migrations give it"
                        f" {column.collation or 'the default'} (keys compare as bytes: the"
                        " fastest btree order)",
                        f"`ALTER TABLE {table} ALTER COLUMN {column.name} TYPE {spelled}`"
                        " (rewrites the table under a lock)",
                    )
                )
            if live.nullable and not column.nullable:
                findings.append(
                    self.warn(
                        f"column {table}.{column.name} accepts NULL; the migrations make it"
                        " NOT NULL",
                        f"`ALTER TABLE {table} ALTER COLUMN {column.name} SET NOT NULL`"
                        if self.postgres
                        else self.rebuild(table),
                    )
                )
            elif not live.nullable and column.nullable:
                findings.append(
                    self.error(
                        f"column {table}.{column.name} is NOT NULL; the migrations let it be"
                        " NULL, and quota writes rows that leave it NULL",
                        f"`ALTER TABLE {table} ALTER COLUMN {column.name} DROP NOT NULL`"
                        if self.postgres
                        else self.rebuild(table),
                    )
                )
        known = {c.name for c in want.columns}
        for live in have.columns:
            if live.name not in known and not live.nullable and not live.has_default:
                findings.append(
                    self.error(
                        f"column {table}.{live.name} is not one the migrations make, and is"
                        " NOT NULL without a default: every row quota inserts fails",
                        f"`ALTER TABLE {table} DROP COLUMN {live.name}` (or give it a default)",
                    )
                )
        return findings

    def column_missing(self, want: TableShape, column: ColumnShape) -> Finding:
        table = want.name
        revision, statements = self.ddl().table(table)
        definition = _column_definition(statements[0] if statements else "", column.name)
        message = (
            f"column {table}.{column.name} is missing (migration {revision} makes it"
            f" `{definition}`): statements that use it fail"
        )
        if table in EPHEMERAL_TABLES:
            return self.error(message, self.recreate(table))
        if column.nullable:
            return self.error(message, f"`ALTER TABLE {table} ADD COLUMN {definition}`")
        nullable = definition.replace(" NOT NULL", "")
        fix = f"add it back with `ALTER TABLE {table} ADD COLUMN {nullable}`, fill it, then " + (
            f"`ALTER TABLE {table} ALTER COLUMN {column.name} SET NOT NULL`"
            if self.postgres
            else "make it NOT NULL by a rebuild: " + self.rebuild(table)
        )
        return self.error(message, fix)

    def primary_key(self, want: TableShape, have: TableShape) -> list[Finding]:
        if have.primary_key == want.primary_key:
            return []
        table = want.name
        columns = ", ".join(want.primary_key)
        role = (
            "its upserts fail (their ON CONFLICT target has no unique index)"
            if table in _UPSERTED
            else "its rows lose their key"
        )
        said = (
            f"has no primary key; the migrations make it ({columns})"
            if not have.primary_key
            else f"has the primary key ({', '.join(have.primary_key)}); the migrations make it"
            f" ({columns})"
        )
        if self.postgres:
            add = (
                f"ADD CONSTRAINT {want.primary_key_name} PRIMARY KEY ({columns})"
                if want.primary_key_name
                else f"ADD PRIMARY KEY ({columns})"
            )
            drop = f"DROP CONSTRAINT {have.primary_key_name}, " if have.primary_key else ""
            fix = f"`ALTER TABLE {table} {drop}{add}`"
        else:
            fix = self.rebuild(table)
        return [self.error(f"table {table} {said}: {role}", fix)]

    def indexes(self, want: TableShape, have: TableShape, revision: str | None) -> list[Finding]:
        findings = []
        table = want.name
        matched = set()
        for index in want.indexes:
            live = have.index(index.name)
            severity = ERROR if index.unique else WARN
            kind = "unique index" if index.unique else "index"
            role = _INDEX_ROLE.get(index.name, "queries that use it slow down")
            if live is not None:
                matched.add(live.name)
            else:
                twin = next((i for i in have.indexes if i.same_definition(index) and i.valid), None)
                if twin is not None:
                    matched.add(twin.name)
                    findings.append(
                        self.warn(
                            f"{kind} {index.name} on {table} is there as {twin.name}: it works,"
                            " but `quota downgrade` looks for it by its name",
                            f"`ALTER INDEX {twin.name} RENAME TO {index.name}`"
                            if self.postgres
                            else _statements([f"DROP INDEX {twin.name}", self.create(index.name)]),
                        )
                    )
                    continue
            if live is None:
                created_in, statement = self.ddl().index(index.name) or ("", "")
                if _behind(revision, created_in):
                    continue  # the migration has not run yet: the schema finding says so
                findings.append(
                    Finding(
                        "schema_drift", severity, f"{kind} {index.name} on {table} is missing: {role}",
                        f"recreate it as migration {created_in} made it: `{statement}`",
                    )
                )  # fmt: skip
            elif not live.valid:
                findings.append(
                    Finding(
                        "schema_drift", severity,
                        f"{kind} {index.name} on {table} is INVALID (a CREATE INDEX"
                        f" CONCURRENTLY that failed?), so PostgreSQL does not use it: {role}",
                        f"`REINDEX INDEX {index.name}`"
                        + (
                            " (if it fails on duplicate keys, those rows are what the index"
                            " is there to prevent: resolve them first)"
                            if index.unique
                            else ""
                        ),
                    )
                )  # fmt: skip
            elif not live.same_definition(index):
                findings.append(
                    Finding(
                        "schema_drift", severity,
                        f"{kind} {index.name} on {table} is not the one the migrations make"
                        f" ({_index_words(live, True)} instead of {_index_words(index, True)}):"
                        f" {role}",
                        _statements([f"DROP INDEX {index.name}", self.create(index.name)]),
                    )
                )  # fmt: skip
        for live in have.indexes:
            if live.name in matched:
                continue
            if live.unique:
                findings.append(
                    self.warn(
                        f"unique index {live.name} on {table} {_index_words(live)} is not one"
                        " the migrations make: it may reject rows quota writes",
                        f"`DROP INDEX {live.name}` unless something else needs it",
                    )
                )
            elif table in UPDATED_IN_PLACE:
                findings.append(
                    self.warn(
                        f"index {live.name} on {table} {_index_words(live)} is not one the"
                        " migrations make: every update of a column it covers writes it too"
                        " (no HOT update)",
                        f"`DROP INDEX {live.name}` unless something else needs it",
                    )
                )
        return findings

    def create(self, index: str) -> str:
        return (self.ddl().index(index) or ("", ""))[1]

    def storage(self, want: TableShape, have: TableShape) -> list[Finding]:
        table = want.name
        findings = []
        if have.partitioned and not want.partitioned:
            fix = self.recreate(table) if table in EPHEMERAL_TABLES else self.rebuild(table)
            findings.append(
                self.error(
                    f"table {table} is partitioned; no migration makes it so, and quota's"
                    " statements need it plain",
                    fix,
                )
            )
        if want.partitioned and not have.default_partition:
            _, statements = self.ddl().table(table)
            default = [s for s in statements if " PARTITION OF " in s]
            findings.append(
                self.error(
                    f"the partitioned {table} has no DEFAULT partition {DEFAULT_PARTITION}:"
                    " a window outside every partition cannot be counted",
                    f"restore it as the migration made it: {_statements(default)}",
                )
            )
        if self.postgres and have.unlogged and table in DURABLE_TABLES:
            findings.append(
                self.error(
                    f"table {table} is UNLOGGED: a database crash empties it, and standbys do"
                    " not have it; the migrations make it a logged table",
                    f"`ALTER TABLE {table} SET LOGGED` (rewrites the table under a lock)",
                )
            )
        if want.without_rowid and have.without_rowid is False:
            findings.append(
                self.warn(
                    f"table {table} is a rowid table; the migrations make it WITHOUT ROWID, so"
                    " a lookup by key reads one b-tree instead of two",
                    self.rebuild(table),
                )
            )
        return findings


def _index_words(index: IndexShape, unique: bool = False) -> str:
    """``(subject, at)``, ``UNIQUE (…) WHERE …`` (UNIQUE only when `unique`)."""
    words = ("UNIQUE " if unique and index.unique else "") + f"({', '.join(index.keys)})"
    return words + (f" WHERE {index.where}" if index.where else "")


def _column_definition(create_table: str, column: str) -> str:
    """The definition of `column` in a one-line ``CREATE TABLE`` (``count BIGINT NOT NULL``)."""
    opened = create_table.find("(")
    end = _closing(create_table, opened)
    for item in _split_top_level(create_table[opened + 1 : end] if end else ""):
        if item.strip().startswith(f"{column} "):
            return item.strip()
    return column


def _closing(text: str, opened: int) -> int | None:
    """Where the parenthesis opened at `opened` closes."""
    depth = 0
    for at in range(max(opened, 0), len(text)):
        depth += (text[at] == "(") - (text[at] == ")")
        if depth == 0:
            return at
    return None


def drift_findings(
    expected: dict[str, TableShape],
    live: dict[str, TableShape],
    *,
    dialect: str,
    revision: str | None,
    url: str,
    ddl: Callable[[], MigrationDdl] | None = None,
) -> list[Finding]:
    """Every difference between the `live` tables and the `expected` ones, with its fix.

    `revision` is the one in the version table (None without one); objects a migration
    not run yet would make are left to the schema finding, in one finding saying to
    migrate. Pure, but for the migrations rendered offline when a fix needs a statement
    (`ddl`, default `migration_ddl`).
    """
    if revision is not None and revision not in REVISIONS:
        return []  # newer code migrated it: the schema finding says so; no head to compare to
    logged = any(not t.unlogged for n, t in live.items() if n in EPHEMERAL_TABLES)
    counters = live.get("quota_counters")
    partitioned = counters is not None and counters.partitioned
    drift = _Drift(
        dialect, logged,
        ddl or (lambda: migration_ddl(dialect, logged=logged, partitioned=partitioned)),
    )  # fmt: skip
    present = [name for name in expected if name in live and name != VERSION_TABLE]
    if revision is None:
        if present:
            return [drift.version_table_missing(present, empty=VERSION_TABLE in live)]
        return []  # nothing migrated: the schema finding says to migrate
    findings: list[Finding] = []
    later = [
        name for name in expected
        if name not in live and _behind(revision, TABLE_REVISIONS.get(name, ""))
    ]  # fmt: skip
    if any(not _behind(REQUIRED, TABLE_REVISIONS[name]) for name in later):
        findings.append(
            drift.error(
                f"the schema is at revision {revision}, so {', '.join(later)} (made by later"
                " migrations) are not here yet",
                f"run `{migrate_command(url)}`",
            )
        )
    elif later:  # only tables this code runs without (see `quota._sql.schema.REQUIRED`)
        findings.append(
            drift.warn(
                f"the schema is at revision {revision}, so {', '.join(later)} (made by a later"
                f" migration) {'is' if len(later) == 1 else 'are'} not here yet: "
                + "; ".join(_TABLE_ROLE.get(name, "unused") for name in later),
                f"run `{migrate_command(url)}`",
            )
        )
    for name, want in expected.items():
        have = live.get(name)
        if have is None:
            if name not in later:
                findings.append(drift.table_missing(name, revision))
            continue
        findings += drift.storage(want, have)
        findings += drift.columns(want, have)
        findings += drift.primary_key(want, have)
        findings += drift.indexes(want, have, revision)
    if not findings:
        findings.append(
            Finding(
                "schema_drift", OK,
                f"the tables, columns, indexes and primary keys are those revision {revision}"
                " makes",
            )
        )  # fmt: skip
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


# -- reading the live schema ----------------------------------------------------------


def _sqlite_quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _split_top_level(text: str) -> list[str]:
    """`text` split at the commas outside parentheses."""
    parts, depth, current = [], 0, ""
    for char in text:
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
            continue
        depth += (char == "(") - (char == ")")
        current += char
    return [*parts, current]


def sqlite_index_shape(name: str, sql: str, unique: bool) -> IndexShape | None:
    """An index from its ``CREATE INDEX`` in ``sqlite_master`` (None when it cannot be read)."""
    match = re.search(r"\sON\s+(\"[^\"]+\"|[^\s(]+)\s*\(", sql, re.IGNORECASE)
    if not match:
        return None
    opened = match.end() - 1
    end = _closing(sql, opened)
    if end is None:
        return None
    keys = tuple(normalize_sql(k) for k in _split_top_level(sql[opened + 1 : end]))
    where = re.match(r"\s*WHERE\s+(.*)$", sql[end + 1 :], re.IGNORECASE | re.DOTALL)
    return IndexShape(name, keys, unique, normalize_sql(where[1]) if where else "")


def sqlite_schema(query: Query, tables: Sequence[str]) -> dict[str, TableShape]:
    """The `tables` that exist in a SQLite database, as they are."""
    master = {
        (str(kind), str(name)): (str(table), str(sql or ""))
        for kind, name, table, sql in query("SELECT type, name, tbl_name, sql FROM sqlite_master")
    }
    shapes = {}
    for table in tables:
        if ("table", table) not in master:
            continue
        info = query(f"PRAGMA table_info({_sqlite_quote(table)})")
        rowless = bool(re.search(r"\)\s*WITHOUT\s+ROWID\s*$", master[("table", table)][1], re.I))
        # A WITHOUT ROWID table's key columns are NOT NULL, declared so or not.
        columns = tuple(
            ColumnShape(
                str(name), " ".join(str(type_).upper().split()),
                not notnull and not (pk and rowless), has_default=default is not None,
            )
            for _cid, name, type_, notnull, default, pk in info
        )  # fmt: skip
        primary_key = tuple(str(row[1]) for row in sorted(info, key=lambda r: r[5]) if row[5])
        indexes = []
        for _seq, name, unique, origin, _partial in query(
            f"PRAGMA index_list({_sqlite_quote(table)})"
        ):
            if origin == "pk":
                continue
            sql = master.get(("index", str(name)), ("", ""))[1]
            shape = sqlite_index_shape(str(name), sql, bool(unique)) if sql else None
            if shape is None:  # a UNIQUE constraint of the table: its columns only
                keys = query(f"PRAGMA index_info({_sqlite_quote(str(name))})")
                shape = IndexShape(str(name), tuple(str(k[2]) for k in keys), bool(unique))
            indexes.append(shape)
        shapes[table] = TableShape(
            table, columns, primary_key, tuple(indexes), without_rowid=rowless
        )
    return shapes


#: Per table: its kind, its persistence (a partitioned table's: its DEFAULT partition's, else
#: any partition's) and its DEFAULT partition.
_PG_TABLES = (
    "SELECT t.name, c.relkind, coalesce(d.relpersistence, c.relpersistence),"
    " CASE WHEN d.is_default THEN d.relname END"
    " FROM unnest(%s::text[]) AS t(name) JOIN pg_class c ON c.oid = to_regclass(t.name)"
    " LEFT JOIN LATERAL (SELECT p.relname::text, p.relpersistence,"
    "  pg_get_expr(p.relpartbound, p.oid) = 'DEFAULT' AS is_default"
    "  FROM pg_inherits i JOIN pg_class p ON p.oid = i.inhrelid WHERE i.inhparent = c.oid"
    "  ORDER BY 3 DESC LIMIT 1) d ON true"
)
_PG_COLUMNS = (
    "SELECT c.relname, a.attname, format_type(a.atttypid, a.atttypmod), NOT a.attnotnull,"
    " CASE WHEN a.attcollation <> y.typcollation THEN l.collname END, a.atthasdef"
    " FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid"
    " JOIN pg_type y ON y.oid = a.atttypid LEFT JOIN pg_collation l ON l.oid = a.attcollation"
    " WHERE a.attrelid IN (SELECT to_regclass(n) FROM unnest(%s::text[]) AS n)"
    " AND a.attnum > 0 AND NOT a.attisdropped ORDER BY c.relname, a.attnum"
)
_PG_INDEXES = (
    "SELECT c.relname, i.relname, x.indisunique, x.indisprimary, x.indisvalid,"
    " ARRAY(SELECT pg_get_indexdef(x.indexrelid, k, true)"
    "  FROM generate_series(1, x.indnkeyatts) AS k ORDER BY k),"
    " pg_get_expr(x.indpred, x.indrelid, true)"
    " FROM pg_index x JOIN pg_class i ON i.oid = x.indexrelid JOIN pg_class c ON c.oid = x.indrelid"
    " WHERE x.indrelid IN (SELECT to_regclass(n) FROM unnest(%s::text[]) AS n)"
    " ORDER BY c.relname, i.relname"
)


def postgres_schema(
    query: Callable[..., Sequence[Sequence[Any]]], tables: Sequence[str]
) -> dict[str, TableShape]:
    """The `tables` that exist in a PostgreSQL database (on its search path), as they are."""
    names = list(tables)
    found = {str(r[0]): r for r in query(_PG_TABLES, (names,))}
    columns: dict[str, list[ColumnShape]] = {}
    for table, name, type_, nullable, collation, default in query(_PG_COLUMNS, (names,)):
        columns.setdefault(str(table), []).append(
            ColumnShape(str(name), str(type_), bool(nullable), collation, bool(default))
        )
    indexes: dict[str, list[IndexShape]] = {}
    primary: dict[str, tuple[str, tuple[str, ...]]] = {}
    for table, name, unique, is_primary, valid, keys, where in query(_PG_INDEXES, (names,)):
        normalized = tuple(normalize_sql(str(k)) for k in keys)
        if is_primary:
            primary[str(table)] = (str(name), normalized)
            continue
        indexes.setdefault(str(table), []).append(
            IndexShape(
                str(name), normalized, bool(unique), normalize_sql(str(where or "")), bool(valid)
            )
        )
    shapes = {}
    for table, (_, relkind, persistence, default) in found.items():
        pk_name, pk = primary.get(table, ("", ()))
        shapes[table] = TableShape(
            table, tuple(columns.get(table, ())), pk, tuple(indexes.get(table, ())),
            primary_key_name=pk_name, partitioned=relkind == "p",
            unlogged=persistence == "u", default_partition=str(default or ""),
        )  # fmt: skip
    return shapes


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

    findings = _checked("schema", schema)
    if revision:
        findings += _checked("schema_drift", lambda: _drift(read_once, dialect, revision[0], url))
    return findings


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


# -- route classes -------------------------------------------------------------------------

_OVERRIDE_ROUTES = (
    "SELECT route, rates, algorithm, cost, fail_open, exempt FROM quota_policies ORDER BY route"
)
_SETTING_NAMES = "SELECT name, value FROM quota_settings ORDER BY name"


def _route_classes(query: Query) -> list[Finding]:
    """The ``route_classes`` finding; none when the tables cannot be read (the schema
    findings say why)."""
    try:
        overrides = [str(row[0]) for row in query(_OVERRIDE_ROUTES) if any(row[1:5]) or row[5]]
        names = [str(row[0]) for row in query(_SETTING_NAMES) if row[1] is not None]
    except Exception:
        return []
    served = [n[len(ROUTE_CLASS) :] for n in names if n.startswith(ROUTE_CLASS)]
    return route_class_findings(overrides, served)


def route_class_findings(overrides: Sequence[str], served: Sequence[str]) -> list[Finding]:
    """Overrides (their route names) against the route classes the middlewares serve.

    An override of a class no middleware serves changes nothing: a warning
    naming the classes served and the closest one. Nothing is said when no
    override names a class, or when no middleware has recorded its classes.
    """
    named = sorted({route for route in overrides if route != ANY})
    if not named:
        return []
    if not served:
        return [
            Finding(
                "route_classes", OK,
                f"{len(named)} route class(es) overridden; no middleware has recorded the"
                " classes it serves yet (each does at its first request), so they were not"
                " checked",
            )
        ]  # fmt: skip
    served = sorted(set(served))
    problems = [message for route in named if (message := unserved_route(route, served))]
    if not problems:
        return [
            Finding(
                "route_classes", OK,
                f"every overridden route class is served ({', '.join(named)})",
            )
        ]  # fmt: skip
    unknown = [route for route in named if route not in served]
    return [
        Finding(
            "route_classes", WARN, problem,
            f"check the spelling: `quota policy delete {route}` (with its --subject), then"
            " set it again under the name of a class served",
        )
        for route, problem in zip(unknown, problems, strict=True)
    ]  # fmt: skip


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
