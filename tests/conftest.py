"""Fixtures: the PostgreSQL switch, the injectable clock and the table of backends.

PostgreSQL comes from ``$QUOTA_TEST_POSTGRES_URL``, else from
``postgresql://root@127.0.0.1:5432/test`` when something listens on that
port. Without it, tests marked ``postgres`` skip, unless
``QUOTA_TEST_REQUIRE_POSTGRES=1``, where they fail (CI sets it so a dead
service cannot turn the PostgreSQL half of the suite into silent skips).

The session works in a database of its own on that server
(``quota_test_<random>``, dropped at the end) when it may create one, so
it neither sees nor clobbers counters of anyone else using the configured
database; otherwise it uses the configured database as is. Either way the
schema is migrated once and ``quota_counters`` is truncated before each test.

The table of backends below is the one place that says which stores the tests run on,
how each row is marked (so that it runs, skips or fails) and how its database is made.
"""

from __future__ import annotations

import functools
import os
import socket
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import quota
from quota._core.url import DIALECTS
from tests._http_support import FRAMEWORKS
from tests._support import (
    POSTGRES_FACES,
    STORES,
    Backend,
    Clock,
    OpenBackend,
    faces,
    split_row,
    with_database,
)

# -- the table of backends -----------------------------------------------------------------
#
# `tests._support.STORES` is the one table of stores, an entry for every store quota
# declares (`quota._core.url.DIALECTS`). A row is a dialect (``"sqlite"``) or a dialect and
# a face (``"sqlite-async"``), marked as its store's entry says (``postgres``: it skips
# without PostgreSQL, or fails with QUOTA_TEST_REQUIRE_POSTGRES=1; ``redis``: it skips
# without Redis). Parametrize with `backend_params`; get a database with the ``sql_*``
# fixtures (the SQL dialects, ids ``sqlite`` and ``postgresql``), or with `store_url` and
# `new_sql_database` when the parameter is a face or has ids of its own.

#: The SQL dialects (the stores declared with an SQL schema), in the order tests run them.
SQL_DIALECTS = tuple(name for name in STORES if DIALECTS[name].sql)
#: Every row with a face, every store: what the contract tests (`every_backend`) run on.
EVERY_FACE = faces(*STORES)
MEMORY_FACES = faces("memory")
REDIS_FACES = faces("redis")
#: The marker of each dialect that needs a server; the others always run.
DIALECT_MARKS = {
    name: getattr(pytest.mark, store.mark) for name, store in STORES.items() if store.mark
}


def dialect_of(name: str) -> str:
    """The dialect of a row: ``"postgresql-async"`` -> ``"postgresql"``."""
    return split_row(name)[0]


def backend_params(*names: str) -> list[Any]:
    """Rows of the table as `pytest.param` values: each its own id, with its dialect's marker."""
    params = []
    for name in names:
        mark = DIALECT_MARKS.get(dialect_of(name))
        params.append(pytest.param(name, id=name, marks=[mark] if mark else []))
    return params


DEFAULT_POSTGRES_URL = "postgresql://root@127.0.0.1:5432/test"
ENV_URL = "QUOTA_TEST_POSTGRES_URL"
ENV_REQUIRE = "QUOTA_TEST_REQUIRE_POSTGRES"


@dataclass
class _Postgres:
    url: str | None
    reason: str


def _find_postgres() -> _Postgres:
    url = os.environ.get(ENV_URL)
    if url:
        return _Postgres(url, "")
    try:
        socket.create_connection(("127.0.0.1", 5432), timeout=1).close()
    except OSError as exc:
        return _Postgres(
            None,
            f"PostgreSQL not available: ${ENV_URL} is unset and nothing listens on"
            f" 127.0.0.1:5432 ({exc})",
        )
    return _Postgres(DEFAULT_POSTGRES_URL, "")


_POSTGRES = _find_postgres()


