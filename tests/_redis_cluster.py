"""A private Redis Cluster for tests: six local nodes, stopped without fail.

`start_cluster` starts six ``redis-server`` processes (``cluster-enabled yes``, no
persistence: ``--save ""``, ``--appendonly no``) in a temporary directory, on free ports
of 127.0.0.1 whose cluster bus ports (port + 10000) are free too, joins them with
``redis-cli --cluster create … --cluster-replicas 1`` (three masters, one replica each)
and waits until every node reports ``cluster_state:ok`` and agrees on the slot map.

`RedisCluster.kill` ends one node (SIGKILL, as a crash would); `RedisCluster.heal`
starts every killed node again on its port and nodes file (a killed master comes back as
a replica of the node promoted in its place) and waits for a healthy cluster.
`RedisCluster.stop` ends them all (SIGTERM, then SIGKILL) and removes the directory.
Nothing outlives the test process: every node not yet stopped is killed at exit, and on
Linux each also gets SIGTERM when its parent dies (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import atexit
import contextlib
import random
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests._support import parent_death_signal

SERVER = "/usr/bin/redis-server"
CLI = "/usr/bin/redis-cli"
HOST = "127.0.0.1"
NODES = 6
#: Node ports are drawn from here; their bus ports (+10000) stay below the usual ephemeral
#: range (32768 and up) and clear of 6379 and the 7000-7005 habit.
PORTS = range(20_100, 22_700)
BUS_OFFSET = 10_000
START_TIMEOUT = 30.0
STOP_TIMEOUT = 5.0
#: Milliseconds before a silent node is deemed failed (and its replica promoted).
NODE_TIMEOUT_MS = 1000

#: Clusters started and not yet stopped; killed at exit as a backstop.
_LIVE: set[RedisCluster] = set()


class ClusterError(RuntimeError):
    """The cluster would not start or heal (the message says what it lacked)."""


def find_binaries() -> tuple[str, str] | None:
    """(redis-server, redis-cli), the distribution's or the first on PATH; None without both."""
    server = SERVER if Path(SERVER).exists() else shutil.which("redis-server")
    cli = CLI if Path(CLI).exists() else shutil.which("redis-cli")
    return (server, cli) if server and cli else None


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
    return True


def free_ports(count: int, *, taken: set[int] | None = None, attempts: int = 2000) -> list[int]:
    """`count` ports of `PORTS` free on 127.0.0.1 whose bus ports are free too."""
    chosen: list[int] = []
    avoid = set(taken or ())
    for _ in range(attempts):
        port = random.choice(PORTS)
        if port in avoid or port + BUS_OFFSET in avoid:
            continue
        if _bindable(port) and _bindable(port + BUS_OFFSET):
            chosen.append(port)
            avoid.update((port, port + BUS_OFFSET))
            if len(chosen) == count:
                return chosen
    raise ClusterError(f"found only {len(chosen)} of {count} free port pairs in {attempts} tries")


_SET_PARENT_DEATH_SIGNAL = parent_death_signal()


