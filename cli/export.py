"""``quota export``: durable quotas' usage (and ledger) of a time range, as JSON lines or CSV.

A thin layer over `Limiter.export`, which reads in batches: the command streams
each record out as it comes, so its memory stays flat whatever the size of
the export. Exit codes as for every command (see `cli.main`).
"""

from __future__ import annotations

import contextlib
import csv
import datetime as dt
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import click

from quota._limiter.export import (
    DEFAULT_BATCH_SIZE,
    MAX_BATCH_SIZE,
    LedgerRecord,
    UsageRecord,
    fields_of,
)

from .main import Whole, _errors, _limiter, _progress_option, _wants_progress, main, url_option

#: Seconds between two progress lines.
PROGRESS_EVERY = 1.0
#: Records between two looks at the clock for progress.
_CHECK_EVERY = 1000
FORMATS = ("jsonl", "csv")


def _moment(ctx: click.Context, param: click.Parameter, value: str | None) -> dt.datetime | None:
    """An ISO 8601 date (midnight UTC) or date and time (UTC unless it names an offset)."""
    if value is None:
        return None
    text = value.strip()
    bad = click.BadParameter(
        f"{value!r} is not an ISO date or time (2026-01-31, 2026-01-31T12:00:00,"
        " 2026-01-31T12:00:00+01:00)",
        ctx,
        param,
    )
    if not text.isascii():  # fromisoformat reads '\u0661' as the digit 1
        raise bad
    try:
        moment = dt.datetime.fromisoformat(text)
    except ValueError:
        raise bad from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=dt.timezone.utc)
    return moment


class _Progress:
    """Rows written so far, on stderr about once a second when shown."""

    def __init__(self, show: bool) -> None:
        self.show = show
        self.rows = 0
        self.shown_at = time.monotonic()

    def tick(self) -> None:
        self.rows += 1
        if (
            self.show
            and self.rows % _CHECK_EVERY == 0
            and time.monotonic() - self.shown_at >= PROGRESS_EVERY
        ):
            self.shown_at = time.monotonic()
            click.echo(f"export: {self.rows:,} rows written so far", err=True)

    def done(self) -> None:
        if self.show:
            click.echo(f"export: {self.rows:,} rows written", err=True)


@contextlib.contextmanager
def _output(path: str) -> Iterator[IO[str]]:
    """Where the records go: stdout for ``-``; else the file at `path`, which appears whole.

    A regular file is written beside its place under a temporary name and moved
    there when the export is complete, so a failed or interrupted export never
    leaves a file that looks like a whole one. Anything else (``/dev/null``, a
    named pipe) is written as it is.
    """
    if path == "-":
        stream = sys.stdout
        yield stream
        stream.flush()
        return
    target = Path(path)
    if target.is_symlink():  # replace the file it points to, not the link
        target = target.resolve()
    special = target.exists() and not target.is_file()
    try:
        if special:
            stream = open(target, "w", encoding="utf-8", newline="")  # noqa: SIM115
        else:
            handle, temporary = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
            stream = os.fdopen(handle, "w", encoding="utf-8", newline="")
    except OSError as exc:
        raise click.UsageError(f"cannot write --output {path!r}: {exc.strerror or exc}") from None
    if special:
        with stream:
            yield stream
        return
    try:
        with stream:
            yield stream
        os.chmod(temporary, 0o666 & ~_umask())
        os.replace(temporary, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _writable(_ctx: click.Context, _param: click.Parameter, value: str) -> str:
    """`value` if it is ``-`` or a file path whose folder exists."""
    if value != "-":
        folder = Path(value).parent
        if not folder.is_dir():
            raise click.BadParameter(f"{value!r}: the folder {str(folder)!r} does not exist")
        if Path(value).is_dir():
            raise click.BadParameter(f"{value!r} is a folder, not a file")
    return value


@main.command("export")
@click.option(
    "--from", "since", required=True, metavar="DATE", callback=_moment,
    help="Start of the range, included: an ISO date or date and time (UTC unless it has an offset).",
)  # fmt: skip
@click.option(
    "--to", "until", required=True, metavar="DATE", callback=_moment,
    help="End of the range, excluded: as --from.",
)  # fmt: skip
@click.option("--subject", help="Only this subject's quotas.")
@click.option(
    "--format", "fmt", type=click.Choice(FORMATS), default="jsonl", show_default=True,
    help="jsonl: one JSON object per line; csv: a header row, then a row per record.",
)  # fmt: skip
@click.option(
    "--ledger", is_flag=True, help="The ledger entries of the range too, after the usage."
)
@click.option(
    "--output", "-o", default="-", metavar="FILE", callback=_writable,
    help="Write to FILE (it appears when the export is complete); default: stdout.",
)  # fmt: skip
@click.option(
    "--batch-size", type=Whole(minimum=1, maximum=MAX_BATCH_SIZE), default=DEFAULT_BATCH_SIZE,
    show_default=True, help=f"Rows per read (at most {MAX_BATCH_SIZE:,}).",
)  # fmt: skip
@_progress_option
@url_option
@click.pass_context
def export(
    ctx: click.Context, since: dt.datetime, until: dt.datetime, subject: str | None, fmt: str,
    ledger: bool, output: str, batch_size: int, progress: bool | None,
) -> None:  # fmt: skip
    """Durable quotas' usage and ledger from --from to --to, for billing.

    Usage: one record per subject, quota and period whose period starts in
    the range. With --ledger, then one record per ledger entry whose time is
    in the range; its id is stable (a billing meter's idempotency key). Each
    record has a "type": "usage" or "ledger". Streams in constant memory.
    """
    if until <= since:
        raise click.UsageError(
            f"--to must be after --from, got --from {since.isoformat()} --to {until.isoformat()}"
        )
    shown = _Progress(_wants_progress(progress))
    with _errors(), _limiter(ctx) as limiter:
        records = limiter.export(
            since, until, subject=subject, ledger=ledger, batch_size=batch_size
        )
        with _output(output) as stream:
            if fmt == "csv":
                _write_csv(stream, records, ledger, shown)
            else:
                _write_jsonl(stream, records, shown)
    shown.done()


def _write_jsonl(stream: IO[str], records: Iterator[Any], shown: _Progress) -> None:
    write = stream.write
    for record in records:
        write(json.dumps(record.as_dict()) + "\n")
        shown.tick()


def _write_csv(stream: IO[str], records: Iterator[Any], ledger: bool, shown: _Progress) -> None:
    header = fields_of([UsageRecord, LedgerRecord] if ledger else [UsageRecord])
    writer = csv.DictWriter(stream, fieldnames=header, lineterminator="\n")
    writer.writeheader()
    for record in records:
        writer.writerow(record.as_dict())
        shown.tick()


__all__ = ["export"]
