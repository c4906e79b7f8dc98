"""``manage.py quota COMMAND …``: the ``quota`` command line on the project's database."""

from __future__ import annotations

import argparse
from typing import Any, ClassVar

from django.core.management.base import BaseCommand

from ._run import run_cli


class Command(BaseCommand):  # type: ignore[misc]
    help = (
        "Run a `quota` command (doctor, top, reset, usage, grant, refund, ledger, policy …,"
        " cleanup, migrate, hit, peek) with --url set to quota's database: QUOTA['URL'], else"
        " the QUOTA['DATABASE'] alias (default). `manage.py quota --help-quota` lists the"
        " commands; exit codes are quota's."
    )
    requires_system_checks: ClassVar[list[str]] = []

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument(
            "--database",
            default=None,
            help="The DATABASES alias to run on (default: QUOTA['URL'] or QUOTA['DATABASE']).",
        )
        parser.add_argument(
            "--help-quota", action="store_true", help="Show the quota command line's help."
        )
        parser.add_argument("quota_args", nargs=argparse.REMAINDER, metavar="COMMAND ...")

    def handle(self, *args: Any, **options: Any) -> None:
        arguments = list(options["quota_args"])
        if options["help_quota"] or not arguments:
            arguments = ["--help", *arguments]
        run_cli(arguments, database=options["database"], prog_name="manage.py quota")
