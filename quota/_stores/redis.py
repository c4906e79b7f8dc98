"""The Redis store (``redis://host:port/db``): one atomic Lua script per algorithm.

It answers the statements of `quota._sql.statements` like the SQL stores do, with rows of
the same shape, so the limiters, `quota._sql.ops` and the fallback drive it
unchanged: a table of handlers turns each statement (by name) into Redis
commands, and each decision into one ``EVALSHA`` of the script of its
algorithm. `RedisPlan` does all of that without I/O; `RedisStore` and
`AsyncRedisStore` only send its commands. The scripts spell out the
arithmetic of `quota._core.algorithms` operation for operation in IEEE doubles
(they live in ``quota/_stores/lua/``, one file each, plus ``common.lua`` before each);
doubles cross the Lua boundary as ``%.17g`` strings one way and Python
``repr`` the other, both exact, so Redis decides bit for bit as the memory
and SQL stores do.

Keys (``prefix`` defaults to ``quota:``; ``redis://…?prefix=app1:`` changes it)::

    quota:{k:alice}:fw:60:1750003200   a fixed window's count (a string, INCRBY)
    quota:{k:alice}:sw:60              sliding window state: hash of v, p, s
    quota:{k:alice}:tb:60              token bucket: hash of v (tokens), s (stamp)
    quota:{k:alice}:gcra:60            GCRA: hash of v (theoretical arrival time)
    quota:{k:alice}:idx                sorted set of the key's rows, scored by expiry
    quota:{k:alice}:lease              concurrency leases: sorted set of holder -> expiry
    quota:{k:alice}:lease:h            their details: hash of holder -> "slot limit acquired_at"
    quota:{k:alice}:pause:0            a pause: the moment it ends (a string)

The stored key sits in a hash tag, so every row of one caller lives in one
cluster slot. Every row carries a TTL of its expiry plus `GRACE` seconds, so
Redis cleans itself (``cleanup`` finds nothing to delete); the index finds
every row of a key for ``reset`` without scanning the keyspace, and ``top``
scans the fixed-window counters with SCAN.

With ``clock="database"`` the scripts read Redis's ``TIME``. Redis errors
surface as `StorageError`; multi-statement transactions (durable quotas) and
PostgreSQL advisory locks raise `ConfigurationError`. redis-py is the optional
``redis`` extra: ``pip install 'quota[redis]'``.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import re
from collections import deque
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from importlib import resources
from typing import Any, TypeVar
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit

from quota._core.errors import ConfigurationError, StorageError
from quota._core.redaction import redact
from quota._core.url import StoreURL
from quota._sql import statements as _sql
from quota._sql.statements import BATCH_HIT_REDIS, Statement
from quota._sql.steps import Op, Rows, adrive, drive
from quota._stores.base import StoreSettings, handlers, unsupported

T = TypeVar("T")

DEFAULT_PREFIX = "quota:"
#: Seconds a row outlives its expiry: app servers whose clocks lag a little
#: still find it, and a token bucket read back after it is exactly full.
GRACE = 60

# -- the scripts -----------------------------------------------------------------------


def _lua(name: str) -> str:
    return (resources.files("quota._stores") / "lua" / f"{name}.lua").read_text(encoding="utf-8")


_COMMON = _lua("common").replace("__GRACE__", str(GRACE))
#: Each script's source (``common.lua`` first), by name.
SCRIPTS = {
    name: _COMMON + _lua(name).replace("__GRACE__", str(GRACE))
    for name in (
        "fixed_window",
        "sliding_window",
        "token_bucket",
        "gcra",
        "reset",
        "lease",
        "undo",
        "pause",
    )
}
SHAS = {name: hashlib.sha1(source.encode()).hexdigest() for name, source in SCRIPTS.items()}

_HIT, _HIT_CAPPED = _sql.HIT, _sql.HIT_CAPPED

#: A Redis command: its name and its arguments (redis-py's ``execute_command``). One
#: more, ``("PIPELINE", commands)``, sends `commands` (a tuple of commands) in one round
#: trip without ``MULTI`` (redis-py's ``pipeline(transaction=False)``): its reply is the list
#: of their replies in order, a command that failed answering its exception instance
#: (``execute(raise_on_error=False)``); a lost connection raises instead.
Command = tuple[str, tuple[Any, ...]]
#: The commands of one statement: each reply is sent back in; returns the statement's rows.
Plan = Generator[Command, Any, Rows]
#: Commands whose last reply is the result.
Exchange = Generator[Command, Any, Any]


def _glob_escape(text: str) -> str:
    return "".join("\\" + ch if ch in "\\*?[]" else ch for ch in text)


def _number(reply: Any) -> float:
    return float(reply)


def _text(reply: Any) -> str:
    return reply.decode() if isinstance(reply, bytes) else str(reply)


class RedisPlan:
    """The sans-I/O half shared by both faces: statements in, Redis commands out, rows back.

    `plan` looks the statement's name up in a table of handlers; a handler
    is a generator that yields commands, receives their replies (or has a
    Redis error thrown in) and returns the rows the SQL statement would have.
    `no_script` is redis-py's ``NoScriptError``: a server that lost a script
    (restarted, flushed) has it loaded again, once (`_eval`).
    """

    def __init__(self, *, prefix: str, db_clock: bool, no_script: type[Exception]) -> None:
        self.prefix = prefix
        self.db_clock = db_clock
        self._no_script = no_script
        statements: dict[Statement, Callable[[Any], Plan]] = {
            _sql.HIT: self._hit,
            _sql.HIT_CAPPED: self._hit,  # its limit rides after HIT's parameters (`hit_args`)
            _sql.RESET_ALL: functools.partial(self._reset, kind="fw"),
            _sql.RESET_WINDOW: functools.partial(self._reset, kind="fw"),
            _sql.STATE_RESET_ALL: functools.partial(self._reset, kind="state"),
            _sql.STATE_RESET_WINDOW: functools.partial(self._reset, kind="state"),
            _sql.COUNT_EXPIRED: self._nothing_expired,
            _sql.STATE_COUNT_EXPIRED: self._nothing_expired,
            _sql.DELETE_EXPIRED: self._nothing_deleted,
            _sql.STATE_DELETE_EXPIRED: self._nothing_deleted,
            _sql.SCHEMA_VERSION: self._ping,
            BATCH_HIT_REDIS: self._hit_batch,
            _sql.UNDO_FIXED_WINDOW: self._undo_fixed,
            _sql.UNDO_SLIDING_WINDOW: functools.partial(self._undo, kind="sw"),
            _sql.UNDO_TOKEN_BUCKET: functools.partial(self._undo, kind="tb"),
            _sql.UNDO_GCRA: functools.partial(self._undo, kind="gcra"),
            # Each lease set carries a TTL past its last expiry: Redis drops dead ones itself.
            _sql.LEASE_COUNT_EXPIRED: self._nothing_expired,
            _sql.LEASE_DELETE_EXPIRED: self._nothing_deleted,
        }
        #: Statement name -> handler: every statement Redis keeps.
        self._handlers = handlers(self, statements)

    @property
    def no_script(self) -> type[Exception]:
        """The error of an ``EVALSHA`` whose script the server does not hold."""
        return self._no_script

    def base(self, client_key: str) -> str:
        """The common start of every Redis key of one stored key (hash tag included)."""
        return f"{self.prefix}{{{client_key}}}:"

    def plan(self, statement: Statement, params: Sequence[Any]) -> Plan:
        """The commands that run `statement`, and its rows; `ConfigurationError` if Redis has none."""
        try:
            handler = self._handlers[statement.name]
        except (KeyError, AttributeError):  # AttributeError: bare text, no statement
            raise unsupported("Redis", statement) from None
        return handler(params)

    def _eval(self, script: str, keys: tuple[str, ...], args: tuple[Any, ...]) -> Exchange:
        """``EVALSHA`` of `script`, loading it first if the server lost it; returns the reply."""
        try:
            return (yield ("EVALSHA", (SHAS[script], len(keys), *keys, *args)))
        except self._no_script:
            sha = yield ("SCRIPT", ("LOAD", SCRIPTS[script]))
            return (yield ("EVALSHA", (sha, len(keys), *keys, *args)))

    def _now(self, params: Mapping[str, Any]) -> Any:
        return "db" if self.db_clock else params["now"]

    # -- the fixed window ---------------------------------------------------------------

    def hit_args(self, params: Sequence[Any]) -> tuple[Any, ...]:
        """The arguments of the one ``EVALSHA`` of a fixed-window hit, from the parameters of
        `quota._sql.statements.HIT` (of ``HIT_CAPPED``: the limit after them).

        Its reply is the count (an integer), or nil for a capped hit denied. The script
        increments the counter and, only when that creates it, sets its TTL and lists it
        in the caller's index.
        """
        client_key, start, window, cost, now = params[1:6]
        base = f"{self.prefix}{{{client_key}}}:"
        if len(params) > 6:
            return (SHAS["fixed_window"], 2, f"{base}fw:{window}:{start}", base + "idx", cost,
                    now, params[6])  # fmt: skip
        return (SHAS["fixed_window"], 2, f"{base}fw:{window}:{start}", base + "idx", cost, now)

    @staticmethod
    def hit_rows(reply: Any) -> Rows:
        """The rows of `quota._sql.statements.HIT` (``HIT_CAPPED``) from its script's reply."""
        return () if reply is None else ((reply,),)

    def _hit(self, params: Sequence[Any]) -> Plan:
        args = self.hit_args(params)
        return self.hit_rows((yield from self._eval("fixed_window", args[2:4], args[4:])))

    def _hit_batch(self, hits: Sequence[Sequence[Any]]) -> Plan:
        """Group commit (`quota._wrappers.batching`): each hit's own script, in one pipeline.

        One row per hit: its count, or the redis-py error of a hit whose script failed with
        a statement error (`is_statement_error`: a key of another type…), which fails that
        hit's caller only (the store wraps it in `StorageError`)."""
        calls = [self.hit_args(hit) for hit in hits]
        replies = yield from self._pipeline("fixed_window", calls, keep=is_statement_error)
        return [(reply,) for reply in replies]

    def _pipeline(
        self,
        script: str,
        calls: Sequence[tuple[Any, ...]],
        keep: Callable[[BaseException], bool] | None = None,
    ) -> Exchange:
        """The ``EVALSHA`` of each of `calls` (its arguments, `script`'s digest first), in one
        round trip; returns the replies in order.

        A script's error is raised (the first), unless `keep` says to leave it as that
        call's reply; if the server lost `script`, it is loaded and only the calls it
        refused are sent again: none of those ran.
        """

        def failed(reply: Any) -> bool:
            return isinstance(reply, Exception) and not (keep is not None and keep(reply))

        replies = list((yield ("PIPELINE", tuple(("EVALSHA", args) for args in calls))))
        lost = [i for i, reply in enumerate(replies) if isinstance(reply, self._no_script)]
        for reply in replies:
            if failed(reply) and not isinstance(reply, self._no_script):
                raise reply
        if lost:
            sha = yield ("SCRIPT", ("LOAD", SCRIPTS[script]))
            again = yield ("PIPELINE", tuple(("EVALSHA", (sha, *calls[i][1:])) for i in lost))
            for i, reply in zip(lost, again, strict=True):
                if failed(reply):
                    raise reply
                replies[i] = reply
        return replies

    def _fixed(self, params: Mapping[str, Any], *, capped: bool) -> Plan:
        window, client_key, now = params["window"], params["client_key"], params["now"]
        base = self.base(client_key)
        cost = params["cost"]
        if self.db_clock:  # the script reads the time and picks the window
            args = (cost, "db", params["limit"]) if capped else (cost, "db")
            reply = yield from self._eval(
                "fixed_window", (f"{base}fw:{window}:", base + "idx"), args
            )
            if reply is None:
                return ()
            return ((int(reply[0]), int(reply[1]), _number(reply[2])),)
        second = int(now)
        start = second - second % window
        args = (cost, now, params["limit"]) if capped else (cost, now)
        reply = yield from self._eval(
            "fixed_window", (f"{base}fw:{window}:{start}", base + "idx"), args
        )
        return () if reply is None else ((reply, start, float(now)),)

    def _peek(self, params: Sequence[Any]) -> Plan:
        window, start, client_key = str(params[0]).split(":", 2)
        reply = yield ("GET", (f"{self.base(client_key)}fw:{window}:{start}",))
        return () if reply is None else ((int(reply),),)

    # -- the other algorithms -------------------------------------------------------------

    def _state_keys(self, params: Mapping[str, Any]) -> tuple[str, str]:
        algorithm, window, client_key = str(params["bucket_key"]).split(":", 2)
        base = self.base(client_key)
        return f"{base}{algorithm}:{window}", base + "idx"

    def _sliding(self, params: Mapping[str, Any]) -> Plan:
        reply = yield from self._eval(
            "sliding_window", self._state_keys(params),
            (self._now(params), params["window"], params["limit"], params["cost"], params["ws"],
             params["weight"]),
        )  # fmt: skip
        value, prev, stamp, allowed, now = reply
        return ((_number(value), _number(prev), _number(stamp), int(allowed), _number(now)),)

    def _bucket(self, params: Mapping[str, Any]) -> Plan:
        reply = yield from self._eval(
            "token_bucket", self._state_keys(params),
            (self._now(params), params["capacity"], params["rate"], params["cost"]),
        )  # fmt: skip
        tokens, allowed, now = reply
        return ((_number(tokens), int(allowed), _number(now)),)

    def _gcra(self, params: Mapping[str, Any]) -> Plan:
        reply = yield from self._eval(
            "gcra", self._state_keys(params),
            (self._now(params), params["increment"], params["tolerance"]),
        )  # fmt: skip
        tat, allowed, now = reply
        return ((_number(tat), int(allowed), _number(now)),)

    # -- giving a hit back (lua/undo.lua) ------------------------------------------------

    def _undo_fixed(self, params: Mapping[str, Any]) -> Plan:
        window, start, client_key = str(params["bucket_key"]).split(":", 2)
        key = f"{self.base(client_key)}fw:{window}:{start}"
        reply = yield from self._eval("undo", (key,), ("fw", params["cost"]))
        return () if reply is None else ((int(reply),),)

    def _undo(self, params: Mapping[str, Any], *, kind: str) -> Plan:
        state = self._state_keys(params)[0]
        if kind == "sw":
            args: tuple[Any, ...] = (params["cost"], params["stamp"], params["window"])
        elif kind == "tb":
            args = (params["cost"], params["capacity"])
        else:
            args = (params["increment"],)
        reply = yield from self._eval("undo", (state,), (kind, *args))
        return () if reply is None else ((_number(reply),),)

    def _state_peek(self, params: Sequence[Any]) -> Plan:
        algorithm, window, client_key = str(params[0]).split(":", 2)
        reply = yield ("HMGET", (f"{self.base(client_key)}{algorithm}:{window}", "v", "p", "s"))
        value, prev, stamp = reply
        if value is None:
            return ()
        return ((_number(value), _number(prev or 0), _number(stamp or 0)),)

    # -- pauses (lua/pause.lua) ------------------------------------------------------------

    def _pause_set(self, params: Mapping[str, Any]) -> Plan:
        reply = yield from self._eval(
            "pause", self._state_keys(params), ("set", self._now(params), params["horizon"])
        )
        ends, now = reply
        return ((_number(ends), _number(now)),)

    def _pause_left(self, params: Mapping[str, Any]) -> Plan:
        if self.db_clock:
            reply = yield from self._eval("pause", self._state_keys(params), ("left", "db"))
            return () if reply is None else ((_number(reply),),)
        # On the app clock a read is enough: one GET, no script.
        reply = yield ("GET", (self._state_keys(params)[0],))
        left = 0.0 if reply is None else _number(reply) - params["now"]
        return ((left,),) if left > 0 else ()

    # -- maintenance ------------------------------------------------------------------------

    def _reset(self, params: Sequence[Any], *, kind: str) -> Plan:
        client_key = params[0]
        window = str(params[1]) if len(params) > 1 else ""
        base = self.base(client_key)
        deleted = yield from self._eval("reset", (base + "idx", base), (kind, window))
        return [(1,)] * int(deleted)

    def _top(self, params: Sequence[Any]) -> Plan:
        """SCAN the fixed-window counters (this is O(keyspace): an admin's view, not a hot path)."""
        now, limit = params
        pattern = _glob_escape(self.prefix) + "{*}:fw:*"
        live: list[tuple[str, int, int, int]] = []
        cursor: Any = 0
        while True:
            cursor, keys = yield ("SCAN", (cursor, "MATCH", pattern, "COUNT", 1000))
            counts = (yield ("MGET", tuple(keys))) if keys else []
            live.extend(self._live_counters(keys, counts, now))
            if int(cursor) == 0:
                break
        live.sort(key=lambda r: (-r[3], r[0]))
        return live[:limit]

    def _live_counters(
        self, keys: Sequence[bytes], counts: Sequence[Any], now: float
    ) -> Iterator[tuple[str, int, int, int]]:
        """The rows of `top` among scanned counter `keys` and their `counts`: windows still running."""
        for raw, count in zip(keys, counts, strict=True):
            head, kind, window, start = raw.decode()[len(self.prefix) :].rsplit(":", 3)
            end = int(start) + int(window)
            if count is not None and kind == "fw" and end > now:
                yield (head[1:-1], int(window), int(start), int(count))

    # -- concurrency leases (lua/lease.lua) ---------------------------------------------

    def _lease_keys(self, lease_key: str) -> tuple[str, str]:
        base = self.base(lease_key)
        return base + "lease", base + "lease:h"

    def _lease(self, lease_key: str, step: str, now: Any, *args: Any) -> Exchange:
        keys = self._lease_keys(lease_key)
        return (yield from self._eval("lease", keys, (step, "db" if self.db_clock else now, *args)))

    def _lease_acquire(self, params: Mapping[str, Any]) -> Plan:
        reply = yield from self._lease(
            params["lease_key"], "acquire", params["now"], params["holder"], params["slots"],
            params["first"], params["horizon"],
        )  # fmt: skip
        return () if reply is None else ((int(reply),),)

    def _lease_renew(self, params: Mapping[str, Any]) -> Plan:
        reply = yield from self._lease(
            params["lease_key"], "renew", params["now"], params["holder"], params["horizon"]
        )
        return () if reply is None else ((params["slot"],),)

    def _lease_release(self, params: Sequence[Any]) -> Plan:
        # A holder is unique to one take: its slot adds nothing to find it.
        freed = yield from self._lease(params[0], "release", 0, params[-1])
        return [(1,)] * int(freed)

    _lease_abandon = _lease_release

    def _lease_holders(self, params: Mapping[str, Any]) -> Plan:
        flat = yield from self._lease(params["lease_key"], "holders", params["now"])
        return [
            (int(flat[i]), _text(flat[i + 1]), int(flat[i + 2]), _number(flat[i + 3]),
             _number(flat[i + 4]))
            for i in range(0, len(flat), 5)
        ]  # fmt: skip

    def _lease_top(self, params: Mapping[str, Any]) -> Plan:
        """SCAN the lease sets, then each one's summary (an admin's view, not a hot path)."""
        rows = []
        suffix = ":lease"
        for raw in (yield from self._scan(_glob_escape(self.prefix) + "{*}" + suffix)):
            lease_key = _text(raw)[len(self.prefix) + 1 : -len(suffix) - 1]
            held, most, first = yield from self._lease(lease_key, "summary", params["now"])
            if int(held):
                rows.append((lease_key, int(held), int(most), _number(first)))
        rows.sort(key=lambda r: (-r[1], r[0]))
        return rows[: params["n"]]

    def _scan(self, pattern: str) -> Exchange:
        """Every key matching `pattern` (SCAN: O(keyspace))."""
        found: set[bytes] = set()
        cursor: Any = 0
        while True:
            cursor, keys = yield ("SCAN", (cursor, "MATCH", pattern, "COUNT", 1000))
            found.update(keys)
            if int(cursor) == 0:
                return sorted(found)

    def _nothing_expired(self, params: Sequence[Any]) -> Plan:
        # Every row has a TTL: Redis has already removed what cleanup would.
        return ((0,),)
        yield  # pragma: no cover - makes this a generator

    def _nothing_deleted(self, params: Sequence[Any]) -> Plan:
        return ()
        yield  # pragma: no cover - makes this a generator

    def _ping(self, params: Sequence[Any]) -> Plan:
        # No schema to be at: a Redis that answers is current (the fallback probes with this).
        from quota._sql.schema import REQUIRED

        yield ("PING", ())
        return ((REQUIRED,),)