def _unavailable(reason: str) -> None:
    if os.environ.get(ENV_REQUIRE) == "1":
        pytest.fail(f"{reason} (and {ENV_REQUIRE}=1)", pytrace=False)
    pytest.skip(reason)


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("postgres") is not None and _POSTGRES.url is None:
        _unavailable(_POSTGRES.reason)


def pytest_report_header() -> str:
    return f"quota postgres: {_POSTGRES.url or _POSTGRES.reason}"


@pytest.fixture(scope="session")
def pg_server_url() -> str:
    """The configured PostgreSQL URL, checked by connecting; skips (or fails) without one."""
    if _POSTGRES.url is None:
        _unavailable(_POSTGRES.reason)
    assert _POSTGRES.url is not None
    import psycopg

    try:
        psycopg.connect(_POSTGRES.url, connect_timeout=5).close()
    except psycopg.Error as exc:
        _unavailable(f"PostgreSQL at {_POSTGRES.url} refused a connection: {exc}")
    return _POSTGRES.url


def _admin_execute(server_url: str, sql: str) -> None:
    import psycopg

    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(sql)


@pytest.fixture(scope="session")
def pg_url(pg_server_url: str) -> Iterator[str]:
    """A migrated PostgreSQL database for this session (see the module docstring)."""
    import psycopg

    name = f"quota_test_{uuid.uuid4().hex[:12]}"
    try:
        _admin_execute(pg_server_url, f'CREATE DATABASE "{name}"')
    except psycopg.errors.InsufficientPrivilege:
        own_database = False
    else:
        own_database = True
    if not own_database:
        quota.migrate(pg_server_url)
        yield pg_server_url
        return
    url = with_database(pg_server_url, name)
    try:
        quota.migrate(url)
        yield url
    finally:
        _admin_execute(pg_server_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def pg_clean_url(pg_url: str) -> str:
    """`pg_url` with an empty counters table."""
    import psycopg

    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute("TRUNCATE quota_counters, quota_state")
    return pg_url


@pytest.fixture
def pg_make_database(pg_server_url: str) -> Iterator[Callable[[], str]]:
    """Makes throwaway, empty databases on the server; drops them after the test."""
    names: list[str] = []

    def make() -> str:
        name = f"quota_test_tmp_{uuid.uuid4().hex[:12]}"
        _admin_execute(pg_server_url, f'CREATE DATABASE "{name}"')
        names.append(name)
        return with_database(pg_server_url, name)

    yield make
    for name in names:
        _admin_execute(pg_server_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def open_backend() -> Iterator[OpenBackend]:
    """Builds a `Backend` on any URL (``open_backend("sqlite-async", url, **options)``).

    Each gets its own `Clock`; all are closed after the test.
    """
    made: list[Backend] = []

    def open_(name: str, url: str, **options: Any) -> Backend:
        made.append(Backend(name, url, Clock(), **options))
        return made[-1]

    yield open_
    for backend in made:
        backend.close()


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    """A fresh, migrated SQLite file."""
    url = f"sqlite:///{tmp_path / 'quota.db'}"
    quota.migrate(url)
    return url


def _backend(request: pytest.FixtureRequest, clock: Clock) -> Iterator[Backend]:
    name: str = request.param
    backend = Backend(name, store_url(request, dialect_of(name)), clock)
    try:
        yield backend
    finally:
        backend.close()


@pytest.fixture(params=backend_params(*faces(*SQL_DIALECTS)))
def backend(request: pytest.FixtureRequest, clock: Clock) -> Iterator[Backend]:
    """Every SQL store and face: SQLite and PostgreSQL, each sync and async, on `clock`."""
    yield from _backend(request, clock)


@pytest.fixture(params=backend_params(*POSTGRES_FACES))
def pg_backend(request: pytest.FixtureRequest, clock: Clock) -> Iterator[Backend]:
    """The PostgreSQL rows of the backend table only."""
    yield from _backend(request, clock)


# -- memory and Redis: the other two rows of the backend table ----------------------------
#
# Redis comes from ``$QUOTA_TEST_REDIS_URL``, else ``redis://127.0.0.1:6379/0``; without
# one (or without redis-py) tests marked ``redis`` skip, saying why. Each test gets a key
# prefix of its own, whose keys are deleted afterwards.

REDIS_ENV_URL = "QUOTA_TEST_REDIS_URL"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


@functools.cache
def _find_redis() -> tuple[str | None, str]:
    url = os.environ.get(REDIS_ENV_URL) or DEFAULT_REDIS_URL
    try:
        import redis
    except ImportError:
        return None, "Redis tests need redis-py: pip install 'quota[redis]'"
    try:
        with redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2) as client:
            client.ping()
    except redis.RedisError as exc:
        return None, f"Redis not available at {url} (${REDIS_ENV_URL}): {exc}"
    return url, ""


@pytest.fixture
def redis_url() -> Iterator[str]:
    """A Redis store URL with a key prefix of its own; skips without Redis."""
    server, reason = _find_redis()
    if server is None:
        pytest.skip(reason)
    import redis

    prefix = f"quota-test-{uuid.uuid4().hex[:12]}:"
    yield f"{server}{'&' if '?' in server else '?'}prefix={prefix}"
    with redis.Redis.from_url(server) as client:
        keys = list(client.scan_iter(match=prefix + "*", count=1000))
        if keys:
            client.delete(*keys)


def _empty_quota_tables(url: str) -> None:
    """Empty every quota table of the PostgreSQL database at `url` (not the version table).

    Only the tables holding rows are truncated: a TRUNCATE costs milliseconds a table
    even when there is nothing to remove, and most tests leave most tables empty.
    """
    import psycopg

    from quota._sql.schema import TABLES
    from quota._sql.statements import VERSION_TABLE

    tables = [table for table in TABLES if table != VERSION_TABLE]
    holding_rows = " UNION ALL ".join(
        f"SELECT '{table}' WHERE EXISTS (SELECT 1 FROM {table})" for table in tables
    )
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SET lock_timeout = '30s'")  # a session left holding a lock: fail, not hang
        full = [str(row[0]) for row in conn.execute(holding_rows)]
        if full:
            conn.execute(f"TRUNCATE {', '.join(full)}")


@pytest.fixture
def pg_store_url(pg_url: str) -> str:
    """The session's migrated PostgreSQL database (`pg_url`) with every quota table emptied."""
    _empty_quota_tables(pg_url)
    return pg_url


@pytest.fixture
def memory_url() -> str:
    """A memory store of this test's own, named: every limiter of the test shares it."""
    return f"memory://test-{uuid.uuid4().hex}"


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[Any]:
    """The session's private Redis Cluster (tests/_redis_cluster.py); skips (or fails, with
    QUOTA_TEST_REQUIRE_POSTGRES=1) without redis-py or the Redis binaries."""
    try:
        import redis  # noqa: F401
    except ImportError:
        pytest.skip("Redis Cluster tests need redis-py: pip install 'quota[redis]'")
    from tests._redis_cluster import find_binaries, running_cluster

    if find_binaries() is None:
        _unavailable(
            "Redis Cluster tests need redis-server and redis-cli (apt-get install redis-server)"
        )
    with running_cluster() as cluster:
        yield cluster


@pytest.fixture
def redis_cluster_url(redis_cluster: Any) -> Iterator[str]:
    """A Redis Cluster URL with a key prefix of its own; the keys are deleted afterwards
    (every killed node started again first)."""
    prefix = f"quota-test-{uuid.uuid4().hex[:12]}:"
    yield redis_cluster.url(prefix=prefix)
    redis_cluster.heal()
    for port in redis_cluster.masters():
        with redis_cluster.node(port) as client:
            for key in list(client.scan_iter(match=prefix + "*", count=1000)):
                client.delete(key)


def store_url(request: pytest.FixtureRequest, dialect: str) -> str:
    """An empty store of `dialect` for this test, from the fixture its `STORES` entry names.

    SQLite is a new migrated file; PostgreSQL is the session's migrated database
    (`pg_url`) with every quota table emptied; memory a named store of the test's own;
    Redis and Redis Cluster a key prefix of the test's own.
    """
    try:
        fixture = STORES[dialect].url
    except KeyError:
        raise ValueError(f"no store dialect {dialect!r} in the table of backends") from None
    return str(request.getfixturevalue(fixture))


def new_sql_database(
    request: pytest.FixtureRequest, dialect: str, revision: str | None = "head"
) -> str:
    """A database of this test's own: a new SQLite file, or a new PostgreSQL database
    (dropped after the test); migrated to `revision`, or without quota's tables for None."""
    if dialect == "sqlite":
        tmp_path: Path = request.getfixturevalue("tmp_path")
        url = f"sqlite:///{tmp_path / f'own-{uuid.uuid4().hex[:8]}.db'}"
    elif dialect == "postgresql":
        make: Callable[[], str] = request.getfixturevalue("pg_make_database")
        url = make()
    else:
        raise ValueError(f"no SQL dialect {dialect!r} in the table of backends")
    if revision is not None:
        quota.migrate(url, revision=revision)
    return url


#: The rows of `every_backend`: every face of every store of the table.
EVERY_BACKEND = backend_params(*EVERY_FACE)


@pytest.fixture(params=EVERY_BACKEND)
def every_backend(request: pytest.FixtureRequest, clock: Clock) -> Iterator[Backend]:
    """Every store and face (`tests._support.STORES`), each sync and async, on `clock`."""
    name: str = request.param
    backend = Backend(name, store_url(request, dialect_of(name)), clock)
    try:
        yield backend
    finally:
        backend.close()


# -- the SQL dialects: one parametrization, ids "sqlite" and "postgresql" -------------------
#
# All of these hang on `sql_dialect`: a test asking for several runs once per dialect, and
# they are the same dialect.


@pytest.fixture(params=backend_params(*SQL_DIALECTS))
def sql_dialect(request: pytest.FixtureRequest) -> str:
    """Each SQL dialect: ``"sqlite"``, then ``"postgresql"`` (marked ``postgres``)."""
    name: str = request.param
    return name


@pytest.fixture
def sql_url(request: pytest.FixtureRequest, sql_dialect: str) -> str:
    """A migrated database with quota's tables empty: a new SQLite file, or the session's
    PostgreSQL database with every quota table emptied (`store_url`)."""
    return store_url(request, sql_dialect)


@pytest.fixture
def sql_empty_url(request: pytest.FixtureRequest, sql_dialect: str) -> str:
    """A new database without quota's tables (unmigrated): a SQLite path, or a new
    PostgreSQL database dropped after the test."""
    return new_sql_database(request, sql_dialect, revision=None)


@pytest.fixture
def sql_own_url(request: pytest.FixtureRequest, sql_dialect: str) -> str:
    """A new migrated database of this test's own (not the session's): for tests that drop
    tables or downgrade."""
    return new_sql_database(request, sql_dialect)


@pytest.fixture
def sql_database(request: pytest.FixtureRequest, sql_dialect: str) -> Callable[..., str]:
    """Makes new databases of this test's own: ``sql_database()`` migrated to head,
    ``sql_database(revision)`` to `revision`, ``sql_database(None)`` not migrated."""

    def make(revision: str | None = "head") -> str:
        return new_sql_database(request, sql_dialect, revision)

    return make


# -- PgBouncer: PostgreSQL behind a transaction- or session-pooling bouncer ----------------
#
# Each fixture starts a private PgBouncer (tests/_pgbouncer.py) on a free port of 127.0.0.1,
# in front of the server and database of `pg_url`, and returns a URL through it:
# ``postgresql://root@127.0.0.1:PORT/quota_test_...``. Without pgbouncer installed they skip,
# saying why, unless QUOTA_TEST_REQUIRE_POSTGRES=1, where they fail. Every bouncer is
# stopped at its fixture's end, however the tests end. Tests that use them are postgres
# tests: the hook below marks them so.

PGBOUNCER_FIXTURES = frozenset(
    {"pgbouncer_binary", "pgbouncer_txn_url", "pgbouncer_session_url", "pgbouncer_single_txn_url"}
)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if PGBOUNCER_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.postgres)


