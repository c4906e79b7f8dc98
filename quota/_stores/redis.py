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
from collections import deque
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from importlib import resources
from typing import Any, TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit

from quota._core.errors import ConfigurationError, StorageError
from quota._sql import statements as _sql
from quota._sql.statements import Statement
from quota._stores.base import Op, Rows, adrive, drive, handlers, unsupported
from quota._stores.url import redact
from quota._wrappers.batching import BATCH_HIT_REDIS

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
    name: _COMMON + _lua(name)
    for name in ("fixed_window", "sliding_window", "token_bucket", "gcra", "reset")
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
            _sql.PEEK: self._peek,
            _sql.STATE_PEEK: self._state_peek,
            _sql.RESET_ALL: functools.partial(self._reset, kind="fw"),
            _sql.RESET_WINDOW: functools.partial(self._reset, kind="fw"),
            _sql.STATE_RESET_ALL: functools.partial(self._reset, kind="state"),
            _sql.STATE_RESET_WINDOW: functools.partial(self._reset, kind="state"),
            _sql.COUNT_EXPIRED: self._nothing_expired,
            _sql.STATE_COUNT_EXPIRED: self._nothing_expired,
            _sql.DELETE_EXPIRED: self._nothing_deleted,
            _sql.STATE_DELETE_EXPIRED: self._nothing_deleted,
            _sql.TOP: self._top,
            _sql.SCHEMA_VERSION: self._ping,
            _sql.SLIDING_WINDOW: self._sliding,
            _sql.TOKEN_BUCKET: self._bucket,
            _sql.GCRA: self._gcra,
            _sql.HIT_DB_CLOCK: functools.partial(self._fixed, capped=False),
            _sql.HIT_DB_CLOCK_CAPPED: functools.partial(self._fixed, capped=True),
            BATCH_HIT_REDIS: self._hit_batch,
        }
        #: Statement name -> handler: every statement Redis keeps.
        self._handlers = handlers(statements)

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
        """Group commit (`quota._wrappers.batching`): each hit's own script, in one pipeline."""
        replies = yield from self._pipeline("fixed_window", [self.hit_args(hit) for hit in hits])
        return [(reply,) for reply in replies]

    def _pipeline(self, script: str, calls: Sequence[tuple[Any, ...]]) -> Exchange:
        """The ``EVALSHA`` of each of `calls` (its arguments, `script`'s digest first), in one
        round trip; returns the replies in order.

        A script's error is raised (the first); if the server lost `script`, it is loaded
        and only the calls it refused are sent again: none of those ran.
        """
        replies = list((yield ("PIPELINE", tuple(("EVALSHA", args) for args in calls))))
        lost = [i for i, reply in enumerate(replies) if isinstance(reply, self._no_script)]
        for reply in replies:
            if isinstance(reply, Exception) and not isinstance(reply, self._no_script):
                raise reply
        if lost:
            sha = yield ("SCRIPT", ("LOAD", SCRIPTS[script]))
            again = yield ("PIPELINE", tuple(("EVALSHA", (sha, *calls[i][1:])) for i in lost))
            for i, reply in zip(lost, again, strict=True):
                if isinstance(reply, Exception):
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

    def _state_peek(self, params: Sequence[Any]) -> Plan:
        algorithm, window, client_key = str(params[0]).split(":", 2)
        reply = yield ("HMGET", (f"{self.base(client_key)}{algorithm}:{window}", "v", "p", "s"))
        value, prev, stamp = reply
        if value is None:
            return ()
        return ((_number(value), _number(prev or 0), _number(stamp or 0)),)

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

    def _failed(self, exc: Exception) -> StorageError:
        return StorageError(f"Redis error on {redact(self.url)}: {type(exc).__name__}: {exc}")

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
        plan = planner.plan(statement, params)
        try:
            return drive(plan, self._send)
        except self._errors as exc:
            raise self._failed(exc) from exc

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
    """Async Redis store on redis.asyncio; safe to share between tasks of one loop."""

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
        plan = planner.plan(statement, params)
        try:
            return await adrive(plan, self._send)
        except self._errors as exc:
            raise self._failed(exc) from exc

    execute_strict = execute

    async def run(self, op: Op[T], *, transaction: bool, maintenance: bool = False) -> T:
        """See `RedisStore.run`."""
        self._one_by_one(transaction)
        return await adrive(op, self.execute)

    async def aclose(self) -> None:
        await self.client.aclose()