def split_url(url: str) -> tuple[str, str]:
    """(the URL for redis-py, the key prefix): ``?prefix=`` is ours, the rest redis-py's."""
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    prefixes = [value for name, value in query if name == "prefix"]
    rest = [(name, value) for name, value in query if name != "prefix"]
    prefix = prefixes[-1] if prefixes else DEFAULT_PREFIX
    if not prefix or any(ch in prefix for ch in "{}"):
        raise ConfigurationError(
            f"prefix in {redact(url)!r} must be non-empty and free of braces, got {prefix!r}"
        )
    return parts._replace(query=urlencode(rest)).geturl(), prefix


def _import_redis(url: str) -> Any:
    try:
        import redis
        import redis.asyncio
    except ImportError as exc:
        raise ConfigurationError(
            f"url {redact(url)!r} needs redis-py: pip install 'quota[redis]'"
        ) from exc
    return redis


def _client_options(timeout: float) -> dict[str, Any]:
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    # No retries: a script that ran but whose reply was lost must not count twice.
    return {
        "socket_timeout": timeout,
        "socket_connect_timeout": timeout,
        "retry": Retry(NoBackoff(), 0),
    }


_EXPECTED = "expected redis://[:password@]host[:port][/db] (rediss:// for TLS)"


@contextlib.contextmanager
def _bad_url(url: str, *, kind: str = "Redis URL", expected: str = _EXPECTED) -> Iterator[None]:
    """Turn redis-py's (and urllib's) ValueError about `url` into a `ConfigurationError`
    naming it (a `kind` of URL, `expected` saying what one looks like), password hidden."""
    try:
        yield
    except ConfigurationError:
        raise
    except (ValueError, TypeError) as exc:
        detail = str(exc)
        password = _password(url)
        if password:
            detail = detail.replace(password, "***")
        raise ConfigurationError(
            f"url {redact(url)!r} is not a valid {kind} ({detail}); {expected}"
        ) from None


