"""Exactness under real concurrency: several OS processes on one key allow exactly `limit`.

No mocks: separate processes (``spawn``), each with its own connections,
race on one counter row. Two lanes run side by side on one key each: one
limiter counting denied hits (the counter must end at the number of hits
made: no lost update) and one with ``count_denied=False`` (the counter must
stop at the limit).
"""

from __future__ import annotations

import multiprocessing

import pytest

import quota
from tests import _workers

pytestmark = pytest.mark.slow

HITS_PER_PROCESS = 50
LIMIT = 37  # well under the 4 x 50 = 200 hits made on each key


def _lanes() -> list[_workers.Lane]:
    return [("hammered", LIMIT, 3600, True), ("hammered-capped", LIMIT, 3600, False)]


def _check(url: str, faces: list[str], results: list[dict[str, int]]) -> None:
    total_hits = HITS_PER_PROCESS * len(faces)
    for key, limit, window, count_denied in _lanes():
        allowed = [result[key] for result in results]
        assert sum(allowed) == limit, f"{key}: allowed per process {allowed}, limit {limit}"
        with quota.connect(url, clock=lambda: _workers.FIXED_NOW) as limiter:
            count = limiter.peek(key, limit, window).count
        assert count == (total_hits if count_denied else limit), key


def test_processes_on_one_sqlite_file_allow_exactly_the_limit(sqlite_url: str) -> None:
    faces = ["sync"] * 4
    results = _workers.run_processes(
        multiprocessing.get_context("spawn"),
        _workers.hit_worker,
        [(sqlite_url, face, _lanes(), HITS_PER_PROCESS, 1, _workers.FIXED_NOW) for face in faces],
    )
    _check(sqlite_url, faces, results)


@pytest.mark.postgres
def test_processes_on_postgresql_sync_and_async_allow_exactly_the_limit(
    pg_clean_url: str,
) -> None:
    faces = ["sync", "async", "sync", "async"]
    tasks = 5  # concurrent tasks in each async process
    results = _workers.run_processes(
        multiprocessing.get_context("spawn"),
        _workers.hit_worker,
        [
            (pg_clean_url, face, _lanes(), HITS_PER_PROCESS, tasks, _workers.FIXED_NOW)
            for face in faces
        ],
    )
    _check(pg_clean_url, faces, results)
