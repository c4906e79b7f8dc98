"""The Redis Cluster store (``redis+cluster://host:port,host:port/``): the Redis store, sharded.

URL::

    redis+cluster://[[user]:password@]host:port[,host:port…]/[?prefix=app1:&option=value…]
    rediss+cluster://…   (TLS)

The hosts are startup nodes: one is enough, several let the store start while
one of them is down; masters or replicas alike, the client learns the whole
cluster (``CLUSTER SLOTS``) from the first that answers. The port defaults to
6379; the path may only be empty or ``/0`` (a cluster has database 0 only).
``?prefix=`` works as on ``redis://``; the other query parameters are the
connection options of `OPTIONS`, given to every node's connections (an unknown
one is a `ConfigurationError` naming it, never silently dropped).

Why a scheme of its own and not ``redis://…?cluster=true``: a cluster is
another kind of store, not an option of one server. It takes a list of hosts
(which no ``redis://`` URL parser accepts), it has no database number, and it
runs through other clients (redis-py's ``RedisCluster``) with other
commands for ``top``; the scheme is what picks the store
(`quota._core.url.DIALECTS`), so it shows in logs, ``quota doctor`` and
``bench`` as what it is. It is also the spelling the ``limits`` library uses.
``redis://…?cluster=true`` and a host list on ``redis://`` are
`ConfigurationError`\\ s that point here.

Everything the single-node store does, the cluster store does with the same
`RedisPlan` (one ``EVALSHA`` per decision; the scripts are cluster-safe: every
key one call touches sits in the ``{k:…}`` hash tag, so in one slot):

* the client follows ``MOVED`` and ``ASK`` redirections and refreshes its slot
  map itself: a resharding is invisible to callers. A redirection means the
  script did not run, so following it never counts twice; a lost reply (a
  timeout, a dropped connection) is never retried, as on one server;
* a script a node lost (``SCRIPT FLUSH``, a restart, a replica promoted by a
  failover: replicas do not share their master's script cache) runs from its
  source (``EVAL``) on the key's node, which caches it again; its ``NOSCRIPT``
  answer means it had not run, so nothing counts twice;
* group commit (``batching=True``) sends one pipeline per node; a command
  redirected meanwhile goes again on its own, a reply lost to a timeout never;
* ``top`` scans every master (``SCAN`` on each) and reads the counters with
  one ``MGET`` per slot; ``reset``, ``peek`` and every algorithm go to the
  key's node; ``cleanup`` has nothing to delete (TTLs);
* ``clock="database"`` reads ``TIME`` on the node that owns the key: keep the
  nodes' clocks in step (NTP), as app servers' clocks would be otherwise;
* the fallback's probe (`quota._sql.statements.SCHEMA_VERSION`) is a ``PING``
  of every master: while a master is unreachable the store stays down and
  memory decides; once its replica is promoted (and the client's slot map
  says so) the probe answers and decisions come from the cluster again.

Errors are `StorageError`\\ s, whatever redis-py raised (its cluster errors are
not all ``RedisError``\\ s). The sync client discovers the cluster on its
first call (so a process may start while the cluster is down); the async one
likewise.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast
from urllib.parse import parse_qsl, urlsplit

from quota._core.errors import ConfigurationError
from quota._core.redaction import redact
from quota._core.url import StoreURL
from quota._stores.base import StoreSettings
from quota._stores.redis import (
    SCRIPTS,
    SHAS,
    AsyncRedisStore,
    Exchange,
    Plan,
    RedisPlan,
    RedisStore,
    _glob_escape,
    _import_redis,
    fresh_before_send,
    split_url,
)
from quota._stores.redis import _bad_url as _redis_bad_url

DEFAULT_PORT = 6379
#: Pseudo-commands of `ClusterPlan`, answered by the store from its client's slot map.
PRIMARIES = "quota:primaries"
"""The names (``host:port``) of the masters; no arguments."""
NODE_SCAN = "quota:scan-node"
"""``SCAN`` on one node: ``(node name, cursor, "MATCH", pattern, "COUNT", n)``."""
PIPELINE = "PIPELINE"
"""Several commands at once (`RedisPlan`'s group commit): the arguments are the commands; the
reply is one entry per command, in order: its reply, or the exception it ended in."""

#: The query parameters a cluster URL takes besides ``prefix``: connection options given to
#: every node's connections (both faces accept them).
OPTIONS = (
    "client_name",
    "max_connections",
    "socket_connect_timeout",
    "socket_keepalive",
    "socket_timeout",
    "ssl_ca_certs",
    "ssl_ca_data",
    "ssl_cert_reqs",
    "ssl_certfile",
    "ssl_check_hostname",
    "ssl_keyfile",
)
_EXPECTED = (
    "expected redis+cluster://[[user]:password@]host:port[,host:port…]/ (rediss+cluster:// for TLS)"
)


@dataclass(frozen=True)
class ClusterTarget:
    """What a cluster URL says: the startup nodes, the client's options and the key prefix."""

    nodes: tuple[tuple[str, int], ...]
    prefix: str
    options: dict[str, Any] = field(default_factory=dict)


def _bad_url(url: str) -> contextlib.AbstractContextManager[None]:
    """Turn a ValueError about `url` into a `ConfigurationError` naming it, password hidden."""
    return _redis_bad_url(url, kind="Redis Cluster URL", expected=_EXPECTED)


def parse_cluster_url(url: str) -> ClusterTarget:
    """The `ClusterTarget` of `url`; `ConfigurationError` naming it (redacted) if it is not one."""
    from redis.connection import parse_url

    with _bad_url(url):
        target, prefix = split_url(url)
        parts = urlsplit(target)
        scheme = parts.scheme.partition("+")[0]
        if scheme not in ("redis", "rediss") or parts.scheme.partition("+")[2] != "cluster":
            raise ValueError(f"unknown scheme {parts.scheme!r}")
        credentials, at, hosts = parts.netloc.rpartition("@")
        nodes: list[tuple[str, int]] = []
        for item in hosts.split(","):
            node = urlsplit("//" + item.strip())
            port = node.port  # ValueError for a port that is no number
            if not node.hostname:
                raise ValueError(f"host {item.strip()!r} names no host")
            nodes.append((node.hostname, port or DEFAULT_PORT))
        if parts.path not in ("", "/", "/0"):
            raise ValueError(f"path {parts.path!r}: a cluster has database 0 only")
        names = [name for name, _ in parse_qsl(parts.query, keep_blank_values=True)]
        unknown = [name for name in names if name not in OPTIONS]
        if unknown:
            raise ConfigurationError(
                f"url {redact(url)!r}: unknown option {unknown[0]!r} for a Redis Cluster"
                + (
                    " (the redis+cluster:// scheme says it is one)"
                    if unknown[0] == "cluster"
                    else ""
                )
                + f"; the options are prefix, {', '.join(OPTIONS)}"
            )
        # redis-py reads the credentials and types the options as it would for one node.
        first = hosts.split(",")[0].strip()
        untyped: Any = parse_url  # redis-py leaves it unannotated
        options: dict[str, Any] = untyped(f"{scheme}://{credentials}{at}{first}/?{parts.query}")
    for name in ("host", "port", "db", "path"):
        options.pop(name, None)
    if options.pop("connection_class", None) is not None:
        options["ssl"] = True  # rediss+cluster://
    return ClusterTarget(tuple(dict.fromkeys(nodes)), prefix, options)


class ClusterPlan(RedisPlan):
    """`RedisPlan` with ``top`` over every master (`PRIMARIES`, `NODE_SCAN`)."""

    def _top(self, params: Sequence[Any]) -> Plan:
        """SCAN each master's fixed-window counters; MGET them slot by slot (an admin's view)."""
        now, limit = params
        pattern = _glob_escape(self.prefix) + "{*}:fw:*"
        # By (key, window, start): a key scanned twice (its slot moving mid-scan) counts once.
        live: dict[tuple[str, int, int], int] = {}
        primaries = yield (PRIMARIES, ())
        for node in primaries:
            cursor: Any = 0
            while True:
                cursor, keys = yield (NODE_SCAN, (node, cursor, "MATCH", pattern, "COUNT", 1000))
                counts = (yield ("MGET", tuple(keys))) if keys else []
                for key, window, start, count in self._live_counters(keys, counts, now):
                    live[(key, window, start)] = max(count, live.get((key, window, start), 0))
                if int(cursor) == 0:
                    break
        rows = [(key, window, start, count) for (key, window, start), count in live.items()]
        rows.sort(key=lambda r: (-r[3], r[0]))
        return rows[:limit]

    def _scan(self, pattern: str) -> Exchange:
        """Every key matching `pattern` on every master."""
        found: set[bytes] = set()
        primaries = yield (PRIMARIES, ())
        for node in primaries:
            cursor: Any = 0
            while True:
                cursor, keys = yield (NODE_SCAN, (node, cursor, "MATCH", pattern, "COUNT", 1000))
                found.update(keys)
                if int(cursor) == 0:
                    break
        return sorted(found)


#: Each script's source by its digest (what a NOSCRIPT answer asks for).
_SOURCES = {sha: SCRIPTS[script] for script, sha in SHAS.items()}


def _evaluated(name: str, args: tuple[Any, ...], error: Exception) -> tuple[Any, ...] | None:
    """The ``EVAL`` arguments that run the script an ``EVALSHA`` of ours asked for, when the
    node answered `error` NOSCRIPT; None for any other command or error (raise that)."""
    from redis.exceptions import NoScriptError

    if name != "EVALSHA" or not isinstance(error, NoScriptError):
        return None
    source = _SOURCES.get(str(args[0]))
    return None if source is None else (source, *args[1:])


def _settings(target: ClusterTarget, timeout: float) -> dict[str, Any]:
    # The URL's options win over the limiter's timeout, as on redis://.
    return {"socket_timeout": timeout, "socket_connect_timeout": timeout, **target.options}


class _ClusterStore:
    """What both cluster faces set up: the URL, the planner and the errors they catch."""

    dialect = "redis-cluster"

    def _set_up(self, url: str, *, db_clock: bool) -> tuple[Any, ClusterTarget]:
        _import_redis(url)  # ConfigurationError naming the extra, without redis-py
        import redis.asyncio.cluster
        import redis.cluster

        target = parse_cluster_url(url)
        self.url = url
        self.db_clock = db_clock
        self.planner: RedisPlan = ClusterPlan(
            prefix=target.prefix, db_clock=db_clock, no_script=redis.exceptions.NoScriptError
        )
        # RedisClusterException (no reachable node, a slot no node serves) is no RedisError.
        # A tuple where the base class has one class: ``except`` takes either (nested too).
        self._errors = cast(
            "type[Exception]", (redis.RedisError, redis.exceptions.RedisClusterException)
        )
        return redis, target


class RedisClusterStore(_ClusterStore, RedisStore):
    """Sync Redis Cluster store on redis-py's ``RedisCluster``; thread-safe.

    The client is made on the first call (it discovers the cluster then), so a
    store opened while the cluster is down raises `StorageError` from its
    calls (or its fallback decides) rather than from `quota.connect`.
    """

    def __init__(self, url: str, *, timeout: float = 10.0, db_clock: bool = False) -> None:
        redis, target = self._set_up(url, db_clock=db_clock)
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self._startup = [redis.cluster.ClusterNode(host, port) for host, port in target.nodes]
        self._options = _settings(target, timeout)
        # No retries: a script that ran but whose reply was lost must not count twice.
        # Redirections (MOVED, ASK, TRYAGAIN: the command did not run) are still followed.
        self._retry = Retry(NoBackoff(), 0)
        self._cluster_class = redis.cluster.RedisCluster
        self._client: Any = None
        self._lock = threading.Lock()

    def _connected(self) -> Any:
        client = self._client
        if client is None:
            with self._lock:
                if self._client is None:
                    self._client = self._cluster_class(
                        startup_nodes=self._startup, retry=self._retry, **self._options
                    )
                    _close_dropped_nodes(self._client.nodes_manager)
                client = self._client
        return client

    def _send(self, name: str, args: tuple[Any, ...]) -> Any:
        client = self._connected()
        if name == PRIMARIES:  # no round trip: the client knows them
            return _primaries(client)
        if name == PIPELINE:
            return self._pipeline(client, list(args))
        routed = _routed(client, name, args)
        if routed is None:
            return self._keyed(client, name, args)
        call, answer = routed
        return answer(call())

    def _keyed(self, client: Any, name: str, args: tuple[Any, ...]) -> Any:
        """A command routed by its keys. A node that lost our script (flushed, restarted, a
        promoted replica) runs it from its source instead: ``EVAL`` caches it there, and the
        NOSCRIPT answer means nothing ran, so nothing counts twice."""
        try:
            return client.execute_command(name, *args)
        except self._errors as exc:
            evaluated = _evaluated(name, args, exc)
            if evaluated is None:
                raise
            return client.execute_command("EVAL", *evaluated)

    def _pipeline(self, client: Any, commands: list[tuple[str, tuple[Any, ...]]]) -> list[Any]:
        """Send `commands` as one pipeline per node; redirected ones again one by one.

        redis-py's own cluster pipeline sends a command again after a timeout or a
        dropped connection, which would count a script twice: here a node's lost
        replies stay errors, and only redirected commands (which did not run) go again.
        """
        from redis.exceptions import AskError, TryAgainError

        groups: dict[str, tuple[Any, list[int]]] = {}
        for index, (name, args) in enumerate(commands):
            node = client.nodes_manager.get_node_from_slot(client.determine_slot(name, *args))
            groups.setdefault(node.name, (node, []))[1].append(index)
        replies: list[Any] = [None] * len(commands)
        for node, indexes in groups.values():
            pipe = client.get_redis_connection(node).pipeline(transaction=False)
            for index in indexes:
                pipe.execute_command(commands[index][0], *commands[index][1])
            try:
                results = pipe.execute(raise_on_error=False)
            except self._errors as exc:
                results = [exc] * len(indexes)
            for index, result in zip(indexes, results, strict=True):
                replies[index] = result
        for index, reply in enumerate(replies):
            name, args = commands[index]
            # Redirected (MovedError is an AskError) or NOSCRIPT: none of these ran.
            if isinstance(reply, (AskError, TryAgainError)) or _evaluated(name, args, reply):
                try:
                    replies[index] = self._keyed(client, name, args)
                except self._errors as exc:
                    replies[index] = exc
        return replies

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is None:
            return
        client.close()  # the nodes of its cache, not its startup nodes
        for node in _nodes_of(client.nodes_manager).values():
            if node.redis_connection is not None:
                node.redis_connection.close()


class AsyncRedisClusterStore(_ClusterStore, AsyncRedisStore):
    """Async Redis Cluster store on redis.asyncio's ``RedisCluster``; safe to share between
    tasks of one loop. It discovers the cluster on its first call."""

    def __init__(self, url: str, *, timeout: float = 10.0, db_clock: bool = False) -> None:
        redis, target = self._set_up(url, db_clock=db_clock)
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        startup = [redis.asyncio.cluster.ClusterNode(host, port) for host, port in target.nodes]
        with _bad_url(url):
            # No retries (see RedisClusterStore); redirections are followed. Each MOVED
            # patches the slot map (``reinitialize_steps=0``): by default every fifth one
            # closes every connection of the client, the ones other tasks are sending and
            # reading on too, and under a resharding their calls failed, not to be retried.
            self.client = redis.asyncio.cluster.RedisCluster(
                startup_nodes=startup, retry=Retry(NoBackoff(), 0), reinitialize_steps=0,
                **_settings(target, timeout),
            )  # fmt: skip
        manager = self.client.nodes_manager
        _track_dropped_nodes(manager)
        # Every node's connections (those it discovers later too) replace a socket the
        # server closed before writing a command on it (see `fresh_before_send`).
        plain = manager.connection_kwargs.get("connection_class")
        fresh = fresh_before_send(plain or redis.asyncio.connection.Connection)
        manager.connection_kwargs["connection_class"] = fresh
        for node in manager.startup_nodes.values():
            node.connection_class = fresh
        self._ways_in = list(target.nodes)

    async def _send(self, name: str, args: tuple[Any, ...]) -> Any:
        client = self.client
        manager = client.nodes_manager
        if not manager.startup_nodes:
            # redis-py 5.x forgets each node that fails a command as a way in; through a
            # failover it can forget them all. The URL's nodes are the way in again.
            from redis.asyncio.cluster import ClusterNode

            for host, port in self._ways_in:
                node = ClusterNode(host, port, **manager.connection_kwargs)
                manager.startup_nodes[node.name] = node
            client._initialize = True
        # Discover the cluster (again, after a failure) before the command, under the
        # client's lock: tasks racing into redis.asyncio's lazy discovery with their
        # commands can lose their connections to each other.
        await client.initialize()
        if name == PRIMARIES:
            return _primaries(client)
        if name == PIPELINE:
            return await self._pipeline(list(args))
        routed = _routed(client, name, args)
        if routed is None:
            return await self._keyed(name, args)
        call, answer = routed
        return answer(await call())

    async def _keyed(self, name: str, args: tuple[Any, ...]) -> Any:
        """See `RedisClusterStore._keyed`."""
        try:
            return await self.client.execute_command(name, *args)
        except self._errors as exc:
            evaluated = _evaluated(name, args, exc)
            if evaluated is None:
                raise
            return await self.client.execute_command("EVAL", *evaluated)

    async def _pipeline(self, commands: list[tuple[str, tuple[Any, ...]]]) -> list[Any]:
        """Send `commands` as one pipeline per node, the nodes at once; redirected ones (and
        NOSCRIPT) again one by one. One entry per command: its reply or its exception.

        Each node's pipeline is written and read once on one of its connections (redis.asyncio's
        ``ClusterNode.execute_pipeline``), never sent again: a node's lost replies stay
        errors (see `RedisClusterStore._pipeline`).
        """
        from redis.asyncio.cluster import PipelineCommand
        from redis.exceptions import AskError, ConnectionError, TimeoutError, TryAgainError

        client = self.client
        groups: dict[str, tuple[Any, list[Any]]] = {}
        for index, (name, args) in enumerate(commands):
            node = client.nodes_manager.get_node_from_slot(_script_slot(client, name, args))
            groups.setdefault(node.name, (node, []))[1].append(PipelineCommand(index, name, *args))
        replies: list[Any] = [None] * len(commands)

        async def send(node: Any, batch: list[Any]) -> None:
            try:
                await node.execute_pipeline(batch)
            except self._errors as exc:
                for command in batch:
                    command.result = exc
                if isinstance(exc, (ConnectionError, TimeoutError)):
                    # As the client does for a command: learn the cluster again before
                    # the next call (a failover may have moved the node's slots).
                    free = getattr(node, "disconnect_free_connections", None)
                    if free is not None:
                        await free()
                        # redis-py 6+ (checked against 7.4.1) has no public way to ask a
                        # client to discover the cluster again at its next `initialize()`:
                        # its own execute_command sets this flag after a connection error.
                        client._initialize = True
                    else:
                        # redis-py 5.x, as its own execute_command does: close every
                        # connection, discover again.
                        with contextlib.suppress(self._errors, OSError):
                            await client.aclose()
            for command in batch:
                replies[command.position] = command.result

        await asyncio.gather(*(send(node, batch) for node, batch in groups.values()))
        for index, reply in enumerate(replies):
            name, args = commands[index]
            # Redirected (MovedError is an AskError) or NOSCRIPT: none of these ran.
            if isinstance(reply, (AskError, TryAgainError)) or _evaluated(name, args, reply):
                try:
                    replies[index] = await self._keyed(name, args)
                except self._errors as exc:
                    replies[index] = exc
        return replies

    async def aclose(self) -> None:
        manager = self.client.nodes_manager
        await self.client.aclose()
        # Nodes a rediscovery dropped are closed by tasks of their own (their idle
        # connections only): let those finish, then close what they left.
        # redis-py (checked against 7.4.1) keeps those tasks only in this private set, and
        # offers no public way to wait for them; versions without it have none to wait for.
        pending = list(getattr(manager, "_background_tasks", ()))
        await asyncio.gather(*pending, return_exceptions=True)
        noted = _DROPPED.pop(id(manager), {})
        for nodes in manager.slots_cache.values():
            noted.update((id(node), node) for node in nodes)
        await asyncio.gather(*(n.disconnect() for n in noted.values()), return_exceptions=True)


def _script_slot(client: Any, name: str, args: tuple[Any, ...]) -> int:
    """The slot of a pipelined ``EVALSHA sha numkeys key …`` (the only command pipelined):
    its keys' slot, from redis.asyncio's public ``keyslot``.

    Raises redis-py's `RedisClusterException` when the keys are in different slots (as
    redis-py's own routing does) or the command is not a script call with keys.
    """
    from redis.exceptions import RedisClusterException

    cross_slot: Any = RedisClusterException  # redis-py leaves it unannotated
    keys = args[2 : 2 + int(args[1])] if name.upper() in ("EVAL", "EVALSHA") else ()
    slots = {client.keyslot(key) for key in keys}
    if len(slots) != 1:
        raise cross_slot(f"{name}: a pipelined script's keys must share one slot")
    return int(slots.pop())


def _nodes_of(manager: Any) -> dict[int, Any]:
    """The nodes `manager` holds now (its cache, startup nodes and slot map), by identity."""
    caches = (manager.nodes_cache, manager.startup_nodes)
    nodes = {id(node): node for cache in caches for node in cache.values()}
    for slot_nodes in manager.slots_cache.values():
        nodes.update((id(node), node) for node in slot_nodes)
    return nodes


def _close_dropped_nodes(manager: Any) -> None:
    """Make every rediscovery of `manager` close the idle connections of the nodes it drops.

    redis-py's sync client replaces its node objects when it rediscovers the cluster
    (after a connection error, after ``MOVED``s), leaving their sockets to the garbage
    collector. A connection in use by another thread is left to finish its command.
    """
    discover = manager.initialize

    def initialize(*args: Any, **kwargs: Any) -> Any:
        before = _nodes_of(manager)
        try:
            return discover(*args, **kwargs)
        finally:
            after = _nodes_of(manager)
            for key, node in before.items():
                if key not in after and node.redis_connection is not None:
                    node.redis_connection.connection_pool.disconnect(inuse_connections=False)

    manager.initialize = initialize


#: Nodes of each async client (by id of its nodes manager) that its own close may miss,
#: with connections perhaps still open: `AsyncRedisClusterStore.aclose` closes them.
_DROPPED: dict[int, dict[int, Any]] = {}
_TRACKING: dict[type, type] = {}


def _track_dropped_nodes(manager: Any) -> None:
    """Make `manager` (redis.asyncio's nodes manager) note in `_DROPPED` the nodes its
    client's close would miss.

    A rediscovery routes commands through new node objects (its slot map) while it keeps
    the old ones of the same name in its node cache, which is all the client closes; and a
    node dropped while one of its connections was busy keeps that connection open. Left
    alone, those connections are closed by the garbage collector, with a warning.
    """
    base = type(manager)
    tracking = _TRACKING.get(base)
    if tracking is None:

        def set_nodes(self: Any, old: Any, new: Any, remove_old: bool = False) -> None:
            if remove_old:
                noted = _DROPPED.setdefault(id(self), {})
                for key, node in list(noted.items()):  # closed since: forget them
                    # A node's connections are only in its private list: redis-py (checked
                    # against 7.4.1) has no public way to ask whether any is still open.
                    if not any(c.is_connected for c in node._connections):
                        del noted[key]
                for name, node in old.items():
                    if name not in new:
                        noted[id(node)] = node
                for nodes in self.slots_cache.values():
                    for node in nodes:
                        noted[id(node)] = node
            base.set_nodes(self, old, new, remove_old)

        attributes = {"__slots__": (), "set_nodes": set_nodes}
        tracking = type(f"Tracking{base.__name__}", (base,), attributes)
        _TRACKING[base] = tracking
    manager.__class__ = tracking


#: A cluster call to make (its result awaited on the async client), and what to make of
#: its answer.
_Routed = tuple[Callable[[], Any], Callable[[Any], Any]]


def _routed(client: Any, name: str, args: tuple[Any, ...]) -> _Routed | None:
    """How a command not routed by its keys reaches the cluster, the same for both
    clients; None for a command routed by its keys (and for a pipeline, and `PRIMARIES`)."""
    if name == "PING":  # the fallback's probe: every master must answer
        call = functools.partial(client.execute_command, "PING", target_nodes=client.PRIMARIES)
    elif name == "SCRIPT" and str(args[0]).upper() == "LOAD":
        call = functools.partial(client.script_load, args[1])  # on every master; one SHA back
    elif name == "MGET":
        call = functools.partial(client.mget_nonatomic, list(args))
    elif name == NODE_SCAN:
        node = client.get_node(node_name=args[0])
        if node is None:
            raise _gone(args[0])
        scan = functools.partial(client.execute_command, "SCAN", *args[1:], target_nodes=node)
        return scan, lambda answer: (answer[0][node.name], answer[1])
    else:
        return None
    return call, _as_is


def _primaries(client: Any) -> list[str]:
    return [node.name for node in client.get_primaries()]


def _as_is(answer: Any) -> Any:
    return answer


def _gone(node: str) -> Exception:
    from redis.exceptions import ConnectionError

    gone: Exception = ConnectionError(f"node {node} is no longer in the cluster")
    return gone


def open_sync(parsed: StoreURL, settings: StoreSettings) -> RedisClusterStore:
    """The sync store of a ``redis+cluster://`` URL (`quota._core.url.DIALECTS`)."""
    return RedisClusterStore(parsed.url, timeout=settings.timeout, db_clock=settings.db_clock)


def open_async(parsed: StoreURL, settings: StoreSettings) -> AsyncRedisClusterStore:
    """The async store of a ``redis+cluster://`` URL."""
    return AsyncRedisClusterStore(parsed.url, timeout=settings.timeout, db_clock=settings.db_clock)