def _password(url: str) -> str:
    """The text between ``user:`` and the last ``@`` of the host part, if any."""
    rest = url.partition("://")[2]
    first_at = rest.find("@")
    if first_at < 0:
        return ""
    slash = rest.find("/", first_at)
    head = rest if slash < 0 else rest[:slash]
    return head.rpartition("@")[0].partition(":")[2]


def _checked_url(url: str) -> tuple[str, str]:
    """`split_url`, and a `ConfigurationError` naming `url` (redacted) for a URL that is not one."""
    with _bad_url(url):
        target, prefix = split_url(url)
        parts = urlsplit(target)
        if "," in parts.netloc.rpartition("@")[2]:
            raise ConfigurationError(
                f"url {redact(url)!r} lists several hosts; a Redis Cluster is"
                " redis+cluster://host:port,host:port/ (rediss+cluster:// for TLS)"
            )
        if any(name == "cluster" for name, _ in parse_qsl(parts.query, keep_blank_values=True)):
            raise ConfigurationError(
                f"url {redact(url)!r}: cluster= is not an option of redis://; a Redis Cluster"
                " is redis+cluster://host:port[,host:port…]/ (rediss+cluster:// for TLS)"
            )
        parts.port  # noqa: B018  (urllib checks the port when it is read)
        if not parts.hostname:
            raise ValueError("it names no host")
    return target, prefix


