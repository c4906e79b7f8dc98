"""Runtime settings: tier multipliers and the abuse threshold from ``quota_settings``.

* ``quota policy multiplier/abuse-threshold/settings/unset`` write and list the
  table, checking values as `HttpConfig` checks them, with its messages.
* The middleware reads the settings with the policies and applies a change
  at the same wall-clock boundary on every worker: two middlewares on one
  database, driven by one injected clock, switch at the same instant. A
  deleted setting gives the configured value back.
* A malformed row counts as no row and is logged once; a database not
  migrated to 0005_settings keeps its runtime policies (the settings read
  fails alone, logged once per failing streak).
* ``quota migrate`` then ``quota doctor`` is clean; the downgrade guard
  protects the table's rows.

Every behaviour runs on Starlette (ASGI, async limiter) and Flask (WSGI,
sync limiter), on SQLite and PostgreSQL. Time comes from the injected clock;
nothing sleeps. A change written through the CLI is stamped with the real
clock, so those tests set the injected clock from the row's stamp.
"""

from __future__ import annotations

import json
import logging
import math
import sqlite3
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

import quota
from quota._cli import main
from quota._sql.policies import Snapshot
from quota._sql.schema import REVISIONS
from quota.admin import Admin, PolicyRow, SettingRow
from quota.http import HttpConfig, RoutePolicy
from quota.http._core import Guard
from quota.http._identity import Identity
from quota.http._runtime import MARGIN, RuntimePolicies
from tests._http_support import HttpClient, make_client
from tests._support import Clock

SECRET = "settings-hash-secret-0123456789"
PERIOD = 5.0
#: A multiple of PERIOD: boundaries fall at BASE + 0, 5, 10, …
BASE = 1_750_000_000.0
LIMIT = 10
AUTH_MULTIPLIER = 5
AUTH = {"authorization": "Bearer tok-settings"}


def _config(rates: str = f"{LIMIT}/minute", **changes: Any) -> HttpConfig:
    settings: dict[str, Any] = {
        "policies": [RoutePolicy(name="api", paths=["/api"], rates=rates)],
        "hash_secret": SECRET,
        "tier_multipliers": {"anon": 1, "auth": AUTH_MULTIPLIER},
        "unvalidated_token_ceiling": None,
        "runtime_policies": True,
        "policy_cache_seconds": PERIOD,
    }
    settings.update(changes)
    return HttpConfig(**settings)


def _truncate(url: str) -> None:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("TRUNCATE quota_counters, quota_state, quota_policies, quota_settings")


@pytest.fixture
def db_url(sql_url: str, sql_dialect: str) -> Iterator[str]:
    """`sql_url`: a migrated database without overrides or settings."""
    yield sql_url
    if sql_dialect == "postgresql":
        _truncate(sql_url)  # the session's database: leave no setting to other tests


Make = Callable[..., HttpClient]


@pytest.fixture
def make(http_client: Callable[..., HttpClient]) -> Callable[..., HttpClient]:
    def build(url: str, config: HttpConfig | None = None, **options: Any) -> HttpClient:
        return http_client(url, config or _config(), **options)

    return build


def _cli(url: str, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["--url", url, "policy", *args])
    return result.exit_code, result.output


def _limit(client: HttpClient, **headers: str) -> str | None:
    return client.get("/api/items", **headers).header("X-RateLimit-Limit")


def _limits(clients: list[HttpClient], **headers: str) -> set[str | None]:
    return {_limit(client, **headers) for client in clients}


def _stamp(url: str, name: str) -> float:
    with quota.connect(url) as limiter:
        ((stamp,),) = limiter.store.execute(
            "SELECT updated_at FROM quota_settings WHERE name = ?", (name,)
        )
    return float(stamp)


def _applies_at(stamp: float) -> float:
    """The boundary a row stamped at `stamp` applies at, on every worker."""
    return math.ceil((stamp + MARGIN) / PERIOD) * PERIOD


def _guard(client: HttpClient) -> Guard:
    guard: Guard = client.middleware.guard
    return guard


