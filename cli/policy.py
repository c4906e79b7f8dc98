"""``quota policy``: edit the runtime overrides and settings of the HTTP layer.

``list/set/delete`` are a thin layer over `quota.admin.Admin.policies`,
`set_policy` and `delete_policy`; ``multiplier``, ``abuse-threshold``,
``settings`` and ``unset`` over `Admin.set_setting`, `settings` and
`delete_setting` (the tier multipliers and the abuse alert threshold, in
``quota_settings``). Every middleware applies a change at the first boundary of
its cache period (5 s by default) at least one second after it was written,
all at the same moment. ``--ip`` and ``--token`` name one caller by the
keyed hash the middleware uses (``$QUOTA_HASH_SECRET`` must be the app's),
so raw IPs and tokens are never stored. Exit codes as for every command (3:
database or schema error; 2: bad option or URL); ``delete`` and ``unset``
exit 4 when there was no such row. ``--url`` may follow ``policy`` and each subcommand.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict

import click

import quota
from quota._core.url import SCHEMALESS
from quota._sql.policies import SETTINGS_TABLE, TABLE
from quota.admin import (
    ABUSE_THRESHOLD,
    TIER_MULTIPLIER,
    Admin,
    PolicyRow,
    parse_setting,
)
from quota.http import hash_secret_from_env, ip_subject, token_subject

from .main import EXIT_DENIED, POSITIVE, _errors, _json_option, _limiter, main, url_option

#: The app's default `HttpConfig.ipv6_prefix`.
DEFAULT_IPV6_PREFIX = 64
_FIELDS = "--rates (with --algorithm), --cost, --fail-open/--fail-closed, --exempt"


def _subject(
    subject: str | None, ip: str | None, token: str | None, tier: str | None,
    ipv6_prefix: int | None,
) -> str:  # fmt: skip
    given = [v for v in (subject, ip, token, tier) if v is not None]
    if len(given) > 1:
        raise click.UsageError("give at most one of --subject, --ip, --token, --tier")
    if ipv6_prefix is not None:
        if ip is None:
            raise click.UsageError(
                "--ipv6-prefix goes with --ip (the app's HttpConfig.ipv6_prefix)"
            )
        if ipv6_prefix > 128:
            raise click.BadParameter(
                f"{ipv6_prefix} is more than 128", param_hint="'--ipv6-prefix'"
            )
    if tier is not None:
        return f"tier:{tier}"
    if ip is None and token is None:
        return subject or "*"
    try:
        key = hash_secret_from_env(os.environ)
    except quota.ConfigurationError as exc:
        raise click.UsageError(str(exc)) from None
    if key is None:
        raise click.UsageError(
            "--ip and --token hash with the app's secret: set QUOTA_HASH_SECRET to the value the app uses"
        )
    if ip is not None:
        try:
            return ip_subject(ip, key, ipv6_prefix=ipv6_prefix or DEFAULT_IPV6_PREFIX)
        except quota.ConfigurationError as exc:
            raise click.BadParameter(str(exc), param_hint="'--ip'") from None
    assert token is not None
    return token_subject(token, key)


_subject_options = [
    click.option(
        "--subject", help="'*' (default), 'tenant:<id>', 'key:<key id>' or a stored subject."
    ),
    click.option(
        "--tier", help="Every caller of this tier (anon, auth, trusted, or the app's own)."
    ),
    click.option("--ip", help="One client IP (stored only as its keyed hash)."),
    click.option(
        "--ipv6-prefix",
        type=POSITIVE,
        help=f"With an IPv6 --ip: the prefix the app keys IPv6 clients by (HttpConfig.ipv6_prefix, default {DEFAULT_IPV6_PREFIX}).",
    ),
    click.option("--token", help="One bearer token or API key (stored only as its keyed hash)."),
]


def _with_subject_options(func: click.decorators.FC) -> click.decorators.FC:
    for option in reversed(_subject_options):
        func = option(func)
    return func


@contextmanager
def _table(ctx: click.Context, table: str = TABLE) -> Iterator[Admin]:
    """The admin of ``--url``'s limiter, on a store that keeps `table` (exit 2 on one that cannot)."""
    with _errors(), _limiter(ctx) as limiter:
        dialect = limiter.store.dialect
        if dialect in SCHEMALESS:
            raise click.UsageError(
                f"the {dialect} store keeps no {table} table: runtime policies need a database"
                " (sqlite:// or postgresql://), and the app's middleware has none on this store"
            )
        yield Admin(limiter)


@main.group()
@url_option
def policy() -> None:
    """Runtime overrides and settings of the HTTP middleware (quota_policies, quota_settings)."""


@policy.command("list")
@url_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def list_command(ctx: click.Context, as_json: bool) -> None:
    """Every override, by route class and subject."""
    with _table(ctx) as admin:
        rows = admin.policies()
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
@url_option
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
    ipv6_prefix: int | None, token: str | None, rates: str | None, algorithm: str | None,
    cost: int | None, fail_open: bool | None, exempt: bool, note: str | None, as_json: bool,
) -> None:  # fmt: skip
    """Insert or replace the override of ROUTE ('*' for every route class) for a subject.

    Give at least one of --rates, --cost, --fail-open/--fail-closed, --exempt.
    Every app worker applies the change at the same moment: the first
    boundary of its cache period at least one second from now. A ROUTE that
    no middleware on the database serves is stored all the same, with a
    warning naming the classes served (the middlewares record them at their
    first request).
    """
    who = _subject(subject, ip, token, tier, ipv6_prefix)
    if rates is None and cost is None and fail_open is None and not exempt:
        raise click.UsageError(
            f"nothing to override: give at least one of {_FIELDS}"
            " (to remove an override, use `quota policy delete`)"
        )
    if algorithm is not None and rates is None:
        raise click.UsageError("--algorithm applies to the override's rates: give --rates with it")
    with _errors():
        row = PolicyRow(route=route, subject=who, rates=rates, algorithm=algorithm, cost=cost,
                        fail_open=fail_open, exempt=exempt, note=note)  # fmt: skip
    with _table(ctx) as admin:
        stored = admin.set_policy(row)
        warning = admin.unserved_route(route)
    if as_json:
        click.echo(json.dumps(asdict(stored), indent=2, sort_keys=True))
    else:
        click.echo(f"set {route} for {who}")
    if warning is not None:
        click.echo(f"warning: {warning}", err=True)