#: Error replies that say the server (not the statement) cannot answer now: a script
#: running too long, a dataset loading, a failover or a resharding under way.
_TRANSIENT_REPLIES = frozenset(
    ("BUSY", "LOADING", "MASTERDOWN", "CLUSTERDOWN", "TRYAGAIN", "MOVED", "ASK", "READONLY",
     "NOREPLICAS")
)  # fmt: skip


def is_statement_error(exc: BaseException) -> bool:
    """True for a redis-py error about the command itself, which every call alike would
    meet: an error reply (a key of another type, a permission missing, ``OOM``, a script
    error) or a value redis-py refused to send. False for an outage: no connection, a
    timeout, a garbled reply, or a reply saying the server cannot answer now
    (`_TRANSIENT_REPLIES`, redirections a cluster client did not follow)."""
    from redis import exceptions

    if isinstance(exc, exceptions.DataError):
        return True
    if not isinstance(exc, exceptions.ResponseError) or isinstance(
        exc, (exceptions.ReadOnlyError, exceptions.AskError, exceptions.TryAgainError,
              exceptions.ClusterError)
    ):  # fmt: skip
        return False
    return str(exc).split(" ", 1)[0] not in _TRANSIENT_REPLIES


def failed(url: str, exc: Exception) -> StorageError:
    """The `StorageError` of redis-py's `exc` from the store at `url`: an outage, or a
    statement error (``outage=False``, `is_statement_error`); a missing ACL permission
    names the user and what to grant."""
    from redis.exceptions import NoPermissionError

    detail = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, NoPermissionError) or str(exc).startswith("NOPERM"):
        user = unquote(urlsplit(url).username or "") or "default"
        command = re.search(r"'([^']+)' command", str(exc))
        what = f"the {command[1].upper()} command" if command else "a command or key it needs"
        grant = f" (ACL SETUSER {user} +{command[1].lower()})" if command else ""
        return StorageError(
            f"Redis user {user!r} on {redact(url)} has no permission to run {what}, which"
            f" quota needs: grant it{grant} ({detail})",
            outage=False,
        )
    return StorageError(
        f"Redis error on {redact(url)}: {detail}", outage=not is_statement_error(exc)
    )


