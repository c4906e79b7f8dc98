"""Runtime policies: where they work, what ``quota policy`` accepts, and when a change applies.

* Off on stores that cannot hold the ``quota_policies`` table (memory, Redis):
  no reads, no failures counted or logged; one info line at startup.
* ``quota policy set`` keys ``--ip`` exactly as the middleware does, holds
  ``$QUOTA_HASH_SECRET`` to the middleware's rule and refuses empty overrides.
* Every worker switches to a change at the same wall-clock boundary: two
  guards on one SQLite file, driven by one injected clock, decide alike at
  every instant. Nothing sleeps.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest
from click.testing import CliRunner

import quota
from quota._cli import main
from quota.admin import Admin, PolicyRow
from quota.http import HttpConfig, RoutePolicy
from quota.http._core import Guard, drive_sync, sync_effects
from quota.http._identity import Identity, RequestInfo
from quota.http._runtime import MARGIN, RuntimePolicies
from quota.http.wsgi import QuotaWSGIMiddleware
from tests._support import Clock

SECRET = "runtime-hash-secret-0123456789"
PERIOD = 5.0
#: A multiple of PERIOD: boundaries fall at BASE + 0, 5, 10, …
BASE = 1_750_000_000.0
BASE_LIMIT = 1000


def _config(**changes: Any) -> HttpConfig:
    settings: dict[str, Any] = {
        "policies": [RoutePolicy(name="api", paths=["/api"], rates=f"{BASE_LIMIT}/minute")],
        "hash_secret": SECRET,
        "runtime_policies": True,
        "policy_cache_seconds": PERIOD,
    }
    settings.update(changes)
    return HttpConfig(**settings)


class Worker:
    """One app process: a guard and a limiter of its own on the shared database."""

    def __init__(self, url: str, clock: Clock, config: HttpConfig | None = None) -> None:
        self.limiter = quota.connect(url, clock=clock)
        self.guard = Guard(config or _config(), dialect="sqlite", clock=clock)
        self.effects = sync_effects(self.limiter)

    def limit(self, peer: str = "203.0.113.9") -> str:
        """The X-RateLimit-Limit a request from `peer` gets now ('exempt' when let through)."""
        verdict = drive_sync(
            self.guard.flow(RequestInfo("GET", "/api/x", "/api/x", {}, peer)), *self.effects
        )
        headers = verdict.response.headers if verdict.response is not None else verdict.headers
        return dict(headers).get("X-RateLimit-Limit", "exempt")

    def close(self) -> None:
        self.limiter.close()


@pytest.fixture
def clock() -> Clock:
    return Clock(BASE + 0.25)


@pytest.fixture
def workers(sqlite_url: str, clock: Clock) -> Iterator[tuple[Worker, Worker]]:
    pair = (Worker(sqlite_url, clock), Worker(sqlite_url, clock))
    yield pair
    for worker in pair:
        worker.close()


def _cli(url: str, *args: str, **env: str) -> tuple[int, str]:
    environ = {"QUOTA_HASH_SECRET": SECRET, "RATE_LIMIT_SECRET": ""}
    environ.update(env)
    result = CliRunner().invoke(main, ["--url", url, "policy", *args], env=environ)
    return result.exit_code, result.output


# -- stores without the table ----------------------------------------------------------------


def _wsgi_get(app: QuotaWSGIMiddleware, path: str = "/api/x") -> str:
    status: list[str] = []

    def start_response(line: str, _headers: Any, _exc: Any = None) -> None:
        status.append(line)

    environ = {"REQUEST_METHOD": "GET", "PATH_INFO": path, "REMOTE_ADDR": "203.0.113.9"}
    b"".join(app(environ, start_response))
    return status[0]


def _ok_app(_environ: Any, start_response: Any) -> list[bytes]:
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"ok"]


def test_the_memory_store_reads_no_policies_and_logs_one_info_line(
    clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    limiter = quota.connect("memory://runtime-policies", clock=clock)
    with caplog.at_level(logging.DEBUG, logger="quota.http"):
        app = QuotaWSGIMiddleware(_ok_app, limiter=limiter, config=_config())
        replies = []
        for _ in range(4):  # across several cache periods
            replies.append(_wsgi_get(app))
            clock.advance(PERIOD)
    limiter.close()

    assert replies == ["200 OK"] * 4
    assert app.guard.runtime is None
    assert app.metrics.get("policy_refresh_failed") == 0
    assert [r.levelname for r in caplog.records] == ["INFO"]
    assert "runtime policies are off" in caplog.text and "memory" in caplog.text


@pytest.mark.parametrize("dialect", ["memory", "redis"])
def test_stores_without_the_table_get_no_runtime_policies(dialect: str) -> None:
    assert Guard(_config(), dialect=dialect).runtime is None
    assert Guard(_config(), dialect="sqlite").runtime is not None
    assert Guard(_config(runtime_policies=False), dialect="sqlite").runtime is None


def test_turned_off_on_such_a_store_there_is_nothing_to_say(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.DEBUG, logger="quota.http"):
        Guard(_config(runtime_policies=False), dialect="memory")
    assert caplog.records == []


# -- quota policy set: --ip ------------------------------------------------------------------


def test_an_ip_that_is_no_address_is_a_usage_error_naming_it(sqlite_url: str) -> None:
    code, out = _cli(sqlite_url, "set", "api", "--ip", "not-an-ip", "--rates", "5/minute")
    assert code == 2
    assert "--ip" in out and "not-an-ip" in out
    assert _cli(sqlite_url, "list", "--json")[1].strip() == "[]"


@pytest.mark.parametrize(
    ("given", "peer"),
    [
        ("::ffff:198.51.100.7", "198.51.100.7"),  # IPv4-mapped, as a dual-stack socket shows it
        ("198.51.100.7 ", "198.51.100.7"),
        (" 198.51.100.7", "::ffff:198.51.100.7"),
        ("2001:db8:1:2::5", "2001:db8:1:2:ffff::9"),  # the same /64
        ("2001:DB8:1:2:0:0:0:5", "2001:db8:1:2::5"),
        ("[2001:db8:1:2::5]", "2001:db8:1:2::5"),
    ],
)
def test_an_ip_override_reaches_the_caller_the_middleware_sees(
    sqlite_url: str, clock: Clock, given: str, peer: str
) -> None:
    assert _cli(sqlite_url, "set", "api", "--ip", given, "--rates", "1234/minute")[0] == 0
    worker = Worker(sqlite_url, clock)
    try:
        assert worker.limit(peer) == "1234"
        assert worker.limit("198.51.100.8") == str(BASE_LIMIT)
    finally:
        worker.close()


def test_the_ipv6_prefix_matches_the_apps(sqlite_url: str, clock: Clock) -> None:
    assert _cli(sqlite_url, "set", "api", "--ip", "2001:db8::5", "--rates", "11/minute")[0] == 0
    code, _ = _cli(
        sqlite_url, "set", "api", "--ip", "2001:db8::5", "--ipv6-prefix", "128",
        "--rates", "22/minute",
    )  # fmt: skip
    assert code == 0
    per_64 = Worker(sqlite_url, clock)
    per_address = Worker(sqlite_url, clock, _config(ipv6_prefix=128))
    try:
        assert per_64.limit("2001:db8::77") == "11"
        assert per_address.limit("2001:db8::5") == "22"
        assert per_address.limit("2001:db8::77") == str(BASE_LIMIT)
    finally:
        per_64.close()
        per_address.close()


@pytest.mark.parametrize("prefix", ["0", "129", "x"])
def test_a_bad_ipv6_prefix_is_a_usage_error(sqlite_url: str, prefix: str) -> None:
    code, out = _cli(
        sqlite_url, "set", "api", "--ip", "2001:db8::5", "--ipv6-prefix", prefix, "--exempt"
    )
    assert code == 2
    assert "--ipv6-prefix" in out


def test_the_ipv6_prefix_goes_only_with_an_ip(sqlite_url: str) -> None:
    code, out = _cli(sqlite_url, "set", "api", "--ipv6-prefix", "48", "--exempt")
    assert code == 2
    assert "--ipv6-prefix" in out and "--ip" in out


# -- quota policy set: the hash secret -------------------------------------------------------


@pytest.mark.parametrize("name", ["QUOTA_HASH_SECRET", "RATE_LIMIT_SECRET"])
def test_a_short_hash_secret_is_refused_as_the_middleware_refuses_it(
    sqlite_url: str, name: str
) -> None:
    with pytest.raises(quota.ConfigurationError) as refused:
        HttpConfig.from_env({name: "short"})
    env = {"QUOTA_HASH_SECRET": "", name: "short"}
    for subject in (["--ip", "198.51.100.7"], ["--token", "t0k3n"]):
        code, out = _cli(sqlite_url, "set", "api", *subject, "--rates", "5/minute", **env)
        assert code == 2
        assert str(refused.value) in out
    assert _cli(sqlite_url, "list", "--json")[1].strip() == "[]"


def test_a_hash_secret_of_16_bytes_is_enough(sqlite_url: str) -> None:
    HttpConfig.from_env({"QUOTA_HASH_SECRET": "x" * 16})
    code, _ = _cli(sqlite_url, "set", "api", "--token", "t", "--exempt", QUOTA_HASH_SECRET="x" * 16)
    assert code == 0


# -- quota policy set: an override must override something -----------------------------------


@pytest.mark.parametrize(
    "extra", [[], ["--note", "why"], ["--tier", "auth"], ["--algorithm", "gcra"]]
)
def test_an_override_that_changes_nothing_is_refused(sqlite_url: str, extra: list[str]) -> None:
    code, out = _cli(sqlite_url, "set", "api", *extra)
    assert code == 2
    for option in ("--rates", "--cost", "--fail-open", "--exempt"):
        assert option in out
    assert _cli(sqlite_url, "list", "--json")[1].strip() == "[]"


def test_set_policy_refuses_a_row_that_changes_nothing(sql_url: str) -> None:
    with quota.connect(sql_url) as limiter:
        with pytest.raises(quota.ConfigurationError, match="at least one of"):
            Admin(limiter).set_policy(PolicyRow(route="api", note="nothing"))
        with pytest.raises(quota.ConfigurationError, match="algorithm"):
            Admin(limiter).set_policy(PolicyRow(route="api", algorithm="gcra"))
        assert Admin(limiter).policies() == []


@pytest.mark.parametrize("args", [["--cost", "2"], ["--fail-closed"], ["--exempt"]])
def test_any_one_field_is_an_override(sqlite_url: str, args: list[str]) -> None:
    assert _cli(sqlite_url, "set", "api", *args)[0] == 0


def test_a_store_without_the_table_is_named_by_the_cli() -> None:
    code, out = _cli("memory://cli", "list")
    assert code == 2
    assert "memory" in out and "quota_policies" in out


# -- deletions -----------------------------------------------------------------------------------


def test_a_deletion_is_a_stamped_row_that_list_hides(sql_url: str, clock: Clock) -> None:
    with quota.connect(sql_url, clock=clock) as limiter:
        Admin(limiter).set_policy(PolicyRow(route="api", rates="5/minute"))
        clock.advance(1)
        assert Admin(limiter).delete_policy("api")
        assert Admin(limiter).policies() == []
        assert not Admin(limiter).delete_policy("api"), "already deleted"
        (stamp,) = limiter.store.execute(
            "SELECT updated_at FROM quota_policies WHERE route = ? AND subject = ?", ("api", "*")
        )
        assert stamp[0] == clock.now
        Admin(limiter).set_policy(PolicyRow(route="api", rates="6/minute"))
        assert [r.rates for r in Admin(limiter).policies()] == ["6/minute"]
    assert _cli(sql_url, "delete", "api")[0] == 0
    assert _cli(sql_url, "delete", "api")[0] == 4
    assert _cli(sql_url, "list")[1].strip() == "no overrides"


def test_old_deletion_rows_are_purged_when_the_table_is_next_edited(
    sql_url: str, clock: Clock
) -> None:
    with quota.connect(sql_url, clock=clock) as limiter:
        Admin(limiter).set_policy(PolicyRow(route="api", rates="5/minute"))
        Admin(limiter).set_policy(PolicyRow(route="web", rates="5/minute"))
        Admin(limiter).delete_policy("api")
        clock.advance(3 * 3600)
        Admin(limiter).delete_policy("web")
        rows = limiter.store.execute("SELECT route FROM quota_policies", ())
        assert [r[0] for r in rows] == ["web"], "the fresh deletion row stays a while"


# -- when a change applies -----------------------------------------------------------------------


def test_the_cache_is_read_at_wall_clock_boundaries() -> None:
    cache = RuntimePolicies(5)
    assert cache.claim(103.0)
    assert not cache.claim(104.9)
    assert cache.claim(105.0)
    assert not cache.claim(109.99)
    assert cache.claim(117.0)
    assert not cache.claim(119.0)


def test_a_slow_read_overtaken_by_a_later_one_is_dropped() -> None:
    def rows(rates: str) -> list[tuple[Any, ...]]:
        return [("api", "*", rates, None, None, None, False, None, 50.0)]

    cache = RuntimePolicies(5)
    assert cache.claim(100.0)
    assert cache.claim(105.0)
    cache.load(rows("2/minute"), 105.0)
    cache.load(rows("1/minute"), 100.0)  # the read claimed at 100 answers last
    found = cache.lookup("api", Identity("anon", "ip:1"))
    assert found is not None and found.row.rates == "2/minute"


def test_two_workers_switch_at_the_same_instant(
    sqlite_url: str, clock: Clock, workers: tuple[Worker, Worker]
) -> None:
    """Each worker reads on its own traffic; at every instant both decide with the same limits."""
    one, two = workers
    writes = {  # tenths of a second from BASE -> rates, or None to delete
        30: "2000/minute",  # applies at 5
        95: "3000/minute",  # within the margin of 10: pending, applies at 15
        120: "4000/minute",
        130: "5000/minute",  # replaces 4000 before it applied: 5000 at 15
        170: None,  # deleted: the class's own rates again at 20
        210: "6000/minute",  # replaced by 7000 before any worker read it: never applies
        245: "7000/minute",  # within the margin of 25: applies at 30
        295: "8000/minute",  # within the margin of 30: pending
        345: "9000/minute",  # within the margin of 35 again: 8000 at 35, 9000 at 40
    }
    expected = [
        (0, str(BASE_LIMIT)), (50, "2000"), (150, "5000"), (200, str(BASE_LIMIT)),
        (300, "7000"), (350, "8000"), (400, "9000"),
    ]  # fmt: skip
    admin = quota.connect(sqlite_url, clock=clock)
    one.limit()  # worker one starts at 0.25
    clock.now = BASE + 2.6
    two.limit()  # worker two at 2.6: on a per-worker timer they would switch 2.35 s apart
    disagreements, unexpected = [], []
    for tenth in range(26, 430):
        clock.now = BASE + tenth / 10
        if tenth in writes:
            rates = writes[tenth]
            if rates is None:
                assert Admin(admin).delete_policy("api")
            else:
                Admin(admin).set_policy(PolicyRow(route="api", rates=rates))
        want = [limit for start, limit in expected if tenth >= start][-1]
        seen = [one.limit()]
        if tenth % 7 == 0:  # worker two has less traffic: it reads later in each period
            seen.append(two.limit())
        if len(set(seen)) > 1:
            disagreements.append((tenth / 10, seen))
        if set(seen) != {want}:
            unexpected.append((tenth / 10, seen, want))
    admin.close()

    assert disagreements == []
    assert unexpected == []


def test_a_worker_that_reads_late_still_applies_a_change_it_saw_pending(
    sqlite_url: str, clock: Clock, workers: tuple[Worker, Worker]
) -> None:
    one, two = workers
    admin = quota.connect(sqlite_url, clock=clock)
    one.limit()
    two.limit()
    clock.now = BASE + 4.5  # within the margin of 5: pending at 5
    Admin(admin).set_policy(PolicyRow(route="api", rates="2000/minute"))
    clock.now = BASE + 5.1
    assert one.limit() == two.limit() == str(BASE_LIMIT)
    clock.now = BASE + 10.05  # one reads at 10: 2000 applies
    assert one.limit() == "2000"
    clock.now = BASE + 11.0
    Admin(admin).set_policy(PolicyRow(route="api", rates="3000/minute"))  # pending until 15
    clock.now = BASE + 14.0  # two reads late in the period, seeing only 3000 (stamped 11)
    assert two.limit() == one.limit() == "2000"
    clock.now = BASE + 15.0
    assert one.limit() == two.limit() == "3000"
    admin.close()


def test_a_starting_worker_uses_the_newest_rows_at_once(sqlite_url: str, clock: Clock) -> None:
    with quota.connect(sqlite_url, clock=clock) as admin:
        Admin(admin).set_policy(PolicyRow(route="api", rates="2000/minute"))
    worker = Worker(sqlite_url, clock)
    try:
        assert worker.limit() == "2000"
    finally:
        worker.close()


def test_a_row_from_the_future_waits_for_its_time_and_is_reported_once(
    sqlite_url: str, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    worker = Worker(sqlite_url, clock)
    ahead = Clock(clock.now + 3600)  # the host running `quota policy` is an hour ahead
    try:
        worker.limit()
        with quota.connect(sqlite_url, clock=ahead) as admin:
            Admin(admin).set_policy(PolicyRow(route="api", rates="2000/minute"))
        with caplog.at_level(logging.WARNING, logger="quota.http"):
            for _ in range(3):
                clock.advance(PERIOD)
                assert worker.limit() == str(BASE_LIMIT)
        assert sum("ahead" in r.message for r in caplog.records) == 1
        clock.now = ahead.now + MARGIN + PERIOD
        assert worker.limit() == "2000"
    finally:
        worker.close()


def test_without_a_cache_every_request_reads_and_applies_at_once(
    sqlite_url: str, clock: Clock
) -> None:
    worker = Worker(sqlite_url, clock, _config(policy_cache_seconds=0))
    try:
        assert worker.limit() == str(BASE_LIMIT)
        with quota.connect(sqlite_url, clock=clock) as admin:
            Admin(admin).set_policy(PolicyRow(route="api", rates="2000/minute"))
            assert worker.limit() == "2000"
            Admin(admin).delete_policy("api")
            assert worker.limit() == str(BASE_LIMIT)
    finally:
        worker.close()


def test_a_cli_change_shows_in_json_with_its_stamp(sqlite_url: str) -> None:
    code, out = _cli(sqlite_url, "set", "api", "--rates", "5/minute", "--json")
    assert code == 0
    assert json.loads(out)["updated_at"] > 0


@pytest.mark.parametrize(
    ("row_algorithm", "expected"),
    [(None, ["sliding_window", "gcra"]), ("fixed_window", ["fixed_window", "fixed_window"])],
)
def test_an_override_without_an_algorithm_keeps_each_class_algorithm(
    row_algorithm: str | None, expected: list[str]
) -> None:
    # main: the rates were read with the default algorithm, whatever the class's.
    classes = [
        RoutePolicy(name="a", paths=["/a"], rates="3/minute", algorithm="sliding_window"),
        RoutePolicy(name="b", paths=["/b"], rates="3/minute", algorithm="gcra"),
    ]
    config = HttpConfig(
        policies=classes, hash_secret="override-algorithm-0123", policy_cache_seconds=5
    )
    guard = Guard(config, dialect="sqlite")
    assert guard.runtime is not None
    now = 1_000.0
    row = ("*", "*", "10/minute", row_algorithm, None, None, False, None, now - 60)
    guard.runtime.load([row], now)

    seen = []
    for policy in classes:
        request = RequestInfo("GET", f"/{policy.name}", f"/{policy.name}", {}, "203.0.113.9")
        plan = guard.plan(policy, request, now)
        assert plan is not None
        assert [rate.limit for rate in plan.hit.rates] == [10]
        seen.append(plan.hit.rates[0].algorithm)

    assert seen == expected