@policy.command("delete")
@url_option
@click.argument("route")
@_with_subject_options
@_json_option
@click.pass_context
def delete_command(
    ctx: click.Context, route: str, subject: str | None, tier: str | None, ip: str | None,
    ipv6_prefix: int | None, token: str | None, as_json: bool,
) -> None:  # fmt: skip
    """Delete the override of ROUTE for a subject (exit 4 if there was none).

    Like a change, the deletion applies on every app worker at the same
    boundary of its cache period.
    """
    who = _subject(subject, ip, token, tier, ipv6_prefix)
    with _table(ctx) as admin:
        found = admin.delete_policy(route, who)
    if as_json:
        click.echo(json.dumps({"route": route, "subject": who, "deleted": found}, sort_keys=True))
    if not found:
        click.echo(f"no override of {route} for {who}", err=True)
        sys.exit(EXIT_DENIED)
    if not as_json:
        click.echo(f"deleted {route} for {who}")


# -- settings: tier multipliers and the abuse threshold -----------------------------------


def _set(ctx: click.Context, name: str, value: str, param: str, note: str | None,
         as_json: bool) -> None:  # fmt: skip
    try:
        parse_setting(name, value)
    except quota.ConfigurationError as exc:
        raise click.BadParameter(str(exc), param_hint=param) from None
    with _table(ctx, SETTINGS_TABLE) as admin:
        stored = admin.set_setting(name, value, note=note)
    if as_json:
        click.echo(json.dumps(asdict(stored), indent=2, sort_keys=True))
    else:
        click.echo(f"set {name} to {stored.value}")


@policy.command("multiplier")
@url_option
@click.argument("tier")
@click.argument("value")
@click.option("--note", help="Why, for the next person.")
@_json_option
@click.pass_context
def multiplier_command(
    ctx: click.Context, tier: str, value: str, note: str | None, as_json: bool
) -> None:
    """Scale the limits of TIER by VALUE (0.001 to 1000), as HttpConfig.tier_multipliers.

    Replaces the app's configured multiplier of TIER on every app worker at
    the same moment: the first boundary of its cache period at least one
    second from now. Exact tier rates and exact overrides are not scaled.
    `quota policy unset tier_multiplier.TIER` gives back the configured one.
    """
    name = TIER_MULTIPLIER + tier
    try:
        parse_setting(name, 1.0)
    except quota.ConfigurationError as exc:
        raise click.BadParameter(str(exc), param_hint="'TIER'") from None
    _set(ctx, name, value, "'VALUE'", note, as_json)


@policy.command("abuse-threshold")
@url_option
@click.argument("n")
@click.option("--note", help="Why, for the next person.")
@_json_option
@click.pass_context
def abuse_threshold_command(ctx: click.Context, n: str, note: str | None, as_json: bool) -> None:
    """Raise an abuse alert after N 429s to one key (0: no alerts), as HttpConfig.abuse_threshold.

    Replaces the app's configured threshold on every app worker at the same
    moment, as a multiplier does; the alert's window and quiet interval stay
    the app's. `quota policy unset abuse_threshold` gives back the
    configured threshold.
    """
    _set(ctx, ABUSE_THRESHOLD, n, "'N'", note, as_json)


@policy.command("settings")
@url_option
@_json_option
@click.pass_context
def settings_command(ctx: click.Context, as_json: bool) -> None:
    """Every setting (tier multipliers, abuse threshold), by name."""
    with _table(ctx, SETTINGS_TABLE) as admin:
        rows = admin.settings()
    if as_json:
        click.echo(json.dumps([asdict(r) for r in rows], indent=2, sort_keys=True))
        return
    if not rows:
        click.echo("no settings (the app's configured values apply)")
        return
    click.echo(f"{'NAME':<32} {'VALUE':<12} NOTE")
    for r in rows:
        try:
            r.parsed()
        except quota.ConfigurationError as exc:
            note = f"IGNORED by the middleware: {exc}"
        else:
            note = r.note or ""
        click.echo(f"{r.name:<32} {r.value or '':<12} {note}")


@policy.command("unset")
@url_option
@click.argument("name")
@_json_option
@click.pass_context
def unset_command(ctx: click.Context, name: str, as_json: bool) -> None:
    """Delete the setting NAME: the app's configured value again (exit 4 if there was none).

    NAME as `quota policy settings` lists it: tier_multiplier.<tier> or
    abuse_threshold. Like a change, it applies on every app worker at the
    same boundary of its cache period.
    """
    with _table(ctx, SETTINGS_TABLE) as admin:
        found = admin.delete_setting(name)
    if as_json:
        click.echo(json.dumps({"name": name, "deleted": found}, sort_keys=True))
    if not found:
        click.echo(f"no setting {name}", err=True)
        sys.exit(EXIT_DENIED)
    if not as_json:
        click.echo(f"unset {name}: the app's configured value applies again")


__all__ = ["policy"]
