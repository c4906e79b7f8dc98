"""``quota doctor`` and `quota.diagnose`: real databases for the checks, pure functions for the thresholds."""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

import quota
from quota._cli import main
from quota._sql.schema import REQUIRED, REVISIONS
from quota._tools.doctor import ERROR, OK, SEVERITIES, WARN
from quota._tools.doctor.base import Clock
from quota._tools.doctor.clock import skew_finding
from quota._tools.doctor.postgres import (
    fillfactor,
    fillfactor_finding,
    hot_finding,
    persistence_finding,
)
from quota._tools.doctor.sqlite import sqlite_version_finding

UNREACHABLE = "postgresql://root:sekrit@127.0.0.1:1/test"


def _by_check(findings: list[quota.Finding]) -> dict[str, list[quota.Finding]]:
    out: dict[str, list[quota.Finding]] = {}
    for finding in findings:
        out.setdefault(finding.check, []).append(finding)
    return out


def _one(findings: list[quota.Finding], check: str) -> quota.Finding:
    (finding,) = _by_check(findings)[check]
    return finding


def _doctor_cli(*args: str) -> Result:
    return CliRunner().invoke(main, list(args), env={"QUOTA_DATABASE_URL": None})


def _assert_fixes_are_given(findings: list[quota.Finding]) -> None:
    for finding in findings:
        assert finding.severity in SEVERITIES
        assert bool(finding.fix) == (finding.severity != OK), finding


@pytest.fixture
def used_sqlite_url(sqlite_url: str) -> str:
    """A migrated SQLite file a limiter has used (so the file is in WAL mode)."""
    with quota.connect(sqlite_url) as limiter:
        limiter.rate_limit("k", 10, 60)
    return sqlite_url


# -- SQLite -----------------------------------------------------------------------------


def test_a_healthy_sqlite_database_is_all_ok(used_sqlite_url: str) -> None:
    findings = quota.diagnose(used_sqlite_url)

    assert {f.check for f in findings} == {
        "sqlite_version",
        "connectivity",
        "schema",
        "schema_drift",
        "journal_mode",
        "clock_skew",
    }
    assert [f for f in findings if f.severity != OK] == []
    assert REQUIRED in _one(findings, "schema").message
    _assert_fixes_are_given(findings)

    result = _doctor_cli("--url", used_sqlite_url, "doctor")
    assert result.exit_code == 0, result.output
    assert "0 error(s), 0 warning(s)" in result.output


def test_a_file_just_migrated_is_not_in_wal_yet_which_warns_but_passes(sqlite_url: str) -> None:
    findings = quota.diagnose(sqlite_url)
    journal = _one(findings, "journal_mode")
    assert journal.severity == WARN
    assert "PRAGMA journal_mode=WAL" in journal.fix
    assert [f.check for f in findings if f.severity == ERROR] == []

    assert _doctor_cli("doctor", "--url", sqlite_url).exit_code == 0
    strict = _doctor_cli("doctor", "--url", sqlite_url, "--strict")
    assert strict.exit_code == 3, strict.output


def test_an_unmigrated_sqlite_file_is_an_error_naming_the_command(tmp_path: Path) -> None:
    path = tmp_path / "empty.db"
    sqlite3.connect(path).close()
    url = f"sqlite:///{path}"

    findings = quota.diagnose(url)

    schema = _one(findings, "schema")
    assert schema.severity == ERROR
    assert "missing" in schema.message
    assert schema.fix == f"run `quota --url '{url}' migrate`"
    assert _one(findings, "connectivity").severity == OK
    _assert_fixes_are_given(findings)

    result = _doctor_cli("--url", url, "doctor")
    assert result.exit_code == 3
    assert "ERROR  schema" in result.output
    assert f"fix: run `quota --url '{url}' migrate`" in result.output


def test_the_command_the_schema_finding_names_does_fix_it(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'fixme.db'}"
    sqlite3.connect(tmp_path / "fixme.db").close()
    fix = _one(quota.diagnose(url), "schema").fix
    command = fix.split("`")[1]
    import shlex

    program, *args = shlex.split(command)
    assert program == "quota"
    assert _doctor_cli(*args).exit_code == 0
    assert _one(quota.diagnose(url), "schema").severity == OK


@pytest.mark.skipif(len(REVISIONS) < 2, reason="only one schema revision exists")
def test_a_schema_behind_is_an_error(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'old.db'}"
    quota.migrate(url, revision=REVISIONS[0])
    schema = _one(quota.diagnose(url), "schema")
    assert schema.severity == ERROR
    assert f"at revision {REVISIONS[0]}; this code needs {REQUIRED}" in schema.message


def test_a_schema_newer_than_this_code_warns(sqlite_url: str) -> None:
    path = sqlite_url.removeprefix("sqlite:///")
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE quota_alembic_version SET version_num = '9999_future'")
    conn.close()
    schema = _one(quota.diagnose(sqlite_url), "schema")
    assert schema.severity == WARN
    assert "9999_future" in schema.message


