"""Process targets of the Django tests (spawned: each configures Django itself)."""

from __future__ import annotations

from typing import Any


def migrate(databases: dict[str, Any], quota_setting: dict[str, Any], alias: str) -> None:
    """``manage.py migrate quota`` on `alias`, in a process of its own."""
    import django
    from django.conf import settings
    from django.core.management import call_command

    settings.configure(
        DATABASES=databases,
        INSTALLED_APPS=["quota.contrib.django"],
        QUOTA=quota_setting,
        USE_TZ=True,
    )
    django.setup()
    call_command("migrate", "quota", database=alias, verbosity=0)
