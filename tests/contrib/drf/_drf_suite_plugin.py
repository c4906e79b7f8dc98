"""The pytest plugin that runs Django REST framework's throttling tests on quota's throttles.

No tests here: `test_drf_suite.py` beside it runs DRF's
``tests/test_throttling.py`` (from its sdist) in a subprocess with
``-p _drf_suite_plugin --noconftest``, and this plugin, loaded there and
only there, does what DRF's conftest does (Django settings: an in-memory
SQLite database for Django, the apps the test file uses) and then:

* puts quota's classes in ``rest_framework.throttling`` before the test file
  imports its names: ``SimpleRateThrottle`` is `QuotaThrottle`, and
  ``AnonRateThrottle``, ``UserRateThrottle``, ``ScopedRateThrottle`` are
  quota's (``BaseThrottle`` stays DRF's); the test file itself is unchanged;
* points quota at ``$QUOTA_DRF_SUITE_URL`` (``QUOTA["URL"]``: a migrated
  SQLite file or PostgreSQL database), and empties quota's counters before
  every test, as DRF's tests clear Django's cache in ``setUp``;
* starts ``test_requests_are_throttled``, the one test on the real clock,
  in the first half of a second: its four requests then fall in one of
  quota's windows (aligned to the epoch), as they do in DRF's sliding log;
* marks each documented difference (`XFAIL`) ``xfail(strict=True)`` with its
  reason: it must fail, and for that reason alone.

Nothing here imports from quota's own ``tests`` package: in the subprocess
``tests`` is DRF's.
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest

#: The quota URL the throttles count on (set by the outer test).
URL_ENV = "QUOTA_DRF_SUITE_URL"

#: DRF's tests that show a documented difference, each with the reason.
XFAIL: dict[str, str] = {
    "test_wait_returns_correct_waiting_time_without_history": (
        "quota differs: wait() is the time until the next request passes, from the last"
        " decision; a throttle that decided nothing (DRF's test only assigns history)"
        " returns None, not DRF's duration / (num_requests - len(history) + 1)"
    ),
}

#: The test on the real clock, started early in a second (see the module's docstring).
REAL_CLOCK_TESTS = frozenset({"test_requests_are_throttled"})

#: Django's URLs in the subprocess: none (DRF's throttling tests call views directly).
urlpatterns: list[Any] = []


def pytest_configure(config: pytest.Config) -> None:
    import django
    from django.conf import settings

    config.addinivalue_line("markers", "requires_postgres: DRF's marker (unused here)")
    settings.configure(
        DEBUG_PROPAGATE_EXCEPTIONS=True,
        DEFAULT_AUTO_FIELD="django.db.models.AutoField",
        DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}},
        SECRET_KEY="not very secret in tests",
        ROOT_URLCONF=__name__,
        MIDDLEWARE=(),
        INSTALLED_APPS=(
            "django.contrib.auth",
            "django.contrib.contenttypes",
            "django.contrib.sessions",
            "rest_framework",
        ),
        PASSWORD_HASHERS=("django.contrib.auth.hashers.MD5PasswordHasher",),
        QUOTA={"URL": os.environ[URL_ENV], "OPTIONS": {"pool_size": 1}},
    )
    django.setup()

    from rest_framework import throttling

    from quota.contrib import drf

    throttling.SimpleRateThrottle = drf.QuotaThrottle
    throttling.AnonRateThrottle = drf.AnonRateThrottle
    throttling.UserRateThrottle = drf.UserRateThrottle
    throttling.ScopedRateThrottle = drf.ScopedRateThrottle


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    from quota.contrib import drf

    for item in items:
        module = getattr(item, "module", None)
        for name in ("AnonRateThrottle", "UserRateThrottle", "ScopedRateThrottle"):
            # The run is about quota's classes: never DRF's by mistake.
            assert getattr(module, name, None) is getattr(drf, name), (item.nodeid, name)
        assert getattr(module, "SimpleRateThrottle", None) is drf.QuotaThrottle, item.nodeid
        reason = XFAIL.get(item.name)
        if reason is not None:
            item.add_marker(pytest.mark.xfail(reason=reason, strict=True))


def _clear_counters() -> None:
    from sqlalchemy import create_engine, text

    url = os.environ[URL_ENV]
    if url.startswith("postgresql://"):
        url = "postgresql+psycopg://" + url[len("postgresql://") :]
    engine = create_engine(url)
    try:
        with engine.begin() as connection:
            connection.execute(text("DELETE FROM quota_counters"))
            connection.execute(text("DELETE FROM quota_state"))
    finally:
        engine.dispose()


@pytest.fixture(autouse=True)
def _quota_fresh(request: pytest.FixtureRequest) -> None:
    _clear_counters()
    if request.node.name in REAL_CLOCK_TESTS:
        fraction = time.time() % 1
        if fraction > 0.5:
            time.sleep(1.0 - fraction + 0.01)


@pytest.fixture(scope="session", autouse=True)
def _close_quota() -> Any:
    yield
    from quota.contrib.django import conf

    conf.reset()
