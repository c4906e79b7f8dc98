"""A private PgBouncer for tests: started in a temporary directory, stopped without fail.

`start_pgbouncer` writes a configuration (a free port on 127.0.0.1, no Unix socket,
``auth_type = trust``, every database forwarded to one PostgreSQL server), starts
``pgbouncer CONFIG`` in the foreground as a child process of this one and waits until
its port accepts connections. `PgBouncer.stop` ends it (SIGTERM, then SIGKILL) and
removes the directory; `running_pgbouncer` does both around a ``with`` block.

PgBouncer refuses to run as root: under root it runs as ``postgres`` (the directory and
its files are handed to that user). Nothing outlives the test process: every bouncer
not yet stopped is killed at exit, and on Linux each one also gets SIGTERM when its
parent dies (``PR_SET_PDEATHSIG``), for a pytest killed outright.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import quote

from tests._support import parent_death_signal

PoolMode = Literal["session", "transaction"]

#: Where Debian's package puts the binary (``/usr/sbin`` is not on every user's PATH).
DEFAULT_BINARY = "/usr/sbin/pgbouncer"
#: The user PgBouncer runs as when this process is root.
RUN_AS = "postgres"
#: Startup parameters PgBouncer does not track but lets pass, where it would otherwise
#: refuse the client ("unsupported startup parameter"). ``extra_float_digits`` is sent by
#: some clients (pgjdbc, for one); asyncpg 0.32 and psycopg 3 connect without it. Not
#: ``options`` (``-c name=value``): ignoring it would drop the settings silently.
IGNORE_STARTUP_PARAMETERS = ("extra_float_digits",)
START_TIMEOUT = 10.0
STOP_TIMEOUT = 5.0

#: Bouncers started and not yet stopped; killed at exit as a backstop.
_LIVE: set[PgBouncer] = set()


def find_binary() -> str | None:
    """The pgbouncer executable: Debian's path, else the first on PATH; None without one."""
    if os.access(DEFAULT_BINARY, os.X_OK):
        return DEFAULT_BINARY
    return shutil.which("pgbouncer")


class PgBouncerError(RuntimeError):
    """PgBouncer would not start (the message carries the tail of its log)."""


@dataclass(eq=False)
class PgBouncer:
    """A running PgBouncer on 127.0.0.1:`port`; `stop` it (idempotent)."""

    port: int
    process: subprocess.Popen[bytes]
    directory: Path
    user: str = "root"
    _stopped: bool = field(default=False, repr=False)

    def url(self, database: str) -> str:
        """``postgresql://USER@127.0.0.1:PORT/DATABASE`` through this bouncer."""
        return f"postgresql://{quote(self.user, safe='')}@127.0.0.1:{self.port}/{quote(database)}"

    def _read(self, name: str) -> list[str]:
        try:
            return (self.directory / name).read_text(errors="replace").splitlines()
        except OSError:
            return []

    def log_tail(self, lines: int = 30) -> str:
        """The last lines of PgBouncer's log file, and what it wrote to stderr alone.

        It logs to both; stderr also has what came before the log file was opened
        (a configuration PgBouncer refused, say).
        """
        log = self._read("pgbouncer.log")
        logged = set(log)
        stderr = [line for line in self._read("stderr.log") if line not in logged]
        parts = [
            f"--- {name} ---\n" + "\n".join(text[-lines:])
            for name, text in (("pgbouncer.log", log), ("stderr", stderr))
            if text
        ]
        return "\n".join(parts) or "(PgBouncer wrote no log)"

    def stop(self) -> None:
        """Terminates PgBouncer (killed if it lingers), reaps it and removes its directory."""
        if self._stopped:
            return
        try:
            _end(self.process)
        finally:
            self._stopped = True
            _LIVE.discard(self)
            shutil.rmtree(self.directory, ignore_errors=True)


