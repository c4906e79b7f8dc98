"""End to end: the example project's DRF view under gunicorn (4 workers) on PostgreSQL, exact.

One client sends 30 concurrent requests (bounded threads, each request on a
connection of its own, on a private port of 127.0.0.1) to ``/drf/hello``,
throttled at 10/minute by quota's ``AnonRateThrottle``: exactly 10 get 200
and 20 get 429 with ``Retry-After``, though four processes answer them. The
same burst on ``/drf/hello-drf-cache``, throttled by DRF's own
``AnonRateThrottle`` on a file cache the workers share, is printed (``-rP``)
but not asserted: it admits more or fewer depending on the interleaving. The
database is created for the module and dropped; gunicorn is stopped, its
whole process group, however the test ends.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.contrib.django._e2e_support import (
    burst,
    gunicorn,
    manage,
    postgres_database,
    project_env,
    truncate_counters,
)

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

LIMIT = 10
REQUESTS = 30
RATE = f"{LIMIT}/minute"
#: Seconds a burst takes at most: it starts no later than this before a minute's end,
#: so that all of it falls in one of quota's minute windows (aligned to the epoch).
BURST_SECONDS = 15


@pytest.fixture(scope="module")
def database(pg_server_url: str) -> Iterator[str]:
    with postgres_database(pg_server_url, prefix="quota_drf_e2e") as url:
        manage(project_env(QUOTA_EXAMPLE_POSTGRES=url), "migrate", "--no-input")
        yield url


def _in_one_window() -> None:
    """Wait (at most `BURST_SECONDS`) until the rest of this minute holds a whole burst."""
    left = 60 - time.time() % 60
    if left < BURST_SECONDS:
        time.sleep(left + 0.2)


def test_drf_throttle_is_exact_under_gunicorn(database: str, tmp_path: Path) -> None:
    truncate_counters(database)
    cache = tmp_path / "drf-cache"
    cache.mkdir()
    env = project_env(
        QUOTA_EXAMPLE_POSTGRES=database,
        QUOTA_EXAMPLE_DRF_RATE=RATE,
        QUOTA_EXAMPLE_CACHE_DIR=str(cache),
    )
    with gunicorn(env, workers=4) as server:
        _in_one_window()
        replies = burst(server.port, "/drf/hello", REQUESTS)
        theirs = burst(server.port, "/drf/hello-drf-cache", REQUESTS)

    statuses = Counter(status for status, _, _ in replies)
    their_statuses = Counter(status for status, _, _ in theirs)
    # -rP shows both.
    print(f"quota.contrib.drf.AnonRateThrottle, {REQUESTS} requests at {RATE}: {dict(statuses)}")
    print(f"DRF's AnonRateThrottle (file cache), same burst: {dict(their_statuses)}")
    assert statuses == {200: LIMIT, 429: REQUESTS - LIMIT}
    for status, headers, _ in replies:
        if status == 429:
            assert 1 <= int(headers["retry-after"]) <= 60
            assert headers["x-ratelimit-remaining"] == "0"
    remaining = sorted(int(h["x-ratelimit-remaining"]) for s, h, _ in replies if s == 200)
    assert remaining == list(range(LIMIT))  # each allowed request saw its own place
