"""The Django app: ``INSTALLED_APPS += ["quota.contrib.django"]`` (label ``quota``)."""

from __future__ import annotations

from typing import Any

from django.apps import AppConfig


class QuotaConfig(AppConfig):  # type: ignore[misc]
    """quota's tables (through its migrations), its commands and its decorator.

    quota's tables are created by its own schema revisions, which the app's
    migrations apply; the app's models are table-less entries for the Django
    admin (`quota.contrib.django.admin`).
    """

    name = "quota.contrib.django"
    label = "quota"
    # The admin's models' keys, whatever the project's DEFAULT_AUTO_FIELD (migration 0005).
    default_auto_field = "django.db.models.BigAutoField"
    verbose_name = "quota rate limits"

    def ready(self) -> None:
        _close_before_test_databases_are_destroyed()


def _close_before_test_databases_are_destroyed() -> None:
    """Close quota's connections before Django drops a test database.

    quota reaches the database through connections of its own, which Django
    does not know of: PostgreSQL would refuse to drop a test database they
    still use. Each PostgreSQL and SQLite alias's ``destroy_test_db`` first
    closes quota's limiter (only that alias's creation object is wrapped).
    """
    from django.db import connections

    from quota.contrib.django import conf

    for alias, settings_dict in connections.settings.items():
        if conf._ENGINE_VENDORS.get(str(settings_dict.get("ENGINE") or "")) is None:
            continue
        creation = connections[alias].creation
        destroy = creation.destroy_test_db
        if getattr(destroy, "_quota_wrapped", False):
            continue

        def destroy_test_db(*args: Any, _destroy: Any = destroy, **kwargs: Any) -> Any:
            conf.reset()
            return _destroy(*args, **kwargs)

        destroy_test_db._quota_wrapped = True  # type: ignore[attr-defined]
        creation.destroy_test_db = destroy_test_db
