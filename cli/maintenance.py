"""``quota migrate``, ``downgrade`` and ``cleanup``: the schema and the sweep of expired rows.

(``quota doctor`` is in `cli.doctor`.) Exit codes as for every command (see `cli.main`).
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import click

import quota

from .main import (
    EXIT_INTERRUPTED,
    WHOLE,
    Echo,
    _duration,
    _errors,
    _json_option,
    _limiter,
    _on_terminal,
    _progress_option,
    _require_database,
    _url,
    _wants_progress,
    main,
    url_option,
)


def _revision_out(ctx: click.Context, as_json: bool) -> None:
    with _errors():
        now = quota.current_revision(_url(ctx))
    click.echo(f"quota schema at {now or 'base (no quota tables)'}", err=True)
    if as_json:
        click.echo(json.dumps({"revision": now}))


@main.command()
@url_option
@click.option("--revision", default="head", show_default=True, help="Target revision.")
@click.option("--sql", is_flag=True, help="Print the SQL instead of running it (for a DBA).")
@click.option(
    "--logged-counters",
    is_flag=True,
    help="PostgreSQL: create the counters table as a normal logged table instead of UNLOGGED.",
)
@click.option(
    "--partitioned-counters",
    is_flag=True,
    help="PostgreSQL: create the counters table range-partitioned by window start, so"
    " cleanup drops whole expired partitions instead of deleting rows.",
)
@_json_option
@click.pass_context
def migrate(
    ctx: click.Context, revision: str, sql: bool, logged_counters: bool, partitioned_counters: bool,
    as_json: bool,
) -> None:  # fmt: skip
    """Create or upgrade the quota tables (the deploy step).

    With --json, prints the revision reached: {"revision": "…"}.
    """
    if sql and as_json:
        raise click.UsageError("--sql prints the SQL, --json the revision reached: give one")
    with _errors():
        quota.migrate(
            _url(ctx), revision=revision, sql=sql, counters_logged=logged_counters,
            counters_partitioned=partitioned_counters,
        )  # fmt: skip
    if not sql:
        _revision_out(ctx, as_json)


@main.command()
@url_option
@click.argument("revision")
@click.option("--sql", is_flag=True, help="Print the SQL instead of running it.")
@click.option(
    "--drop-data", is_flag=True,
    help="Drop tables that hold durable rows (quota usage, the ledger, runtime policies);"
    " without it such a downgrade is refused (exit 2, a usage error) and names the tables and row counts.",
)  # fmt: skip
@_json_option
@click.pass_context
def downgrade(ctx: click.Context, revision: str, sql: bool, drop_data: bool, as_json: bool) -> None:
    """Downgrade the quota tables to REVISION ('base' drops them all).

    With --json, prints the revision reached ({"revision": null} at base).
    """
    if sql and as_json:
        raise click.UsageError("--sql prints the SQL, --json the revision reached: give one")
    if not sql:
        _require_database(_url(ctx))
    with _errors():
        quota.downgrade(_url(ctx), revision=revision, sql=sql, drop_data=drop_data)
    if not sql:
        _revision_out(ctx, as_json)


#: Seconds between two progress lines of a long command.
PROGRESS_EVERY = 1.0


class _Stopped(BaseException):
    """SIGTERM or Ctrl-C reached ``cleanup --every`` mid-sweep: stop after this slice.

    A BaseException, so no store turns it into a `quota.StorageError`.
    """


class _Sweep:
    """One cleanup's progress: the rows deleted so far, and a line now and then when shown."""

    def __init__(self, echo: Echo, *, show: bool, stop: threading.Event) -> None:
        self.echo = echo
        self.show = show
        self.stop = stop
        self.start()

    def start(self) -> None:
        self.deleted = 0
        self.ledger = False  # past the rate windows, trimming the ledger
        self.shown_at = time.monotonic()

    def __call__(self, deleted: int) -> None:
        self.deleted = deleted
        if self.show and time.monotonic() - self.shown_at >= PROGRESS_EVERY:
            self.shown_at = time.monotonic()
            self.echo.err(f"cleanup: {deleted:,} rows deleted so far")
        if self.stop.is_set():
            raise _Stopped

    def summary(self) -> str:
        done = f"at least {self.deleted:,} rows deleted"
        if self.ledger:
            return f"{done}, then stopped while trimming the ledger"
        return done


