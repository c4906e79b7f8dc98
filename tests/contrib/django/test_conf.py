"""quota's settings in Django: the URL of an alias, ``QUOTA``, and the shared limiters."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import threading
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured as DjangoImproperlyConfigured
from django.db import connections
from django.test import override_settings

import quota
from quota.contrib.django import conf


@pytest.fixture
def alias_settings(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Add an alias to Django's database settings for one test."""

    def add(alias: str, settings_dict: dict[str, Any]) -> None:
        monkeypatch.setitem(connections.settings, alias, settings_dict)
        if hasattr(connections._connections, alias):
            delattr(connections._connections, alias)

    yield add
    if hasattr(connections._connections, "x"):
        delattr(connections._connections, "x")


def pg(**extra: Any) -> dict[str, Any]:
    base = {"ENGINE": "django.db.backends.postgresql", "NAME": "app", "USER": "app",
            "PASSWORD": "s3cr:t@/x", "HOST": "db.internal", "PORT": 5433, "OPTIONS": {}}  # fmt: skip
    return base | extra


def test_postgresql_url(alias_settings: Any) -> None:
    alias_settings("x", pg())
    assert conf.database_url("x") == "postgresql://app:s3cr%3At%40%2Fx@db.internal:5433/app"


def test_postgresql_options_become_libpq_parameters(alias_settings: Any) -> None:
    alias_settings(
        "x",
        pg(
            OPTIONS={"sslmode": "require", "options": "-c search_path=app", "isolation_level": 2,
                     "pool": True, "application_name": "web"},
            DISABLE_SERVER_SIDE_CURSORS=True,
        ),
    )  # fmt: skip
    url = conf.database_url("x")
    assert url.endswith(
        "/app?sslmode=require&options=-c%20search_path%3Dapp&application_name=web"
        "&prepared_statements=false"
    )
    from quota._core.url import parse_url

    parsed = parse_url(url)
    assert parsed.prepared_statements is False
    assert "isolation_level" not in url and "pool" not in url


def test_postgresql_socket_and_ipv6_hosts(alias_settings: Any) -> None:
    alias_settings("x", pg(HOST="/var/run/postgresql", PORT="", USER="", PASSWORD=""))
    assert conf.database_url("x") == "postgresql:///app?host=%2Fvar%2Frun%2Fpostgresql"
    alias_settings("x", pg(HOST="::1", PASSWORD=""))
    assert conf.database_url("x") == "postgresql://app@[::1]:5433/app"


def test_sqlite_url_is_absolute(alias_settings: Any, tmp_path: Any) -> None:
    alias_settings("x", {"ENGINE": "django.db.backends.sqlite3", "NAME": tmp_path / "app.db"})
    assert conf.database_url("x") == f"sqlite:///{tmp_path / 'app.db'}"


@pytest.mark.parametrize("name", [":memory:", "", "file:memorydb_default?mode=memory&cache=shared"])
def test_in_memory_sqlite_is_refused(alias_settings: Any, name: str) -> None:
    alias_settings("x", {"ENGINE": "django.db.backends.sqlite3", "NAME": name})
    with pytest.raises(conf.ImproperlyConfigured, match=r"needs the SQLite database .* in a file"):
        conf.database_url("x")


def test_other_engines_are_refused_naming_the_engine(alias_settings: Any) -> None:
    alias_settings("x", pg(ENGINE="django.db.backends.mysql"))
    with pytest.raises(conf.ImproperlyConfigured) as refused:
        conf.database_url("x")
    message = str(refused.value)
    assert "django.db.backends.mysql" in message and "PostgreSQL" in message
    assert "s3cr" not in message
    # Both Django's and quota's error.
    assert isinstance(refused.value, DjangoImproperlyConfigured)
    assert isinstance(refused.value, quota.ConfigurationError)


def test_unknown_alias() -> None:
    with pytest.raises(conf.ImproperlyConfigured, match="no database alias 'nope'"):
        conf.database_url("nope")


def test_the_test_database_is_followed(quota_db: str) -> None:
    name = connections[quota_db].settings_dict["NAME"]
    assert "test" in name
    assert conf.database_url() == conf.database_url(quota_db)
    assert name in conf.database_url()


