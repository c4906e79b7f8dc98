"""The webhook worker (`quota.notify`): signing, backoff, claims with leases, delivery at
least once, retries without loss, several workers at once, cleanup of delivered events.

Each test runs on SQLite and PostgreSQL (`sql_url`) against a receiver on a free
loopback port (`tests._webhook_receiver`); clocks and sleeps are injected, so no test
waits out a real backoff.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from decimal import Decimal

import pytest

import quota
from quota import notify
from quota.notify import Notifier, backoff, body_of, sign, verify
from tests import _webhook_receiver
from tests._support import Clock
from tests.limiter.test_quotas import db_rows

SECRET = "whsec_test"


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def limiter(sql_url: str, clock: Clock) -> Iterator[quota.Limiter]:
    with quota.connect(sql_url, clock=clock, pool_size=2) as limiter:
        yield limiter


def fire(
    limiter: quota.Limiter, subjects: int, thresholds: tuple[float, ...] = (0.5, 1.0)
) -> list[int]:
    """Fire `thresholds` for `subjects` subjects; the events' ids."""
    ids = []
    for i in range(subjects):
        d = limiter.consume_quota(f"acct_{i}", "llm_calls", 2, "day", cost=2, thresholds=thresholds)
        ids += [e.id for e in d.fired]
    assert len(ids) == subjects * len(thresholds)
    return ids


def undelivered(url: str) -> int:
    return int(db_rows(url, "SELECT count(*) FROM quota_events WHERE delivered_at IS NULL")[0][0])


# -- without a database ----------------------------------------------------------------------


def test_sign_and_verify() -> None:
    body = b'{"id":1}'
    header = sign(body, SECRET)
    assert header.startswith("sha256=") and len(header) == len("sha256=") + 64
    assert verify(body, header, SECRET)
    assert not verify(body + b" ", header, SECRET)
    assert not verify(body, header, "another secret")
    assert not verify(body, None, SECRET)
    assert not verify(body, "sha256=00", SECRET)
    # The known answer of HMAC-SHA256 (RFC 4231, test case 2).
    assert sign(b"what do ya want for nothing?", "Jefe") == (
        "sha256=5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
    )


def test_the_body_is_the_event_as_json() -> None:
    event = quota.ThresholdEvent(
        id=7, subject="acct", quota="llm", period_start=1767225600, threshold=Decimal("0.8"),
        used=800, limit=1000, at=1767300000.25,
    )  # fmt: skip
    assert json.loads(body_of(event)) == {
        "id": 7, "subject": "acct", "quota": "llm", "period_start": 1767225600,
        "threshold": 0.8, "used": 800, "limit": 1000, "at": 1767300000.25,
    }  # fmt: skip


def test_backoff_doubles_to_the_cap_with_jitter() -> None:
    assert [backoff(n, 60, lambda: 1.0) for n in range(1, 9)] == [1, 2, 4, 8, 16, 32, 60, 60]
    assert [backoff(n, 60, lambda: 0.0) for n in (1, 3, 10)] == [0.5, 2, 30]
    assert backoff(10_000, 60, lambda: 0.5) == 45  # no overflow, however many failures


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"webhook": "ftp://example.com/x"}, "webhook"),
        ({"webhook": "not a url"}, "webhook"),
        ({"lease": 5, "timeout": 10}, "lease"),
        ({"timeout": 0}, "timeout"),
        ({"max_backoff": -1}, "max_backoff"),
        ({"batch": 0}, "batch"),
        ({"secret": ""}, "secret"),
    ],
)
def test_bad_settings_name_themselves(
    sqlite_url: str, kwargs: dict[str, object], named: str
) -> None:
    settings: dict[str, object] = {"webhook": "http://127.0.0.1:9/"} | kwargs
    with quota.connect(sqlite_url) as limiter, pytest.raises(quota.ConfigurationError, match=named):
        Notifier(limiter, **settings)  # type: ignore[arg-type]


# -- delivery ---------------------------------------------------------------------------------


def test_every_event_is_delivered_once_signed(limiter: quota.Limiter, sql_url: str) -> None:
    ids = fire(limiter, 5)
    with _webhook_receiver.running(SECRET) as receiver:
        worker = Notifier(limiter, receiver.url, secret=SECRET, batch=3)
        done = worker.drain()
        assert (done.delivered, done.failed) == (10, 0)
        assert worker.drain().claimed == 0  # nothing twice
    assert sorted(receiver.ids()) == sorted(ids)
    assert all(receiver.signed)
    assert receiver.received[0]["quota"] == "llm_calls"
    assert undelivered(sql_url) == 0
    assert worker.pending() == (0, None)


def test_without_a_secret_there_is_no_signature(limiter: quota.Limiter) -> None:
    fire(limiter, 1, (1.0,))
    seen: list[dict[str, str]] = []

    def post(url: str, body: bytes, headers: object, timeout: float) -> int:
        seen.append(dict(headers))  # type: ignore[call-overload]
        return 204

    Notifier(limiter, "http://127.0.0.1:9/", post=post).drain()
    assert len(seen) == 1 and "Quota-Signature" not in seen[0]
    assert seen[0]["Content-Type"] == "application/json"


