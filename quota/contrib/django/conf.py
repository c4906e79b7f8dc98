"""quota's settings in a Django project, and the limiters built from them.

Everything is optional. Without a ``QUOTA`` setting quota keeps its counters
in the database of the ``default`` alias of ``DATABASES`` (PostgreSQL or
SQLite), through connections of its own. One dict configures the rest::

    QUOTA = {
        "DATABASE": "default",   # the DATABASES alias holding quota's tables
        "URL": None,             # or an explicit quota URL: redis://…, memory://, …
        "OPTIONS": {"fallback": True, "pool_size": 2},  # quota.Options fields
        "HTTP": {...},           # read by quota.contrib.django.middleware
        "DROP_DATA": False,      # let ``migrate quota zero`` drop durable quota data
    }

The alias is read when quota first needs it, so the test databases Django
creates (``test_…``) are followed.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import threading
import weakref
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any
from urllib.parse import quote, urlencode

from django.core import exceptions as django_exceptions
from django.core.signals import setting_changed
from django.db import connections

from quota._core.errors import ConfigurationError
from quota._core.redaction import redact
from quota._core.url import parse_url
from quota._limiter import AsyncLimiter, Limiter, Options, connect, connect_async
from quota._limiter.base import options_from

__all__ = [
    "ImproperlyConfigured",
    "QuotaSettings",
    "database_url",
    "get_async_limiter",
    "get_limiter",
    "quota_settings",
    "reset",
]

#: The keys of the ``QUOTA`` setting.
SETTING_KEYS = ("DATABASE", "URL", "OPTIONS", "HTTP", "DROP_DATA")
#: Database engines quota opens itself, by Django's ``vendor`` name.
SUPPORTED_VENDORS = ("postgresql", "sqlite")
_ENGINE_VENDORS = {
    "django.db.backends.sqlite3": "sqlite",
    "django.contrib.gis.db.backends.spatialite": "sqlite",
    "django.db.backends.postgresql": "postgresql",
    "django.db.backends.postgresql_psycopg2": "postgresql",
    "django.contrib.gis.db.backends.postgis": "postgresql",
}
#: Keywords libpq understands in a connection URL; other ``OPTIONS`` of a PostgreSQL
#: alias are Django's or the driver's (``isolation_level``, ``pool``, …) and are left out.
LIBPQ_PARAMETERS = frozenset(
    {
        "application_name", "channel_binding", "client_encoding", "connect_timeout",
        "fallback_application_name", "gssdelegation", "gssencmode", "gsslib", "hostaddr",
        "keepalives", "keepalives_count", "keepalives_idle", "keepalives_interval",
        "krbsrvname", "load_balance_hosts", "options", "passfile", "require_auth",
        "requirepeer", "service", "ssl_max_protocol_version", "ssl_min_protocol_version",
        "sslcert", "sslcertmode", "sslcompression", "sslcrl", "sslcrldir", "sslkey",
        "sslmode", "sslnegotiation", "sslpassword", "sslrootcert", "sslsni",
        "target_session_attrs", "tcp_user_timeout",
    }
)  # fmt: skip


class ImproperlyConfigured(django_exceptions.ImproperlyConfigured, ConfigurationError):  # type: ignore[misc]
    """A bad ``QUOTA`` setting or a database quota cannot use.

    Both Django's ``ImproperlyConfigured`` and `quota.ConfigurationError`, so
    either ``except`` catches it.
    """


@dataclass(frozen=True)
class QuotaSettings:
    """The ``QUOTA`` setting, checked."""

    database: str = "default"
    """The ``DATABASES`` alias whose database holds quota's tables."""
    url: str | None = None
    """An explicit quota URL used instead of the alias (``redis://…``, ``memory://``, …)."""
    options: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    """`quota.Options` fields for the limiters (``fallback``, ``pool_size``, ``batching``, …)."""
    http: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    """The middleware's settings, as given."""
    drop_data: bool = False
    """Let ``manage.py migrate quota zero`` drop tables holding durable quota data."""

    def limiter_options(self) -> Options:
        """The `quota.Options` the limiters are built with."""
        try:
            return options_from(None, dict(self.options))
        except ConfigurationError as exc:
            raise ImproperlyConfigured(f"QUOTA['OPTIONS']: {exc}") from exc


