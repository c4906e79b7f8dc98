"""``quota usage``, ``grant``, ``refund`` and ``ledger``: durable quotas from the shell.

A thin layer over `quota.admin.Admin.usage` and `ledger` and over
`Limiter.grant_quota` and `refund_quota`. Exit codes as for every command (see `cli.main`): 0 done (a refund
that found nothing to give back is done too, and says so), 2 bad option,
argument or URL, 3 database or schema error.
"""

from __future__ import annotations

import csv
import datetime as dt
import io
import time
from dataclasses import asdict
from typing import Any

import click

import quota
from quota._core.decision import parse_duration
from quota._core.periods import CALENDAR
from quota.admin import Admin

from .main import (
    WHOLE,
    _emit,
    _errors,
    _json_option,
    _limiter,
    human_duration,
    main,
    url_option,
    utc,
    when,
)


def _iso(epoch: float | None) -> str:
    """`epoch` as ISO 8601 in UTC (``-`` for None), as the ledger's JSON and CSV give it."""
    if epoch is None:
        return "-"
    moment = dt.datetime.fromtimestamp(epoch, dt.timezone.utc)
    return moment.isoformat(timespec="seconds" if epoch == int(epoch) else "milliseconds")


def _period(_ctx: click.Context, _param: click.Parameter, value: str) -> str | int:
    if value in CALENDAR:
        return value
    try:
        return parse_duration("period", value)
    except quota.ConfigurationError:
        raise click.BadParameter(
            f"{value!r} is not one of {', '.join(CALENDAR)} or a duration (3600, 90m, 12h, 7d)"
        ) from None


def _since(_ctx: click.Context, _param: click.Parameter, value: str | None) -> float | None:
    """``7d`` (that long ago) or an ISO 8601 date or time (UTC unless it names an offset)."""
    if value is None:
        return None
    text = value.strip()
    bad = click.BadParameter(
        f"{value!r} is neither a duration ago (7d, 12h) nor an ISO date or time"
        " (2026-01-31, 2026-01-31T12:00:00+01:00)"
    )
    if not text.isascii():  # fromisoformat and int() read '\u0661\u0660' as 10
        raise bad
    if text[-1:].isalpha() and text[:-1].isdigit():
        try:
            return time.time() - parse_duration("since", text)
        except quota.ConfigurationError as exc:
            raise click.BadParameter(str(exc)) from None
    try:
        moment = dt.datetime.fromisoformat(text)
    except ValueError:
        raise bad from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=dt.timezone.utc)
    return moment.timestamp()


@main.command()
@click.argument("subject")
@click.option("--all", "include_ended", is_flag=True, help="Ended periods too, newest first.")
@_json_option
@url_option
@click.pass_context
def usage(ctx: click.Context, subject: str, include_ended: bool, as_json: bool) -> None:
    """SUBJECT's durable quotas: used, reserved, limit, granted, remaining and reset, per period.

    Lists the periods running now (the limit shown is that of the last
    consumption; '-' when the period only saw grants).
    """
    with _errors(), _limiter(ctx) as limiter:
        rows = Admin(limiter).usage(subject, include_ended=include_ended)
    header = (
        f"{'NAME':<20} {'PERIOD':<20} {'USED':>10} {'RESERVED':>10} {'LIMIT':>10}"
        f" {'GRANTED':>8} {'REMAINING':>10}  {'RESETS IN':>9}  RESETS AT (UTC)"
    )
    lines = [header]
    now = time.time()
    for u in rows:
        period = f"{u.period}@{u.tz}" if u.tz and u.tz != "UTC" else str(u.period)
        left = human_duration(u.resets_at - now) if u.resets_at > now else "ended"
        lines.append(
            f"{u.name:<20} {period:<20} {u.used:>10} {u.reserved:>10} {_dash(u.limit):>10}"
            f" {u.granted:>8} {_dash(u.remaining):>10}  {left:>9}  {utc(u.resets_at)}"
        )
    if not rows:
        lines.append(f"(no quota of {subject!r} in a running period)")
    _emit([asdict(u) for u in rows], as_json, "\n".join(lines))