def test_a_failing_receiver_is_retried_with_backoff_until_delivered(
    limiter: quota.Limiter, sql_url: str, clock: Clock
) -> None:
    [event_id] = fire(limiter, 1, (1.0,))
    with _webhook_receiver.running(statuses=[500, 503, 502, 200]) as receiver:
        worker = Notifier(
            limiter, receiver.url, clock=clock, draw=lambda: 1.0, max_backoff=3, timeout=1,
            lease=5,
        )  # fmt: skip
        waits = []
        for _ in range(3):
            assert worker.drain().failed == 1
            [(due, error, attempts)] = db_rows(
                sql_url, "SELECT claimed_until, last_error, attempts FROM quota_events"
            )
            waits.append(float(due) - clock())
            assert error.startswith("HTTP 5")
            assert worker.drain().claimed == 0  # not before its backoff ran out
            clock.advance(waits[-1])
        assert waits == [1, 2, 3]  # doubling, capped by max_backoff
        assert worker.drain().delivered == 1
    assert receiver.ids() == [event_id] * 4
    assert receiver.delivered_ids() == [event_id]
    [(delivered_at, attempts, error)] = db_rows(
        sql_url, "SELECT delivered_at, attempts, last_error FROM quota_events"
    )
    assert (float(delivered_at), attempts, error) == (clock(), 4, None)


def test_no_answer_is_a_failure_too(limiter: quota.Limiter, sql_url: str, clock: Clock) -> None:
    fire(limiter, 1, (1.0,))
    with _webhook_receiver.running() as receiver:
        url = receiver.url
    # The receiver is gone: the connection is refused.
    worker = Notifier(limiter, url, clock=clock, timeout=1, lease=5)
    assert worker.drain().failed == 1
    [(error,)] = db_rows(sql_url, "SELECT last_error FROM quota_events")
    assert "URLError" in error or "Connection" in error
    assert undelivered(sql_url) == 1


def test_run_delivers_until_stopped(limiter: quota.Limiter, clock: Clock) -> None:
    ids = fire(limiter, 2)
    stop = threading.Event()
    polls = []

    def sleep(seconds: float) -> None:
        polls.append(seconds)
        clock.advance(seconds)
        if len(polls) >= 3 or len(receiver.delivered_ids()) == len(ids):
            stop.set()

    with _webhook_receiver.running(statuses=[500, 200]) as receiver:
        worker = Notifier(limiter, receiver.url, clock=clock, sleep=sleep, draw=lambda: 1.0)
        worker.run(stop)
    assert sorted(receiver.delivered_ids()) == sorted(ids)
    assert len(polls) <= 3


def test_a_claim_runs_out_after_its_lease(limiter: quota.Limiter, clock: Clock) -> None:
    """A worker that died holding claims: after the lease, another worker takes them."""
    fire(limiter, 1, (1.0,))
    from quota._limiter import thresholds as _thresholds

    claimed = limiter.run(_thresholds.claim("dead-worker", clock(), 30, 10))
    assert len(claimed) == 1
    with _webhook_receiver.running() as receiver:
        worker = Notifier(limiter, receiver.url, clock=clock, lease=30)
        assert worker.drain().claimed == 0
        clock.advance(30)
        assert worker.drain().delivered == 1


def test_several_workers_share_the_outbox(limiter: quota.Limiter, sql_url: str) -> None:
    ids = fire(limiter, 30)
    with _webhook_receiver.running(SECRET) as receiver:
        workers = [
            Notifier(quota.connect(sql_url, pool_size=1), receiver.url, secret=SECRET, batch=4)
            for _ in range(3)
        ]
        errors: list[BaseException] = []

        def drain(worker: Notifier) -> None:
            try:
                worker.drain()
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)

        threads = [threading.Thread(target=drain, args=(w,)) for w in workers]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        for worker in workers:
            worker.limiter.close()
    assert not errors and not any(t.is_alive() for t in threads)
    assert sorted(set(receiver.ids())) == sorted(ids)  # every event, at least once
    assert sorted(receiver.ids()) == sorted(ids)  # and here, with live leases, once
    assert undelivered(sql_url) == 0


def test_cleanup_deletes_only_delivered_events_past_retention(
    limiter: quota.Limiter, sql_url: str, clock: Clock
) -> None:
    fire(limiter, 2)
    with _webhook_receiver.running() as receiver:
        Notifier(limiter, receiver.url, clock=clock, batch=2).deliver_round()  # two of four
    clock.advance(notify_retention := 30 * 86400)
    assert limiter.cleanup_events(dry_run=True).expired == 0  # exactly 30 days: kept
    clock.advance(1)
    assert limiter.cleanup_events(dry_run=True).expired == 2
    assert limiter.cleanup_events(batch_size=1).deleted == 2
    assert undelivered(sql_url) == 2
    assert db_rows(sql_url, "SELECT count(*) FROM quota_events") == [(2,)]
    assert limiter.cleanup_events(older_than=notify_retention).deleted == 0


def test_the_module_says_what_it_exports() -> None:
    assert set(notify.__all__) <= set(dir(notify))