#: `fresh_before_send` of each redis.asyncio connection class, made once.
_FRESH: dict[type, type] = {}


def fresh_before_send(base: Any) -> type:
    """A subclass of redis.asyncio's connection class `base` that, before it writes a
    command, replaces its socket if the server closed it while it sat idle.

    A server closes idle connections (its ``timeout``, a proxy's or a managed service's
    idle limit, ``CLIENT KILL``); a command written on one is lost with a
    ``ConnectionError``, and since redis-py cannot tell whether it ran, it is not sent
    again. redis.asyncio's pool checks for this only while maintenance notifications are
    off, and its cluster client not at all. Once the socket has read the server's end of
    the stream, nothing written on it can have run: a new connection before the command
    goes out loses nothing and never counts a hit twice.
    """
    fresh = _FRESH.get(base)
    if fresh is None:

        async def send_packed_command(self: Any, command: Any, check_health: bool = True) -> None:
            reader = getattr(self, "_reader", None)
            if reader is not None and (reader.at_eof() or reader.exception() is not None):
                await self.disconnect()
            await base.send_packed_command(self, command, check_health)

        fresh = type(base.__name__, (base,), {"send_packed_command": send_packed_command})
        fresh.__module__ = base.__module__
        _FRESH[base] = fresh
    return fresh


