"""A downgrade never drops durable quota data by surprise.

Dropping `quota_usage`, `quota_ledger` or `quota_policies` with rows in them needs
``drop_data=True`` (``quota downgrade --drop-data``); without it the downgrade is
refused, names each table and its rows, and changes nothing. ``--sql`` still prints.
"""

from __future__ import annotations

import io
import subprocess
import sys

import pytest

import quota
from quota._sql.schema import REVISIONS


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", "from quota._cli import main; main()", *args],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_a_downgrade_that_would_drop_quota_rows_is_refused(sql_own_url: str) -> None:
    with quota.connect(sql_own_url) as limiter:
        limiter.consume_quota("acme", "calls", 100, "day", cost=3, idempotency_key="a")
        limiter.consume_quota("acme", "calls", 100, "day", cost=4, idempotency_key="b")

    with pytest.raises(quota.ConfigurationError) as refused:
        quota.downgrade(sql_own_url, revision="0001_counters")
    message = str(refused.value)
    assert "quota_usage (1 rows)" in message and "quota_ledger (2 rows)" in message
    assert "drop_data=True" in message
    assert quota.current_revision(sql_own_url) == REVISIONS[-1]  # nothing changed

    result = _cli("downgrade", "--url", sql_own_url, "0001_counters")
    assert result.returncode == 2, result.stderr  # a usage error: the flag is missing
    assert "quota_ledger (2 rows)" in result.stderr and "--drop-data" in result.stderr

    sql = io.StringIO()  # the statements stay available for review
    quota.downgrade(sql_own_url, revision="0001_counters", sql=True, output=sql)
    assert "DROP TABLE quota_ledger" in sql.getvalue()
    with quota.connect(sql_own_url) as limiter:
        assert [u.used for u in limiter.quota_usage("acme")] == [7]

    # Dropping only what holds no durable rows needs no flag.
    quota.downgrade(sql_own_url, revision="0003_algorithms")
    assert quota.current_revision(sql_own_url) == "0003_algorithms"

    result = _cli("downgrade", "--url", sql_own_url, "0001_counters", "--drop-data")
    assert result.returncode == 0, result.stderr
    assert "quota schema at 0001_counters" in result.stderr
    assert quota.current_revision(sql_own_url) == "0001_counters"


def test_policy_rows_are_durable_too(sql_own_url: str) -> None:
    from quota.admin import Admin, PolicyRow

    with quota.connect(sql_own_url) as limiter:
        Admin(limiter).set_policy(PolicyRow(route="api", rates="5/minute"))
    with pytest.raises(quota.ConfigurationError, match=r"quota_policies \(1 rows\)"):
        quota.downgrade(sql_own_url, revision="0003_algorithms")
    quota.downgrade(sql_own_url, revision="0003_algorithms", drop_data=True)
    assert quota.current_revision(sql_own_url) == "0003_algorithms"


def test_empty_durable_tables_downgrade_without_the_flag(sql_own_url: str) -> None:
    quota.downgrade(sql_own_url, revision="base")
    assert quota.current_revision(sql_own_url) is None


def test_deleted_overrides_and_settings_are_no_rows_to_keep(sql_own_url: str) -> None:
    # main: the stamped rows a deletion leaves (for two hours) made the downgrade ask
    # for --drop-data, as if they held data.
    from quota.admin import Admin, PolicyRow

    with quota.connect(sql_own_url) as limiter:
        Admin(limiter).set_policy(PolicyRow(route="api", rates="5/minute"))
        Admin(limiter).set_setting("abuse_threshold", "7")
        assert Admin(limiter).delete_policy("api")
        assert Admin(limiter).delete_setting("abuse_threshold")

    quota.downgrade(sql_own_url, revision="0003_algorithms")
    assert quota.current_revision(sql_own_url) == "0003_algorithms"


def test_route_classes_a_middleware_recorded_are_no_rows_to_keep(sql_own_url: str) -> None:
    # The route_class.<name> rows a middleware writes say which classes it serves
    # (for `quota policy set`'s warning and doctor), not a setting anyone made.
    from quota._sql.policies import read_op
    from quota.admin import Admin

    with quota.connect(sql_own_url) as limiter:
        limiter.run(read_op(["api", "login"], 1.0))
        assert sorted(Admin(limiter).served_routes()) == ["api", "login"]

    quota.downgrade(sql_own_url, revision="0004_policies")
    assert quota.current_revision(sql_own_url) == "0004_policies"
