"""The Redis checks: connectivity and the ``maxmemory-policy`` of the server (of every
master of a cluster)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from quota._core.url import StoreURL
from quota._tools.doctor.base import ERROR, OK, WARN, Clock, Finding, display_url

#: The one ``maxmemory-policy`` that never evicts quota's keys: a full Redis refuses
#: writes instead (each decision is then a statement error, logged and decided from memory).
SAFE_EVICTION = "noeviction"


@dataclass(frozen=True, slots=True)
class Nodes:
    """The Redis server, or every master of a cluster, as the checks use them."""

    clients: list[tuple[str, Any]]
    """(the node's name for output, a client of it)."""


@contextmanager
def connect(
    parsed: StoreURL, clock: Clock, timeout: float
) -> Iterator[tuple[list[Finding], Nodes | None]]:
    """The ``connectivity`` finding, and the nodes unless they cannot be reached (closed
    on exit). `clock` is unused: Redis keeps no clock the limiter reads."""
    shown = display_url(parsed.url)
    try:
        import redis  # noqa: F401  (the error a missing redis-py gets)
    except ImportError:
        yield [
            Finding(
                "connectivity", ERROR, "redis-py is not installed", "pip install 'quota[redis]'"
            )
        ], None  # fmt: skip
        return
    cluster: Any = None
    try:
        nodes, cluster = _open(parsed, timeout)
        for _, client in nodes:
            client.ping()
        versions = sorted({_redis_version(client) for _, client in nodes})
    except Exception as exc:
        if cluster is not None:
            cluster.close()
        yield [
            Finding(
                "connectivity", ERROR, f"cannot connect to {shown}: {' '.join(str(exc).split())}",
                "check host, port and credentials, and that the server is up"
                " (`redis-cli -u URL ping`; a cluster: `redis-cli -c -h HOST -p PORT cluster info`)",
            )
        ], None  # fmt: skip
        return
    try:
        masters = f", {len(nodes)} masters" if cluster is not None else ""
        yield (
            [Finding("connectivity", OK, f"connected to Redis {', '.join(versions)}{masters}")],
            Nodes(nodes),
        )
    finally:
        for _, client in nodes:
            client.close()
        if cluster is not None:
            cluster.close()


def _open(parsed: StoreURL, timeout: float) -> tuple[list[tuple[str, Any]], Any]:
    """(name, client) of the server or of every master, and the cluster client (None for
    one server)."""
    import redis

    options = {"socket_timeout": timeout, "socket_connect_timeout": timeout}
    if parsed.dialect == "redis":
        from quota._stores.redis import _checked_url

        target, _prefix = _checked_url(parsed.url)
        return [(display_url(parsed.url), redis.Redis.from_url(target, **options))], None
    from redis.cluster import ClusterNode, RedisCluster

    from quota._stores.redis_cluster import parse_cluster_url

    found = parse_cluster_url(parsed.url)
    node: Any = ClusterNode  # redis-py leaves it unannotated
    cluster: Any = RedisCluster(
        startup_nodes=[node(host, port) for host, port in found.nodes],
        **{**options, **found.options},
    )
    try:
        return [(n.name, cluster.get_redis_connection(n)) for n in cluster.get_primaries()], cluster
    except Exception:
        cluster.close()
        raise


def eviction(nodes: Nodes) -> list[Finding]:
    """The ``eviction`` finding of each node."""
    return [eviction_finding(name, *_eviction_policy(client)) for name, client in nodes.clients]


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
