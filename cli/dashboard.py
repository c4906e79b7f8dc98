"""``quota dashboard``: serve `quota.dashboard` alone, under uvicorn (the ``dashboard`` extra).

The token comes from ``$QUOTA_DASHBOARD_TOKEN``, never from an option (it would
show in the process list). Without one the command refuses to start (exit 2,
before binding), unless ``--insecure-local`` and a loopback ``--host``: then a
token made up for the run is printed to the terminal.
"""

from __future__ import annotations

import ipaddress
import os
import secrets

import click

from quota.admin import Admin

from .main import EXIT_USAGE, _errors, _fail, _limiter, _url, main, url_option

#: The environment variable holding the dashboard's token.
TOKEN_ENV = "QUOTA_DASHBOARD_TOKEN"


def is_loopback(host: str) -> bool:
    """Whether `host` is a loopback address (``localhost``, 127.0.0.0/8, ``::1``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@main.command()
@url_option
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option("--port", default=8089, show_default=True, type=click.IntRange(0, 65535))
@click.option("--read-only", is_flag=True, help="Refuse every change (403): look, do not touch.")
@click.option(
    "--insecure-local",
    is_flag=True,
    help=f"Without ${TOKEN_ENV}, make up a token for this run and print it: loopback --host only.",
)
@click.pass_context
def dashboard(
    ctx: click.Context, host: str, port: int, read_only: bool, insecure_local: bool
) -> None:
    """Serve the operator dashboard (pages /, /keys, /quotas, /policies) on HOST:PORT.

    Every page needs the token of $QUOTA_DASHBOARD_TOKEN (the login form, or
    `Authorization: Bearer`). Needs the dashboard extra: pip install 'quota[dashboard]'.
    """
    token = os.environ.get(TOKEN_ENV, "")
    if not token:
        if not insecure_local:
            _fail(
                f"set {TOKEN_ENV} to the dashboard's token (every request must show it);"
                " or, on a loopback --host only, pass --insecure-local",
                EXIT_USAGE,
            )
        if not is_loopback(host):
            _fail(
                f"--insecure-local serves without {TOKEN_ENV} only on a loopback address,"
                f" not on --host {host}",
                EXIT_USAGE,
            )
        # Still a token, never an open dashboard: one made up for this run, told to the
        # terminal that started it (only this machine can reach the port).
        token = secrets.token_urlsafe(24)
        click.echo(f"warning: no {TOKEN_ENV}: this run's token is {token}", err=True)
    url = _url(ctx)
    # Fail here, not on the first page: a bad URL is exit 2, a database that is
    # unreachable, absent or not migrated exit 3, as for every command.
    with _errors(), _limiter(ctx) as limiter:
        Admin(limiter).top(1)
    try:
        import uvicorn

        from quota.dashboard import create_app
    except ImportError as exc:
        _fail(
            f"quota dashboard needs the dashboard extra ({exc.name} is missing):"
            " pip install 'quota[dashboard]'",
            EXIT_USAGE,
        )
    with _errors():
        app = create_app(url, token=token, read_only=read_only)
    click.echo(f"quota dashboard on http://{host}:{port}/{' (read-only)' if read_only else ''}")
    click.echo(
        "no decision rates here: this process makes no decisions; to see them, mount"
        " quota.dashboard.create_app(..., metrics=metrics) in the app that makes them"
    )
    uvicorn.run(app, host=host, port=port, log_level="info", lifespan="off")
