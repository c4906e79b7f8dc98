"""quota's outbox of usage threshold events (schema revision 0008_thresholds)."""

from typing import ClassVar

from django.db import migrations

from quota.contrib.django.operations import QuotaSchema


class Migration(migrations.Migration):  # type: ignore[misc]
    atomic = False  # quota's own run holds its own transaction and lock
    dependencies: ClassVar[list[tuple[str, str]]] = [("quota", "0003_reservations")]
    operations: ClassVar[list[QuotaSchema]] = [
        QuotaSchema(target="0008_thresholds", previous="0007_reservations")
    ]
