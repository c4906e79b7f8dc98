"""End to end: the example Django project under gunicorn (4 workers) on PostgreSQL, exact.

One client sends three times the limit of concurrent requests (bounded
threads, each request on a connection of its own) to the view the
middleware limits and to the view the ``@ratelimit`` decorator limits:
exactly the limit gets 200 and the rest 429, though the requests are spread
over four processes, each with its own limiter. Sync workers, gthread
workers and uvicorn's ASGI workers (the middleware and the decorator then
run async); then the same with Django's PgBouncer settings
(``DISABLE_SERVER_SIDE_CURSORS``, ``CONN_MAX_AGE = 0``) through a private
PgBouncer in transaction mode. The database is created for the module
(``quota_django_e2e_<random>``), migrated with ``manage.py migrate`` and
dropped; every gunicorn is stopped, its whole process group.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tests._pgbouncer import find_binary, running_pgbouncer
from tests.contrib.django._e2e_support import (
    burst,
    gunicorn,
    manage,
    postgres_database,
    project_env,
    truncate_counters,
)

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

LIMIT = 12
REQUESTS = 3 * LIMIT
#: Week-long windows: a run cannot straddle two of them (but at a week's turn).
MIDDLEWARE_RATE = f"{LIMIT}/week"
DECORATOR_RATE = f"{LIMIT}/7d"


@pytest.fixture(scope="module")
def database(pg_server_url: str) -> Iterator[str]:
    with postgres_database(pg_server_url) as url:
        manage(project_env(QUOTA_EXAMPLE_POSTGRES=url), "migrate", "--no-input")
        yield url


def _env(url: str, **extra: str) -> dict[str, str]:
    return project_env(
        QUOTA_EXAMPLE_POSTGRES=url,
        QUOTA_POLICY_API_RATES=MIDDLEWARE_RATE,
        QUOTA_EXAMPLE_DECORATOR_RATE=DECORATOR_RATE,
        **extra,
    )


def _check_exact(port: int) -> None:
    for path in ("/api/hello", "/limited"):
        replies = burst(port, path, REQUESTS)
        statuses = sorted(status for status, _, _ in replies)
        assert statuses == [200] * LIMIT + [429] * (REQUESTS - LIMIT), path
        if path == "/api/hello":  # the middleware's headers: each allowed one saw its place
            allowed = [h for s, h, _ in replies if s == 200]
            remaining = sorted(int(h["x-ratelimit-remaining"]) for h in allowed)
            assert remaining == list(range(LIMIT))
            for status, headers, body in replies:
                if status == 429:
                    assert headers["content-type"] == "application/problem+json"
                    assert int(headers["retry-after"]) >= 1
                    assert json.loads(body)["code"] == "RATE_LIMITED"


@pytest.mark.parametrize(
    ("worker_class", "threads", "app"),
    [
        ("sync", 1, "example.wsgi:application"),
        ("gthread", 4, "example.wsgi:application"),
        # ASGI: the middleware and the decorator run async, on each loop's async limiter.
        ("uvicorn.workers.UvicornWorker", 1, "example.asgi:application"),
    ],
    ids=["sync", "gthread", "asgi"],
)
def test_exact_across_four_gunicorn_workers(
    database: str, worker_class: str, threads: int, app: str
) -> None:
    truncate_counters(database)
    with gunicorn(
        _env(database), workers=4, worker_class=worker_class, threads=threads, app=app
    ) as server:
        _check_exact(server.port)


def test_exact_behind_pgbouncer_in_transaction_mode(database: str) -> None:
    if find_binary() is None:
        pytest.skip("pgbouncer is not installed")
    truncate_counters(database)
    name = database.rsplit("/", 1)[1]
    with running_pgbouncer(pool_mode="transaction", default_pool_size=2) as bouncer:
        env = _env(bouncer.url(name), QUOTA_EXAMPLE_PGBOUNCER="1")
        with gunicorn(env, workers=4) as server:
            _check_exact(server.port)
