"""quota's concurrency leases table (schema revision 0006_leases)."""

from typing import ClassVar

from django.db import migrations

from quota.contrib.django.operations import QuotaSchema


class Migration(migrations.Migration):  # type: ignore[misc]
    atomic = False  # quota's own run holds its own transaction and lock
    dependencies: ClassVar[list[tuple[str, str]]] = [("quota", "0001_initial")]
    operations: ClassVar[list[QuotaSchema]] = [
        QuotaSchema(target="0006_leases", previous="0005_settings")
    ]
