"""The ``quota`` command: a thin click layer over the library's public functions.

Exit codes (every command; `EXIT_CODES` is the table ``quota --help`` shows):

    0    done; for ``hit`` and ``peek``: allowed
    1    an unexpected error (a bug: please report it)
    2    usage: a bad option, argument or URL, or a store that cannot do this
    3    the database: unreachable, absent (a SQLite file that does not exist),
         schema missing or behind, or a database error; ``doctor``: an error found
    4    the answer is no: ``hit`` / ``peek`` denied, ``policy delete`` found nothing
    130  interrupted (Ctrl-C): what was done so far is printed

Text output gives times as a person reads them (``resets in 1m12s
(2026-01-31T12:03:00Z)``); ``--json`` keeps epoch seconds.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any, TypeVar

import click

import quota
from quota._core.decision import parse_duration
from quota._sql import ops as _ops
from quota._stores.url import DEFAULT_URL, ENV_VAR, parse_url, redact

EXIT_OK = 0
EXIT_CRASH = 1
EXIT_USAGE = 2
EXIT_ERROR = 3
EXIT_DENIED = 4
EXIT_INTERRUPTED = 130

#: The exit-code table, as ``quota --help`` prints it (``\b``: click keeps the lines).
EXIT_CODES = """Exit codes, the same for every command:

\b
  0    done; allowed (hit, peek)
  1    an unexpected error (a bug: please report it)
  2    usage: a bad option, argument or URL
  3    the database: unreachable, absent, schema missing or behind, a database
       error; doctor: an error found
  4    the answer is no: denied (hit, peek), no such override (policy delete)
  130  interrupted (Ctrl-C); what was done so far is printed

Text output gives times as "in 1m12s (2026-01-31T12:03:00Z)", in UTC;
--json gives epoch seconds.
"""

#: Seconds between two progress lines of a long command.
PROGRESS_EVERY = 1.0

T = TypeVar("T")


def _fail(message: str, code: int = EXIT_ERROR) -> None:
    click.echo(f"Error: {message}", err=True)
    sys.exit(code)


@contextmanager
def _errors() -> Iterator[None]:
    """Turn library errors into a one-line message: exit 2 for bad input, 3 for the database."""
    try:
        yield
    except quota.ConfigurationError as exc:
        raise click.UsageError(str(exc)) from exc
    except quota.QuotaError as exc:
        _fail(str(exc))


# -- times as a person reads them ----------------------------------------------------------

_UNITS = (("d", 86400), ("h", 3600), ("m", 60), ("s", 1))


def human_duration(seconds: float) -> str:
    """``42s``, ``1m12s``, ``3h5m``, ``2d1h``: the two largest units, rounded up to a second."""
    left = max(0, math.ceil(seconds))
    parts = []
    for unit, size in _UNITS:
        amount, left = divmod(left, size)
        parts.append((amount, unit))
    first = next((i for i, (amount, _) in enumerate(parts) if amount), len(parts) - 1)
    shown = [f"{amount}{unit}" for amount, unit in parts[first : first + 2] if amount]
    return "".join(shown) or "0s"


def utc(epoch: float) -> str:
    """`epoch` as ISO 8601 in UTC: ``2026-01-31T12:03:00Z`` (milliseconds when it has them)."""
    moment = dt.datetime.fromtimestamp(epoch, dt.timezone.utc)
    fraction = f".{moment.microsecond // 1000:03d}" if epoch != int(epoch) else ""
    return f"{moment:%Y-%m-%dT%H:%M:%S}{fraction}Z"


def when(epoch: float, now: float) -> str:
    """``in 1m12s (2026-01-31T12:03:00Z)``, or ``3s ago (…)`` for a moment past."""
    if epoch >= now:
        return f"in {human_duration(epoch - now)} ({utc(epoch)})"
    return f"{human_duration(now - epoch)} ago ({utc(epoch)})"


# -- where lines go -------------------------------------------------------------------------


class Echo:
    """A command's output: results on stdout, messages on stderr.

    `stamped` (``--every``): each line starts with the UTC time, and ``--json``
    prints one object per line with a ``time`` field.
    """

    def __init__(self, *, stamped: bool = False) -> None:
        self.stamped = stamped

    def _lines(self, text: str) -> str:
        if not self.stamped:
            return text
        now = utc(int(time.time()))
        return "\n".join(f"{now} {line}" for line in text.splitlines() or [""])

    def out(self, text: str) -> None:
        click.echo(self._lines(text))

    def err(self, text: str) -> None:
        click.echo(self._lines(text), err=True)

    def emit(self, data: Any, as_json: bool, text: str) -> None:
        if not as_json:
            self.out(text)
        elif self.stamped:
            click.echo(json.dumps({"time": utc(int(time.time())), **data}, sort_keys=True))
        else:
            click.echo(json.dumps(data, indent=2, sort_keys=True))


def _emit(data: Any, as_json: bool, text: str) -> None:
    Echo().emit(data, as_json, text)


def _on_terminal() -> bool:
    stream = sys.stderr
    return stream is not None and stream.isatty()


def _wants_progress(flag: bool | None) -> bool:
    """``--progress``/``--no-progress``, else whether stderr is a terminal (not cron, not a pipe)."""
    return _on_terminal() if flag is None else flag


_progress_option = click.option(
    "--progress/--no-progress",
    default=None,
    help="Report progress on stderr as the work goes (default: only when stderr is a terminal).",
)


class Whole(click.types.IntParamType):
    """A whole number in ASCII digits, at least `minimum` (click's ``int`` reads U+0661 U+0660 as 10)."""

    name = "integer"
    _TEXT = re.compile(r"-?[0-9]{1,19}")

    def __init__(self, minimum: int | None = None) -> None:
        self.minimum = minimum

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int) and not isinstance(value, bool):
            number = value
        elif isinstance(value, str) and self._TEXT.fullmatch(value.strip()):
            number = int(value.strip())
        else:
            self.fail(f"{value!r} is not a whole number (ASCII digits)", param, ctx)
        if self.minimum is not None and number < self.minimum:
            self.fail(f"{number} is less than {self.minimum}", param, ctx)
        return number


