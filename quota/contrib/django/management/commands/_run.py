"""Running the ``quota`` command line from ``manage.py``, on the project's database."""

from __future__ import annotations

import importlib
from collections.abc import Sequence

from django.core.management.base import CommandError

from quota.contrib.django.conf import database_url


def run_cli(args: Sequence[str], *, database: str | None, prog_name: str) -> None:
    """Run ``quota ARGS`` with ``--url`` set to quota's database; keep its exit code.

    Returns on exit code 0; any other code leaves as `SystemExit` with that code
    (``manage.py`` exits with it), the command having printed its message.
    """
    # The command line ships inside the wheel as quota._cli (cli/ in a checkout).
    main = importlib.import_module("quota._cli").main

    try:
        url = database_url(database)
    except Exception as exc:
        raise CommandError(str(exc), returncode=2) from exc
    try:
        main.main(args=["--url", url, *args], prog_name=prog_name, standalone_mode=True)
    except SystemExit as exc:
        if exc.code in (0, None):
            return
        raise
