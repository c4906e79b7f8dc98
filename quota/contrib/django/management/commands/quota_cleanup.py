"""``manage.py quota_cleanup``: delete ended rate windows from quota's tables (``quota cleanup``)."""

from __future__ import annotations

from typing import Any, ClassVar

from django.core.management.base import BaseCommand

from ._run import run_cli


class Command(BaseCommand):  # type: ignore[misc]
    help = (
        "Delete rate windows and algorithm state that have ended (never durable quota usage)."
        " With --every, keep running and clean on that period until SIGTERM or Ctrl-C."
        " The same as `quota cleanup`, on quota's database; its exit codes."
    )
    requires_system_checks: ClassVar[list[str]] = []

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument(
            "--every", help="Clean on this period (seconds, or e.g. 30m) until stopped."
        )
        parser.add_argument(
            "--grace", default="60s", help="Keep windows that ended less than this long ago."
        )
        parser.add_argument("--batch-size", default="10000", help="Rows per DELETE.")
        parser.add_argument("--dry-run", action="store_true", help="Only count the expired rows.")
        parser.add_argument(
            "--ledger-older-than",
            help="Also delete quota ledger entries older than this (e.g. 400d; at least 1d).",
        )
        parser.add_argument("--json", action="store_true", help="Machine-readable output.")
        parser.add_argument("--database", default=None, help="The DATABASES alias to clean.")

    def handle(self, *args: Any, **options: Any) -> None:
        arguments = ["cleanup", "--grace", options["grace"], "--batch-size", options["batch_size"]]
        if options["every"] is not None:
            arguments += ["--every", options["every"]]
        if options["ledger_older_than"] is not None:
            arguments += ["--ledger-older-than", options["ledger_older_than"]]
        if options["dry_run"]:
            arguments.append("--dry-run")
        if options["json"]:
            arguments.append("--json")
        run_cli(arguments, database=options["database"], prog_name="manage.py quota_cleanup")
