"""Schema migrations: one public function upgrades a database, everything reaches it.

`migrate` takes a store URL or a SQLAlchemy connection the host app already
holds (for its own deploy step or its own Alembic ``env.py``). ``quota
migrate`` and ``alembic upgrade head`` (from a checkout) both end in the same
Alembic environment, `run_env`, which keeps its own version table
(``quota_alembic_version``) so a host app's Alembic history never collides
with ours.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import re
import sys
import time
from collections.abc import Iterator
from importlib import resources
from typing import Any, TextIO

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.runtime.environment import EnvironmentContext

from quota._core.errors import ConfigurationError, SchemaError, StorageError
from quota._core.parsing import parse_flag
from quota._core.redaction import redact
from quota._core.url import check_schema, default_url, parse_url
from quota._sql.schema import include_name, include_object, metadata, missing_sqlite_file
from quota._sql.statements import VERSION_TABLE

#: Options a migration reads, from ``migrate(**options)`` or ``alembic -x name=value``.
OPTION_COUNTERS_LOGGED = "counters_logged"
#: PostgreSQL: counters range-partitioned by window start (see `quota._sql.partitions`).
OPTION_COUNTERS_PARTITIONED = "counters_partitioned"


def _script_location() -> str:
    return str(resources.files("quota._migrations"))


def _config(output: TextIO | None = None) -> Config:
    cfg = Config(stdout=output or sys.stdout, output_buffer=output or sys.stdout)
    cfg.set_main_option("script_location", _script_location())
    return cfg


def option(context: Any, name: str) -> bool:
    """A boolean migration option: ``config.attributes[name]`` or ``-x name=…`` (default False).

    Raises `ConfigurationError` naming the option for a value that is no
    true/false word (``-x counters_logged=ture`` would otherwise migrate as if
    it were false).
    """
    value = context.config.attributes.get(name)
    if value is None:
        value = context.get_x_argument(as_dictionary=True).get(name)
    if value is None:
        return False
    flag = value if isinstance(value, bool) else parse_flag(str(value))
    if flag is None:
        raise ConfigurationError(
            f"migration option {name} must be true or false (1, yes, on / 0, no, off),"
            f" got {value!r}"
        )
    return flag


def run_env(context: EnvironmentContext) -> None:
    """The body of ``migrations/env.py``: run migrations on a handed-in connection, a URL, or offline."""
    cfg = context.config
    schema = cfg.attributes.get("schema")
    opts: dict[str, Any] = {
        "version_table": VERSION_TABLE,
        "version_table_schema": schema,
        "target_metadata": metadata,
        "include_name": include_name,
        "render_as_batch": True,  # SQLite alters tables by copying them
    }
    connection = cfg.attributes.get("connection")
    if connection is not None:
        context.configure(
            connection=connection, include_object=include_object(connection.dialect.name), **opts
        )
        with context.begin_transaction():
            _serialize(connection)
            with _in_schema(connection, schema):
                context.run_migrations()
        return
    url = cfg.get_main_option("sqlalchemy.url") or parse_url(default_url()).sqlalchemy_url()
    if context.is_offline_mode():
        context.configure(
            url=url, literal_binds=True,
            include_object=include_object(sa.make_url(url).get_backend_name()), **opts,
        )  # fmt: skip
        with context.begin_transaction():
            if schema:
                context.execute(f'CREATE SCHEMA IF NOT EXISTS "{schema}"')
                context.execute(f'SET LOCAL search_path TO "{schema}"')
            context.run_migrations()
        return

    def run(conn: sa.Connection) -> None:
        # SQLite too runs every step in one transaction (it has transactional DDL;
        # Alembic assumes not): begun IMMEDIATE, so it is also the lock that
        # serializes concurrent runs (`_sqlite_engine`).
        context.configure(
            connection=conn, transactional_ddl=True,
            include_object=include_object(conn.dialect.name), **opts,
        )  # fmt: skip
        with context.begin_transaction():
            _serialize(conn)
            with _in_schema(conn, schema):
                context.run_migrations()

    # Behind a transaction pooler (?prepared_statements=false): asyncpg's unnamed
    # statements only, none cached by name on a server connection others share.
    pooled = cfg.attributes.get("prepared_statements") is False
    if sa.make_url(url).get_dialect().is_async:
        connect_args: dict[str, Any] = (
            {"statement_cache_size": 0, "prepared_statement_cache_size": 0} if pooled else {}
        )
        # libpq's ?options=-c… (a search_path, say): asyncpg takes it as a startup
        # setting, but SQLAlchemy would hand it to asyncpg.connect as an argument.
        parsed_url = sa.make_url(url)
        if "options" in parsed_url.query:
            options = parsed_url.query["options"]
            connect_args["server_settings"] = {
                "options": options if isinstance(options, str) else " ".join(options)
            }
            url = parsed_url.difference_update_query(["options"]).render_as_string(
                hide_password=False
            )
        asyncio.run(_run_async(url, run, connect_args))
    else:
        if sa.make_url(url).get_backend_name() == "sqlite":
            engine = _sqlite_engine(url)
        else:
            # psycopg: never prepare by name (it would after five runs of one text).
            engine = sa.create_engine(
                url, poolclass=sa.NullPool,
                connect_args={"prepare_threshold": None} if pooled else {},
            )  # fmt: skip
        try:
            with engine.connect() as conn:
                run(conn)
        finally:
            engine.dispose()


#: PostgreSQL: every migration run takes this transaction-scoped lock first, so runs
#: started together (several instances deploying at once) go one after the other, each
#: reading the version the one before it committed. First 8 bytes of sha256("quota.migrate").
MIGRATE_LOCK_ID = 0x6B0D_52E1_33A8_F4C7 - 2**63
#: SQLite: how long a migration waits for another one holding the file.
SQLITE_MIGRATE_TIMEOUT = 120.0


def _serialize(conn: sa.Connection) -> None:
    """Queue this run behind any other one on the same database (PostgreSQL; SQLite's
    write lock, taken by ``BEGIN IMMEDIATE``, does it there)."""
    if conn.dialect.name == "postgresql":
        conn.execute(sa.text("SELECT pg_advisory_xact_lock(:id)"), {"id": MIGRATE_LOCK_ID})


@contextlib.contextmanager
def _in_schema(conn: sa.Connection, schema: str | None) -> Iterator[None]:
    """Create `schema` if needed and make it the transaction's search_path, then give the
    connection's own search_path back (a host's env.py goes on on the same connection)."""
    if not schema:
        yield
        return
    before = conn.execute(sa.text("SELECT current_setting('search_path')")).scalar_one()
    conn.execute(sa.text(f'CREATE SCHEMA IF NOT EXISTS "{schema}"'))
    conn.execute(sa.text("SELECT set_config('search_path', :path, true)"), {"path": f'"{schema}"'})
    yield
    conn.execute(sa.text("SELECT set_config('search_path', :path, true)"), {"path": before})


def _sqlite_engine(url: str) -> sa.Engine:
    """A SQLite engine whose transactions begin IMMEDIATE: the write lock, taken before the
    version is read, serializes migrations of several processes (SQLAlchemy's recipe)."""
    engine = sa.create_engine(
        url, poolclass=sa.NullPool, connect_args={"timeout": SQLITE_MIGRATE_TIMEOUT}
    )

    @sa.event.listens_for(engine, "connect")
    def _no_implicit_begin(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None

    @sa.event.listens_for(engine, "begin")
    def _begin_immediate(conn: sa.Connection) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE")

    return engine


async def _run_async(url: str, run: Any, connect_args: dict[str, Any]) -> None:
    from sqlalchemy.ext.asyncio import create_async_engine

    engine = create_async_engine(url, poolclass=sa.NullPool, connect_args=connect_args)
    try:
        async with engine.connect() as conn:
            await conn.run_sync(run)
    finally:
        await engine.dispose()


#: What SQLAlchemy adds around a driver's message: the class of the error it
#: wrapped, in front, and a link to its own documentation, at the end.
_SA_WRAPPING = re.compile(
    r"^\((?:sqlalchemy|psycopg|asyncpg|sqlite3)[\w.]*\) |\s*\(Background on this error at: [^)]*\)"
)


def _driver_text(exc: BaseException) -> str:
    """The driver's own message of `exc`, without SQLAlchemy's wrapping."""
    return _SA_WRAPPING.sub("", str(exc)).strip()


@contextlib.contextmanager
def _alembic_errors(url: str | None) -> Iterator[None]:
    """Wrap driver errors, and give a host's Alembic context back as it was.

    Called from a host app's own ``env.py`` (``quota.migrate(connection)``),
    quota's nested Alembic run would remove the host's ``alembic.context``
    and ``alembic.op`` proxies on its way out (Alembic keeps one of each, as
    module globals); the host's run then fails (``KeyError: 'config'``) or,
    before its own migrations, runs none. The proxies found on entry are
    installed again on exit.
    """
    from alembic.operations import Operations

    hosts = [
        proxy
        for cls in (EnvironmentContext, Operations)
        for module_globals, _ in cls._setups[cls][1]
        if (proxy := module_globals.get("_proxy")) is not None
    ]
    try:
        yield
    except (sa.exc.DBAPIError, OSError) as exc:
        where = redact(url) if url else "the given connection"
        text = _driver_text(exc)
        text = text.replace(url, where) if url else text
        if "prepared statement" in text:
            text += (
                " (a transaction pooler in front of the database? add ?prepared_statements=false"
                " to the URL)"
            )
        raise StorageError(f"migration failed on {where}: {text}") from exc
    finally:
        for proxy in hosts:
            proxy._install_proxy()


def _prepare(
    target: str | sa.Connection | None, sql: bool, output: TextIO | None,
    schema: str | None = None, *, creating: bool = False, **options: bool,
) -> tuple[Config, str | None]:  # fmt: skip
    cfg = _config(output)
    for name, value in options.items():
        cfg.attributes[name] = value
    if schema is not None:
        check_schema(schema)
    if isinstance(target, sa.Connection):
        if sql:
            raise ConfigurationError(
                "sql=True renders SQL from a URL; pass a URL, not a connection"
            )
        if schema is not None and target.dialect.name != "postgresql":
            raise ConfigurationError(f"schema={schema!r} is for PostgreSQL connections only")
        cfg.attributes["connection"] = target
        cfg.attributes["schema"] = schema
        return cfg, None
    url = target if target is not None else default_url()
    parsed = parse_url(url)
    if schema is not None and parsed.dialect != "postgresql":
        raise ConfigurationError(f"schema={schema!r} is for PostgreSQL; {redact(url)} has none")
    if parsed.dialect == "sqlite" and not sql:
        missing = missing_sqlite_file(parsed.target, url, creating=creating)
        if missing is not None:
            raise missing
    cfg.set_main_option("sqlalchemy.url", parsed.sqlalchemy_url().replace("%", "%%"))
    cfg.attributes["prepared_statements"] = parsed.prepared_statements
    cfg.attributes["schema"] = schema or parsed.schema
    return cfg, url


def migrate(
    target: str | sa.Connection | None = None,
    *,
    revision: str = "head",
    sql: bool = False,
    counters_logged: bool = False,
    counters_partitioned: bool = False,
    output: TextIO | None = None,
    schema: str | None = None,
) -> None:
    """Upgrade the quota tables to `revision` (default: the newest).

    `target` is a store URL (default: ``$QUOTA_DATABASE_URL``, else the
    embedded SQLite file) or an open SQLAlchemy `Connection`, which is used
    as is and left open (commit it if your app runs it in a transaction).
    With ``sql=True`` nothing is run: the SQL a DBA would apply is written to
    `output` (default stdout). `counters_logged` keeps the PostgreSQL counters
    table a normal (WAL-logged) table instead of UNLOGGED; it only matters
    when the table is created. `counters_partitioned` creates it range-partitioned
    by window start instead, so cleanup drops whole partitions (PostgreSQL only;
    ignored on SQLite; also only when the table is created). `schema` (or the
    URL's ``?schema=``; PostgreSQL) puts quota's tables, and its version table,
    in that schema, creating it if needed; a connection's ``search_path`` is
    given back as it was.

    Raises `StorageError` when the database cannot be reached.
    """
    cfg, url = _prepare(
        target, sql, output, schema, creating=True,
        **{OPTION_COUNTERS_LOGGED: counters_logged, OPTION_COUNTERS_PARTITIONED: counters_partitioned},
    )  # fmt: skip
    with _alembic_errors(url):
        command.upgrade(cfg, revision, sql=sql)


#: Tables whose rows are durable (quotas, their ledger, runtime policies and settings), by
#: the revision whose downgrade drops them. Counters and algorithm state are ephemeral.
DURABLE_TABLES: dict[str, tuple[str, ...]] = {
    "0002_quotas": ("quota_usage", "quota_ledger"),
    "0004_policies": ("quota_policies",),
    "0005_settings": ("quota_settings",),
    # Not data, but blocks running now: dropping their slots would let more in than
    # their limit (a dead holder's lease, expired, is no row to keep).
    "0006_leases": ("quota_leases",),
    # Every settle is a charge the ledger's downgrade would lose with its kind.
    "0007_reservations": ("quota_reservations",),
    # Events not delivered yet are owed to a webhook.
    "0008_thresholds": ("quota_events",),
}
#: What counts as a held row: a deleted override or setting stays a while as a
#: stamped row saying nothing (so every worker drops it at the same moment), and a
#: ``route_class.<name>`` row only says which route classes a middleware serves.
LIVE_ROWS: dict[str, str] = {
    "quota_policies": " WHERE NOT (rates IS NULL AND algorithm IS NULL AND cost IS NULL"
    " AND fail_open IS NULL AND NOT exempt)",
    "quota_settings": " WHERE value IS NOT NULL AND name NOT LIKE 'route\\_class.%' ESCAPE '\\'",
    "quota_leases": " WHERE expires_at > {now}",
    "quota_events": " WHERE delivered_at IS NULL",
}


def _live_rows(table: str) -> str:
    """`LIVE_ROWS`' condition for `table`, with the time of now in it."""
    return LIVE_ROWS.get(table, "").format(now=repr(time.time()))


def downgrade(
    target: str | sa.Connection | None = None,
    *,
    revision: str,
    sql: bool = False,
    output: TextIO | None = None,
    drop_data: bool = False,
    schema: str | None = None,
) -> None:
    """Downgrade the quota tables to `revision` (``base`` removes them all).

    A downgrade that would drop a table holding durable rows (quota usage,
    the ledger, runtime policies and settings) or live concurrency leases (blocks
    running now) raises `ConfigurationError`
    naming each such table and its row count, and changes nothing, unless
    `drop_data` is True.
    With ``sql=True`` nothing runs and nothing is checked: the SQL is written
    to `output` for review.
    """
    if not isinstance(drop_data, bool):
        raise ConfigurationError(f"drop_data must be a bool, got {drop_data!r}")
    cfg, url = _prepare(target, sql, output, schema)
    if not sql and not drop_data:
        _refuse_to_drop_data(target, revision, cfg.attributes.get("schema"))
    with _alembic_errors(url):
        command.downgrade(cfg, revision if not sql else f"head:{revision}", sql=sql)


def migration_sql(
    url: str, revisions: str, *, upgrade: bool = True, schema: str | None = None
) -> str:
    """The SQL that upgrades (with ``upgrade=False``: downgrades) the quota tables across
    `revisions` (``from:to``, e.g. ``0001_initial:0002_quotas``) on `url`'s dialect, as
    ``quota migrate --sql`` writes it.

    Nothing is run and nothing is checked (a downgrade's guard of durable rows
    included); `schema` is as for `migrate`. Raises `ConfigurationError` for a bad
    URL or schema.
    """
    output = io.StringIO()
    cfg, _ = _prepare(url, True, output, schema)
    with _alembic_errors(url):
        if upgrade:
            command.upgrade(cfg, revisions, sql=True)
        else:
            command.downgrade(cfg, revisions, sql=True)
    return output.getvalue()


def _refuse_to_drop_data(
    target: str | sa.Connection | None, revision: str, schema: str | None
) -> None:
    from quota._sql.schema import REVISIONS

    current = current_revision(target, schema=schema)
    if current not in REVISIONS:
        return  # nothing there (or a revision this code does not know): Alembic decides
    if revision != "base" and revision not in REVISIONS:
        raise ConfigurationError(
            f"revision must be 'base' or one of {', '.join(REVISIONS)}, got {revision!r}"
        )
    keep = 0 if revision == "base" else REVISIONS.index(revision) + 1
    undone = REVISIONS[keep : REVISIONS.index(current) + 1]
    tables = [table for rev in undone for table in DURABLE_TABLES.get(rev, ())]
    if not tables:
        return
    counts = _row_counts(target, tables, schema)
    held = {table: rows for table, rows in counts.items() if rows}
    if held:
        listed = ", ".join(f"{table} ({rows} rows)" for table, rows in held.items())
        raise ConfigurationError(
            f"downgrade to {revision} would drop {listed}: durable quota data"
            f"{' or concurrency slots held now' if 'quota_leases' in held else ''}, refused."
            " Back it up, then pass drop_data=True (quota downgrade --drop-data);"
            " --sql prints the statements for review"
        )


def _row_counts(
    target: str | sa.Connection | None, tables: list[str], schema: str | None
) -> dict[str, int]:
    """Rows in each of `tables` that exists (in `schema`, else on the search path)."""

    def named(table: str) -> str:
        return f'"{schema}".{table}' if schema else table

    def count(conn: sa.Connection) -> dict[str, int]:
        present = set(sa.inspect(conn).get_table_names(schema=schema))
        return {
            table: int(
                conn.execute(
                    sa.text(f"SELECT count(*) FROM {named(table)}{_live_rows(table)}")
                ).scalar_one()
            )
            for table in tables
            if table in present
        }

    if isinstance(target, sa.Connection):
        return count(target)
    url = target if target is not None else default_url()
    parsed = parse_url(url)
    if parsed.dialect == "sqlite":
        engine = sa.create_engine(f"sqlite:///{parsed.target}", poolclass=sa.NullPool)
        with _alembic_errors(url):
            try:
                with engine.connect() as conn:
                    return count(conn)
            finally:
                engine.dispose()
    return asyncio.run(_pg_row_counts(url, parsed.target, [named(t) for t in tables]))


async def _pg_row_counts(url: str, dsn: str, tables: list[str]) -> dict[str, int]:
    import asyncpg

    try:
        conn = await asyncpg.connect(dsn, statement_cache_size=0)
    except Exception as exc:
        raise StorageError(f"cannot connect to {redact(url)}: {exc}") from exc
    try:
        counts: dict[str, int] = {}
        for table in tables:
            if await conn.fetchval("SELECT to_regclass($1)", table) is not None:
                name = table.rpartition(".")[2]
                counts[name] = int(
                    await conn.fetchval(f"SELECT count(*) FROM {table}{_live_rows(name)}")
                )
        return counts
    finally:
        await conn.close()


def current_revision(
    target: str | sa.Connection | None = None, *, schema: str | None = None
) -> str | None:
    """The revision the database is at, or None when the quota tables were never created."""
    buffer = io.StringIO()
    try:
        cfg, url = _prepare(target, False, buffer, schema)
    except SchemaError:
        return None  # no SQLite file: nothing was ever created (and reading creates none)
    with _alembic_errors(url):
        command.current(cfg)
    words = buffer.getvalue().split()
    return words[0] if words else None