def _dash(value: int | None) -> str:
    return "-" if value is None else str(value)


@main.command()
@click.argument("subject")
@click.argument("name")
@click.argument("amount", type=WHOLE)
@click.option(
    "--period", "-p", required=True, callback=_period,
    help="The quota's period: day, week, month, or seconds (3600, 12h).",
)  # fmt: skip
@click.option("--tz", help="IANA time zone of calendar periods (default UTC).")
@_json_option
@url_option
@click.pass_context
def grant(
    ctx: click.Context, subject: str, name: str, amount: int, period: str | int, tz: str | None,
    as_json: bool,
) -> None:  # fmt: skip
    """Give SUBJECT AMOUNT more units of quota NAME for the current period only."""
    with _errors(), _limiter(ctx) as limiter:
        u = limiter.grant_quota(subject, name, amount, period, tz)
    text = (
        f"granted {amount} to {subject!r} {name!r} for this period:"
        f" {u.granted} granted, {u.used} used, {_dash(u.remaining)} remaining;"
        f" resets {when(u.resets_at, time.time())}"
    )
    _emit(asdict(u), as_json, text)


@main.command()
@click.argument("subject")
@click.argument("name")
@click.argument("idempotency_key")
@_json_option
@url_option
@click.pass_context
def refund(
    ctx: click.Context, subject: str, name: str, idempotency_key: str, as_json: bool
) -> None:
    """Give back the charge IDEMPOTENCY_KEY holds on SUBJECT's quota NAME.

    Refunding an unknown key or one already refunded changes nothing, says
    so, and exits 0.
    """
    with _errors(), _limiter(ctx) as limiter:
        result = limiter.refund_quota(subject, name, idempotency_key)
    if result.refunded:
        text = (
            f"refunded {result.amount} to {subject!r} {name!r}; {result.used} used in that period"
        )
    elif result.status == "already_refunded":
        text = f"nothing to refund: {idempotency_key!r} was already refunded"
    else:
        text = f"nothing to refund: no charge of {subject!r} {name!r} holds {idempotency_key!r}"
    _emit(asdict(result), as_json, text)


_LEDGER_FIELDS = [
    "id", "time", "at", "subject", "name", "kind", "cost", "idempotency_key", "period_start",
    "resets_at", "limit", "used", "remaining", "refunded_at", "reservation_id", "reserved",
]  # fmt: skip


@main.command()
@click.argument("subject")
@click.option(
    "--since", callback=_since,
    help="Entries from then on: a duration ago (7d, 12h) or an ISO date or time (UTC by default).",
)  # fmt: skip
@_json_option
@click.option("--csv", "as_csv", is_flag=True, help="CSV with a header row, for spreadsheets.")
@url_option
@click.pass_context
def ledger(
    ctx: click.Context, subject: str, since: float | None, as_json: bool, as_csv: bool
) -> None:
    """SUBJECT's ledger, oldest first: every consume, denial, refund, grant, reserve, settle
    and release."""
    if as_json and as_csv:
        raise click.UsageError("give --json or --csv, not both")
    with _errors(), _limiter(ctx) as limiter:
        entries = Admin(limiter).ledger(subject, since)
    rows: list[dict[str, Any]] = [{"time": _iso(e.at), **asdict(e)} for e in entries]
    if as_csv:
        out = io.StringIO()
        writer = csv.DictWriter(out, fieldnames=_LEDGER_FIELDS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        click.echo(out.getvalue(), nl=False)
        return
    lines = [
        f"{'TIME (UTC)':<24} {'KIND':<11} {'NAME':<16} {'COST':>6} {'USED':>8} {'RESERVED':>8}  KEY"
    ]
    lines += [
        f"{utc(r['at']):<24} {r['kind']:<11} {r['name']:<16} {r['cost']:>6}"
        f" {_dash(r['used']):>8} {_dash(r['reserved']):>8}  {r['idempotency_key'] or '-'}"
        + (" (refunded)" if r["refunded_at"] is not None else "")
        for r in rows
    ]
    _emit(rows, as_json, "\n".join(lines))