class _RedisStore:
    """What both faces share: the URL, the client, the planner and the error wrapping."""

    dialect = "redis"
    #: No fallback answers for a Redis store.
    up = True

    def __init__(self, url: str, *, timeout: float, db_clock: bool, asynchronous: bool) -> None:
        redis = _import_redis(url)
        target, prefix = _checked_url(url)
        self.url = url
        self.db_clock = db_clock
        self.planner = RedisPlan(
            prefix=prefix, db_clock=db_clock, no_script=redis.exceptions.NoScriptError
        )
        self._errors: type[Exception] = redis.RedisError
        client = redis.asyncio.Redis if asynchronous else redis.Redis
        with _bad_url(url):
            self.client = client.from_url(target, **_client_options(timeout))
            # redis-py hands unknown query parameters to each connection it makes: a
            # TypeError at the first call. One connection built now (it opens no socket)
            # names a bad parameter at connect time instead.
            pool = self.client.connection_pool
            pool.connection_class(**pool.connection_kwargs)
            if asynchronous:
                pool.connection_class = fresh_before_send(pool.connection_class)

    def _failed(self, exc: Exception) -> StorageError:
        return failed(self.url, exc)

    def _planned(self, statement: Statement, params: Sequence[Any]) -> Plan:
        """The plan of `statement` (`RedisPlan.plan`) as both faces drive it off the hot
        path: a redis-py error made its `StorageError`, and a group commit's rows checked."""
        try:
            rows = yield from self.planner.plan(statement, params)
        except self._errors as exc:
            raise self._failed(exc) from exc
        return self._batch_rows(rows) if statement is BATCH_HIT_REDIS else rows

    def _batch_rows(self, rows: Rows) -> Rows:
        """The rows of a group commit, a hit's redis-py error made its `StorageError`."""
        return [(self._failed(row[0]),) if isinstance(row[0], Exception) else row for row in rows]

    @staticmethod
    def _one_by_one(transaction: bool) -> None:
        if transaction:
            raise ConfigurationError(
                "the Redis store runs one atomic script per statement and cannot run a"
                " multi-statement transaction (durable quotas need sqlite:// or postgresql://)"
            )