def _end(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is not None:
        return
    # SIGTERM is PgBouncer's immediate shutdown (SIGINT would wait for its clients).
    process.terminate()
    try:
        process.wait(STOP_TIMEOUT)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@atexit.register
def _kill_leftovers() -> None:
    for bouncer in list(_LIVE):
        with contextlib.suppress(Exception):
            bouncer.process.kill()
            bouncer.process.wait(STOP_TIMEOUT)
        shutil.rmtree(bouncer.directory, ignore_errors=True)
        _LIVE.discard(bouncer)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _quote(value: str) -> str:
    return '"' + value.replace('"', '""') + '"'


def _config(
    directory: Path,
    *,
    port: int,
    server_host: str,
    server_port: int,
    pool_mode: PoolMode,
    default_pool_size: int,
    max_client_conn: int,
) -> str:
    return "\n".join(
        [
            "[databases]",
            f"* = host={server_host} port={server_port}",
            "",
            "[pgbouncer]",
            "listen_addr = 127.0.0.1",
            f"listen_port = {port}",
            "unix_socket_dir =",
            "auth_type = trust",
            f"auth_file = {directory / 'userlist.txt'}",
            f"pool_mode = {pool_mode}",
            f"default_pool_size = {default_pool_size}",
            f"max_client_conn = {max_client_conn}",
            "server_reset_query = DISCARD ALL",
            f"ignore_startup_parameters = {','.join(IGNORE_STARTUP_PARAMETERS)}",
            f"logfile = {directory / 'pgbouncer.log'}",
            f"pidfile = {directory / 'pgbouncer.pid'}",
            "",
        ]
    )


# Prepared here, in the parent: the child runs as `RUN_AS` by then, which may not read
# this Python's files to import anything (see `tests._support.parent_death_signal`).
_SET_PARENT_DEATH_SIGNAL = parent_death_signal()


def start_pgbouncer(
    *,
    pool_mode: PoolMode = "transaction",
    default_pool_size: int = 2,
    max_client_conn: int = 50,
    server_host: str = "127.0.0.1",
    server_port: int = 5432,
    user: str = "root",
    password: str = "",
    binary: str | None = None,
    timeout: float = START_TIMEOUT,
    attempts: int = 3,
) -> PgBouncer:
    """Starts a PgBouncer in front of `server_host`:`server_port` and waits for its port.

    Clients log in as `user` without a password (``auth_type = trust``); PgBouncer logs in
    to the server as the same user, with `password` if one is given. Raises
    `PgBouncerError` (with the log's tail) when it does not listen within `timeout`
    seconds; a port taken between choosing and binding it is retried `attempts` times.
    """
    if pool_mode not in ("session", "transaction"):
        raise ValueError(f"pool_mode must be 'session' or 'transaction', not {pool_mode!r}")
    executable = binary or find_binary()
    if executable is None:
        raise PgBouncerError(f"pgbouncer is not installed ({DEFAULT_BINARY} nor on PATH)")
    for attempt in range(1, attempts + 1):
        bouncer = _spawn(
            executable,
            pool_mode=pool_mode,
            default_pool_size=default_pool_size,
            max_client_conn=max_client_conn,
            server_host=server_host,
            server_port=server_port,
            user=user,
            password=password,
        )
        try:
            _wait_until_listening(bouncer, timeout)
        except _PortTaken:
            bouncer.stop()
            if attempt == attempts:
                raise PgBouncerError(
                    f"pgbouncer found its port taken {attempts} times in a row"
                ) from None
        except BaseException:
            bouncer.stop()
            raise
        else:
            return bouncer
    raise AssertionError("unreachable")


@contextlib.contextmanager
def running_pgbouncer(**options: Any) -> Iterator[PgBouncer]:
    """`start_pgbouncer` (same options) around a ``with`` block; stopped however it ends."""
    bouncer = start_pgbouncer(**options)
    try:
        yield bouncer
    finally:
        bouncer.stop()


class _PortTaken(Exception):
    pass


def _spawn(
    executable: str,
    *,
    pool_mode: PoolMode,
    default_pool_size: int,
    max_client_conn: int,
    server_host: str,
    server_port: int,
    user: str,
    password: str,
) -> PgBouncer:
    directory = Path(tempfile.mkdtemp(prefix="quota-pgbouncer-"))
    try:
        port = _free_port()
        config = directory / "pgbouncer.ini"
        config.write_text(
            _config(
                directory,
                port=port,
                server_host=server_host,
                server_port=server_port,
                pool_mode=pool_mode,
                default_pool_size=default_pool_size,
                max_client_conn=max_client_conn,
            )
        )
        (directory / "userlist.txt").write_text(f"{_quote(user)} {_quote(password)}\n")
        uid = gid = groups = None
        if os.geteuid() == 0:
            account = pwd.getpwnam(RUN_AS)  # KeyError: no such user; reported below
            for path in (directory, *directory.iterdir()):
                os.chown(path, account.pw_uid, account.pw_gid)
            uid, gid, groups = account.pw_uid, account.pw_gid, []
        with open(directory / "stderr.log", "wb") as stderr:
            process = subprocess.Popen(
                [executable, str(config)],
                stdin=subprocess.DEVNULL,
                stdout=stderr,
                stderr=stderr,
                cwd=directory,
                # Its own session: a Ctrl-C at the terminal is for pytest, whose teardown
                # then stops this bouncer; PgBouncer itself would wait for its clients.
                start_new_session=True,
                user=uid,
                group=gid,
                extra_groups=groups,
                preexec_fn=_SET_PARENT_DEATH_SIGNAL,
            )
    except KeyError:
        shutil.rmtree(directory, ignore_errors=True)
        raise PgBouncerError(
            f"PgBouncer refuses to run as root and there is no user {RUN_AS!r} to run it as"
        ) from None
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    bouncer = PgBouncer(port=port, process=process, directory=directory, user=user)
    _LIVE.add(bouncer)
    return bouncer


def _wait_until_listening(bouncer: PgBouncer, timeout: float) -> None:
    # Its own word that it listens (not merely that something answers on the port, which
    # another process could have taken meanwhile), then a connection to make sure.
    listening = f"listening on 127.0.0.1:{bouncer.port}"
    deadline = time.monotonic() + timeout
    while True:
        code = bouncer.process.poll()
        if code is not None:
            tail = bouncer.log_tail()
            if "Address already in use" in tail:
                raise _PortTaken
            raise PgBouncerError(f"pgbouncer exited with status {code} on start:\n{tail}")
        if any(listening in line for line in bouncer._read("stderr.log")):
            try:
                socket.create_connection(("127.0.0.1", bouncer.port), timeout=0.5).close()
            except OSError:
                pass
            else:
                return
        if time.monotonic() >= deadline:
            raise PgBouncerError(
                f"pgbouncer did not listen on 127.0.0.1:{bouncer.port} within {timeout:g} s:\n"
                f"{bouncer.log_tail()}"
            )
        time.sleep(0.05)
