"""`quota.admin`: the admin API, on SQLite and PostgreSQL, each through `Admin` and `AsyncAdmin`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

import quota
from quota._sql.policies import read_op
from quota.admin import Admin, AsyncAdmin, Health, PolicyRow
from quota.http import HttpConfig, hashed_subject, ip_subject, token_subject
from quota.http._core import Guard
from tests._support import Backend

SECRET = b"admin-test-secret-0123456789"


class Calls:
    """The admin of `backend`'s limiter (`Admin` or `AsyncAdmin`) behind plain sync calls."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.admin: Admin | AsyncAdmin = (AsyncAdmin if backend.is_async else Admin)(
            backend.limiter
        )

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self.admin, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            result = method(*args, **kwargs)
            return self.backend.run(result) if self.backend.is_async else result

        return call


def _value(backend: Backend, result: Any) -> Any:
    """`result`, awaited on `backend`'s loop for an async face."""
    return backend.run(result) if backend.is_async else result


@pytest.fixture
def admin(backend: Backend) -> Calls:
    """The admin of `backend`, on a database whose quota tables are all empty."""
    if backend.dialect == "postgresql":
        import psycopg

        from quota._sql.schema import TABLES
        from quota._sql.statements import VERSION_TABLE

        tables = ", ".join(table for table in TABLES if table != VERSION_TABLE)
        with psycopg.connect(backend.url, autocommit=True) as conn:
            conn.execute("SET lock_timeout = '30s'")
            conn.execute(f"TRUNCATE {tables}")
    return Calls(backend)


def test_policies_are_set_listed_and_deleted(admin: Calls, backend: Backend) -> None:
    assert admin.policies() == []
    stored = admin.set_policy(PolicyRow(route="api", subject="tier:anon", rates="5/minute"))
    assert stored.updated_at == backend.clock.now, "stamped with the limiter's clock"
    admin.set_policy(PolicyRow(route="*", exempt=True, note="launch"))
    assert [(r.route, r.subject, r.rates, r.exempt, r.note) for r in admin.policies()] == [
        ("*", "*", None, True, "launch"),
        ("api", "tier:anon", "5/minute", False, None),
    ]
    assert admin.delete_policy("api", "tier:anon")
    assert not admin.delete_policy("api", "tier:anon"), "already deleted"
    assert [r.route for r in admin.policies()] == ["*"]


def test_a_policy_that_changes_nothing_is_refused(admin: Calls) -> None:
    with pytest.raises(quota.ConfigurationError, match="must change something"):
        admin.set_policy(PolicyRow(route="api", note="nothing"))
    with pytest.raises(quota.ConfigurationError, match="give rates with it"):
        admin.set_policy(PolicyRow(route="api", algorithm="gcra"))
    with pytest.raises(quota.ConfigurationError, match=r"row must be a quota\.admin\.PolicyRow"):
        admin.set_policy({"route": "api", "rates": "1/s"})
    with pytest.raises(quota.ConfigurationError, match="route must be a non-empty string"):
        admin.delete_policy("")
    assert admin.policies() == []


def test_settings_are_set_listed_and_deleted(admin: Calls, backend: Backend) -> None:
    assert admin.settings() == []
    assert admin.set_tier_multiplier("auth", 2.0).value == "2"
    row = admin.set_abuse_threshold(0, note="quiet launch")
    assert (row.name, row.value, row.note, row.updated_at) == (
        "abuse_threshold", "0", "quiet launch", backend.clock.now,
    )  # fmt: skip
    admin.set_setting("tier_multiplier.anon", "0.5")
    assert [(r.name, r.value) for r in admin.settings()] == [
        ("abuse_threshold", "0"),
        ("tier_multiplier.anon", "0.5"),
        ("tier_multiplier.auth", "2"),
    ]
    assert admin.delete_setting("tier_multiplier.auth")
    assert not admin.delete_setting("tier_multiplier.auth"), "already deleted"
    assert [r.name for r in admin.settings()] == ["abuse_threshold", "tier_multiplier.anon"]


def test_a_bad_setting_is_refused_naming_it(admin: Calls) -> None:
    with pytest.raises(quota.ConfigurationError, match=r"tier_multipliers\['auth'\].*5000"):
        admin.set_tier_multiplier("auth", 5000)
    with pytest.raises(quota.ConfigurationError, match="abuse_threshold must be a whole number"):
        admin.set_abuse_threshold(-1)
    with pytest.raises(quota.ConfigurationError, match="unknown setting 'colour'"):
        admin.set_setting("colour", 1)
    with pytest.raises(quota.ConfigurationError, match="tier must be a non-empty string"):
        admin.set_tier_multiplier("", 2)
    assert admin.settings() == []


def test_a_route_no_middleware_serves_is_named(admin: Calls, backend: Backend) -> None:
    assert admin.unserved_route("apj") is None, "no class recorded yet: nothing to compare"
    _value(backend, backend.limiter.run(read_op(["api", "search"], 1.0)))
    assert admin.served_routes() == ["api", "search"]
    assert admin.settings() == [], "the records are no settings"
    warning = admin.unserved_route("apj")
    assert warning is not None and "did you mean 'api'?" in warning
    assert admin.unserved_route("api") is None
    assert admin.unserved_route("*") is None