def test_quota_settings_defaults_and_url() -> None:
    with override_settings(QUOTA=None):
        built = conf.quota_settings()
    assert (built.database, built.url, dict(built.options), dict(built.http)) == (
        "default", None, {}, {},
    )  # fmt: skip
    with override_settings(QUOTA={"URL": "memory://", "HTTP": {"anything": [1]}}):
        built = conf.quota_settings()
        assert built.http["anything"] == [1]
        assert conf.database_url() == "memory://"
        assert conf.get_limiter().store.dialect == "memory"
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.url = "x"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("setting", "named"),
    [
        ({"DATABSE": "default"}, "DATABSE"),
        ({"OPTIONS": {"pool_sise": 2}}, "pool_sise"),
        ({"OPTIONS": {"pool_size": "two"}}, "pool_size"),
        ({"URL": "mysql://x"}, "mysql"),
        ({"OPTIONS": []}, "OPTIONS"),
        ({"DROP_DATA": "yes"}, "DROP_DATA"),
    ],
)
def test_bad_settings_name_the_key(setting: dict[str, Any], named: str) -> None:
    with override_settings(QUOTA=setting), pytest.raises(DjangoImproperlyConfigured, match=named):
        conf.quota_settings()


def test_one_limiter_per_process_shared_by_threads(quota_db: str) -> None:
    seen: list[quota.Limiter] = []
    barrier = threading.Barrier(8)

    def get() -> None:
        barrier.wait()
        seen.append(conf.get_limiter())

    threads = [threading.Thread(target=get) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len({id(limiter) for limiter in seen}) == 1
    assert seen[0] is conf.get_limiter()


def test_settings_changes_replace_the_limiter(quota_db: str) -> None:
    first = conf.get_limiter()
    with override_settings(QUOTA={"URL": "memory://"}):
        assert conf.get_limiter() is not first
    again = conf.get_limiter()
    assert again is not first and again.store.dialect != "memory"


def test_options_reach_the_limiter(quota_db: str, django_clock: Any) -> None:
    limiter = conf.get_limiter()
    assert limiter.options.pool_size == 1
    assert limiter.rate_limit("clocked", 1, 60).reset_at == int(django_clock.now) + 60


def test_a_forked_child_opens_its_own_limiter(
    quota_db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    parent = conf.get_limiter()
    parent.rate_limit("before-fork", 5, 60)
    closed: list[bool] = []
    monkeypatch.setattr(parent, "close", lambda: closed.append(True))
    real_pid = os.getpid()
    monkeypatch.setattr(os, "getpid", lambda: real_pid + 100_000)
    child = conf.get_limiter()
    assert child is not parent
    assert closed == []  # the parent's connections are left to the parent
    assert child.peek("before-fork", 5, 60).count == 1
    monkeypatch.undo()
    conf.reset()  # the child's limiter belongs to another pid now: closed here by hand
    child.close()
    parent.close()


def test_one_async_limiter_per_event_loop(quota_db: str) -> None:
    async def two() -> tuple[quota.AsyncLimiter, quota.AsyncLimiter, int]:
        first = conf.get_async_limiter()
        decision = await first.rate_limit("async-key", 5, 60)
        return first, conf.get_async_limiter(), decision.count

    a, same, count = asyncio.run(two())
    b, _, count_again = asyncio.run(two())
    assert a is same and a is not b
    assert (count, count_again) == (1, 2)


def test_async_limiter_closes_with_its_loop(quota_db: str, monkeypatch: pytest.MonkeyPatch) -> None:
    closed: list[bool] = []

    async def use() -> None:
        limiter = conf.get_async_limiter()
        original = limiter.aclose

        async def aclose() -> None:
            closed.append(True)
            await original()

        monkeypatch.setattr(limiter, "aclose", aclose)
        await limiter.rate_limit("closing", 5, 60)

    asyncio.run(use())
    assert closed == [True]


def test_an_async_limiter_replaced_by_a_settings_change_is_closed_once(
    quota_db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    closed: list[str] = []

    async def use() -> None:
        old = conf.get_async_limiter()
        original = old.aclose

        async def aclose() -> None:
            closed.append("old")
            await original()

        monkeypatch.setattr(old, "aclose", aclose)
        await old.rate_limit("replaced", 5, 60)
        conf.reset()  # what setting_changed does for QUOTA or DATABASES
        new = conf.get_async_limiter()
        assert new is not old
        assert (await new.rate_limit("replaced", 5, 60)).count == 2  # same database
        # The old one is closed on this loop, in the background.
        await asyncio.wait_for(asyncio.gather(*conf._closing), timeout=10)
        assert closed == ["old"]

    asyncio.run(use())
    assert closed == ["old"]  # not closed again when the loop shut down


def test_get_async_limiter_needs_a_running_loop() -> None:
    with pytest.raises(RuntimeError):
        conf.get_async_limiter()