class RedisStore(_RedisStore):
    """Sync Redis store on redis-py's connection pool; thread-safe.

    The fixed window's hits (`_send_hit`) go out on connections of the store's own,
    made by redis-py with the pool's settings but kept outside its pool: taking a
    connection from redis-py's pool and giving it back costs more client CPU than
    sending the script and reading its reply (a lock each way, a read to check the
    connection is clean, metrics). A connection whose call failed other than by an
    error reply is closed, never reused: a late reply cannot reach the next caller; an
    idle one the server closed is replaced before its next call, as the pool does.
    """

    def __init__(self, url: str, *, timeout: float = 10.0, db_clock: bool = False) -> None:
        super().__init__(url, timeout=timeout, db_clock=db_clock, asynchronous=False)
        from redis.exceptions import ResponseError

        self._error_reply: type[Exception] = ResponseError
        self._idle: deque[Any] = deque()  # the hot path's connections, free
        self._pid = os.getpid()
        self._own_connections = True

    #: Whether `_send_hit` uses the store's own connections (a subclass that sends its
    #: commands otherwise, overriding `_send`, leaves it False and is sent them there).
    _own_connections = False

    def _send_hit(self, args: tuple[Any, ...]) -> Any:
        """``EVALSHA`` with `args`: the hot path's one command (see the class docstring)."""
        if not self._own_connections:
            return self._send("EVALSHA", args)
        if self._pid != os.getpid():  # a forked child: its parent's sockets are not its own
            self._idle, self._pid = deque(), os.getpid()
        idle = self._idle
        try:
            connection = idle.pop()
        except IndexError:
            pool = self.client.connection_pool
            connection = pool.connection_class(**pool.connection_kwargs)
        else:
            # As redis-py's pool does: an idle connection with something to read was
            # closed by the server (a restart, a failover, its idle ``timeout``); a new
            # one replaces it before anything is sent, so the call cannot be lost.
            try:
                stale = connection.can_read()
            except (OSError, self._errors):
                stale = True
            if stale:
                connection.disconnect()
        try:
            connection.send_command("EVALSHA", *args)
            reply = connection.read_response()
        except self._error_reply:
            idle.append(connection)  # an error reply, read in full: the connection is clean
            raise
        except BaseException:
            connection.disconnect()
            raise
        idle.append(connection)
        return reply

    def _send(self, name: str, args: tuple[Any, ...]) -> Any:
        if name == "PIPELINE":
            pipe = self.client.pipeline(transaction=False)
            for command, command_args in args:
                pipe.execute_command(command, *command_args)
            return pipe.execute(raise_on_error=False)
        return self.client.execute_command(name, *args)

    def execute(self, statement: Statement, params: Sequence[Any]) -> Rows:
        """Run one statement as its Redis commands; see `quota._stores.base.SyncStore.execute`."""
        planner = self.planner
        if statement is _HIT or statement is _HIT_CAPPED:  # the hot path: its one EVALSHA
            try:
                return planner.hit_rows(self._send_hit(planner.hit_args(params)))
            except planner.no_script:
                pass  # the server lost the script: the plan loads it
            except self._errors as exc:
                raise self._failed(exc) from exc
        return drive(self._planned(statement, params), self._send)

    execute_strict = execute

    def run(self, op: Op[T], *, transaction: bool, maintenance: bool = False) -> T:
        """Drive `op` one statement at a time; `ConfigurationError` for a transaction.
        (`maintenance` changes nothing: the store's timeout is its socket's.)"""
        self._one_by_one(transaction)
        return drive(op, self.execute)

    def close(self) -> None:
        idle, self._idle = self._idle, deque()
        for connection in idle:
            connection.disconnect()
        self.client.close()


