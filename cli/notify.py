"""``quota notify``: deliver usage threshold events to a webhook (a thin layer over `quota.notify`).

Exit codes as for every command (see `cli.main`); SIGTERM or Ctrl-C stops the worker
after the event it is delivering, and it exits 0.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading

import click

from quota import notify as _notify

from .main import Echo, _duration, _errors, _json_option, _limiter, main, url_option

#: Where ``--secret`` is read from when not given.
SECRET_ENV = "QUOTA_WEBHOOK_SECRET"


@main.command()
@url_option
@click.option("--webhook", required=True, help="The http(s) URL each event is POSTed to.")
@click.option(
    "--secret", envvar=SECRET_ENV, show_envvar=True, default=None,
    help="Sign each body: header Quota-Signature: sha256=<hex HMAC-SHA256 of the body>.",
)  # fmt: skip
@click.option("--once", is_flag=True, help="Deliver the events due now, then exit.")
@click.option(
    "--lease", default="60s", show_default=True, callback=_duration("lease"),
    help="How long a worker holds the events it claimed; a killed worker's come back after it.",
)  # fmt: skip
@click.option(
    "--timeout", default="10s", show_default=True, callback=_duration("timeout"),
    help="How long to wait for the receiver's answer to one POST.",
)  # fmt: skip
@click.option(
    "--max-backoff", default="60s", show_default=True, callback=_duration("max-backoff"),
    help="The longest wait before a failed event is tried again.",
)  # fmt: skip
@click.option(
    "--batch", type=click.IntRange(1, 10_000), default=100, show_default=True,
    help="Events claimed at once.",
)  # fmt: skip
@_json_option
@click.pass_context
def notify(
    ctx: click.Context, webhook: str, secret: str | None, once: bool, lease: int, timeout: int,
    max_backoff: int, batch: int, as_json: bool,
) -> None:  # fmt: skip
    """POST each usage threshold event to --webhook as JSON, at least once.

    Runs until SIGTERM or Ctrl-C (then exits 0), or with --once until the
    events due now are delivered or have failed (failed ones wait out their
    backoff for the next run). Several workers may run at once. A failed
    POST (no answer, or not 2xx) is retried with exponential backoff and
    jitter up to --max-backoff; an event is never dropped. With --json,
    --once prints {"claimed": …, "delivered": …, "failed": …}.
    """
    echo = Echo()
    # The worker's lines (each event delivered or failed) on stderr, for this run only.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
    logger = logging.getLogger("quota.notify")
    logger.addHandler(handler)
    # setLevel, not an assignment: it clears the logger's cache of levels already asked for.
    level = logger.level
    logger.setLevel(logging.INFO)
    # A logging configuration loaded before (disable_existing_loggers) may have turned it off.
    disabled, logger.disabled = logger.disabled, False
    try:
        _notify_with(ctx, echo, webhook, secret, once, lease, timeout, max_backoff, batch, as_json)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.disabled = disabled


def _notify_with(
    ctx: click.Context, echo: Echo, webhook: str, secret: str | None, once: bool, lease: int,
    timeout: int, max_backoff: int, batch: int, as_json: bool,
) -> None:  # fmt: skip
    with _errors(), _limiter(ctx) as limiter:
        worker = _notify.Notifier(
            limiter, webhook, secret=secret or None, lease=lease, timeout=timeout,
            max_backoff=max_backoff, batch=batch,
        )  # fmt: skip
        if once:
            done = worker.drain()
            echo.emit(
                {"claimed": done.claimed, "delivered": done.delivered, "failed": done.failed},
                as_json,
                f"delivered {done.delivered} event(s), {done.failed} failed",
            )
            return
        stop = threading.Event()

        def on_signal(signum: int, _frame: object) -> None:
            click.echo(f"received {signal.Signals(signum).name}, stopping", err=True)
            stop.set()

        previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            click.echo(f"delivering threshold events to {webhook}", err=True)
            worker.run(stop)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