# -- a change applies at the same boundary everywhere; unset gives the configured value back --


def test_a_cli_multiplier_switches_two_workers_at_the_same_boundary(
    make: Make, db_url: str, clock: Clock
) -> None:
    clock.now = time.time() - 30
    workers = [make(db_url), make(db_url)]
    assert _limits(workers, **AUTH) == {str(LIMIT * AUTH_MULTIPLIER)}

    code, out = _cli(db_url, "multiplier", "auth", "2", "--note", "launch day", "--json")
    assert code == 0, out
    stored = json.loads(out)
    assert (stored["name"], stored["value"], stored["note"]) == (
        "tier_multiplier.auth", "2", "launch day",
    )  # fmt: skip
    boundary = _applies_at(stored["updated_at"])

    clock.now = boundary - 0.01  # each worker reads in this period: the row waits
    assert _limits(workers, **AUTH) == {str(LIMIT * AUTH_MULTIPLIER)}
    clock.now = boundary
    assert [_limit(w, **AUTH) for w in workers] == [str(LIMIT * 2)] * 2
    assert _limits(workers) == {str(LIMIT)}, "anon keeps its own multiplier"
    assert _guard(workers[0]).config.tier_multipliers["auth"] == 2.0

    code, out = _cli(db_url, "unset", "tier_multiplier.auth")
    assert code == 0, out
    # Written (real clock) before the boundary both read at, so it applies at the next.
    clock.now = boundary + PERIOD - 0.01
    assert _limits(workers, **AUTH) == {str(LIMIT * 2)}
    clock.now = boundary + PERIOD
    assert [_limit(w, **AUTH) for w in workers] == [str(LIMIT * AUTH_MULTIPLIER)] * 2
    assert _cli(db_url, "unset", "tier_multiplier.auth")[0] == 4


def test_a_setting_written_within_the_margin_waits_for_the_next_boundary(
    make: Make, db_url: str, clock: Clock
) -> None:
    clock.now = BASE + 0.25
    workers = [make(db_url), make(db_url)]
    _limits(workers, **AUTH)
    with quota.connect(db_url, clock=clock) as admin:
        clock.now = BASE + PERIOD - MARGIN / 2  # too close to BASE + 5
        Admin(admin).set_setting("tier_multiplier.auth", 3)
        clock.now = BASE + PERIOD
        assert _limits(workers, **AUTH) == {str(LIMIT * AUTH_MULTIPLIER)}
        clock.now = BASE + 2 * PERIOD - 0.01
        assert _limits(workers, **AUTH) == {str(LIMIT * AUTH_MULTIPLIER)}
        clock.now = BASE + 2 * PERIOD
        assert [_limit(w, **AUTH) for w in workers] == [str(LIMIT * 3)] * 2

        clock.now = BASE + 2 * PERIOD + 1
        assert Admin(admin).delete_setting("tier_multiplier.auth")
        assert not Admin(admin).delete_setting("tier_multiplier.auth"), "already deleted"
        assert Admin(admin).settings() == []
        clock.now = BASE + 3 * PERIOD - 0.01
        assert _limits(workers, **AUTH) == {str(LIMIT * 3)}
        clock.now = BASE + 3 * PERIOD
        assert [_limit(w, **AUTH) for w in workers] == [str(LIMIT * AUTH_MULTIPLIER)] * 2


