"""``manage.py migrate`` / ``sqlmigrate`` for quota's tables, beside ``quota migrate``.

The ``scratch`` aliases (SQLite and PostgreSQL) start each test without
quota's tables, unmigrated in Django's eyes too.
"""

from __future__ import annotations

import importlib
import io
import multiprocessing
import pkgutil
from collections.abc import Iterator
from typing import Any

import pytest
from django.conf import settings
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connections
from django.test import override_settings

import quota
from quota._sql.schema import HEAD, REVISIONS
from quota.contrib.django import conf
from quota.contrib.django import migrations as app_migrations
from quota.contrib.django.operations import QuotaSchema
from tests.contrib.django import _workers
from tests.contrib.django.conftest import quota_settings_for

SCRATCH = [
    pytest.param("scratch", id="sqlite"),
    pytest.param(
        "pgscratch",
        id="postgresql",
        marks=[
            pytest.mark.postgres,
            pytest.mark.skipif("pg" not in settings.DATABASES, reason="no PostgreSQL server"),
        ],
    ),
]


@pytest.fixture(params=SCRATCH)
def scratch(
    request: pytest.FixtureRequest, django_db_setup: None, django_db_blocker: Any
) -> Iterator[str]:
    """An alias holding no quota tables, quota's database for the test."""
    alias: str = request.param
    with django_db_blocker.unblock(), override_settings(QUOTA=quota_settings_for(alias)):
        _wipe(alias)
        yield alias
        _wipe(alias)
        connections[alias].close()


def _wipe(alias: str) -> None:
    conf.reset()
    quota.downgrade(conf.database_url(alias), revision="base", drop_data=True)
    call_command("migrate", "quota", "zero", database=alias, fake=True, verbosity=0)


def _applied(alias: str) -> bool:
    from django.db.migrations.recorder import MigrationRecorder

    return ("quota", "0001_initial") in MigrationRecorder(connections[alias]).applied_migrations()


def test_migrate_creates_the_tables_on_a_fresh_database(scratch: str) -> None:
    url = conf.database_url(scratch)
    assert quota.current_revision(url) is None
    call_command("migrate", "quota", database=scratch, verbosity=0)
    assert quota.current_revision(url) == HEAD
    assert _applied(scratch)
    assert conf.get_limiter().rate_limit("k", 1, 60).allowed


def test_migrate_after_quota_migrate_applies_nothing(scratch: str) -> None:
    url = conf.database_url(scratch)
    quota.migrate(url)
    conf.get_limiter().rate_limit("kept", 5, 60)
    call_command("migrate", "quota", database=scratch, verbosity=0)  # would fail re-creating
    assert quota.current_revision(url) == HEAD
    assert _applied(scratch)
    assert conf.get_limiter().peek("kept", 5, 60).count == 1


def test_migrate_applies_only_the_missing_revisions(scratch: str) -> None:
    url = conf.database_url(scratch)
    quota.migrate(url, revision=REVISIONS[1])
    call_command("migrate", "quota", database=scratch, verbosity=0)
    assert quota.current_revision(url) == HEAD


def test_quota_migrate_after_django_migrate_applies_nothing(scratch: str) -> None:
    url = conf.database_url(scratch)
    call_command("migrate", "quota", database=scratch, verbosity=0)
    output = io.StringIO()
    quota.migrate(url, sql=False, output=output)
    assert quota.current_revision(url) == HEAD
    assert "Running upgrade" not in output.getvalue()


def test_migrate_on_another_alias_leaves_quota_alone(scratch: str) -> None:
    other = "default" if scratch == "scratch" else "pg"
    url = conf.database_url(scratch)
    with override_settings(QUOTA=quota_settings_for(other)):
        call_command("migrate", "quota", "zero", database=scratch, fake=True, verbosity=0)
        call_command("migrate", "quota", database=scratch, verbosity=0)
    assert quota.current_revision(url) is None


