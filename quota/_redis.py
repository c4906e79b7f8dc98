"""The Redis store (``redis://host:port/db``): one atomic Lua script per algorithm.

It answers the statements of `quota._sql` like the SQL stores do, with rows of
the same shape, so the limiters, `quota._ops` and the fallback drive it
unchanged: each statement becomes one Redis command, and each decision one
``EVALSHA`` of the script of its algorithm. The scripts spell out the
arithmetic of `quota._algorithms` operation for operation in IEEE doubles;
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
import hashlib
from collections.abc import Generator, Iterator, Mapping, Sequence
from typing import Any, TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit

from quota import _sql
from quota._errors import ConfigurationError, StorageError
from quota._sql import Named
from quota._store import Rows, Statement, adrive, drive

T = TypeVar("T")

DEFAULT_PREFIX = "quota:"
#: Seconds a row outlives its expiry: app servers whose clocks lag a little
#: still find it, and a token bucket read back after it is exactly full.
GRACE = 60

# -- the scripts -----------------------------------------------------------------------

_COMMON = """
local function fmt(x) return string.format('%.17g', x) end
local function clock(arg)
  if arg == 'db' then
    local t = redis.call('TIME')
    return tonumber(t[1]) + tonumber(t[2]) / 1000000
  end
  return tonumber(arg)
end
-- Keep `key` until `expires` (+ GRACE), and list it in the caller's index under its
-- name past the caller's prefix (`fw:60:1750003200`, `sw:60`).
local function keep(key, index, expires, now, created)
  local member = string.match(key, '}:(%a+:[%d:]+)$')
  local grace = __GRACE__
  local ttl = math.ceil((expires - now + grace) * 1000)
  if ttl < 1 then ttl = 1 end
  redis.call('PEXPIRE', key, ttl)
  redis.call('ZADD', index, fmt(expires), member)
  if created then redis.call('ZREMRANGEBYSCORE', index, '-inf', '(' .. fmt(now - grace)) end
  if redis.call('PTTL', index) < ttl then redis.call('PEXPIRE', index, ttl) end
end
"""

_FIXED_WINDOW = """
-- KEYS: the counter's key without its window start, the index.
-- ARGV: now|'db', window, cost, limit|'' (capped), window start
local now = clock(ARGV[1])
local window, cost = tonumber(ARGV[2]), tonumber(ARGV[3])
local start = tonumber(ARGV[5])
if ARGV[1] == 'db' then
  local second = math.floor(now)
  start = second - second % window
end
local suffix = string.format('%d', start)
local key = KEYS[1] .. suffix
if ARGV[4] ~= '' then
  local current = redis.call('GET', key)
  if current and tonumber(current) + cost > tonumber(ARGV[4]) then return false end
end
local count = redis.call('INCRBY', key, cost)
if count == cost then keep(key, KEYS[2], start + window, now, true) end
return {count, suffix, fmt(now)}
"""

# quota._algorithms.sliding_step
_SLIDING_WINDOW = """
-- KEYS: the state, the index. ARGV: now|'db', window, limit, cost, ws, weight
local now = clock(ARGV[1])
local window, limit, cost = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local ws, weight = tonumber(ARGV[5]), tonumber(ARGV[6])
if ARGV[1] == 'db' then
  local second = math.floor(now)
  ws = second - second % window
  weight = (window - (now - ws)) / window
end
local row = redis.call('HMGET', KEYS[1], 'v', 'p', 's')
local value, prev, stamp, allowed = cost, 0.0, ws, true
if row[1] then
  local v, p, s = tonumber(row[1]), tonumber(row[2]), tonumber(row[3])
  local current, previous = 0.0, 0.0
  if s >= ws then
    current, previous = v, p
    -- a late call: as at the start of the row's window, the previous one in full
    if s > ws then weight = 1.0 end
  elseif s == ws - window then
    previous = v
  end
  allowed = previous * weight + current + cost <= limit
  value = current
  if allowed then value = current + cost end
  prev, stamp = previous, math.max(s, ws)