class Number(click.types.FloatParamType):
    """A finite decimal number in ASCII digits (click's ``float`` takes ``nan`` and U+0661 U+0660)."""

    name = "number"
    _TEXT = re.compile(r"(?:[0-9]{1,15}(?:\.[0-9]{0,15})?|\.[0-9]{1,15})(?:[eE][+-]?[0-9]{1,3})?")

    def __init__(self, above: float = 0.0, maximum: float = math.inf) -> None:
        self.above = above
        self.maximum = maximum

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str) and self._TEXT.fullmatch(value.strip()):
            number = float(value.strip())
        else:
            self.fail(f"{value!r} is not a decimal number (ASCII digits)", param, ctx)
        if not self.above < number <= self.maximum:
            self.fail(
                f"{value!r} is not above {self.above:g} and at most {self.maximum:g}", param, ctx
            )
        return number


WHOLE = Whole()
POSITIVE = Whole(minimum=1)


def _duration(name: str) -> Callable[[click.Context, click.Parameter, Any], int | None]:
    def convert(_ctx: click.Context, _param: click.Parameter, value: Any) -> int | None:
        if value is None:
            return None
        try:
            return parse_duration(name, str(value))
        except quota.ConfigurationError as exc:
            raise click.BadParameter(str(exc)) from exc

    return convert


def _url(ctx: click.Context) -> str:
    url: str = ctx.obj["url"]
    return url


def _set_url(ctx: click.Context, _param: click.Parameter, value: str | None) -> None:
    if value is not None:
        ctx.ensure_object(dict)["url"] = value


#: ``quota COMMAND --url URL`` works as well as ``quota --url URL COMMAND``; the
#: one after the command wins. Every command and command group takes it.
url_option = click.option(
    "--url",
    default=None,
    expose_value=False,
    callback=_set_url,
    help=f"Database URL for this command (overrides `quota --url` and ${ENV_VAR}).",
)


def _require_database(url: str) -> None:
    """Exit 3 when `url` names a SQLite file that does not exist (connecting would create it)."""
    with _errors():
        parsed = parse_url(url)
    if parsed.dialect != "sqlite" or parsed.target.startswith("file:"):
        return
    if not Path(parsed.target).exists():
        _fail(
            f"the database does not exist: no SQLite file at {Path(parsed.target).absolute()};"
            f" create it with `quota --url '{redact(url)}' migrate` (or check the path)"
        )


def _limiter(ctx: click.Context) -> quota.Limiter:
    """The limiter of ``--url``; exit 3 if it names a SQLite file that does not exist."""
    url = _url(ctx)
    _require_database(url)
    with _errors():
        return quota.connect(url)


