"""Outbound rate limiting across processes: 24 clients, three transports, one store.

8 processes with ``httpx.Client`` over `quota.contrib.httpx.RateLimitedTransport`, 8 with
``httpx.AsyncClient`` over `AsyncRateLimitedTransport` and 8 with a ``requests.Session``
over `quota.contrib.requests.RateLimitedAdapter` (`tests/contrib/_outbound_workers.py`)
send GETs as fast as they can to one recording server (`tests/contrib/_outbound_server.py`),
all limited to ``10/second`` in one SQLite file or one PostgreSQL database. The server
sees at most 10 requests in any wall-clock second, and hardly fewer; when it answers one
request 429 with ``Retry-After: 2``, no process sends anything for those 2 seconds, and
the refused GET comes again after them.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tempfile
import time
from collections import Counter
from contextlib import ExitStack
from pathlib import Path
from typing import IO

import httpx
import pytest

from tests._support import parent_death_signal
from tests.conftest import backend_params, new_sql_database
from tests.contrib._outbound_server import Arrival, RecordingServer

ROOT = Path(__file__).resolve().parents[2]
KINDS = ("httpx", "httpx-async", "requests")
PER_KIND = 8
LIMIT = 10  # the workers' "10/second"
STEADY = 5  # aligned seconds measured before the 429
RETRY_AFTER = 2
HOLD = 0.2  # how long the server holds the request it answers 429
READY_TIMEOUT = 60.0  # 24 interpreters importing httpx and requests on a small machine


def test_the_recording_server_answers_one_request_429_after_holding_it() -> None:
    with RecordingServer() as server, httpx.Client() as client:
        assert client.get(server.url + "/a", headers={"X-Worker": "w1"}).status_code == 200
        server.arm(time.time(), delay=HOLD, retry_after=RETRY_AFTER)
        t0 = time.time()
        refused = client.get(server.url + "/b", headers={"X-Worker": "w2", "X-Attempt": "1"})
        assert refused.status_code == 429
        assert refused.headers["Retry-After"] == str(RETRY_AFTER)
        assert time.time() - t0 >= HOLD
        assert client.post(server.url + "/c", content=b"xyz").status_code == 200
        rejection = server.wait_rejected(1.0)
    assert rejection is not None
    assert rejection.arrival.path == "/b" and rejection.arrival.status == 429
    assert rejection.sent_at - rejection.arrival.at >= HOLD
    assert [(a.method, a.path, a.worker, a.attempt, a.status) for a in server.arrivals] == [
        ("GET", "/a", "w1", None, 200),
        ("GET", "/b", "w2", "1", 429),
        ("POST", "/c", None, None, 200),
    ]


def _start(kind: str, index: int, url: str, server: str, err: IO[bytes]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.contrib._outbound_workers",
         kind, url, server, "-", "-", f"{kind}-{index}"],
        cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
        preexec_fn=parent_death_signal(), env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip


def _wait_ready(procs: list[subprocess.Popen[str]], errs: list[IO[bytes]]) -> None:
    """Every worker has sent its warm-up GET and printed ``ready`` (or the test fails)."""
    waiting = {proc.stdout.fileno(): (proc, err) for proc, err in zip(procs, errs, strict=True)}  # type: ignore[union-attr]
    deadline = time.monotonic() + READY_TIMEOUT
    while waiting:
        left = deadline - time.monotonic()
        assert left > 0, f"{len(waiting)} of {len(procs)} workers not ready in {READY_TIMEOUT}s"
        readable, _, _ = select.select(list(waiting), [], [], left)
        for fd in readable:
            proc, err = waiting.pop(fd)
            assert proc.stdout is not None
            line = proc.stdout.readline().strip()
            assert line == "ready", (line, proc.args, _tail(err))


def _tail(err: IO[bytes]) -> str:
    err.flush()
    err.seek(0)
    return err.read().decode(errors="replace")[-3000:]


def _steady_seconds(arrivals: list[Arrival], first: int) -> dict[int, int]:
    """Arrivals in each aligned second of the steady phase, the warm-ups (``n0``) left out."""
    counts = Counter(int(a.at) for a in arrivals if not a.path.endswith("/n0"))
    return {second: counts[second] for second in range(first, first + STEADY)}


@pytest.mark.parametrize("dialect", backend_params("sqlite", "postgresql"))
def test_24_processes_on_three_transports_share_one_limit_and_one_pause(
    request: pytest.FixtureRequest, dialect: str
) -> None:
    url = new_sql_database(request, dialect)
    procs: list[subprocess.Popen[str]] = []
    errs: list[IO[bytes]] = []
    with RecordingServer() as server, ExitStack() as files:
        try:
            for index in range(PER_KIND):
                for kind in KINDS:
                    errs.append(files.enter_context(tempfile.TemporaryFile()))
                    procs.append(_start(kind, index, url, server.url, errs[-1]))
            _wait_ready(procs, errs)
            # The steady phase: STEADY whole seconds from `start`; then the server answers
            # the first GET of the next second but one 429 (held HOLD s), and the workers go
            # on until well after the pause, so that the refused GET is sent again.
            start = int(time.time()) + 2
            armed_at = start + STEADY + 0.5
            stop = armed_at + 1 + HOLD + RETRY_AFTER + 1.5
            server.arm(armed_at, delay=HOLD, retry_after=RETRY_AFTER)
            for proc in procs:
                assert proc.stdin is not None
                proc.stdin.write(f"{start} {stop}\n")
                proc.stdin.flush()
            outs = []
            for proc in procs:
                out, _ = proc.communicate(timeout=max(5.0, stop - time.time() + 30))
                outs.append(out)
            arrivals = server.arrivals
            rejection = server.rejection
        finally:
            for proc in procs:
                proc.kill()
                proc.wait(timeout=10)
            tails = [_tail(err) for err in errs]

    failed = [(p.args[3:], p.returncode, tail) for p, tail in zip(procs, tails, strict=True)
              if p.returncode != 0]  # fmt: skip
    assert not failed, failed
    sent = [json.loads(out.strip().splitlines()[-1]) for out in outs]
    # The server saw every GET the workers sent, each once but the refused one.
    paths = Counter(a.path for a in arrivals)
    assert len(paths) == sum(s["sent"] for s in sent), (len(paths), sent)
    assert [n for n in paths.values() if n != 1] == ([2] if rejection else []), paths
    refused_ones = [a for a in arrivals if a.status != 200]
    assert refused_ones == ([rejection.arrival] if rejection else []), refused_ones

    # At most LIMIT arrivals in any aligned second, and hardly fewer, from all three kinds.
    seconds = _steady_seconds(arrivals, start)
    print(f"{dialect}: arrivals per second {seconds}")
    assert max(seconds.values()) <= LIMIT, seconds
    assert sum(seconds.values()) >= 0.9 * LIMIT * STEADY, seconds
    steady = [a for a in arrivals if start <= a.at < start + STEADY and not a.path.endswith("/n0")]
    assert {a.worker.rsplit("-", 1)[0] for a in steady if a.worker} == set(KINDS)

    # One GET was refused; nothing arrived from anyone during its pause; it came again after.
    assert rejection is not None, "no request arrived after the server was armed"
    refused = rejection.arrival
    assert refused.at >= armed_at
    paused = [a for a in arrivals if rejection.sent_at < a.at < rejection.sent_at + RETRY_AFTER]
    assert not paused, (rejection, paused)
    again = [a for a in arrivals if a.path == refused.path and a is not refused]
    assert len(again) == 1, (refused, again)
    assert again[0].worker == refused.worker
    assert again[0].at >= rejection.sent_at + RETRY_AFTER
    print(
        f"{dialect}: 429 sent {rejection.sent_at - start:.3f}s after the start, "
        f"{refused.path} again {again[0].at - rejection.sent_at:.3f}s after it; "
        f"{len(arrivals)} GETs in all"
    )
    after = Counter(
        int((a.at - rejection.sent_at) * 10) / 10 for a in arrivals if a.at > refused.at
    )
    print(
        f"{dialect}: arrivals after the 429 by tenth of a second after it: {sorted(after.items())}"
    )