class AsyncRedisStore(_RedisStore):
    """Async Redis store on redis.asyncio; safe to share between tasks of one loop.

    A connection the server closed while it sat idle is replaced before a command is
    written on it (`fresh_before_send`), as the sync store does.
    """

    def __init__(self, url: str, *, timeout: float = 10.0, db_clock: bool = False) -> None:
        super().__init__(url, timeout=timeout, db_clock=db_clock, asynchronous=True)

    async def _send(self, name: str, args: tuple[Any, ...]) -> Any:
        if name == "PIPELINE":
            pipe = self.client.pipeline(transaction=False)
            for command, command_args in args:
                pipe.execute_command(command, *command_args)
            return await pipe.execute(raise_on_error=False)
        return await self.client.execute_command(name, *args)

    async def execute(self, statement: Statement, params: Sequence[Any]) -> Rows:
        """See `RedisStore.execute`."""
        planner = self.planner
        if statement is _HIT or statement is _HIT_CAPPED:  # the hot path: its one EVALSHA
            try:
                return planner.hit_rows(await self._send("EVALSHA", planner.hit_args(params)))
            except planner.no_script:
                pass  # the server lost the script: the plan loads it
            except self._errors as exc:
                raise self._failed(exc) from exc
        return await adrive(self._planned(statement, params), self._send)

    execute_strict = execute

    async def run(self, op: Op[T], *, transaction: bool, maintenance: bool = False) -> T:
        """See `RedisStore.run`."""
        self._one_by_one(transaction)
        return await adrive(op, self.execute)

    async def aclose(self) -> None:
        await self.client.aclose()


def open_sync(parsed: StoreURL, settings: StoreSettings) -> RedisStore:
    """The sync store of a ``redis://`` URL (`quota._core.url.DIALECTS`)."""
    return RedisStore(parsed.url, timeout=settings.timeout, db_clock=settings.db_clock)


def open_async(parsed: StoreURL, settings: StoreSettings) -> AsyncRedisStore:
    """The async store of a ``redis://`` URL."""
    return AsyncRedisStore(parsed.url, timeout=settings.timeout, db_clock=settings.db_clock)
