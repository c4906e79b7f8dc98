"""Store URLs: which database, which driver, which face.

``sqlite:///relative/path.db`` and ``sqlite:////absolute/path.db`` as in
SQLAlchemy; ``postgresql://user@host:port/db`` (``postgres://`` too). A
``+driver`` suffix picks the driver: ``+aiosqlite`` and ``+asyncpg`` are the
async drivers, ``+pysqlite`` and ``+psycopg`` the sync ones. Without one,
`quota.connect` uses the sync default and `quota.connect_async` the async one.

``memory://`` (a store of its own per connect), ``memory://NAME`` (shared by
name within the process), ``redis://host:port/db`` (``rediss://`` for TLS) and
``redis+cluster://host:port,host:port/`` (a Redis Cluster; ``rediss+cluster://``
for TLS) keep no SQL schema: there is nothing to migrate on them.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import parse_qsl, urlencode

from quota._core.errors import ConfigurationError
from quota._core.parsing import parse_flag
from quota._core.redaction import redact

# Store URLs are shown without their password; the functions that hide it are this
# module's too (most callers import them from here).

#: Where the embedded default keeps its counters when nothing is configured.
DEFAULT_URL = "sqlite:///quota.sqlite3"
ENV_VAR = "QUOTA_DATABASE_URL"


@dataclass(frozen=True, slots=True, kw_only=True)
class Dialect:
    """One kind of store, declared once: its URL schemes, each face's driver, what it can
    do, and where it is opened. Every other table of stores derives from `DIALECTS`."""

    schemes: tuple[str, ...]
    """The URL schemes that name it (with a ``+driver`` suffix too, where one exists)."""
    sync_driver: str
    """The driver of the sync face (`quota.connect`)."""
    async_driver: str
    """The driver of the async face (`quota.connect_async`)."""
    target: str
    """How `parse_url` reads the rest of a URL: ``"path"`` (a file), ``"dsn"`` (a libpq URL
    and quota's own query parameters), ``"name"`` (``NAME?options``) or ``"url"`` (whole)."""
    module: str
    """The module of `quota._stores` whose ``open_sync`` and ``open_async`` open it
    (imported when a store is opened, so that ``import quota`` imports no driver)."""
    sql: bool = True
    """It keeps an SQL schema: migrations, durable quotas, leases, runtime policies,
    cleanup. False: rate limits only, nothing to migrate."""
    batching: bool = True
    """Group commit (``batching=True``) has something to group: a round trip per hit."""
    pipelined: bool = False
    """A batch is a pipeline of the one-by-one hits (Redis), each answering its own count,
    rather than one SQL statement summing them."""
    schemas: bool = False
    """Its tables may live in a named schema (``?schema=``, ``schema=``)."""
    in_process: bool = False
    """No I/O at all: the store lives in this process."""
    speaks_redis: bool = False
    """A Redis server (or cluster) answers, running quota's Lua scripts."""
    preferred_face: str = "sync"
    """The face that gets the most from it (``quota bench`` measures it by default)."""

    @property
    def schemaless(self) -> bool:
        """True when it keeps no SQL schema (nothing to migrate)."""
        return not self.sql


#: Every store quota opens, by the name `StoreURL.dialect` carries: the one declaration of
#: each store. The URL schemes, the drivers, the store openers (`quota._stores.base.open_sync`)
#: and every capability table are read from it.
DIALECTS: dict[str, Dialect] = {
    "sqlite": Dialect(
        schemes=("sqlite", "sqlite+aiosqlite", "sqlite+pysqlite"),
        sync_driver="pysqlite", async_driver="aiosqlite", target="path",
        module="quota._stores.sqlite",
    ),
    "postgresql": Dialect(
        schemes=("postgres", "postgresql", "postgresql+asyncpg", "postgresql+psycopg"),
        sync_driver="psycopg", async_driver="asyncpg", target="dsn",
        module="quota._stores.postgres", schemas=True, preferred_face="async",
    ),
    "memory": Dialect(
        schemes=("memory",), sync_driver="memory", async_driver="memory", target="name",
        module="quota._stores.memory", sql=False, batching=False, in_process=True,
    ),
    "redis": Dialect(
        schemes=("redis", "rediss"), sync_driver="redis", async_driver="redis.asyncio",
        target="url", module="quota._stores.redis", sql=False, pipelined=True,
        speaks_redis=True,
    ),
    "redis-cluster": Dialect(
        schemes=("redis+cluster", "rediss+cluster"), sync_driver="redis.cluster",
        async_driver="redis.asyncio.cluster", target="url", module="quota._stores.redis_cluster",
        sql=False, pipelined=True, speaks_redis=True,
    ),
}  # fmt: skip
_SYNC_DRIVERS = {name: dialect.sync_driver for name, dialect in DIALECTS.items()}
_ASYNC_DRIVERS = {name: dialect.async_driver for name, dialect in DIALECTS.items()}
#: Stores without a SQL schema (nothing to migrate).
SCHEMALESS = tuple(name for name, dialect in DIALECTS.items() if dialect.schemaless)
#: Every URL scheme `parse_url` accepts, sorted (as error messages list them).
KNOWN_SCHEMES = tuple(sorted(scheme for dialect in DIALECTS.values() for scheme in dialect.schemes))
_DIALECT_OF = {scheme: name for name, dialect in DIALECTS.items() for scheme in dialect.schemes}


@dataclass(frozen=True, slots=True)
class StoreURL:
    """A parsed store URL."""

    url: str
    """The URL as given."""
    dialect: str
    """``sqlite``, ``postgresql``, ``memory``, ``redis`` or ``redis-cluster``."""
    driver: str | None
    """The explicit driver, or None for the face's default."""
    target: str
    """The file path (SQLite), the libpq DSN without a driver and without quota's own query
    parameters (PostgreSQL), ``NAME?options`` (memory) or the URL itself (Redis, Redis Cluster)."""
    parameters: Mapping[str, bool | str] = field(default_factory=dict)
    """quota's own query parameters of a PostgreSQL URL (`QUOTA_PARAMETERS`)."""

    @property
    def kind(self) -> Dialect:
        """The declaration of its store (`DIALECTS`)."""
        return DIALECTS[self.dialect]

    @property
    def prepared_statements(self) -> bool:
        """False when the URL says ``?prepared_statements=false`` (a transaction pooler)."""
        return self.parameters.get("prepared_statements", True) is not False

    @property
    def schema(self) -> str | None:
        """The schema of quota's tables when the URL says ``?schema=NAME``."""
        schema = self.parameters.get("schema")
        return schema if isinstance(schema, str) else None

    @property
    def is_async_driver(self) -> bool:
        return self.driver in _ASYNC_DRIVERS.values()

    def driver_for(self, *, asynchronous: bool) -> str:
        """The driver to use for the sync or async face; raise if the URL names the other one."""
        wanted = (_ASYNC_DRIVERS if asynchronous else _SYNC_DRIVERS)[self.dialect]
        if self.driver is None or self.driver == wanted:
            return wanted
        if asynchronous:
            raise ConfigurationError(
                f"url {redact(self.url)!r} names the sync driver {self.driver!r};"
                " use quota.connect(url)"
                f" for it, or {self.dialect}+{wanted}:// (or no driver) with quota.connect_async()"
            )
        raise ConfigurationError(
            f"url {redact(self.url)!r} names the async driver {self.driver!r}; use"
            f" quota.connect_async(url) for it, or {self.dialect}:// with quota.connect()"
        )

    def sqlalchemy_url(self) -> str:
        """The URL SQLAlchemy and Alembic use for migrations; `ConfigurationError` without a schema."""
        if self.dialect in SCHEMALESS:
            raise ConfigurationError(
                f"url {redact(self.url)!r} is a {self.dialect} store, which keeps no SQL schema:"
                " there is nothing to migrate (migrations are for sqlite:// and postgresql://)"
            )
        if self.kind.target == "path":
            return f"{self.dialect}:///{self.target}"
        driver = self.driver or self.kind.async_driver
        return f"{self.dialect}+{driver}://{self.target.split('://', 1)[1]}"


#: Query parameters of a PostgreSQL URL that are quota's own, not libpq's.
QUOTA_PARAMETERS = ("prepared_statements", "schema")
#: A schema name quota accepts: a plain PostgreSQL identifier (it is quoted anyway).
_SCHEMA = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")


def check_schema(schema: object, where: str = "schema") -> str:
    """`schema` if it is a plain identifier; `ConfigurationError` naming `where` otherwise."""
    if not isinstance(schema, str) or not _SCHEMA.fullmatch(schema):
        raise ConfigurationError(
            f"{where} must be a plain identifier (letters, digits, _; at most 63), got {schema!r}"
        )
    return schema


def own_parameters(url: str, target: str) -> tuple[str, dict[str, bool | str]]:
    """`target` (a libpq URL) without quota's own query parameters, and their values.

    ``postgresql://app@db/app?prepared_statements=false&schema=limits&sslmode=require``
    gives the DSN with ``sslmode`` only and ``{"prepared_statements": False,
    "schema": "limits"}``.
    """
    base, sep, query = target.partition("?")
    if not sep:
        return target, {}
    own: dict[str, bool | str] = {}
    kept: list[tuple[str, str]] = []
    for name, value in parse_qsl(query, keep_blank_values=True):
        if name not in QUOTA_PARAMETERS:
            kept.append((name, value))
        elif name == "schema":
            own[name] = check_schema(value, f"url query parameter schema in {redact(url)!r}")
        elif (flag := parse_flag(value)) is not None:
            own[name] = flag
        else:
            raise ConfigurationError(
                f"url query parameter {name}={value!r} in {redact(url)!r} must be true or false"
            )
    return (f"{base}?{urlencode(kept)}" if kept else base), own


def default_url() -> str:
    """``$QUOTA_DATABASE_URL``, else the embedded SQLite file in the working directory."""
    return os.environ.get(ENV_VAR) or DEFAULT_URL


def parse_url(url: object) -> StoreURL:
    """Parse a store URL; raise `ConfigurationError` naming the URL when it is not one."""
    if not isinstance(url, str) or "://" not in url:
        shown = redact(url) if isinstance(url, str) else url
        raise ConfigurationError(
            f"url must look like 'scheme://…', got {shown!r};"
            f" known schemes: {', '.join(KNOWN_SCHEMES)}"
        )
    scheme, rest = url.split("://", 1)
    dialect = _DIALECT_OF.get(scheme)
    if dialect is None:
        raise ConfigurationError(
            f"unknown url scheme {scheme!r} in {redact(url)!r};"
            f" known schemes: {', '.join(KNOWN_SCHEMES)}"
        )
    target = DIALECTS[dialect].target
    if target == "name":
        return StoreURL(url, dialect, None, rest)
    if target == "url":
        return StoreURL(url, dialect, None, url)
    driver = scheme.partition("+")[2]
    if target == "path":
        # sqlite:///rel.db -> "rel.db"; sqlite:////abs.db -> "/abs.db"
        path = rest[1:] if rest.startswith("/") else rest
        path = path.split("?", 1)[0]
        if not path or path == ":memory:" or path.startswith("file::memory:"):
            raise ConfigurationError(
                f"url {redact(url)!r} is an in-memory SQLite database, which every connection sees"
                " empty; give a file path, e.g. sqlite:///quota.sqlite3"
            )
        return StoreURL(url, dialect, driver or None, path)
    dsn, own = own_parameters(url, f"{dialect}://{rest}")
    return StoreURL(url, dialect, driver or None, dsn, own)