def test_a_starting_worker_uses_the_newest_settings_at_once(
    make: Make, db_url: str, clock: Clock
) -> None:
    clock.now = BASE + 0.25
    with quota.connect(db_url, clock=clock) as admin:
        Admin(admin).set_setting("tier_multiplier.auth", 0.5)
    assert _limit(make(db_url), **AUTH) == str(LIMIT // 2)


# -- the abuse threshold -----------------------------------------------------------------------


def test_the_abuse_threshold_from_the_cli_and_zero_turning_alerts_off(
    make: Make, db_url: str, clock: Clock
) -> None:
    alerts: list[tuple[str, int]] = []
    config = _config(rates="2/minute", abuse_threshold=100, tier_multipliers={"auth": 1})
    clock.now = time.time() - 30
    client = make(db_url, config, on_abuse=lambda key, count: alerts.append((key, count)))
    client.get("/api/items")  # the first read: no setting yet
    guard = _guard(client)
    assert guard.abuse is not None and guard.abuse.threshold == 100

    def deny(token: str, times: int) -> list[int]:
        """Requests of one caller: its 2 allowed, then `times` denials; alerts after each."""
        statuses = [client.get("/api/items", authorization=f"Bearer {token}").status
                    for _ in range(2)]  # fmt: skip
        assert statuses == [200, 200]
        seen = []
        for _ in range(times):
            assert client.get("/api/items", authorization=f"Bearer {token}").status == 429
            seen.append(len(alerts))
        return seen

    assert _cli(db_url, "abuse-threshold", "3")[0] == 0
    clock.now = math.ceil(time.time() / 60) * 60 + 60  # a fresh window, well past the stamp
    assert deny("a", 6) == [0, 0, 0, 1, 1, 1], "the 4th denial alerts, once"
    assert guard.abuse.threshold == 3
    assert client.metrics.get("abuse_alerts") == 1

    assert _cli(db_url, "abuse-threshold", "0")[0] == 0
    clock.now += 60
    assert deny("b", 20) == [1] * 20, "0: no alerts"

    assert _cli(db_url, "unset", "abuse_threshold")[0] == 0
    clock.now += 60
    assert deny("c", 4) == [1] * 4
    assert guard.abuse.threshold == 100, "the configured threshold again"


def test_an_abuse_threshold_turns_alerts_on_for_an_app_started_without(
    make: Make, db_url: str, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    clock.now = BASE + 0.25
    with quota.connect(db_url, clock=clock) as admin:
        Admin(admin).set_setting("abuse_threshold", 1)
    client = make(db_url, _config(rates="1/minute", abuse_threshold=0))
    with caplog.at_level(logging.WARNING, logger="quota"):
        statuses = [client.get("/api/items").status for _ in range(4)]
    assert statuses == [200, 429, 429, 429]
    assert client.metrics.get("abuse_alerts") == 1
    assert sum("abuse alert" in r.message for r in caplog.records) == 1


# -- malformed rows --------------------------------------------------------------------------


def _insert(url: str, rows: list[tuple[str, str | None, float]]) -> None:
    with quota.connect(url) as limiter:
        for name, value, stamp in rows:
            limiter.store.execute(
                "INSERT INTO quota_settings (name, value, note, updated_at) VALUES (?, ?, NULL, ?)"
                " RETURNING 1",
                (name, value, stamp),
            )


def test_malformed_rows_are_skipped_and_logged_once(
    make: Make, db_url: str, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    _insert(db_url, [
        ("tier_multiplier.auth", "lots", 1.0),
        ("tier_multiplier.anon", "0", 1.0),
        ("tier_multiplier.", "2", 1.0),
        ("abuse_threshold", "-1", 1.0),
        ("colour", "blue", 1.0),
        ("tier_multiplier.partner", "4", 1.0),  # the one good row
    ])  # fmt: skip
    clock.now = BASE + 0.25
    client = make(db_url)
    with caplog.at_level(logging.WARNING, logger="quota.http"):
        for _ in range(3):  # three reads
            assert client.get("/api/items").status == 200
            assert _limit(client, **AUTH) == str(LIMIT * AUTH_MULTIPLIER)
            clock.advance(PERIOD)

    ignored = [r.message for r in caplog.records if "ignoring the row" in r.message]
    assert len(ignored) == 5
    assert any("tier_multipliers['auth'] must be a number between 0.001 and 1000" in m
               for m in ignored)  # fmt: skip
    assert any("unknown setting 'colour'" in m for m in ignored)
    assert client.metrics.get("setting_invalid") == 5
    guard = _guard(client)
    assert guard.config.tier_multipliers["partner"] == 4.0
    assert guard.config.tier_multipliers["anon"] == 1.0
    assert guard.abuse is not None and guard.abuse.threshold == HttpConfig().abuse_threshold

    code, out = _cli(db_url, "settings")
    assert code == 0
    assert "IGNORED" in out and "colour" in out
    assert _cli(db_url, "unset", "colour")[0] == 0


def test_a_value_turned_malformed_gives_the_configured_value_back() -> None:
    guard = Guard(_config(), dialect="sqlite", clock=lambda: BASE)
    runtime = guard.runtime
    assert runtime is not None
    runtime.refresh(Snapshot([], [("tier_multiplier.auth", "2", None, BASE - 60)]), BASE, guard)
    assert guard.config.tier_multipliers["auth"] == 2.0
    bad = [("tier_multiplier.auth", "2x", None, BASE + PERIOD - MARGIN / 2)]
    runtime.refresh(Snapshot([], bad), BASE + PERIOD, guard)
    assert guard.config.tier_multipliers["auth"] == 2.0, "written within the margin: waits"
    runtime.refresh(Snapshot([], bad), BASE + 2 * PERIOD, guard)
    assert guard.config.tier_multipliers["auth"] == AUTH_MULTIPLIER


def test_applying_changes_only_what_changed() -> None:
    guard = Guard(_config(), dialect="sqlite", clock=lambda: BASE)
    runtime = guard.runtime
    assert runtime is not None
    calls: list[tuple[str, float]] = []
    set_tier_multiplier = guard.set_tier_multiplier

    def spy(tier: str, value: float) -> None:
        calls.append((tier, value))
        set_tier_multiplier(tier, value)

    guard.set_tier_multiplier = spy  # type: ignore[method-assign]
    rows = [("tier_multiplier.auth", "2", None, 1.0), ("tier_multiplier.anon", "1", None, 1.0)]
    for period in range(4):
        runtime.refresh(Snapshot([], rows), BASE + period * PERIOD, guard)
    assert calls == [("auth", 2.0)], "anon's 1 is its configured value already"
    guard.set_tier_multiplier("auth", 7)  # the app's own change, after the setting's
    runtime.refresh(Snapshot([], []), BASE + 9 * PERIOD, guard)
    assert guard.config.tier_multipliers["auth"] == 7.0, "not undone by the deletion"


# -- a database without the table ------------------------------------------------------------


@pytest.mark.parametrize("fallback", [False, True], ids=["plain", "fallback"])
def test_a_database_not_migrated_to_settings_keeps_its_policies(
    framework: str, sql_empty_url: str, clock: Clock, fallback: bool,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    quota.migrate(sql_empty_url, revision="0004_policies")
    clock.now = BASE + 0.25
    with quota.connect(sql_empty_url, clock=clock) as admin:
        Admin(admin).set_policy(PolicyRow(route="api", rates="7/minute"))
        with pytest.raises(quota.SchemaError, match="quota_settings comes with revision"):
            Admin(admin).set_setting("tier_multiplier.auth", 2)
    assert _cli(sql_empty_url, "settings")[0] == 3

    connect = quota.connect_async if framework == "starlette" else quota.connect
    limiter = connect(sql_empty_url, clock=clock, fallback=fallback)
    client = make_client(framework, sql_empty_url, clock, _config(), limiter=limiter)
    try:
        with caplog.at_level(logging.INFO, logger="quota.http"):
            for _ in range(3):
                assert _limit(client) == "7"
                clock.advance(PERIOD)
            up = not fallback or limiter.store.up
            quota.migrate(sql_empty_url)  # while the app runs
            with quota.connect(sql_empty_url, clock=clock) as admin:
                Admin(admin).set_setting("tier_multiplier.anon", 2)
            clock.advance(PERIOD)
            assert _limit(client) == "14", "the override's base rates, scaled by the setting"
            assert _limit(client, **AUTH) == str(7 * AUTH_MULTIPLIER)
    finally:
        client.close()

    assert up, "a missing settings table must not mark the database down"
    assert client.metrics.get("policy_refresh_failed") == 0
    assert client.metrics.get("settings_refresh_failed") == 3
    messages = [r.message for r in caplog.records]
    assert sum("cannot read quota_settings" in m for m in messages) == 1
    assert sum("quota_settings readable again" in m for m in messages) == 1


def test_the_settings_do_not_depend_on_the_policies_table(
    framework: str, tmp_path: Path, clock: Clock
) -> None:
    url = f"sqlite:///{tmp_path / 'q.db'}"
    quota.migrate(url)
    clock.now = BASE + 0.25
    with quota.connect(url, clock=clock) as admin:
        Admin(admin).set_setting("tier_multiplier.auth", 3)
    with sqlite3.connect(tmp_path / "q.db") as conn:
        conn.execute("DROP TABLE quota_policies")
    client = make_client(framework, url, clock, _config())
    try:
        assert _limit(client, **AUTH) == str(LIMIT * 3)
    finally:
        client.close()
    assert client.metrics.get("policy_refresh_failed") == 1
    assert client.metrics.get("settings_refresh_failed") == 0


def test_a_failed_read_keeps_the_last_good_settings() -> None:
    guard = Guard(_config(), dialect="sqlite", clock=lambda: BASE)
    runtime = guard.runtime
    assert runtime is not None
    runtime.refresh(Snapshot([], [("tier_multiplier.auth", "2", None, 1.0)]), BASE, guard)
    runtime.refresh(quota.StorageError("down"), BASE + PERIOD, guard)
    runtime.refresh(Snapshot([], quota.StorageError("down")), BASE + 2 * PERIOD, guard)
    assert guard.config.tier_multipliers["auth"] == 2.0
    runtime.refresh([], BASE + 3 * PERIOD, guard)  # the policy rows alone: settings not read
    assert guard.config.tier_multipliers["auth"] == 2.0
    assert runtime.lookup("api", Identity("anon", "ip:1")) is None


# -- what the CLI and the API accept ---------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "config", "param"),
    [
        (["multiplier", "auth", "5000"], {"tier_multipliers": {"auth": 5000.0}}, "VALUE"),
        (["multiplier", "auth", "0.0001"], {"tier_multipliers": {"auth": 0.0001}}, "VALUE"),
        (["multiplier", "auth", "nan"], {"tier_multipliers": {"auth": "nan"}}, "VALUE"),
        (["abuse-threshold", "2.5"], {"abuse_threshold": "2.5"}, "N"),
        (["abuse-threshold", "lots"], {"abuse_threshold": "lots"}, "N"),
    ],
)
def test_a_bad_value_is_refused_with_the_configs_message(
    sqlite_url: str, args: list[str], config: dict[str, Any], param: str
) -> None:
    with pytest.raises(quota.ConfigurationError) as refused:
        HttpConfig(**config)
    code, out = _cli(sqlite_url, *args)
    assert code == 2
    assert str(refused.value) in " ".join(out.split())
    assert f"'{param}'" in out
    assert _cli(sqlite_url, "settings", "--json")[1].strip() == "[]"


def test_the_api_checks_names_and_values(db_url: str, clock: Clock) -> None:
    with quota.connect(db_url, clock=clock) as limiter:
        with pytest.raises(quota.ConfigurationError, match="unknown setting 'colour'"):
            Admin(limiter).set_setting("colour", 1)
        with pytest.raises(quota.ConfigurationError, match="tier must be a non-empty name"):
            Admin(limiter).set_setting("tier_multiplier.", 1)
        with pytest.raises(quota.ConfigurationError, match=r"abuse_threshold must be a whole"):
            Admin(limiter).set_setting("abuse_threshold", -1)
        with pytest.raises(quota.ConfigurationError, match=r"abuse_threshold must be a whole"):
            Admin(limiter).set_setting("abuse_threshold", True)
        assert Admin(limiter).settings() == []
        assert Admin(limiter).set_setting("tier_multiplier.auth", 1.25) == SettingRow(
            name="tier_multiplier.auth", value="1.25", updated_at=clock.now
        )
        Admin(limiter).set_setting("abuse_threshold", "0", note="quiet launch")
        assert [(r.name, r.value, r.note) for r in Admin(limiter).settings()] == [
            ("abuse_threshold", "0", "quiet launch"), ("tier_multiplier.auth", "1.25", None),
        ]  # fmt: skip


def test_old_deletions_are_purged_when_the_table_is_next_edited(db_url: str, clock: Clock) -> None:
    with quota.connect(db_url, clock=clock) as limiter:
        Admin(limiter).set_setting("tier_multiplier.auth", 2)
        Admin(limiter).set_setting("tier_multiplier.anon", 2)
        Admin(limiter).delete_setting("tier_multiplier.auth")
        clock.advance(3 * 3600)
        Admin(limiter).delete_setting("tier_multiplier.anon")
        rows = limiter.store.execute("SELECT name, value FROM quota_settings", ())
        assert [tuple(r) for r in rows] == [("tier_multiplier.anon", None)]


def test_a_store_without_tables_is_named_by_the_cli() -> None:
    code, out = _cli("memory://settings", "settings")
    assert code == 2
    assert "memory" in out and "quota_settings" in out


# -- migrations, doctor, downgrade -------------------------------------------------------------


def test_migrate_then_doctor_is_clean_on_a_fresh_database(sql_empty_url: str) -> None:
    runner = CliRunner()
    migrated = runner.invoke(main, ["--url", sql_empty_url, "migrate"])
    assert migrated.exit_code == 0, migrated.output
    assert quota.current_revision(sql_empty_url) == REVISIONS[-1]

    result = runner.invoke(main, ["--url", sql_empty_url, "doctor", "--json"])
    assert result.exit_code == 0, result.output
    findings = {f["check"]: f for f in json.loads(result.output)["findings"]}
    assert findings["schema"]["severity"] == "ok"
    assert findings["schema_drift"]["severity"] == "ok", findings["schema_drift"]
    assert [f for f in findings.values() if f["severity"] == "error"] == []


def test_doctor_on_a_database_before_settings_warns_and_names_the_table(sql_empty_url: str) -> None:
    quota.migrate(sql_empty_url, revision="0004_policies")
    findings = quota.diagnose(sql_empty_url)
    schema = next(f for f in findings if f.check == "schema")
    assert schema.severity == "ok"
    (drift,) = [f for f in findings if f.check == "schema_drift"]
    assert drift.severity == "warn"
    assert "quota_settings" in drift.message and "migrate" in drift.fix


def test_doctor_names_a_dropped_settings_table(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'q.db'}"
    quota.migrate(url)
    with sqlite3.connect(tmp_path / "q.db") as conn:
        conn.execute("DROP TABLE quota_settings")
    (drift,) = [f for f in quota.diagnose(url) if f.check == "schema_drift"]
    assert drift.severity == "error"
    assert "table quota_settings is missing" in drift.message
    assert "CREATE TABLE quota_settings" in drift.fix


def test_the_downgrade_guard_protects_settings_rows(sql_empty_url: str) -> None:
    quota.migrate(sql_empty_url)
    quota.downgrade(sql_empty_url, revision="0004_policies")  # empty: no flag needed
    quota.migrate(sql_empty_url)
    with quota.connect(sql_empty_url) as limiter:
        Admin(limiter).set_setting("abuse_threshold", 5)
    with pytest.raises(quota.ConfigurationError, match=r"quota_settings \(1 rows\)"):
        quota.downgrade(sql_empty_url, revision="0004_policies")
    assert quota.current_revision(sql_empty_url) == REVISIONS[-1]  # nothing changed
    result = CliRunner().invoke(main, ["--url", sql_empty_url, "downgrade", "0004_policies"])
    assert result.exit_code == 2
    assert "quota_settings (1 rows)" in result.output
    quota.downgrade(sql_empty_url, revision="0004_policies", drop_data=True)
    assert quota.current_revision(sql_empty_url) == "0004_policies"


def test_the_runtime_policies_cache_owns_the_settings() -> None:
    cache = RuntimePolicies(PERIOD)
    assert cache.settings.ttl == PERIOD
    assert cache.settings.values == {}
