"""quota's reservations of durable quotas (schema revision 0007_reservations)."""

from typing import ClassVar

from django.db import migrations

from quota.contrib.django.operations import QuotaSchema


class Migration(migrations.Migration):  # type: ignore[misc]
    atomic = False  # quota's own run holds its own transaction and lock
    dependencies: ClassVar[list[tuple[str, str]]] = [("quota", "0002_leases")]
    operations: ClassVar[list[QuotaSchema]] = [
        QuotaSchema(target="0007_reservations", previous="0006_leases")
    ]