def test_a_missing_sqlite_file_is_reported_and_not_created(tmp_path: Path) -> None:
    path = tmp_path / "nowhere" / "quota.db"
    findings = quota.diagnose(f"sqlite:///{path}")

    connectivity = _one(findings, "connectivity")
    assert connectivity.severity == ERROR
    assert str(path) in connectivity.message
    assert "migrate" in connectivity.fix
    assert not path.exists()
    assert not path.parent.exists()


def test_a_file_that_is_not_a_database_is_a_connectivity_error(tmp_path: Path) -> None:
    path = tmp_path / "junk.db"
    path.write_bytes(b"this is not a SQLite file, not even close" * 100)
    connectivity = _one(quota.diagnose(f"sqlite:///{path}"), "connectivity")
    assert connectivity.severity == ERROR
    assert "not a database" in connectivity.message


def test_clock_skew_is_measured_with_the_app_clock(used_sqlite_url: str) -> None:
    def ahead(seconds: float) -> Clock:
        return lambda: time.time() + seconds

    assert _one(quota.diagnose(used_sqlite_url), "clock_skew").severity == OK
    warn = _one(quota.diagnose(used_sqlite_url, clock=ahead(10)), "clock_skew")
    assert warn.severity == WARN
    assert "ahead of the database clock" in warn.message
    assert "clock='database'" in warn.fix
    error = _one(quota.diagnose(used_sqlite_url, clock=ahead(-600)), "clock_skew")
    assert error.severity == ERROR
    assert "behind" in error.message


# -- PostgreSQL --------------------------------------------------------------------------


@pytest.mark.postgres
def test_a_migrated_postgres_database(pg_url: str) -> None:
    findings = quota.diagnose(pg_url)
    checks = _by_check(findings)

    assert _one(findings, "connectivity").severity == OK
    assert "PostgreSQL" in _one(findings, "connectivity").message
    assert _one(findings, "schema").severity == OK
    assert "standby" not in checks
    counters = [f for f in findings if "quota_counters" in f.message]
    assert {f.check for f in counters} == {"persistence", "fillfactor", "hot_updates"}
    persistence = next(f for f in counters if f.check == "persistence")
    assert "UNLOGGED" in persistence.message
    assert "quota_counters fillfactor is 70" in [f.message for f in checks["fillfactor"]]
    assert _one(findings, "clock_skew").severity == OK
    assert [f for f in findings if f.severity == ERROR] == []
    _assert_fixes_are_given(findings)

    result = _doctor_cli("doctor", "--url", pg_url, "--json")
    data = json.loads(result.output)
    assert data["exit_code"] == result.exit_code
    assert data["counts"]["error"] == 0
    assert [f["check"] for f in data["findings"]] == [f.check for f in findings]


@pytest.mark.postgres
def test_an_unmigrated_postgres_database(pg_make_database: object) -> None:
    url = pg_make_database()  # type: ignore[operator]
    findings = quota.diagnose(url)
    assert _one(findings, "connectivity").severity == OK
    schema = _one(findings, "schema")
    assert schema.severity == ERROR
    assert schema.fix == f"run `quota --url '{url}' migrate`"
    assert "persistence" not in _by_check(findings)  # no tables to look at
    assert _doctor_cli("--url", url, "doctor").exit_code == 3


@pytest.mark.postgres
def test_logged_counters_and_a_full_fillfactor(pg_make_database: object) -> None:
    import psycopg

    url = pg_make_database()  # type: ignore[operator]
    quota.migrate(url, counters_logged=True)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("ALTER TABLE quota_counters RESET (fillfactor)")

    findings = quota.diagnose(url)

    counters = {f.check: f for f in findings if "quota_counters" in f.message}
    assert counters["persistence"].severity == OK
    assert "logged table" in counters["persistence"].message
    assert counters["fillfactor"].severity == WARN
    assert "fillfactor is 100" in counters["fillfactor"].message
    assert "ALTER TABLE quota_counters SET (fillfactor = 70)" in counters["fillfactor"].fix
    result = _doctor_cli("--url", url, "doctor")
    assert result.exit_code == 0, result.output  # warnings pass without --strict
    assert "WARN   fillfactor" in result.output


