"""Django is configured here as in ``tests/contrib/django`` (the same settings, whichever
directory is collected first); quota's throttles count on ``QUOTA["URL"]``, a migrated
SQLite file or PostgreSQL database of the test (`quota_url`)."""

from __future__ import annotations

from collections.abc import Iterator

import django
import pytest
from django.conf import settings

if not settings.configured:
    from tests.contrib.django import settings as test_settings

    settings.configure(
        **{name: getattr(test_settings, name) for name in dir(test_settings) if name.isupper()}
    )
    django.setup()

from django.test import override_settings

from quota.contrib.django import conf


@pytest.fixture
def quota_url(sql_url: str) -> Iterator[str]:
    """The throttles count on `sql_url` (each SQL dialect) through the Django app's limiter."""
    with override_settings(QUOTA={"URL": sql_url, "OPTIONS": {"pool_size": 1}}):
        yield sql_url
    conf.reset()