@pytest.fixture(scope="session")
def pgbouncer_binary() -> str:
    """The pgbouncer executable; skips (or fails) without one."""
    from tests._pgbouncer import DEFAULT_BINARY, find_binary

    binary = find_binary()
    if binary is None:
        _unavailable(
            f"PgBouncer not installed: no {DEFAULT_BINARY} and no pgbouncer on PATH"
            " (apt-get install pgbouncer)"
        )
    assert binary is not None
    return binary


def _pgbouncer_url(pg_url: str, binary: str, **options: Any) -> Iterator[str]:
    """Runs a PgBouncer in front of `pg_url`'s server; yields `pg_url`'s database through it."""
    from urllib.parse import unquote, urlsplit

    from tests._pgbouncer import running_pgbouncer

    parts = urlsplit(pg_url)
    database = unquote(parts.path.lstrip("/"))
    with running_pgbouncer(
        binary=binary,
        server_host=parts.hostname or "127.0.0.1",
        server_port=parts.port or 5432,
        user=unquote(parts.username or "root"),
        password=unquote(parts.password or ""),
        **options,
    ) as bouncer:
        yield bouncer.url(database)


@pytest.fixture(scope="session")
def pgbouncer_txn_url(pg_url: str, pgbouncer_binary: str) -> Iterator[str]:
    """`pg_url`'s database through PgBouncer in transaction mode (2 server connections)."""
    yield from _pgbouncer_url(pg_url, pgbouncer_binary, pool_mode="transaction")