@pytest.mark.slow
def test_concurrent_migrations_queue_behind_the_lock(scratch: str) -> None:
    """Processes migrating at once: quota's lock queues them, one creates the tables."""
    url = conf.database_url(scratch)
    # The child's "default" is this test database, as it is.
    child = {
        key: value for key, value in connections[scratch].settings_dict.items() if key != "TEST"
    }
    context = multiprocessing.get_context("spawn")
    with context.Pool(3) as pool:
        pool.starmap(_workers.migrate, [({"default": child}, {}, "default")] * 3)
    assert quota.current_revision(url) == HEAD
    assert _applied(scratch)


def test_sqlmigrate_prints_the_schema(scratch: str) -> None:
    output = io.StringIO()
    call_command("sqlmigrate", "quota", "0001", database=scratch, stdout=output)
    sql = output.getvalue()
    for table in ("quota_counters", "quota_usage", "quota_ledger", "quota_state", "quota_settings"):
        assert (
            f"CREATE {'UNLOGGED ' if table in ('quota_counters', 'quota_state') and scratch == 'pgscratch' else ''}TABLE {table}"
            in sql
        )
    assert "quota_alembic_version" in sql
    assert quota.current_revision(conf.database_url(scratch)) is None  # printed, not run
    backwards = io.StringIO()
    call_command("sqlmigrate", "quota", "0001", backwards=True, database=scratch, stdout=backwards)
    assert "DROP TABLE quota_counters" in backwards.getvalue()


def test_migrate_zero_refuses_to_drop_durable_data(scratch: str) -> None:
    url = conf.database_url(scratch)
    call_command("migrate", "quota", database=scratch, verbosity=0)
    conf.get_limiter().consume_quota("user-1", "api", 100, "month")
    with pytest.raises(CommandError, match=r"DROP_DATA.*") as refused:
        call_command("migrate", "quota", "zero", database=scratch, verbosity=0)
    assert "quota_usage (1 rows)" in str(refused.value)
    # Django undoes the later migrations first (they drop no durable data); the one
    # whose tables hold the usage stays applied.
    assert quota.current_revision(url) == _migration_modules()[0].Migration.operations[0].target
    assert _applied(scratch)
    with override_settings(QUOTA=quota_settings_for(scratch, DROP_DATA=True)):
        call_command("migrate", "quota", "zero", database=scratch, verbosity=0)
    assert quota.current_revision(url) is None
    assert not _applied(scratch)


def test_migrate_zero_without_durable_data_drops_the_tables(scratch: str) -> None:
    url = conf.database_url(scratch)
    call_command("migrate", "quota", database=scratch, verbosity=0)
    conf.get_limiter().rate_limit("k", 1, 60)  # counters are not durable
    call_command("migrate", "quota", "zero", database=scratch, verbosity=0)
    assert quota.current_revision(url) is None


def _migration_modules() -> list[Any]:
    names = sorted(
        info.name
        for info in pkgutil.iter_modules(app_migrations.__path__)
        if info.name[0].isdigit()
    )
    return [importlib.import_module(f"{app_migrations.__name__}.{name}") for name in names]


def test_the_last_migration_brings_quota_to_its_head() -> None:
    """A quota schema revision without a Django migration fails here (a migration of the
    admin's table-less models runs no quota revision)."""
    targets = []
    previous = None
    for module in _migration_modules():
        operations = [op for op in module.Migration.operations if isinstance(op, QuotaSchema)]
        if not operations:
            continue
        assert len(operations) == 1, module.__name__
        assert operations[0].previous == previous, module.__name__
        previous = operations[0].target
        targets.append(previous)
    assert targets and targets[-1] == HEAD
    assert all(target in REVISIONS for target in targets)


def test_makemigrations_finds_no_changes(django_db_setup: None, django_db_blocker: Any) -> None:
    with django_db_blocker.unblock():
        call_command("makemigrations", "quota", check=True, dry_run=True, verbosity=0)
