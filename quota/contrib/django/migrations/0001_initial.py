"""quota's tables at schema revision 0005_settings (counters, quotas, algorithm state,
policies, settings)."""

from typing import ClassVar

from django.db import migrations

from quota.contrib.django.operations import QuotaSchema


class Migration(migrations.Migration):  # type: ignore[misc]
    initial = True
    atomic = False  # quota's own run holds its own transaction and lock
    dependencies: ClassVar[list[tuple[str, str]]] = []
    operations: ClassVar[list[QuotaSchema]] = [QuotaSchema(target="0005_settings")]
