"""The ``quota`` command: a thin click layer over the library's public functions.

Exit codes (every command; `EXIT_CODES` is the table ``quota --help`` shows):

    0    done; for ``hit`` and ``peek``: allowed
    1    an unexpected error (a bug: please report it)
    2    usage: a bad option, argument or URL, or a store that cannot do this
    3    the database: unreachable, absent (a SQLite file that does not exist),
         schema missing or behind, or a database error; ``doctor``: an error found
    4    the answer is no: ``hit`` / ``peek`` denied, ``peek --leases`` found no slot
         free, ``policy delete`` found nothing
    130  interrupted (Ctrl-C): what was done so far is printed
    141  the reader of the output went away (``quota demo | head -1``): the
         command stops quietly, as a Unix tool killed by SIGPIPE

Text output gives times as a person reads them (``resets in 1m12s
(2026-01-31T12:03:00Z)``); ``--json`` keeps epoch seconds.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import click

import quota
from quota._core.decision import parse_duration
from quota._core.parsing import parse_decimal, parse_whole
from quota._core.redaction import redact
from quota._core.url import DEFAULT_URL, ENV_VAR, parse_url

EXIT_OK = 0
EXIT_CRASH = 1
EXIT_USAGE = 2
EXIT_ERROR = 3
EXIT_DENIED = 4
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, as a Unix tool the pipe's reader left

#: The exit-code table, as ``quota --help`` prints it (``\b``: click keeps the lines).
EXIT_CODES = """Exit codes, the same for every command:

\b
  0    done; allowed (hit, peek)
  1    an unexpected error (a bug: please report it)
  2    usage: a bad option, argument or URL
  3    the database: unreachable, absent, schema missing or behind, a database
       error; doctor: an error found
  4    the answer is no: denied (hit, peek), no slot free (peek --leases),
       nothing to delete (policy delete, policy unset)
  130  interrupted (Ctrl-C); what was done so far is printed
  141  the output's reader went away (quota demo | head -1), quietly

Text output gives times as "in 1m12s (2026-01-31T12:03:00Z)", in UTC;
--json gives epoch seconds.
"""

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
    """A whole number in ASCII digits in ``minimum..maximum`` (click's ``int`` reads U+0661 U+0660 as 10)."""

    name = "integer"

    def __init__(self, minimum: int | None = None, maximum: int | None = None) -> None:
        self.minimum = minimum
        self.maximum = maximum

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int) and not isinstance(value, bool):
            number = value
        elif isinstance(value, str) and (whole := parse_whole(value, signed=True)) is not None:
            number = whole
        else:
            self.fail(f"{value!r} is not a whole number (ASCII digits)", param, ctx)
        if self.minimum is not None and number < self.minimum:
            self.fail(f"{number} is less than {self.minimum}", param, ctx)
        if self.maximum is not None and number > self.maximum:
            self.fail(f"{number} is more than {self.maximum}", param, ctx)
        return number


class Number(click.types.FloatParamType):
    """A finite decimal number in ASCII digits (click's ``float`` takes ``nan`` and U+0661 U+0660)."""

    name = "number"

    def __init__(self, above: float = 0.0, maximum: float = math.inf) -> None:
        self.above = above
        self.maximum = maximum

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str) and (decimal := parse_decimal(value)) is not None:
            number = decimal
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
    """The root group: Ctrl-C anywhere is exit 130 with one line, never a traceback; a
    reader that stops reading (``quota demo | head -1``) is exit 141, without a word."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            # On a terminal, off the line where Ctrl-C echoed "^C".
            click.echo(("\n" if _on_terminal() else "") + "interrupted", err=True)
            raise click.exceptions.Exit(EXIT_INTERRUPTED) from None
        except BrokenPipeError:
            _quit_broken_pipe()

    def make_context(self, *args: Any, **kwargs: Any) -> click.Context:
        try:  # ``quota --help | head -1`` writes while parsing
            return super().make_context(*args, **kwargs)
        except BrokenPipeError:
            _quit_broken_pipe()


def _quit_broken_pipe() -> NoReturn:
    # What is still buffered for the closed pipe goes nowhere, so that
    # flushing it at exit raises nothing more.
    try:
        fileno = sys.stdout.fileno()
    except (OSError, ValueError):  # not a file (a test runner's capture): nothing buffered
        pass
    else:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, fileno)
        os.close(devnull)
    raise click.exceptions.Exit(EXIT_BROKEN_PIPE) from None


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