def test_keys_windows_top_peek_and_reset(admin: Calls, backend: Backend) -> None:
    for _ in range(3):
        backend.rate_limit("busy", 10, 60)
    backend.rate_limit("busy", 100, 3600)
    backend.rate_limit("quiet", 10, 60)
    assert [(u.key, u.count) for u in admin.top(2)] == [("busy", 3), ("busy", 1)]
    assert [(u.window, u.count) for u in admin.windows("busy")] == [(60, 3), (3600, 1)]
    assert admin.peek("busy", 10, 60).remaining == 7
    assert admin.reset("busy", 60) == 1
    assert [u.window for u in admin.windows("busy")] == [3600]
    assert admin.reset("busy") == 1
    assert admin.windows("busy") == []
    with pytest.raises(quota.ConfigurationError, match="n must be"):
        admin.top(0)


def test_leases(admin: Calls, backend: Backend) -> None:
    assert admin.top_leases() == []

    def check() -> None:
        usage = admin.leases("jobs")
        assert (usage.held, usage.limit, usage.free) == (1, 2, 1)
        assert [u.key for u in admin.top_leases(5)] == ["jobs"]

    if backend.is_async:

        async def hold() -> None:
            async with backend.limiter.concurrency("jobs", 2):
                usage = await admin.admin.leases("jobs")  # type: ignore[misc]
                assert (usage.held, usage.free) == (1, 1)
                assert [u.key for u in await admin.admin.top_leases(5)] == ["jobs"]  # type: ignore[misc]

        backend.run(hold())
    else:
        with backend.limiter.concurrency("jobs", 2):
            check()
    assert admin.leases("jobs").held == 0


def test_usage_and_ledger(admin: Calls, backend: Backend) -> None:
    assert admin.usage("acme") == []
    _value(backend, backend.limiter.consume_quota("acme", "exports", 10, "day", cost=3))
    [usage] = admin.usage("acme")
    assert (usage.name, usage.used, usage.remaining) == ("exports", 3, 7)
    [entry] = admin.ledger("acme")
    assert (entry.kind, entry.name, entry.cost) == ("consume", "exports", 3)
    assert admin.ledger("acme", since=backend.clock.now + 1) == []


def test_health_of_a_store_without_a_fallback(admin: Calls, backend: Backend) -> None:
    found = admin.health()
    assert found.latency is not None and found.latency > 0
    assert found == Health(
        dialect=backend.dialect, up=True, fallback=False, reachable=True, latency=found.latency
    )
    assert admin.health(probe=False) == Health(dialect=backend.dialect, up=True, fallback=False)


def test_health_under_a_fallback(backend: Backend) -> None:
    face = backend.connect(fallback=True)
    admin = (AsyncAdmin if backend.is_async else Admin)(face.limiter)
    found = _value(backend, admin.health())
    assert isinstance(found, Health)
    assert (found.fallback, found.up, found.owed, found.down_for) == (True, True, 0, None)
    assert found.reachable is True


def test_health_of_a_store_that_is_down() -> None:
    fallback = quota.Fallback(timeout=0.5, probe_interval=60)
    with quota.connect("postgresql://root@127.0.0.1:1/quota", fallback=fallback) as limiter:
        limiter.rate_limit("k", 10, 60)  # decided from memory: the store is down
        found = Admin(limiter).health()
    assert (found.fallback, found.up, found.reachable, found.latency) == (True, False, False, None)
    assert found.owed == 1, "the hit memory counted"
    assert found.down_for is not None and found.down_for >= 0
    assert found.last_error is not None and found.probe_error is not None


def test_the_admin_of_the_other_face_is_refused(backend: Backend) -> None:
    other = Admin if backend.is_async else AsyncAdmin
    with pytest.raises(quota.ConfigurationError, match="limiter must be a quota"):
        other(backend.limiter)


@pytest.mark.parametrize("url", ["memory://"])
def test_a_store_without_tables_has_no_policies(url: str) -> None:
    with quota.connect(url) as limiter:
        admin = Admin(limiter)
        with pytest.raises(quota.ConfigurationError, match="memory store keeps no quota_policies"):
            admin.policies()
        with pytest.raises(quota.ConfigurationError, match="keeps no quota_settings"):
            admin.set_abuse_threshold(3)
        assert admin.top() == []
        assert admin.health().reachable is True


def test_callers_are_named_as_the_middleware_names_them() -> None:
    assert ip_subject(" 198.51.100.7 ", SECRET) == hashed_subject("ip", "198.51.100.7", SECRET)
    assert token_subject("sk_live_1", SECRET) == hashed_subject("tok", "sk_live_1", SECRET)
    with pytest.raises(quota.ConfigurationError, match="not an IP address"):
        ip_subject("localhost", SECRET)


def test_the_guard_takes_an_abuse_threshold_at_run_time() -> None:
    guard = Guard(HttpConfig(abuse_threshold=0), dialect="memory")
    assert guard.abuse is None and guard.abuse_threshold == 0
    assert not guard.set_abuse_threshold(0), "off already"
    assert guard.set_abuse_threshold(3)
    assert guard.abuse is not None and guard.abuse_threshold == 3
    assert not guard.set_abuse_threshold(3)
    assert guard.set_abuse_threshold(0)
    assert guard.abuse is not None, "kept: a request may be using it"
    assert guard.abuse_threshold == 0
    with pytest.raises(quota.ConfigurationError, match="abuse_threshold must be a whole number"):
        guard.set_abuse_threshold(True)
