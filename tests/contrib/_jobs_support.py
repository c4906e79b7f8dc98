"""What the job-integration tests share: a journal of task runs written by worker
processes, and the checks read off it.

Each run of a test task appends one JSON line to the journal (one ``write`` of a
short line to a file opened for appending: lines of several processes never
interleave). A line holds what the test needs: the task's ``id``, ``event``
(``"start"`` when its body began, ``"run"`` for each time the decorated call was
entered, admitted or not), the wall-clock time ``at``, the ``pid`` of the worker,
and whatever else the task adds (``tenant``, ``seconds`` spent in the call…).
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any


def record(path: str | os.PathLike[str], **fields: Any) -> None:
    """Appends one line of `fields` to the journal at `path`."""
    line = json.dumps(fields, separators=(",", ":")) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def read(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every complete line of the journal (none when it does not exist yet)."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.splitlines() if line.endswith("}")]


def wait_for(
    path: str | os.PathLike[str], done: Callable[[list[dict[str, Any]]], bool], *,
    timeout: float, alive: Callable[[], str | None] = lambda: None,
) -> list[dict[str, Any]]:  # fmt: skip
    """The journal once `done` holds for it; AssertionError after `timeout` seconds, or
    as soon as `alive` names a worker that died (it returns a message, else None)."""
    deadline = time.monotonic() + timeout
    while True:
        lines = read(path)
        if done(lines):
            return lines
        dead = alive()
        assert dead is None, dead
        assert time.monotonic() < deadline, (
            f"not done within {timeout:g}s: {len(lines)} lines, the last {lines[-3:]}"
        )
        time.sleep(0.1)


def starts(lines: Iterable[dict[str, Any]], **match: Any) -> list[float]:
    """The start times of the lines whose fields equal `match`."""
    return sorted(
        line["at"]
        for line in lines
        if line["event"] == "start" and all(line.get(k) == v for k, v in match.items())
    )


def per_second(times: Iterable[float]) -> Counter[int]:
    """How many of `times` fall in each aligned second (``int(t)``)."""
    return Counter(int(t) for t in times)