def quota_settings() -> QuotaSettings:
    """The ``QUOTA`` setting as a `QuotaSettings`; `ImproperlyConfigured` naming a bad key."""
    from django.conf import settings as django_settings

    raw = getattr(django_settings, "QUOTA", None)
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ImproperlyConfigured(f"the QUOTA setting must be a dict, got {raw!r}")
    unknown = [key for key in raw if key not in SETTING_KEYS]
    if unknown:
        raise ImproperlyConfigured(
            f"unknown QUOTA key {', '.join(map(repr, unknown))};"
            f" the keys are {', '.join(SETTING_KEYS)}"
        )
    database = raw.get("DATABASE", "default")
    if not isinstance(database, str) or not database:
        raise ImproperlyConfigured(f"QUOTA['DATABASE'] must be a DATABASES alias, got {database!r}")
    url = raw.get("URL")
    if url is not None:
        try:
            parse_url(url)
        except ConfigurationError as exc:
            raise ImproperlyConfigured(f"QUOTA['URL']: {exc}") from exc
    options = raw.get("OPTIONS")
    options = {} if options is None else options
    http = raw.get("HTTP")
    http = {} if http is None else http
    for key, value in (("OPTIONS", options), ("HTTP", http)):
        if not isinstance(value, Mapping):
            raise ImproperlyConfigured(f"QUOTA[{key!r}] must be a dict, got {value!r}")
    drop_data = raw.get("DROP_DATA", False)
    if not isinstance(drop_data, bool):
        raise ImproperlyConfigured(f"QUOTA['DROP_DATA'] must be a bool, got {drop_data!r}")
    built = QuotaSettings(
        database=database,
        url=url,
        options=MappingProxyType(dict(options)),
        http=MappingProxyType(dict(http)),
        drop_data=drop_data,
    )
    built.limiter_options()  # a bad option fails here, naming it
    return built


def database_url(alias: str | None = None) -> str:
    """quota's URL for the Django database `alias`.

    Without `alias`: the URL quota uses, ``QUOTA["URL"]`` when set, else the
    URL of the ``QUOTA["DATABASE"]`` alias (``default``). A SQLite alias gives
    ``sqlite:///<NAME>`` (NAME made absolute; an in-memory database is
    refused: every connection would see its own, empty one), a PostgreSQL one
    ``postgresql://USER:PASSWORD@HOST:PORT/NAME`` with the ``OPTIONS`` libpq
    understands as query parameters, and ``?prepared_statements=false`` when
    ``DISABLE_SERVER_SIDE_CURSORS`` is set (a transaction pooler such as
    PgBouncer). Other engines raise `ImproperlyConfigured`.
    """
    if alias is None:
        configured = quota_settings()
        if configured.url is not None:
            return configured.url
        alias = configured.database
    return _alias_url(alias)


def _alias_url(alias: str) -> str:
    if alias not in connections.settings:
        known = ", ".join(map(repr, connections.settings)) or "none"
        raise ImproperlyConfigured(
            f"quota: no database alias {alias!r} in DATABASES (the aliases: {known})"
        )
    engine = str(connections.settings[alias].get("ENGINE") or "")
    vendor = _ENGINE_VENDORS.get(engine)
    if vendor is None and not engine.startswith(("django.db.", "django.contrib.gis.")):
        try:  # a third-party wrapper of a built-in backend (it says which vendor)
            vendor = connections[alias].vendor
        except Exception:  # its driver missing: not ours to report
            vendor = None
    if vendor in SUPPORTED_VENDORS:
        # The connection's dict: Django points it at the test database during tests.
        settings_dict = connections[alias].settings_dict
        if vendor == "sqlite":
            return _sqlite_url(alias, settings_dict.get("NAME"))
        return _postgresql_url(alias, settings_dict)
    raise ImproperlyConfigured(
        f"quota cannot keep its counters in database {alias!r}: ENGINE {engine!r} is not"
        " supported. quota works on PostgreSQL (django.db.backends.postgresql) and SQLite"
        " (django.db.backends.sqlite3); for another database set QUOTA['URL'] to a quota URL"
        " (postgresql://…, sqlite:///…, redis://…, memory://)"
    )