class _Main(click.Group):
    """The root group: Ctrl-C anywhere is exit 130 with one line, never a traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            # On a terminal, off the line where Ctrl-C echoed "^C".
            click.echo(("\n" if _on_terminal() else "") + "interrupted", err=True)
            raise click.exceptions.Exit(EXIT_INTERRUPTED) from None


@click.group(cls=_Main, context_settings={"help_option_names": ["-h", "--help"]}, epilog=EXIT_CODES)
@click.option(
    "--url",
    envvar=ENV_VAR,
    default=DEFAULT_URL,
    show_default=True,
    help=f"Database URL (sqlite:///file.db or postgresql://…). Env: {ENV_VAR}.",
)
@click.version_option(quota.__version__, prog_name="quota")
@click.pass_context
def main(ctx: click.Context, url: str) -> None:
    """Exact rate limits kept in your SQL database.

    Every command also takes --url after its name.
    """
    ctx.ensure_object(dict)
    ctx.obj["url"] = url


_json_option = click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")


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


def _decision_out(decision: quota.Decision, as_json: bool) -> None:
    headers = decision.headers()
    data = {**asdict(decision), "headers": headers}
    verdict = "allowed" if decision.allowed else "denied"
    now = time.time()
    lines = [
        f"{verdict}: {decision.key!r} {decision.count}/{decision.limit}"
        f" in a {human_duration(decision.window)} window, {decision.remaining} remaining,"
        f" resets {when(decision.reset_at, now)}"
        + (f", retry in {human_duration(decision.retry_after)}" if not decision.allowed else ""),
        *(f"{name}: {value}" for name, value in headers.items()),
    ]
    _emit(data, as_json, "\n".join(lines))
    if not decision.allowed:
        sys.exit(EXIT_DENIED)


_limit_option = click.option(
    "--limit", "-l", type=WHOLE, required=True, help="Hits allowed per window."
)
_window_option = click.option(
    "--window",
    "-w",
    required=True,
    callback=_duration("window"),
    help="Window: 60, 60s, 1m, 1h, 1d.",
)


@main.command()
@url_option
@click.argument("key")
@_limit_option
@_window_option
@click.option(
    "--cost", type=WHOLE, default=1, show_default=True, help="Hits this request counts for."
)
@_json_option
@click.pass_context
def hit(ctx: click.Context, key: str, limit: int, window: int, cost: int, as_json: bool) -> None:
    """Count one hit on KEY; print the decision and the HTTP headers an app would send.

    Exits 0 when allowed, 4 when denied.
    """
    with _errors(), _limiter(ctx) as limiter:
        decision = limiter.rate_limit(key, limit, window, cost=cost)
    _decision_out(decision, as_json)


@main.command()
@url_option
@click.argument("key")
@_limit_option
@_window_option
@_json_option
@click.pass_context
def peek(ctx: click.Context, key: str, limit: int, window: int, as_json: bool) -> None:
    """Show KEY's current window without counting a hit (exit 4 if the next hit would be denied)."""
    with _errors(), _limiter(ctx) as limiter:
        decision = limiter.peek(key, limit, window)
    _decision_out(decision, as_json)


@main.command()
@url_option
@click.argument("key")
@click.option("--window", "-w", callback=_duration("window"), help="Only windows of this length.")
@_json_option
@click.pass_context
def reset(ctx: click.Context, key: str, window: int | None, as_json: bool) -> None:
    """Forget KEY's counts, so its next hit starts a fresh window."""
    with _errors(), _limiter(ctx) as limiter:
        deleted = limiter.reset(key, window)
    data = {"key": key, "window": window, "deleted": deleted}
    _emit(data, as_json, f"reset {key!r}: {deleted} row(s) deleted")


@main.command()
@url_option
@click.option("-n", "count", type=WHOLE, default=10, show_default=True, help="How many keys.")
@_json_option
@click.pass_context
def top(ctx: click.Context, count: int, as_json: bool) -> None:
    """The busiest keys in the windows running now."""
    with _errors(), _limiter(ctx) as limiter:
        rows = limiter.top(count)
    now = time.time()
    text = "\n".join(
        [f"{'COUNT':>8}  {'WINDOW':>7}  {'RESETS IN':>9}  {'RESETS AT (UTC)':<20}  KEY"]
        + [
            f"{u.count:>8}  {human_duration(u.window):>7}  {human_duration(u.reset_at - now):>9}"
            f"  {utc(u.reset_at):<20}  {u.key}"
            for u in rows
        ]
    )
    _emit([asdict(u) for u in rows], as_json, text)


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


