"""The Django admin's table-less models (state only: no database operation)."""

from typing import ClassVar

from django.db import migrations, models


def _admin_model(name: str, **options: object) -> migrations.CreateModel:
    """An unmanaged model: Django records it, creates no table."""
    return migrations.CreateModel(
        name=name,
        fields=[
            (
                "id",
                models.BigAutoField(
                    auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                ),
            )
        ],
        options={"managed": False, **options},
    )


class Migration(migrations.Migration):  # type: ignore[misc]
    dependencies: ClassVar[list[tuple[str, str]]] = [("quota", "0004_thresholds")]
    operations: ClassVar[list[migrations.CreateModel]] = [
        _admin_model(
            "HotKey",
            verbose_name="hot key",
            verbose_name_plural="hot keys",
            db_table="quota_admin_hot_key",
            permissions=(("reset_hotkey", "Can reset a key's counts"),),
            default_permissions=("view",),
        ),
        _admin_model(
            "RoutePolicy",
            verbose_name="route policy",
            verbose_name_plural="route policies",
            db_table="quota_admin_route_policy",
        ),
        _admin_model(
            "Setting",
            verbose_name="setting",
            verbose_name_plural="settings",
            db_table="quota_admin_setting",
        ),
        _admin_model(
            "SubjectUsage",
            verbose_name="durable usage and ledger",
            verbose_name_plural="durable usage and ledger",
            db_table="quota_admin_subject_usage",
            default_permissions=("view",),
        ),
    ]