def _sqlite_url(alias: str, name: object) -> str:
    text = os.fspath(name) if isinstance(name, (str, os.PathLike)) else ""
    text = str(text)
    if text.startswith("file:"):
        path, _, query = text[5:].partition("?")
        memory = "mode=memory" in query or path.startswith(":memory:") or not path
        text = path
    else:
        memory = text in ("", ":memory:")
    if memory:
        raise ImproperlyConfigured(
            f"quota needs the SQLite database of alias {alias!r} in a file, and its NAME is"
            f" {name!r}, an in-memory database that each connection sees empty. Give NAME a"
            " file path (for tests: DATABASES[...]['TEST'] = {'NAME': 'test_db.sqlite3'})"
        )
    return f"sqlite:///{Path(text).absolute()}"


def _postgresql_url(alias: str, settings_dict: Mapping[str, Any]) -> str:
    options = settings_dict.get("OPTIONS") or {}
    user = settings_dict.get("USER") or ""
    password = settings_dict.get("PASSWORD") or ""
    host = str(settings_dict.get("HOST") or "")
    port = str(settings_dict.get("PORT") or "")
    name = settings_dict.get("NAME") or ""
    query: list[tuple[str, str]] = []
    if not name and "service" not in options:
        raise ImproperlyConfigured(
            f"quota: database {alias!r} has no NAME (nor OPTIONS['service']): which database?"
        )
    credentials = ""
    if user:
        credentials = quote(str(user), safe="")
        if password:
            credentials += ":" + quote(str(password), safe="")
        credentials += "@"
    if host.startswith("/"):  # a Unix-domain socket directory
        query.append(("host", host))
        host = ""
    elif ":" in host:  # IPv6
        host = f"[{host}]"
    netloc = credentials + host + (f":{port}" if port else "")
    for key, value in options.items():
        if key in LIBPQ_PARAMETERS and value is not None:
            shown = ("1" if value else "0") if isinstance(value, bool) else str(value)
            query.append((key, shown))
    if settings_dict.get("DISABLE_SERVER_SIDE_CURSORS"):
        query.append(("prepared_statements", "false"))
    url = f"postgresql://{netloc}/{quote(str(name), safe='')}"
    if query:
        url += "?" + urlencode(query, quote_via=quote)
    try:
        parse_url(url)
    except ConfigurationError as exc:  # pragma: no cover - the URL is built to parse
        raise ImproperlyConfigured(
            f"quota: database {alias!r} gives {redact(url)!r}: {exc}"
        ) from exc
    return url


# --- the limiters --------------------------------------------------------------------

_lock = threading.Lock()
#: Bumped by `reset`: a limiter opened under an older generation is replaced on next use.
_generation = 0
_settings: QuotaSettings | None = None
#: The sync limiter: (its process id, generation, URL, the limiter).
_sync: tuple[int, int, str, Limiter] | None = None
#: The async limiters, one per event loop: (process id, generation, URL, limiter, closer).
_async: weakref.WeakKeyDictionary[
    asyncio.AbstractEventLoop, tuple[int, int, str, AsyncLimiter, Any]
] = weakref.WeakKeyDictionary()
#: Limiters inherited from a parent process: never closed here (their connections are the
#: parent's) and never collected (which could close them).
_inherited: list[object] = []
#: Tasks closing replaced async limiters (kept until done).
_closing: set[asyncio.Task[None]] = set()


def _current_settings() -> QuotaSettings:
    global _settings
    built = _settings
    if built is None:
        built = _settings = quota_settings()
    return built


#: The last URL built from an alias: (generation, alias, its settings dict, its NAME, URL).
_built: tuple[int, str, object, object, str] | None = None