@main.command()
@url_option
@click.option(
    "--grace", default="60s", show_default=True, callback=_duration("grace"),
    help="Keep windows that ended less than this long ago.",
)  # fmt: skip
@click.option(
    "--batch-size", type=WHOLE, default=10_000, show_default=True, help="Rows per DELETE."
)
@click.option("--dry-run", is_flag=True, help="Only count the expired rows.")
@click.option(
    "--every", callback=_duration("every"),
    help="Keep running and clean on this period (e.g. 30m) until SIGTERM or Ctrl-C;"
    " each line starts with the UTC time.",
)  # fmt: skip
@click.option(
    "--ledger-older-than", callback=_duration("ledger-older-than"),
    help="Also delete quota ledger entries older than this (e.g. 400d; at least 1d).",
)  # fmt: skip
@_progress_option
@_json_option
@click.pass_context
def cleanup(
    ctx: click.Context, grace: int, batch_size: int, dry_run: bool, every: int | None,
    ledger_older_than: int | None, progress: bool | None, as_json: bool,
) -> None:  # fmt: skip
    """Delete rate windows and algorithm state that have ended. Never touches durable quotas' usage.

    Reservations of durable quotas not settled within their ttl are released
    (a ``release`` ledger entry each). The quota ledger is kept forever unless
    --ledger-older-than is given: then its entries older than that go too,
    with the reservations that ended before then (idempotency keys of charges
    and reservations deleted with them are forgotten). Threshold events
    delivered by `quota notify` go once older than --ledger-older-than (30 days
    without it); events not delivered yet are kept.

    On PostgreSQL only one cleanup runs at a time: a second one says so and
    exits 0. Ctrl-C stops a cleanup between two batches (every batch deleted
    stays deleted), says how many rows went and exits 130; under --every,
    SIGTERM or Ctrl-C stops it the same way and exits 0; a failed run is
    retried next period, unless no retry mends it (schema missing or behind,
    a bad setting, a refused login or privilege): that exits at once (3, or 2).
    """
    if ledger_older_than is not None and ledger_older_than < 86400:
        raise click.BadParameter("must be at least 1d", param_hint="--ledger-older-than")
    if every is not None and every < 1:
        raise click.BadParameter("must be at least 1s", param_hint="--every")
    echo = Echo(stamped=every is not None)
    stop = threading.Event()
    sweep = _Sweep(echo, show=_wants_progress(progress), stop=stop)

    def once(limiter: quota.Limiter) -> None:
        sweep.start()
        result = limiter.cleanup(
            grace=grace, batch_size=batch_size, dry_run=dry_run, progress=sweep
        )
        if result.skipped:
            text = "another cleanup is running; skipped"
        elif result.dry_run:
            text = f"{result.expired:,} expired row(s) would be deleted"
        else:
            text = f"deleted {result.deleted:,} expired row(s)"
        if result.released:
            verb = "would be released" if result.dry_run else "released"
            text += f"\n{result.released:,} reservation(s) past their ttl {verb}"
        data: dict[str, Any] = asdict(result)
        if ledger_older_than is not None:
            sweep.ledger = True
            kept = limiter.cleanup_ledger(
                older_than=ledger_older_than, batch_size=batch_size, dry_run=dry_run
            )
            data["ledger"] = asdict(kept)
            verb = "would be deleted" if kept.dry_run else "deleted"
            text += f"\n{kept.expired} ledger entr{'y' if kept.expired == 1 else 'ies'} {verb}"
        events = _cleanup_events(limiter, ledger_older_than, batch_size, dry_run)
        if events is not None:
            data["events"] = asdict(events)
            if events.expired:  # a line only when there were some: most runs have none
                verb = "would be deleted" if events.dry_run else "deleted"
                text += f"\n{events.expired} delivered threshold event(s) {verb}"
        echo.emit(data, as_json, text)

    with _errors(), _limiter(ctx) as limiter:
        try:
            if every is None:
                once(limiter)
            else:
                _every(every, lambda: once(limiter), echo, stop)
        except KeyboardInterrupt:
            what = "nothing deleted (a dry run)" if dry_run else sweep.summary()
            if _on_terminal():
                click.echo(err=True)  # off the line where Ctrl-C echoed "^C"
            echo.err(f"cleanup interrupted: {what}; run it again to finish")
            sys.exit(EXIT_INTERRUPTED)
        except _Stopped:
            echo.err(f"stopped mid-sweep: {sweep.summary()}")


def _cleanup_events(
    limiter: quota.Limiter, older_than: int | None, batch_size: int, dry_run: bool
) -> quota.CleanupResult | None:
    """Delete delivered threshold events; None on a database without the outbox yet
    (a revision before 0008_thresholds: nothing to delete, nothing to report)."""
    try:
        if older_than is None:
            return limiter.cleanup_events(batch_size=batch_size, dry_run=dry_run)
        return limiter.cleanup_events(older_than=older_than, batch_size=batch_size, dry_run=dry_run)
    except quota.SchemaError as exc:
        if exc.outage or "quota_events comes with revision" not in str(exc):
            raise
        return None


#: SQLSTATE classes and codes no retry mends: invalid authorization (28), a database or
#: schema that does not exist (3D000, 3F000), a statement refused for its syntax or the
#: role's privileges (42: insufficient_privilege, an undefined table or column).
_PERMANENT_SQLSTATES = ("28", "3D000", "3F000", "42")
#: SQLite result codes no retry mends: permission denied, read-only file, not
#: authorized, a corrupt file, not a database.
_PERMANENT_SQLITE_CODES = frozenset({3, 8, 23, 11, 26})


def _permanent(exc: quota.QuotaError) -> bool:
    """True when `exc` will be raised again by every later run: a bad setting, a missing
    or older schema, a refused login or privilege; False for an outage or any other
    database error, which a later run may not meet."""
    if isinstance(exc, quota.ConfigurationError | quota.SchemaError):
        return True
    cause = exc.__cause__
    sqlstate = getattr(cause, "sqlstate", None)
    if isinstance(sqlstate, str):
        return sqlstate.startswith(_PERMANENT_SQLSTATES)
    code = getattr(cause, "sqlite_errorcode", None)
    return isinstance(code, int) and code & 0xFF in _PERMANENT_SQLITE_CODES


def _every(period: int, job: Callable[[], None], echo: Echo, stop: threading.Event) -> None:
    """Run `job` now and then every `period` seconds until SIGTERM/SIGINT.

    A run that fails for a passing reason (an outage, a lock timeout) is reported and
    the next period tries again; a permanent error (`_permanent`) is raised at once.
    """

    def on_signal(signum: int, _frame: object) -> None:
        echo.err(f"received {signal.Signals(signum).name}, stopping")
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        while not stop.is_set():
            try:
                job()
            except quota.QuotaError as exc:
                if _permanent(exc):
                    raise  # no next period mends it: exit now, with the command's code
                # A scheduler must outlive a database blip: report, retry next period.
                echo.err(f"Error: {exc}")
            stop.wait(period)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