end
redis.call('HSET', KEYS[1], 'v', fmt(value), 'p', fmt(prev), 's', fmt(stamp))
keep(KEYS[1], KEYS[2], stamp + 2 * window, now, not row[1])
return {fmt(value), fmt(prev), fmt(stamp), allowed and 1 or 0, fmt(now)}
"""

# quota._algorithms.bucket_step
_TOKEN_BUCKET = """
-- KEYS: the state, the index. ARGV: now|'db', capacity, rate, cost
local now = clock(ARGV[1])
local capacity, rate, cost = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local row = redis.call('HMGET', KEYS[1], 'v', 's')
local tokens, stamp, allowed, expires = capacity - cost, now, true, now + cost / rate
if row[1] then
  local t, s = tonumber(row[1]), tonumber(row[2])
  local refill = math.min(capacity, t + math.max(0.0, now - s) * rate)
  allowed = refill >= cost
  tokens = refill
  if allowed then tokens = refill - cost end
  stamp = math.max(s, now)
  expires = stamp + (capacity - refill + cost) / rate
end
redis.call('HSET', KEYS[1], 'v', fmt(tokens), 's', fmt(stamp))
keep(KEYS[1], KEYS[2], expires, now, not row[1])
return {fmt(tokens), allowed and 1 or 0, fmt(now)}
"""

# quota._algorithms.gcra_step
_GCRA = """
-- KEYS: the state, the index. ARGV: now|'db', increment, tolerance
local now = clock(ARGV[1])
local increment, tolerance = tonumber(ARGV[2]), tonumber(ARGV[3])
local stored = redis.call('HGET', KEYS[1], 'v')
local tat, allowed = now + increment, true
if stored then
  tat = tonumber(stored)
  local arrival = math.max(tat, now) + increment
  allowed = math.max(tat - now, 0.0) + increment <= tolerance
  if allowed then tat = arrival end
end
redis.call('HSET', KEYS[1], 'v', fmt(tat))
keep(KEYS[1], KEYS[2], tat, now, not stored)
return {fmt(tat), allowed and 1 or 0, fmt(now)}
"""

_RESET = """
-- KEYS: the index, the caller's key prefix. ARGV: 'fw' (counters) or 'state', window or ''
local deleted = 0
for _, member in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  local kind, window = string.match(member, '^(%a+):(%d+)')
  if ((kind == 'fw') == (ARGV[1] == 'fw')) and (ARGV[2] == '' or window == ARGV[2]) then
    deleted = deleted + redis.call('DEL', KEYS[2] .. member)
    redis.call('ZREM', KEYS[1], member)
  end
