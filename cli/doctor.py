"""``quota doctor``: the CLI face of `quota.diagnose`.

Exit codes, as for every command: 0 when no finding is an error (warnings
are printed but pass, unless ``--strict``), 2 when the URL itself is bad, 3
when another finding is an error (or, with ``--strict``, any warning).
"""

from __future__ import annotations

import json
import sys

import click

import quota
from quota._tools.doctor import ERROR, OK, WARN, display_url

from .main import EXIT_ERROR, EXIT_USAGE, Number, main, url_option

_MARK = {OK: "ok", WARN: "WARN", ERROR: "ERROR"}


def exit_code(findings: list[quota.Finding], *, strict: bool = False) -> int:
    """0; `EXIT_USAGE` when the URL is bad (as every command); else `EXIT_ERROR` when a
    finding is an error (or, if `strict`, a warning)."""
    if any(f.check == "url" and f.severity == ERROR for f in findings):
        return EXIT_USAGE
    failing = {ERROR, WARN} if strict else {ERROR}
    return EXIT_ERROR if any(f.severity in failing for f in findings) else 0


@main.command()
@url_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--strict", is_flag=True, help="Exit 3 on warnings too (for CI gates).")
@click.option(
    "--timeout", type=Number(maximum=600), default=5.0, show_default=True,
    help="Seconds allowed for the connection and for each query.",
)  # fmt: skip
@click.pass_context
def doctor(ctx: click.Context, as_json: bool, strict: bool, timeout: float) -> None:
    """Check the database and print what to fix.

    Connectivity, schema revision, SQLite version and WAL, PostgreSQL table
    settings (UNLOGGED, fillfactor, HOT updates) and clock skew between this
    host and the database. Changes nothing (a missing SQLite file is
    reported, not created). Exits 0 when nothing is an error (warnings pass
    unless --strict), 2 for a bad URL, 3 otherwise.
    """
    url: str = ctx.obj["url"]
    findings = quota.diagnose(url, timeout=timeout)
    code = exit_code(findings, strict=strict)
    counts = {severity: sum(f.severity == severity for f in findings) for severity in _MARK}
    if as_json:
        data = {
            "url": display_url(url),
            "findings": [f.as_dict() for f in findings],
            "counts": counts,
            "exit_code": code,
        }
        click.echo(json.dumps(data, indent=2))
    else:
        click.echo(f"quota doctor: {display_url(url)}")
        for f in findings:
            click.echo(f"  {_MARK[f.severity]:<5}  {f.check:<14} {f.message}")
            if f.fix:
                click.echo(f"  {'':<5}  {'':<14} fix: {f.fix}")
        click.echo(
            f"{counts[ERROR]} error(s), {counts[WARN]} warning(s), {counts[OK]} ok"
            + (" (warnings fail: --strict)" if strict and counts[WARN] else "")
        )
    sys.exit(code)
