"""``quota hit``, ``peek``, ``reset`` and ``top``: rate-limit windows (and, with
``--leases``, concurrency leases) from the shell.

Exit codes as for every command (see `cli.main`): ``hit`` and ``peek`` exit 4 when denied
(``peek --leases``: when no slot is free).
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict

import click

import quota
from quota.admin import Admin

from .main import (
    EXIT_DENIED,
    WHOLE,
    _duration,
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

#: Keys longer than this are shown cut, with their length (``--json`` keeps them whole).
SHOWN_KEY = 80


def shown_key(key: str) -> str:
    """`key` quoted as text output shows it: a long one cut with an ellipsis and its length."""
    if len(key) <= SHOWN_KEY:
        return repr(key)
    return f"{key[:SHOWN_KEY]!r}… ({len(key):,} characters)"


def _decision_out(decision: quota.Decision, as_json: bool) -> None:
    headers = decision.headers()
    data = {**asdict(decision), "headers": headers}
    verdict = "allowed" if decision.allowed else "denied"
    now = time.time()
    lines = [
        f"{verdict}: {shown_key(decision.key)} {decision.count}/{decision.limit}"
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
@click.option("--limit", "-l", type=WHOLE, help="Hits allowed per window (slots, with --leases).")
@click.option("--window", "-w", callback=_duration("window"), help="Window: 60, 60s, 1m, 1h, 1d.")
@click.option(
    "--leases", is_flag=True,
    help="Show KEY's concurrency leases (limiter.concurrency) instead: who holds its slots.",
)  # fmt: skip
@_json_option
@click.pass_context
def peek(
    ctx: click.Context, key: str, limit: int | None, window: int | None, leases: bool,
    as_json: bool,
) -> None:  # fmt: skip
    """Show KEY's windows without counting a hit.

    Without --limit and --window: every fixed window of KEY still running,
    whatever its limit (exit 0, none found included). With both: the window
    of that limit, as a hit would see it (exit 4 if the next hit would be
    denied). With --leases: the live concurrency leases of KEY and the slots
    free under --limit (default: the limit they were taken under); exit 4
    when none is free.
    """
    if leases:
        _leases_out(ctx, key, limit, as_json)
        return
    if limit is not None and window is not None:
        with _errors(), _limiter(ctx) as limiter:
            decision = Admin(limiter).peek(key, limit, window)
        _decision_out(decision, as_json)
        return
    if limit is not None or window is not None:
        raise click.UsageError("give --limit and --window together, or neither")
    now = time.time()
    with _errors(), _limiter(ctx) as limiter:
        rows = Admin(limiter).windows(key)
    lines = [
        f"{shown_key(key)}: {u.count} hit(s) in a {human_duration(u.window)} window,"
        f" resets {when(u.reset_at, now)}"
        for u in rows
    ] or [f"{shown_key(key)}: no window running"]
    _emit([asdict(u) for u in rows], as_json, "\n".join(lines))


def _leases_out(ctx: click.Context, key: str, limit: int | None, as_json: bool) -> None:
    with _errors(), _limiter(ctx) as limiter:
        usage = Admin(limiter).leases(key, limit)
    now = time.time()
    free = "?" if usage.free is None else str(usage.free)
    lines = [
        f"{key!r}: {usage.held} held, {free} free of"
        f" {'?' if usage.limit is None else usage.limit}"
        + (f", first lease runs out {when(usage.next_expiry, now)}" if usage.next_expiry else ""),
        *(f"  {holder}" for holder in usage.holders),
    ]
    _emit(asdict(usage), as_json, "\n".join(lines))
    if usage.free == 0:
        sys.exit(EXIT_DENIED)


@main.command()
@url_option
@click.argument("key")
@click.option("--window", "-w", callback=_duration("window"), help="Only windows of this length.")
@_json_option
@click.pass_context
def reset(ctx: click.Context, key: str, window: int | None, as_json: bool) -> None:
    """Forget KEY's counts, so its next hit starts a fresh window."""
    with _errors(), _limiter(ctx) as limiter:
        deleted = Admin(limiter).reset(key, window)
    data = {"key": key, "window": window, "deleted": deleted}
    _emit(data, as_json, f"reset {shown_key(key)}: {deleted} row(s) deleted")


@main.command()
@url_option
@click.option("-n", "count", type=WHOLE, default=10, show_default=True, help="How many keys.")
@click.option(
    "--leases", is_flag=True,
    help="List the concurrency keys with the most live leases (limiter.concurrency) instead.",
)  # fmt: skip
@_json_option
@click.pass_context
def top(ctx: click.Context, count: int, leases: bool, as_json: bool) -> None:
    """The busiest keys in the windows running now (with --leases: the fullest concurrency keys)."""
    now = time.time()
    if leases:
        with _errors(), _limiter(ctx) as limiter:
            usages = Admin(limiter).top_leases(count)
        text = "\n".join(
            [f"{'HELD':>6}  {'LIMIT':>6}  {'FREE':>6}  {'NEXT EXPIRY':>11}  KEY"]
            + [
                f"{u.held:>6}  {u.limit:>6}  {u.free:>6}"
                f"  {human_duration((u.next_expiry or now) - now):>11}  {u.key}"
                for u in usages
            ]
        )
        _emit([asdict(u) for u in usages], as_json, text)
        return
    with _errors(), _limiter(ctx) as limiter:
        rows = Admin(limiter).top(count)
    text = "\n".join(
        [f"{'COUNT':>8}  {'WINDOW':>7}  {'RESETS IN':>9}  {'RESETS AT (UTC)':<20}  KEY"]
        + [
            f"{u.count:>8}  {human_duration(u.window):>7}  {human_duration(u.reset_at - now):>9}"
            f"  {utc(u.reset_at):<20}  {u.key}"
            for u in rows
        ]
    )
    _emit([asdict(u) for u in rows], as_json, text)