def _cleanup(
    limiter: quota.Limiter, *, grace: int, batch_size: int, dry_run: bool, progress: _Sweep
) -> _ops.CleanupResult:
    """`Limiter.cleanup`, reporting each committed batch to `progress`."""
    op = _ops.cleanup(
        limiter.store.dialect, limiter._clock(), grace=grace, batch_size=batch_size,
        dry_run=dry_run, progress=progress,
    )  # fmt: skip
    return limiter.store.run(op, transaction=False)


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

    The quota ledger is kept forever unless --ledger-older-than is given:
    then its entries older than that go too (idempotency keys of charges
    deleted with them are forgotten).

    On PostgreSQL only one cleanup runs at a time: a second one says so and
    exits 0. Ctrl-C stops a cleanup between two batches (every batch deleted
    stays deleted), says how many rows went and exits 130; under --every,
    SIGTERM or Ctrl-C stops it the same way and exits 0.
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
        result = _cleanup(
            limiter, grace=grace, batch_size=batch_size, dry_run=dry_run, progress=sweep
        )
        if result.skipped:
            text = "another cleanup is running; skipped"
        elif result.dry_run:
            text = f"{result.expired:,} expired row(s) would be deleted"
        else:
            text = f"deleted {result.deleted:,} expired row(s)"
        data: dict[str, Any] = asdict(result)
        if ledger_older_than is not None:
            sweep.ledger = True
            kept = limiter.cleanup_ledger(
                older_than=ledger_older_than, batch_size=batch_size, dry_run=dry_run
            )
            data["ledger"] = asdict(kept)
            verb = "would be deleted" if kept.dry_run else "deleted"
            text += f"\n{kept.expired} ledger entr{'y' if kept.expired == 1 else 'ies'} {verb}"
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


def _every(period: int, job: Callable[[], None], echo: Echo, stop: threading.Event) -> None:
    """Run `job` now and then every `period` seconds until SIGTERM/SIGINT; survive failing runs."""

    def on_signal(signum: int, _frame: object) -> None:
        echo.err(f"received {signal.Signals(signum).name}, stopping")
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        while not stop.is_set():
            try:
                job()
            except quota.QuotaError as exc:
                # A scheduler must outlive a database blip: report, retry next period.
                echo.err(f"Error: {exc}")
            stop.wait(period)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@main.command()
@url_option
@click.option(
    "--clients", type=POSITIVE, default=6, show_default=True, help="Number of simulated clients."
)
@click.pass_context
def demo(ctx: click.Context, clients: int) -> None:
    """Drive a realistic burst through the real engine and print who got through.

    Creates and migrates the database if needed (the embedded SQLite file by
    default), runs anonymous and authenticated clients at once, then cleans up.
    """
    from quota._tools.demo import run_demo

    with _errors():
        run_demo(_url(ctx), clients=clients, echo=click.echo)


@main.command()
@url_option
@click.option(
    "--concurrency", "-c", type=WHOLE, default=8, show_default=True, help="Concurrent callers."
)
@click.option("--keys", "-k", type=WHOLE, default=1000, show_default=True, help="Distinct keys.")
@click.option(
    "--duration",
    "-d",
    type=Number(maximum=86400),
    default=3.0,
    show_default=True,
    help="Seconds per measurement.",
)
@click.option(
    "--runs", "-r", type=WHOLE, default=3, show_default=True, help="Runs; medians are reported."
)
@click.option(
    "--face", type=click.Choice(["auto", "sync", "async"]), default="auto", show_default=True,
    help="auto: async for PostgreSQL, sync for SQLite.",
)  # fmt: skip
@click.option(
    "--scenario", type=click.Choice(["rate", "quota", "check"]), default="rate",
    show_default=True,
    help="rate: rate_limit; quota: consume_quota with idempotency keys (--keys subjects);"
    " check: two rate windows and a quota, all or nothing.",
)  # fmt: skip
@click.option(
    "--algorithm", type=click.Choice(list(quota.ALGORITHMS)), default="fixed_window",
    show_default=True,
    help="What the rate scenario's quota side runs; the bare side stays the fixed-window upsert.",
)  # fmt: skip
@click.option(
    "--fallback", is_flag=True,
    help="Compare quota with fallback=True against quota without: the resilience layer's"
    " cost on a healthy store (rate scenario).",
)  # fmt: skip
@click.option(
    "--pool-size", type=WHOLE, default=None,
    help="Connections quota's side may open (default: one per caller, like the bare side):"
    " fewer measures callers sharing a pool.",
)  # fmt: skip
@_progress_option
@_json_option
@click.pass_context
def bench(
    ctx: click.Context,
    concurrency: int,
    keys: int,
    duration: float,
    runs: int,
    face: str,
    scenario: str,
    algorithm: str,
    fallback: bool,
    pool_size: int | None,
    progress: bool | None,
    as_json: bool,
) -> None:
    """Decisions per second of quota beside the bare driver running the same statements.

    Runs against --url (migrating it first). Prints both rates and their
    ratio, medians of --runs alternating runs.
    A line per run on stderr tells how far it got (on a terminal, or with
    --progress).
    """
    from quota._tools.bench import run_bench

    show = _wants_progress(progress)

    def say(line: str) -> None:
        if show:
            click.echo(line, err=True)

    with _errors():
        report = run_bench(
            _url(ctx), concurrency=concurrency, keys=keys, duration=duration, runs=runs, face=face,
            scenario=scenario, algorithm=algorithm, fallback=fallback, pool_size=pool_size,
            progress=say,
        )  # fmt: skip
    _emit(report.as_dict(), as_json, report.table())