@pytest.fixture(scope="session")
def pgbouncer_session_url(pg_url: str, pgbouncer_binary: str) -> Iterator[str]:
    """`pg_url`'s database through PgBouncer in session mode (2 server connections)."""
    yield from _pgbouncer_url(pg_url, pgbouncer_binary, pool_mode="session")


@pytest.fixture
def pgbouncer_single_txn_url(pg_url: str, pgbouncer_binary: str) -> Iterator[str]:
    """`pg_url`'s database through a transaction-mode PgBouncer with ONE server connection.

    Every client is served by that same server connection, so a session setting one
    client leaves behind is seen by the next. A bouncer of its own per test: nothing one
    test leaves on the connection reaches another.
    """
    yield from _pgbouncer_url(
        pg_url, pgbouncer_binary, pool_mode="transaction", default_pool_size=1
    )


# -- HTTP: every middleware test runs on each framework's own test client ------------------


@pytest.fixture(params=list(FRAMEWORKS))
def framework(request: pytest.FixtureRequest) -> str:
    """The ASGI middleware on Starlette (async limiter), the WSGI one on Flask (sync)."""
    name: str = request.param
    return name


@pytest.fixture
def http_client(framework: str, clock: Clock) -> Iterator[Callable[..., Any]]:
    """Opens a test client of `framework` on a URL and config, on `clock`; all closed after.

    ``http_client(url, config, **options)``; options go to `tests._http_support.make_client`.
    """
    from tests._http_support import make_client

    made: list[Any] = []

    def open_(url: str, config: Any, **options: Any) -> Any:
        made.append(make_client(framework, url, clock, config, **options))
        return made[-1]

    yield open_
    for client in made:
        client.close()
