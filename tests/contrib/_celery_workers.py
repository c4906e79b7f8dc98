"""Real Celery worker processes for the tests: ``celery -A tests.contrib._celery_app worker``.

`Workers` starts `count` solo workers (``nodeN@%h``, one process each, their own
session) consuming one queue of its own, configured by environment variables
(`tests.contrib._celery_app`), waits until each logs ``ready.`` (and wrote its ``warm``
line to the journal), and kills every
worker's process group when its ``with`` block ends, however it ends.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from types import TracebackType
from typing import Any

from celery import Celery

from tests._support import parent_death_signal
from tests.contrib._jobs_support import read

ROOT = Path(__file__).resolve().parents[2]
READY_TIMEOUT = 30.0


class Workers:
    """`count` worker processes on a queue of their own; use as a context manager."""

    def __init__(
        self, broker: str, directory: Path, *, count: int, store: str | None = None,
        default_store: str | None = None,
    ) -> None:  # fmt: skip
        self.broker = broker
        self.directory = directory
        self.count = count
        self.queue = f"q-{uuid.uuid4().hex[:8]}"
        self.journal = directory / "journal.jsonl"
        self.env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "QUOTA_CELERY_BROKER": broker,
            "QUOTA_CELERY_JOURNAL": str(self.journal),
        }
        self.env.pop("QUOTA_CELERY_STORE", None)
        self.env.pop("QUOTA_DATABASE_URL", None)
        if store is not None:
            self.env["QUOTA_CELERY_STORE"] = store
        if default_store is not None:
            self.env["QUOTA_DATABASE_URL"] = default_store
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.killed: set[str] = set()
        self.client = Celery("quota_celery_client", broker=broker, set_as_current=False)
        self.client.conf.update(result_backend=None, task_ignore_result=True)

    def log(self, node: str) -> Path:
        return self.directory / f"{node}.log"

    def __enter__(self) -> Workers:
        try:
            for index in range(self.count):
                node = f"node{index}"
                with open(self.log(node), "wb") as log:
                    self.procs[node] = subprocess.Popen(
                        [sys.executable, "-m", "celery", "-A", "tests.contrib._celery_app", "worker",
                         "--pool=solo", "--concurrency=1", "-n", f"{node}@%h",
                         "--without-heartbeat", "--without-gossip", "--without-mingle",
                         "-Q", self.queue, "-l", "INFO"],
                        cwd=ROOT, env=self.env, stdin=subprocess.DEVNULL, stdout=log,
                        stderr=log, start_new_session=True, preexec_fn=parent_death_signal(),
                    )  # fmt: skip
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT
        waiting = set(self.procs)
        while waiting:
            for node in list(waiting):
                if "ready." in self.log(node).read_text(errors="replace"):
                    waiting.discard(node)
            if not waiting:  # and each opened its limiters' connections (worker_init)
                warm = {line["pid"] for line in read(self.journal) if line["event"] == "warm"}
                waiting = {node for node, proc in self.procs.items() if proc.pid not in warm}
            dead = self.alive()
            assert dead is None, dead
            assert time.monotonic() < deadline, f"{sorted(waiting)} not ready: {self.tails()}"
            time.sleep(0.05)

    def send(self, name: str, *args: Any, **kwargs: Any) -> str:
        """Sends task `name` to this group's queue; returns its id."""
        result = self.client.send_task(name, args=args, kwargs=kwargs, queue=self.queue)
        return str(result.id)

    def alive(self) -> str | None:
        """None while every worker not killed on purpose runs, else a message saying which died."""
        for node, proc in self.procs.items():
            if node not in self.killed and proc.poll() is not None:
                return f"worker {node} exited with {proc.returncode}:\n{self.tail(node)}"
        return None

    def kill(self, node: str) -> None:
        """SIGKILLs the process group of worker `node` (as a crash would)."""
        self.killed.add(node)
        proc = self.procs[node]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)

    def node_of(self, hostname: str) -> str:
        """The node (``node0``…) of a worker's hostname (``node0@host``)."""
        return hostname.split("@", 1)[0]

    def stop(self) -> None:
        for proc in self.procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        self.client.close()

    def tail(self, node: str) -> str:
        try:
            return self.log(node).read_text(errors="replace")[-3000:]
        except FileNotFoundError:
            return ""

    def tails(self) -> str:
        return "\n".join(f"--- {node}\n{self.tail(node)}" for node in self.procs)
