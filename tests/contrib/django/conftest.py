"""Django is configured here, for the tests in this directory only.

The rest of the suite runs without Django settings; pytest-django (installed
for the whole suite) only acts once settings are configured, which happens
when this file is collected. The settings are `tests.contrib.django.settings`.
"""

from __future__ import annotations

import itertools
import os
import warnings
from collections.abc import Iterator
from typing import Any

import django
import pytest
from django.conf import settings

if not settings.configured:
    from tests.contrib.django import settings as test_settings

    settings.configure(
        **{name: getattr(test_settings, name) for name in dir(test_settings) if name.isupper()}
    )
    django.setup()

from django.core.management import call_command
from django.test import override_settings

from quota.contrib.django import conf
from tests.contrib.django.settings import CLOCK

_windows = itertools.count()


@pytest.fixture(scope="session")
def django_db_setup(django_test_environment: None, django_db_blocker: Any) -> Iterator[None]:
    """Every alias's test database (pytest-django would make only those that tests
    marked ``django_db`` name), and quota's tables in ``pg`` as well as ``default``
    (Django's migrate creates them in the ``QUOTA["DATABASE"]`` alias only)."""
    from django.test.utils import setup_databases, teardown_databases

    with django_db_blocker.unblock():
        databases = setup_databases(verbosity=0, interactive=False, aliases=set(settings.DATABASES))
        if "pg" in settings.DATABASES:
            with override_settings(QUOTA=quota_settings_for("pg")):
                call_command("migrate", "quota", "zero", database="pg", fake=True, verbosity=0)
                call_command("migrate", "quota", database="pg", verbosity=0)
    yield
    conf.reset()
    for connection, _old_name, destroy in databases:
        path = str(connection.settings_dict["NAME"])
        if destroy and connection.vendor == "sqlite" and not os.path.exists(path):
            # Gone before the end of the session: say so, and let the PostgreSQL test
            # databases be dropped all the same (Django's teardown stops at the first error).
            warnings.warn(f"SQLite test database {path} deleted before teardown", stacklevel=1)
            open(path, "a").close()
    with django_db_blocker.unblock():
        teardown_databases(databases, verbosity=0)


def quota_settings_for(alias: str, **more: Any) -> dict[str, Any]:
    """The test ``QUOTA`` setting on `alias`."""
    return {**settings.QUOTA, "DATABASE": alias, **more}


@pytest.fixture(autouse=True)
def django_clock() -> Any:
    """The limiters' clock, at the start of a day no other test used: fresh windows."""
    CLOCK.now = 86400.0 * (12_000 + 3 * next(_windows))
    return CLOCK


POSTGRES = pytest.param(
    "pg",
    id="postgresql",
    marks=[
        pytest.mark.postgres,
        pytest.mark.skipif("pg" not in settings.DATABASES, reason="no PostgreSQL server"),
    ],
)


@pytest.fixture(params=[pytest.param("default", id="sqlite"), POSTGRES])
def quota_db(request: pytest.FixtureRequest, django_db_setup: None) -> Iterator[str]:
    """The alias quota keeps its tables in for this test: SQLite, then PostgreSQL."""
    alias: str = request.param
    with override_settings(QUOTA=quota_settings_for(alias)):
        yield alias
