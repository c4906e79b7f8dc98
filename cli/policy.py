"""``quota policy list/set/delete``: edit the runtime overrides of the HTTP layer.

A thin layer over `quota.http.list_policies`, `set_policy` and
`delete_policy`. Middlewares pick a change up within their cache period
(5 s by default). ``--ip`` and ``--token`` name one caller by the keyed hash
the middleware uses (``$QUOTA_HASH_SECRET`` must be the app's), so raw IPs
and tokens are never stored. Exit codes as for every command (3: database or
schema error; 2: bad option); ``delete`` exits 4 when there was no such row.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict

import click

from quota.http import PolicyRow, delete_policy, hashed_subject, list_policies, set_policy

from .main import EXIT_DENIED, POSITIVE, _errors, _limiter, main

_SECRET_VARS = ("QUOTA_HASH_SECRET", "RATE_LIMIT_SECRET")


def _subject(subject: str | None, ip: str | None, token: str | None, tier: str | None) -> str:
    given = [v for v in (subject, ip, token, tier) if v is not None]
    if len(given) > 1:
        raise click.UsageError("give at most one of --subject, --ip, --token, --tier")
    if tier is not None:
        return f"tier:{tier}"
    if ip is None and token is None:
        return subject or "*"
    secret = next((os.environ[v] for v in _SECRET_VARS if os.environ.get(v)), None)
    if secret is None:
        raise click.UsageError(
            "--ip and --token hash with the app's secret: set QUOTA_HASH_SECRET to the value the app uses"
        )
    try:
        key = secret.encode()
    except UnicodeEncodeError:
        raise click.UsageError(
            "QUOTA_HASH_SECRET must be UTF-8 text (it holds bytes that are not)"
        ) from None
    if ip is not None:
        return hashed_subject("ip", ip, key)
    assert token is not None
    return hashed_subject("tok", token, key)


_subject_options = [
    click.option(
        "--subject", help="'*' (default), 'tenant:<id>', 'key:<key id>' or a stored subject."
    ),
    click.option(
        "--tier", help="Every caller of this tier (anon, auth, trusted, or the app's own)."
    ),
    click.option("--ip", help="One client IP (stored only as its keyed hash)."),
    click.option("--token", help="One bearer token or API key (stored only as its keyed hash)."),
]


def _with_subject_options(func: click.decorators.FC) -> click.decorators.FC:
    for option in reversed(_subject_options):
        func = option(func)
    return func


@main.group()
def policy() -> None:
    """Runtime overrides of the HTTP middleware (the quota_policies table)."""


@policy.command("list")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def list_command(ctx: click.Context, as_json: bool) -> None:
    """Every override, by route class and subject."""
    with _errors(), _limiter(ctx) as limiter:
        rows = list_policies(limiter)
    if as_json:
        click.echo(json.dumps([asdict(r) for r in rows], indent=2, sort_keys=True))
        return
    if not rows:
        click.echo("no overrides")
        return
    click.echo(f"{'ROUTE':<16} {'SUBJECT':<40} {'RATES':<24} {'COST':>4} {'FAIL':<6} EXEMPT  NOTE")
    for r in rows:
        fail = "-" if r.fail_open is None else ("open" if r.fail_open else "closed")
        click.echo(
            f"{r.route:<16} {r.subject:<40} {r.rates or '-':<24} {r.cost or '-':>4} {fail:<6}"
            f" {'yes' if r.exempt else 'no':<6}  {r.note or ''}"
        )


@policy.command("set")
@click.argument("route")
@_with_subject_options
@click.option("--rates", help="Rate string, e.g. '100/minute;1000/day' or '20/s burst 40'.")
@click.option(
    "--algorithm", type=click.Choice(["fixed_window", "sliding_window", "token_bucket", "gcra"])
)
@click.option("--cost", type=POSITIVE, help="Hits one request counts for.")
@click.option(
    "--fail-open/--fail-closed", "fail_open", default=None, help="When the limiter fails."
)
@click.option("--exempt", is_flag=True, help="Let the subject through unlimited.")
@click.option("--note", help="Why, for the next person.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def set_command(
    ctx: click.Context, route: str, subject: str | None, tier: str | None, ip: str | None,
    token: str | None, rates: str | None, algorithm: str | None, cost: int | None,
    fail_open: bool | None, exempt: bool, note: str | None, as_json: bool,
) -> None:  # fmt: skip
    """Insert or replace the override of ROUTE ('*' for every route class) for a subject."""
    who = _subject(subject, ip, token, tier)
    with _errors():
        row = PolicyRow(route=route, subject=who, rates=rates, algorithm=algorithm, cost=cost,
                        fail_open=fail_open, exempt=exempt, note=note)  # fmt: skip
        with _limiter(ctx) as limiter:
            stored = set_policy(limiter, row)
    if as_json:
        click.echo(json.dumps(asdict(stored), indent=2, sort_keys=True))
    else:
        click.echo(f"set {route} for {who}")


@policy.command("delete")
@click.argument("route")
@_with_subject_options
@click.pass_context
def delete_command(
    ctx: click.Context, route: str, subject: str | None, tier: str | None, ip: str | None,
    token: str | None,
) -> None:  # fmt: skip
    """Delete the override of ROUTE for a subject (exit 4 if there was none)."""
    who = _subject(subject, ip, token, tier)
    with _errors(), _limiter(ctx) as limiter:
        found = delete_policy(limiter, route, who)
    if not found:
        click.echo(f"no override of {route} for {who}", err=True)
        sys.exit(EXIT_DENIED)
    click.echo(f"deleted {route} for {who}")


__all__ = ["policy"]