def _url() -> str:
    """The URL the limiters use, rebuilt only when the alias's dict or database name changes."""
    global _built
    configured = _current_settings()
    if configured.url is not None:
        return configured.url
    alias = configured.database
    settings_dict = connections.settings.get(alias)
    name = settings_dict.get("NAME") if settings_dict else None
    built = _built
    if (
        built is not None
        and built[2] is settings_dict
        and built[0] == _generation
        and built[1] == alias
        and built[3] == name
    ):
        return built[4]
    url = _alias_url(alias)
    _built = (_generation, alias, settings_dict, name, url)
    return url


def get_limiter() -> Limiter:
    """The process's sync `quota.Limiter`, opened on first use.

    Thread-safe; closed at interpreter exit; opened again in a forked child
    (a server that loads the app before forking its workers), when the
    ``QUOTA`` or ``DATABASES`` setting changes (``override_settings``), and
    when the alias's database NAME changes (Django's test databases).
    """
    global _sync
    url = _url()
    pid = os.getpid()
    current = _sync
    if (
        current is not None
        and current[2] == url
        and current[1] == _generation
        and current[0] == pid
    ):
        return current[3]
    key = (pid, _generation, url)
    with _lock:
        current = _sync
        if current is not None and current[:3] == key:
            return current[3]
        if current is not None:
            if current[0] != key[0]:
                _inherited.append(current[3])
            else:
                current[3].close()
        limiter = connect(url, options=_current_settings().limiter_options())
        _sync = (*key, limiter)
        return limiter


def get_async_limiter() -> AsyncLimiter:
    """The `quota.AsyncLimiter` of the running event loop, opened on its first use there.

    An async limiter's connections belong to the loop that opened them, so each
    loop (an ASGI server runs one; Django runs an async view under WSGI in a
    fresh one) gets its own, closed when the loop shuts down its async
    generators (``asyncio.run``, asgiref and ASGI servers do). Same settings
    and same renewals as `get_limiter`. Must be called from a coroutine.
    """
    loop = asyncio.get_running_loop()
    key = (os.getpid(), _generation, _url())
    entry = _async.get(loop)
    if entry is not None and entry[:3] == key:
        return entry[3]
    with _lock:
        entry = _async.get(loop)
        if entry is not None and entry[:3] == key:
            return entry[3]
        if entry is not None:
            if entry[0] != key[0]:
                _inherited.append(entry[3:])
            else:
                task = loop.create_task(_retire(entry[4]))
                _closing.add(task)
                task.add_done_callback(_closing.discard)
        limiter = connect_async(key[2], options=_current_settings().limiter_options())
        closer = _close_with_loop(limiter)
        # Starting the generator registers it with the loop, whose shutdown_asyncgens()
        # then runs its finally block: the limiter is closed before the loop is.
        _start(closer)
        _async[loop] = (*key, limiter, closer)
        return limiter


async def _close_with_loop(limiter: AsyncLimiter) -> AsyncIterator[None]:
    try:
        yield
    finally:
        await limiter.aclose()


def _start(closer: AsyncIterator[None]) -> None:
    """Run `closer` to its ``yield`` now: it registers with the running loop, and the
    part before the ``yield`` never awaits, so one step reaches it."""
    step = closer.__anext__()
    try:
        step.send(None)  # type: ignore[attr-defined]
    except StopIteration:
        return
    raise RuntimeError("quota: the closing generator awaited before its yield")  # pragma: no cover


async def _retire(closer: Any) -> None:
    """Close a replaced limiter: its closing generator's ``finally`` does."""
    await closer.aclose()


def reset() -> None:
    """Close the sync limiter and forget the settings; the next use opens a new limiter.

    Async limiters are replaced (and closed) on their loop's next use.
    """
    global _sync, _settings, _generation
    with _lock:
        current, _sync, _settings = _sync, None, None
        _generation += 1
    if current is not None and current[0] == os.getpid():
        current[3].close()


def _setting_changed(*, setting: str, **_kwargs: Any) -> None:
    if setting in ("QUOTA", "DATABASES"):
        reset()


setting_changed.connect(_setting_changed, dispatch_uid="quota.contrib.django.conf")


def _close_at_exit() -> None:
    current = _sync
    if current is not None and current[0] == os.getpid():
        current[3].close()


atexit.register(_close_at_exit)