@pytest.mark.postgres
def test_a_read_only_role_is_an_error(pg_url: str) -> None:
    """A role whose sessions are read-only (``default_transaction_read_only``): every
    decision would fail to write, so doctor reports an error and exits 3."""
    import uuid
    from urllib.parse import urlsplit

    import psycopg

    role = f"quota_ro_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(f"CREATE ROLE {role} LOGIN CONNECTION LIMIT 5")
        try:
            conn.execute(f"ALTER ROLE {role} SET default_transaction_read_only = on")
            conn.execute(f"GRANT SELECT ON ALL TABLES IN SCHEMA public TO {role}")
            parts = urlsplit(pg_url)
            url = parts._replace(netloc=f"{role}@{parts.hostname}:{parts.port or 5432}").geturl()

            findings = quota.diagnose(url)
            assert _one(findings, "connectivity").severity == OK
            read_only = _one(findings, "read_only")
            assert read_only.severity == ERROR
            assert "read-only" in read_only.message and role in read_only.message
            assert "default_transaction_read_only" in read_only.fix
            _assert_fixes_are_given(findings)
            assert _doctor_cli("--url", url, "doctor").exit_code == 3
        finally:
            conn.execute(f"REVOKE ALL ON ALL TABLES IN SCHEMA public FROM {role}")
            conn.execute(f"DROP ROLE {role}")


# -- unreachable and malformed -----------------------------------------------------------


def test_an_unreachable_postgres_url_is_an_error_without_the_password() -> None:
    started = time.monotonic()
    findings = quota.diagnose(UNREACHABLE, timeout=2)
    assert time.monotonic() - started < 10

    assert [f.check for f in findings] == ["connectivity"]
    assert findings[0].severity == ERROR
    assert "sekrit" not in findings[0].message
    assert "root:***@127.0.0.1:1" in findings[0].message

    result = _doctor_cli("doctor", "--url", UNREACHABLE, "--timeout", "2", "--json")
    assert result.exit_code == 3
    assert "sekrit" not in result.output
    data = json.loads(result.output)
    assert data["counts"] == {"ok": 0, "warn": 0, "error": 1}
    assert data["url"] == "postgresql://root:***@127.0.0.1:1/test"


def test_a_malformed_url_is_an_error_finding() -> None:
    findings = quota.diagnose("mysql://db/app")
    assert [(f.check, f.severity) for f in findings] == [("url", ERROR)]
    assert "known schemes" in findings[0].message
    assert _doctor_cli("--url", "mysql://db/app", "doctor").exit_code == 2  # a bad URL is usage


def test_a_bad_timeout_is_a_configuration_error() -> None:
    with pytest.raises(quota.ConfigurationError, match="timeout"):
        quota.diagnose("sqlite:///x.db", timeout=0)


def test_the_url_after_the_command_overrides_the_one_before(used_sqlite_url: str) -> None:
    result = _doctor_cli("--url", "mysql://wrong", "doctor", "--url", used_sqlite_url)
    assert result.exit_code == 0, result.output
    assert used_sqlite_url in result.output


# -- the assessments, without a database -------------------------------------------------


@pytest.mark.parametrize(
    ("skew", "uncertainty", "severity"),
    [
        (0.0, 0.0, OK),
        (0.9, 0.0, OK),
        (-1.4, 0.5, OK),  # within the measurement's own uncertainty
        (1.5, 0.0, WARN),
        (-30.0, 0.01, WARN),
        (59.0, 0.0, WARN),
        (61.0, 0.0, ERROR),
        (-3600.0, 0.0, ERROR),
    ],
)
def test_skew_thresholds(skew: float, uncertainty: float, severity: str) -> None:
    assert skew_finding(skew, uncertainty).severity == severity


@pytest.mark.parametrize(
    ("updates", "hot", "severity"),
    [
        (0, 0, OK),
        (999, 0, OK),
        (1000, 1000, OK),
        (1000, 800, OK),
        (1000, 799, WARN),
        (10**6, 0, WARN),
    ],
)
def test_hot_update_thresholds(updates: int, hot: int, severity: str) -> None:
    finding = hot_finding("quota_counters", updates, hot)
    assert finding.severity == severity
    assert bool(finding.fix) == (severity != OK)


@pytest.mark.parametrize(
    ("options", "value"),
    [
        (None, 100),
        ([], 100),
        (["autovacuum_enabled=false"], 100),
        (["fillfactor=70", "autovacuum_vacuum_scale_factor=0.05"], 70),
        (["autovacuum_vacuum_scale_factor=0.05", "fillfactor=85"], 85),
    ],
)
def test_fillfactor_is_read_from_reloptions(options: list[str] | None, value: int) -> None:
    assert fillfactor(options) == value


@pytest.mark.parametrize(
    ("value", "severity"), [(50, OK), (70, OK), (90, OK), (91, WARN), (100, WARN)]
)
def test_fillfactor_thresholds(value: int, severity: str) -> None:
    assert fillfactor_finding("quota_counters", value).severity == severity


def test_an_old_sqlite_library_is_an_error() -> None:
    assert sqlite_version_finding((3, 34, 1), "3.34.1").severity == ERROR
    assert sqlite_version_finding((3, 35, 0), "3.35.0").severity == OK


def test_both_persistences_are_ok_and_say_which() -> None:
    unlogged = persistence_finding("quota_counters", "u")
    logged = persistence_finding("quota_counters", "p")
    assert (unlogged.severity, logged.severity) == (OK, OK)
    assert "UNLOGGED" in unlogged.message
    assert "logged table" in logged.message