end
return deleted
"""

SCRIPTS = {
    name: _COMMON.replace("__GRACE__", str(GRACE)) + body
    for name, body in (
        ("fixed_window", _FIXED_WINDOW),
        ("sliding_window", _SLIDING_WINDOW),
        ("token_bucket", _TOKEN_BUCKET),
        ("gcra", _GCRA),
        ("reset", _RESET),
    )
}
SHAS = {name: hashlib.sha1(source.encode()).hexdigest() for name, source in SCRIPTS.items()}

#: A command for the driver: ``(_EVAL, script name, keys, args)`` or a plain Redis command.
Command = tuple[Any, ...]
_EVAL = "EVALSHA"


def _glob_escape(text: str) -> str:
    return "".join("\\" + ch if ch in "\\*?[]" else ch for ch in text)


def _number(reply: Any) -> float:
    return float(reply)


class RedisPlan:
    """The sans-I/O half shared by both faces: statements in, Redis commands out, rows back.

    `plan` is a generator per statement: it yields `Command`s, receives
    their replies and returns the rows the SQL statement would have.
    """

    def __init__(self, *, prefix: str, db_clock: bool) -> None:
        self.prefix = prefix
        self.db_clock = db_clock
        self._positional = {
            _sql.HIT: self._hit,
            _sql.HIT_CAPPED: self._hit,
            _sql.PEEK: self._peek,
            _sql.RESET_ALL: self._reset,
            _sql.RESET_WINDOW: self._reset,
            _sql.STATE_RESET_ALL: self._reset,
            _sql.STATE_RESET_WINDOW: self._reset,
            _sql.STATE_PEEK: self._state_peek,
            _sql.TOP: self._top,
            _sql.COUNT_EXPIRED: self._nothing_expired,
            _sql.STATE_COUNT_EXPIRED: self._nothing_expired,
            _sql.DELETE_EXPIRED: self._nothing_deleted,
            _sql.STATE_DELETE_EXPIRED: self._nothing_deleted,
            _sql.SCHEMA_VERSION: self._ping,
        }
        self._named = {
            _sql.SLIDING_WINDOW.name: self._sliding,
            _sql.TOKEN_BUCKET.name: self._bucket,
            _sql.GCRA.name: self._gcra,
            _sql.HIT_DB_CLOCK.name: self._fixed,
            _sql.HIT_DB_CLOCK_CAPPED.name: self._fixed,
        }

    def base(self, client_key: str) -> str:
        """The common start of every Redis key of one stored key (hash tag included)."""
        return f"{self.prefix}{{{client_key}}}:"

    def plan(
        self, sql: str | Named, params: Sequence[Any] | Mapping[str, Any]
    ) -> Generator[Command, Any, Rows]:
        """The commands that run `sql`, and its rows; `ConfigurationError` if Redis has none."""
        if isinstance(sql, Named):
            named = self._named.get(sql.name)
            if named is None:
                raise _unsupported(sql)
            return named(sql, sql.as_dict(params))  # type: ignore[arg-type]
        positional = self._positional.get(sql)
        if positional is None:
            raise _unsupported(sql)
        return positional(sql, params)  # type: ignore[arg-type]

    def _now(self, params: Mapping[str, Any]) -> Any:
        return "db" if self.db_clock else params["now"]

    # -- the fixed window ---------------------------------------------------------------

    def _hit(self, sql: str, params: Sequence[Any]) -> Generator[Command, Any, Rows]:
        _bucket_key, client_key, start, window, cost, now = params[:6]
        limit = params[6] if sql is _sql.HIT_CAPPED or sql == _sql.HIT_CAPPED else ""
        base = self.base(client_key)
        reply = yield (
            _EVAL, "fixed_window", (f"{base}fw:{window}:", base + "idx"),
            (now, window, cost, limit, start),
        )  # fmt: skip
        return () if reply is None else ((int(reply[0]),),)

    def _fixed(self, sql: Named, params: Mapping[str, Any]) -> Generator[Command, Any, Rows]:
        window, client_key, now = params["window"], params["client_key"], params["now"]
        capped = sql.name == _sql.HIT_DB_CLOCK_CAPPED.name
        second = int(now)
        start = second - second % window
        base = self.base(client_key)
        reply = yield (
            _EVAL, "fixed_window", (f"{base}fw:{window}:", base + "idx"),
            (self._now(params), window, params["cost"], params["limit"] if capped else "", start),
        )  # fmt: skip
        if reply is None:
            return ()
        return ((int(reply[0]), int(reply[1]), _number(reply[2])),)

    def _peek(self, sql: str, params: Sequence[Any]) -> Generator[Command, Any, Rows]:
        window, start, client_key = str(params[0]).split(":", 2)
        reply = yield ("GET", f"{self.base(client_key)}fw:{window}:{start}")
        return () if reply is None else ((int(reply),),)

    # -- the other algorithms -------------------------------------------------------------

    def _state_keys(self, params: Mapping[str, Any]) -> tuple[str, str]:
        algorithm, window, client_key = str(params["bucket_key"]).split(":", 2)
        base = self.base(client_key)
        return f"{base}{algorithm}:{window}", base + "idx"

    def _sliding(self, sql: Named, params: Mapping[str, Any]) -> Generator[Command, Any, Rows]:
        reply = yield (
            _EVAL, "sliding_window", self._state_keys(params),
            (self._now(params), params["window"], params["limit"], params["cost"], params["ws"],
             params["weight"]),
        )  # fmt: skip
        value, prev, stamp, allowed, now = reply
        return ((_number(value), _number(prev), _number(stamp), int(allowed), _number(now)),)

    def _bucket(self, sql: Named, params: Mapping[str, Any]) -> Generator[Command, Any, Rows]:
        reply = yield (
            _EVAL, "token_bucket", self._state_keys(params),
            (self._now(params), params["capacity"], params["rate"], params["cost"]),
        )  # fmt: skip
        tokens, allowed, now = reply
        return ((_number(tokens), int(allowed), _number(now)),)

    def _gcra(self, sql: Named, params: Mapping[str, Any]) -> Generator[Command, Any, Rows]:
        reply = yield (
            _EVAL, "gcra", self._state_keys(params),
            (self._now(params), params["increment"], params["tolerance"]),
        )  # fmt: skip
        tat, allowed, now = reply
        return ((_number(tat), int(allowed), _number(now)),)

    def _state_peek(self, sql: str, params: Sequence[Any]) -> Generator[Command, Any, Rows]:
        algorithm, window, client_key = str(params[0]).split(":", 2)
        reply = yield ("HMGET", f"{self.base(client_key)}{algorithm}:{window}", "v", "p", "s")
        value, prev, stamp = reply
        if value is None:
            return ()
        return ((_number(value), _number(prev or 0), _number(stamp or 0)),)

    # -- maintenance ------------------------------------------------------------------------

    def _reset(self, sql: str, params: Sequence[Any]) -> Generator[Command, Any, Rows]:
        client_key = params[0]
        window = str(params[1]) if len(params) > 1 else ""
        kind = "state" if sql in (_sql.STATE_RESET_ALL, _sql.STATE_RESET_WINDOW) else "fw"
        base = self.base(client_key)
        deleted = yield (_EVAL, "reset", (base + "idx", base), (kind, window))
        return [(1,)] * int(deleted)

    def _top(self, sql: str, params: Sequence[Any]) -> Generator[Command, Any, Rows]:
        """SCAN the fixed-window counters (this is O(keyspace): an admin's view, not a hot path)."""
        now, limit = params
        pattern = _glob_escape(self.prefix) + "{*}:fw:*"
        live: list[tuple[str, int, int, int]] = []
        cursor: Any = 0
        while True:
            cursor, keys = yield ("SCAN", cursor, "MATCH", pattern, "COUNT", 1000)
            counts = (yield ("MGET", *keys)) if keys else []
            for raw, count in zip(keys, counts, strict=True):
                head, kind, window, start = raw.decode()[len(self.prefix) :].rsplit(":", 3)
                end = int(start) + int(window)
                if count is not None and kind == "fw" and end > now:
                    live.append((head[1:-1], int(window), int(start), int(count)))
            if int(cursor) == 0:
                break
        live.sort(key=lambda r: (-r[3], r[0]))
        return live[:limit]

    def _nothing_expired(self, sql: str, params: Sequence[Any]) -> Generator[Command, Any, Rows]:
        # Every row has a TTL: Redis has already removed what cleanup would.
        return ((0,),)
        yield  # pragma: no cover - makes this a generator

    def _nothing_deleted(self, sql: str, params: Sequence[Any]) -> Generator[Command, Any, Rows]:
        return ()
        yield  # pragma: no cover - makes this a generator

    def _ping(self, sql: str, params: Sequence[Any]) -> Generator[Command, Any, Rows]:
        # No schema to be at: a Redis that answers is current (the fallback probes with this).
        from quota._schema import REQUIRED

        yield ("PING",)
        return ((REQUIRED,),)


def _unsupported(sql: object) -> ConfigurationError:
    what = f"statement {sql.name!r}" if isinstance(sql, Named) else f"statement {str(sql)[:60]!r}…"
    if sql in (_sql.PG_TRY_LOCK, _sql.PG_UNLOCK):
        what = "PostgreSQL advisory locks"
    return ConfigurationError(
        f"the Redis store cannot run {what}: it keeps rate limits only (every algorithm);"
        " durable quotas and other SQL-only features need sqlite:// or postgresql://"
    )


def _no_transactions() -> ConfigurationError:
    return ConfigurationError(
        "the Redis store runs one atomic script per statement and cannot run a"
        " multi-statement transaction (durable quotas need sqlite:// or postgresql://)"
    )


def redact(url: str) -> str:
    """`url` without its password, for messages (`quota._url.redact`)."""
    from quota._url import redact as hide

    return hide(url)


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


@contextlib.contextmanager
def _bad_url(url: str) -> Iterator[None]:
    """Turn redis-py's (and urllib's) ValueError about `url` into a `ConfigurationError` naming it."""
    try:
        yield
    except ConfigurationError:
        raise
    except (ValueError, TypeError) as exc:
        from quota._url import redact as hide

        detail = str(exc)
        password = _password(url)
        if password:
            detail = detail.replace(password, "***")
        raise ConfigurationError(
            f"url {hide(url)!r} is not a valid Redis URL ({detail}); expected"
            " redis://[:password@]host[:port][/db] (rediss:// for TLS)"
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
        parts.port  # noqa: B018  (urllib checks the port when it is read)
        if not parts.hostname:
            raise ValueError("it names no host")
    return target, prefix


class RedisStore:
    """Sync Redis store on redis-py's connection pool; thread-safe."""

    dialect = "redis"

    def __init__(self, url: str, *, timeout: float = 10.0, db_clock: bool = False) -> None:
        redis = _import_redis(url)
        target, prefix = _checked_url(url)
        self.url = url
        self.db_clock = db_clock
        self.planner = RedisPlan(prefix=prefix, db_clock=db_clock)
        self._errors = redis.RedisError
        self._no_script = redis.exceptions.NoScriptError
        with _bad_url(url):
            self.client = redis.Redis.from_url(target, **_client_options(timeout))

    def _command(self, command: Command) -> Any:
        client = self.client
        if command[0] is not _EVAL:
            return client.execute_command(*command)
        _, name, keys, args = command
        try:
            return client.execute_command(_EVAL, SHAS[name], len(keys), *keys, *args)
        except self._no_script:  # a restarted or flushed server: load it, once
            sha = client.execute_command("SCRIPT", "LOAD", SCRIPTS[name])
            return client.execute_command(_EVAL, sha, len(keys), *keys, *args)

    def execute(self, sql: str | Named, params: Sequence[Any] | Mapping[str, Any]) -> Rows:
        """Run one statement as one Redis command; see `quota._store.SyncStore.execute`."""
        plan = self.planner.plan(sql, params)
        reply: Any = None
        try:
            while True:
                reply = self._command(plan.send(reply))
        except StopIteration as stop:
            rows: Rows = stop.value
            return rows
        except self._errors as exc:
            raise StorageError(f"Redis error on {redact(self.url)}: {type(exc).__name__}: {exc}") from exc  # fmt: skip

    def run(self, op: Generator[Statement, Rows, T], *, transaction: bool) -> T:
        """Drive `op` one statement at a time; `ConfigurationError` for a transaction."""
        if transaction:
            raise _no_transactions()
        return drive(op, self.execute)

    def close(self) -> None:
        self.client.close()


class AsyncRedisStore:
    """Async Redis store on redis.asyncio; safe to share between tasks of one loop."""

    dialect = "redis"

    def __init__(self, url: str, *, timeout: float = 10.0, db_clock: bool = False) -> None:
        redis = _import_redis(url)
        target, prefix = _checked_url(url)
        self.url = url
        self.db_clock = db_clock
        self.planner = RedisPlan(prefix=prefix, db_clock=db_clock)
        self._errors = redis.RedisError
        self._no_script = redis.exceptions.NoScriptError
        with _bad_url(url):
            self.client = redis.asyncio.Redis.from_url(target, **_client_options(timeout))

    async def _command(self, command: Command) -> Any:
        client = self.client
        if command[0] is not _EVAL:
            return await client.execute_command(*command)
        _, name, keys, args = command
        try:
            return await client.execute_command(_EVAL, SHAS[name], len(keys), *keys, *args)
        except self._no_script:  # a restarted or flushed server: load it, once
            sha = await client.execute_command("SCRIPT", "LOAD", SCRIPTS[name])
            return await client.execute_command(_EVAL, sha, len(keys), *keys, *args)

    async def execute(self, sql: str | Named, params: Sequence[Any] | Mapping[str, Any]) -> Rows:
        """See `RedisStore.execute`."""
        plan = self.planner.plan(sql, params)
        reply: Any = None
        try:
            while True:
                reply = await self._command(plan.send(reply))
        except StopIteration as stop:
            rows: Rows = stop.value
            return rows
        except self._errors as exc:
            raise StorageError(f"Redis error on {redact(self.url)}: {type(exc).__name__}: {exc}") from exc  # fmt: skip

    async def run(self, op: Generator[Statement, Rows, T], *, transaction: bool) -> T:
        """See `RedisStore.run`."""
        if transaction:
            raise _no_transactions()
        return await adrive(op, self.execute)

    async def aclose(self) -> None:
        await self.client.aclose()
