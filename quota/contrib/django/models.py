"""The models the Django admin lists quota's data under (label ``quota``).

Django's admin needs a model class for each entry of its index and for its
permissions. These have no table of their own (``managed = False``) and are
never queried: the admin classes in `quota.contrib.django.admin` read and
write quota's data through `quota.admin`, wherever ``QUOTA`` puts its tables.
"""

from __future__ import annotations

from django.db import models


class RoutePolicy(models.Model):  # type: ignore[misc]
    """A runtime route policy override (``quota_policies``)."""

    class Meta:
        managed = False
        db_table = "quota_admin_route_policy"
        verbose_name = "route policy"
        verbose_name_plural = "route policies"


class Setting(models.Model):  # type: ignore[misc]
    """A runtime setting: a tier multiplier or the abuse threshold (``quota_settings``)."""

    class Meta:
        managed = False
        db_table = "quota_admin_setting"
        verbose_name = "setting"
        verbose_name_plural = "settings"


class HotKey(models.Model):  # type: ignore[misc]
    """A busy key's fixed windows: counters, read-only, reset by an action."""

    class Meta:
        managed = False
        db_table = "quota_admin_hot_key"
        verbose_name = "hot key"
        verbose_name_plural = "hot keys"
        default_permissions = ("view",)
        permissions = (("reset_hotkey", "Can reset a key's counts"),)


class SubjectUsage(models.Model):  # type: ignore[misc]
    """A subject's durable quota usage and ledger: read-only."""

    class Meta:
        managed = False
        db_table = "quota_admin_subject_usage"
        verbose_name = "durable usage and ledger"
        verbose_name_plural = "durable usage and ledger"
        default_permissions = ("view",)