def _end(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(STOP_TIMEOUT)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(STOP_TIMEOUT)


@dataclass(eq=False)
class RedisCluster:
    """Six ``redis-server`` nodes on 127.0.0.1 forming one cluster; `stop` it (idempotent)."""

    server: str
    cli: str
    directory: Path
    ports: list[int]
    processes: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)
    _stopped: bool = field(default=False, repr=False)
    #: The masters when the cluster was last healthy.
    _old_masters: set[int] = field(default_factory=set, repr=False)

    # -- URLs and clients --------------------------------------------------------------

    def url(
        self, *, prefix: str | None = None, nodes: int = 3, scheme: str = "redis+cluster"
    ) -> str:
        """``redis+cluster://127.0.0.1:P1,…/`` naming the first `nodes` live nodes."""
        live = [port for port in self.ports if self.alive(port)][:nodes]
        hosts = ",".join(f"{HOST}:{port}" for port in live)
        return f"{scheme}://{hosts}/" + (f"?prefix={prefix}" if prefix else "")

    def node(self, port: int, **options: Any) -> Any:
        """A plain redis-py client of one node (close it)."""
        import redis

        options.setdefault("socket_timeout", 5)
        options.setdefault("socket_connect_timeout", 5)
        return redis.Redis(host=HOST, port=port, **options)

    def command(self, port: int, *args: Any) -> Any:
        with self.node(port) as client:
            return client.execute_command(*args)

    def alive(self, port: int) -> bool:
        process = self.processes.get(port)
        return process is not None and process.poll() is None

    def masters(self) -> dict[int, tuple[int, ...]]:
        """Port of each master -> the ports of its replicas, as the first live node sees it."""
        seen = self._nodes(next(port for port in self.ports if self.alive(port)))
        masters: dict[int, list[int]] = {}
        for port, flags, _master_id, slots in seen.values():
            if "master" in flags and "fail" not in flags and slots:
                masters.setdefault(port, [])
        for port, flags, master_id, _slots in seen.values():
            if "slave" in flags and "fail" not in flags and master_id in seen:
                master_port = seen[master_id][0]
                if master_port in masters:
                    masters[master_port].append(port)
        return {port: tuple(sorted(replicas)) for port, replicas in masters.items()}

    def master_of_key(self, key: str) -> int:
        """The port of the master serving `key`'s slot."""
        first = next(port for port in self.ports if self.alive(port))
        slot = int(self.command(first, "CLUSTER", "KEYSLOT", key))
        for port, flags, _master_id, slots in self._nodes(first).values():
            if "master" in flags and "fail" not in flags and any(a <= slot <= b for a, b in slots):
                return port
        raise ClusterError(f"no master serves slot {slot}")

    def _nodes(self, port: int) -> dict[str, tuple[int, str, str, list[tuple[int, int]]]]:
        raw = self.command(port, "CLUSTER", "NODES")
        text = raw.decode() if isinstance(raw, bytes) else str(raw)
        nodes = {}
        for line in text.splitlines():
            parts = line.split()
            if len(parts) < 8:
                continue
            node_port = int(parts[1].split("@")[0].rsplit(":", 1)[1] or 0)
            slots = []
            for item in parts[8:]:
                if item.startswith("["):
                    continue  # a slot being migrated
                first, _, last = item.partition("-")
                slots.append((int(first), int(last or first)))
            nodes[parts[0]] = (node_port, parts[2], parts[3], slots)
        return nodes

    # -- failures ------------------------------------------------------------------------

    def kill(self, port: int) -> None:
        """SIGKILL one node, as a crash would."""
        process = self.processes[port]
        process.kill()
        process.wait(STOP_TIMEOUT)

    def node_id(self, port: int) -> str:
        raw = self.command(port, "CLUSTER", "MYID")
        return raw.decode() if isinstance(raw, bytes) else str(raw)

    def start_moving(self, slot: int, to: int) -> int:
        """Mark `slot` migrating from its master to the master on port `to`; return the
        source's port. Until `finish_moving`, its keys are answered with ASK or TRYAGAIN."""
        source = next(
            port
            for port, flags, _m, slots in self._nodes(to).values()
            if "master" in flags and any(a <= slot <= b for a, b in slots)
        )
        self.command(to, "CLUSTER", "SETSLOT", slot, "IMPORTING", self.node_id(source))
        self.command(source, "CLUSTER", "SETSLOT", slot, "MIGRATING", self.node_id(to))
        return source

    def finish_moving(self, slot: int, source: int, to: int, timeout: float = 10.0) -> None:
        """Move `slot`'s remaining keys and hand the slot to `to`: its clients get MOVED."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            keys = self.command(source, "CLUSTER", "GETKEYSINSLOT", slot, 100)
            if not keys:
                break
            self.command(source, "MIGRATE", HOST, to, "", 0, 5000, "KEYS", *keys)
        else:
            raise ClusterError(f"slot {slot} still had keys on {HOST}:{source} after {timeout:g}s")
        target = self.node_id(to)
        for port in (to, source):
            self.command(port, "CLUSTER", "SETSLOT", slot, "NODE", target)
        self._wait_healthy(timeout, expect_live=True)

    def wait_promoted(self, dead: int, timeout: float = START_TIMEOUT) -> int:
        """Wait until a live node serves the slots `dead` served; return its port."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                if self._healthy(expect_live=False):
                    masters = self.masters()
                    new = [port for port in masters if port not in self._old_masters]
                    if dead not in masters and len(masters) == 3 and len(new) == 1:
                        return new[0]
            time.sleep(0.05)
        raise ClusterError(f"no replica of {HOST}:{dead} was promoted within {timeout:g}s")

    def heal(self, timeout: float = START_TIMEOUT) -> None:
        """Start every killed node again and wait until all six are in a healthy cluster."""
        for port in self.ports:
            if not self.alive(port):
                self._spawn(port)
        self._wait_listening(timeout)
        self._wait_healthy(timeout, expect_live=True)
        self._old_masters = set(self.masters())

    # -- life cycle --------------------------------------------------------------------

    def _arguments(self, port: int, data: Path) -> list[str]:
        settings = {
            "port": str(port), "bind": HOST, "protected-mode": "no", "cluster-enabled": "yes",
            "cluster-config-file": str(data / "nodes.conf"),
            "cluster-node-timeout": str(NODE_TIMEOUT_MS), "save": "", "appendonly": "no",
            # A replica takes over however long ago it last heard from its master.
            "cluster-replica-validity-factor": "0",
            "dir": str(data), "daemonize": "no", "logfile": "",
        }  # fmt: skip
        return [item for name, value in settings.items() for item in (f"--{name}", value)]

    def _spawn(self, port: int) -> None:
        data = self.directory / str(port)
        data.mkdir(exist_ok=True)
        log = open(data / "stdout.log", "ab")  # noqa: SIM115 - handed to the child
        try:
            self.processes[port] = subprocess.Popen(
                [self.server, *self._arguments(port, data)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                cwd=data,
                start_new_session=True,
                preexec_fn=_SET_PARENT_DEATH_SIGNAL,
            )
        finally:
            log.close()

    def _log_tail(self, port: int, lines: int = 15) -> str:
        try:
            text = (self.directory / str(port) / "stdout.log").read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def _wait_listening(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for port in self.ports:
            while True:
                process = self.processes[port]
                if process.poll() is not None:
                    raise ClusterError(
                        f"redis-server on {HOST}:{port} exited with {process.returncode}:\n"
                        + self._log_tail(port)
                    )
                try:
                    if self.command(port, "PING"):
                        break
                except Exception:  # not up yet
                    pass
                if time.monotonic() >= deadline:
                    raise ClusterError(
                        f"redis-server on {HOST}:{port} did not answer within {timeout:g}s:\n"
                        + self._log_tail(port)
                    )
                time.sleep(0.05)

    def _healthy(self, *, expect_live: bool) -> bool:
        """Every live node says ``cluster_state:ok``, sees the same slot owners and, with
        `expect_live`, sees all six nodes connected and none failing."""
        views = []
        for port in self.ports:
            if not self.alive(port):
                if expect_live:
                    return False
                continue
            info = self.command(port, "CLUSTER", "INFO")
            text = info.decode() if isinstance(info, bytes) else str(info)
            if "cluster_state:ok" not in text:
                return False
            nodes = self._nodes(port)
            if expect_live and (
                len(nodes) != NODES
                or any("fail" in flags or "handshake" in flags or "noaddr" in flags
                       for _p, flags, _m, _s in nodes.values())
            ):  # fmt: skip
                return False
            views.append(
                sorted(
                    (p, tuple(s)) for p, flags, _m, s in nodes.values() if "master" in flags and s
                )
            )
        return bool(views) and all(view == views[0] for view in views)

    def _wait_healthy(self, timeout: float, *, expect_live: bool) -> None:
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(Exception):
                if self._healthy(expect_live=expect_live):
                    return
            if time.monotonic() >= deadline:
                raise ClusterError(
                    f"the cluster on ports {self.ports} was not healthy within {timeout:g}s"
                )
            time.sleep(0.05)

    def stop(self) -> None:
        """Terminates every node (killed if it lingers) and removes the directory."""
        if self._stopped:
            return
        try:
            for process in self.processes.values():
                with contextlib.suppress(Exception):
                    process.terminate()
            for process in self.processes.values():
                _end(process)
        finally:
            self._stopped = True
            _LIVE.discard(self)
            shutil.rmtree(self.directory, ignore_errors=True)


@atexit.register
def _kill_leftovers() -> None:
    for cluster in list(_LIVE):
        for process in cluster.processes.values():
            with contextlib.suppress(Exception):
                process.kill()
                process.wait(STOP_TIMEOUT)
        shutil.rmtree(cluster.directory, ignore_errors=True)
        _LIVE.discard(cluster)


def start_cluster(timeout: float = START_TIMEOUT, attempts: int = 3) -> RedisCluster:
    """Start six nodes, join them (three masters, one replica each), wait for a healthy cluster.

    Raises `ClusterError` when redis-server or redis-cli is missing or the cluster does not
    form within `timeout` seconds; a port taken between choosing and binding it is retried
    `attempts` times.
    """
    binaries = find_binaries()
    if binaries is None:
        raise ClusterError("redis-server and redis-cli are not installed")
    server, cli = binaries
    for attempt in range(1, attempts + 1):
        cluster = RedisCluster(
            server, cli, Path(tempfile.mkdtemp(prefix="quota-redis-cluster-")), free_ports(NODES)
        )
        _LIVE.add(cluster)
        try:
            for port in cluster.ports:
                cluster._spawn(port)
            cluster._wait_listening(timeout)
            created = subprocess.run(
                [cli, "--cluster", "create", *(f"{HOST}:{port}" for port in cluster.ports),
                 "--cluster-replicas", "1", "--cluster-yes"],
                stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout, check=False,
            )  # fmt: skip
            if created.returncode != 0:
                raise ClusterError(
                    "redis-cli --cluster create failed:\n"
                    + created.stdout.decode(errors="replace")[-2000:]
                    + created.stderr.decode(errors="replace")[-2000:]
                )
            cluster._wait_healthy(timeout, expect_live=True)
            cluster._old_masters = set(cluster.masters())
        except ClusterError as exc:
            cluster.stop()
            if "Address already in use" in str(exc) and attempt < attempts:
                continue
            raise
        except BaseException:
            cluster.stop()
            raise
        return cluster
    raise AssertionError("unreachable")


@contextlib.contextmanager
def running_cluster(**options: Any) -> Iterator[RedisCluster]:
    """`start_cluster` around a ``with`` block; stopped however it ends."""
    cluster = start_cluster(**options)
    try:
        yield cluster
    finally:
        cluster.stop()


@dataclass(eq=False)
class RedisServer:
    """One private ``redis-server`` on 127.0.0.1 (no cluster, no persistence); `stop` it."""

    port: int
    directory: Path
    process: subprocess.Popen[bytes]

    def url(self, *, prefix: str | None = None, user: str = "", password: str = "") -> str:
        """``redis://[user:password@]127.0.0.1:PORT/0``, with ``?prefix=`` if given."""
        login = f"{user}:{password}@" if user or password else ""
        return f"redis://{login}{HOST}:{self.port}/0" + (f"?prefix={prefix}" if prefix else "")

    def client(self, **options: Any) -> Any:
        """A plain redis-py client of the server (close it)."""
        import redis

        options.setdefault("socket_timeout", 5)
        options.setdefault("socket_connect_timeout", 5)
        return redis.Redis(host=HOST, port=self.port, **options)

    def command(self, *args: Any) -> Any:
        with self.client() as client:
            return client.execute_command(*args)

    def stop(self) -> None:
        """Terminates the server (killed if it lingers) and removes its directory."""
        try:
            _end(self.process)
        finally:
            shutil.rmtree(self.directory, ignore_errors=True)


@contextlib.contextmanager
def running_server(*settings: str, timeout: float = START_TIMEOUT) -> Iterator[RedisServer]:
    """A private `RedisServer` started with extra `settings` (``"--maxmemory-policy",
    "allkeys-lru"``…) around a ``with`` block; stopped however it ends. Raises
    `ClusterError` when redis-server is missing or does not answer within `timeout`."""
    binaries = find_binaries()
    if binaries is None:
        raise ClusterError("redis-server and redis-cli are not installed")
    port = free_ports(1)[0]
    directory = Path(tempfile.mkdtemp(prefix="quota-redis-"))
    arguments = ["--port", str(port), "--bind", HOST, "--save", "", "--appendonly", "no",
                 "--dir", str(directory), "--daemonize", "no", *settings]  # fmt: skip
    log = open(directory / "stdout.log", "ab")  # noqa: SIM115 - handed to the child
    try:
        process = subprocess.Popen(
            [binaries[0], *arguments], stdin=subprocess.DEVNULL, stdout=log, stderr=log,
            cwd=directory, start_new_session=True, preexec_fn=_SET_PARENT_DEATH_SIGNAL,
        )  # fmt: skip
    finally:
        log.close()
    server = RedisServer(port, directory, process)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if process.poll() is not None:
                tail = (directory / "stdout.log").read_text(errors="replace")[-2000:]
                raise ClusterError(f"redis-server on {HOST}:{port} exited:\n{tail}")
            with contextlib.suppress(Exception):
                if server.command("PING"):
                    break
            if time.monotonic() >= deadline:
                raise ClusterError(f"redis-server on {HOST}:{port} did not answer in time")
            time.sleep(0.05)
        yield server
    finally:
        server.stop()
