"""``quota demo`` and ``quota bench``: the real engine under a simulated load."""

from __future__ import annotations

import click

import quota

from .main import (
    POSITIVE,
    WHOLE,
    Number,
    _emit,
    _errors,
    _json_option,
    _progress_option,
    _url,
    _wants_progress,
    main,
    url_option,
)


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
    "--acquire", is_flag=True,
    help="Compare acquire against hit of the same rate (--algorithm), every slot free:"
    " what waiting for a slot costs a call that need not wait (rate scenario).",
)  # fmt: skip
@click.option(
    "--telemetry", is_flag=True,
    help="Compare quota with telemetry (OpenTelemetry SDK providers, nothing exported) against"
    " quota without: what telemetry costs (rate scenario; needs opentelemetry-sdk).",
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
    acquire: bool,
    telemetry: bool,
    pool_size: int | None,
    progress: bool | None,
    as_json: bool,
) -> None:
    """Decisions per second of quota beside the bare driver running the same statements.

    Runs against --url (migrating it first). Prints both rates and their
    ratio, medians of --runs alternating runs. When done (or interrupted) it
    deletes the windows of the keys it counted (bench:0 to bench:N-1 and
    bench:warm), as demo does, and no other rows.
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
            acquire=acquire, telemetry=telemetry, progress=say,
        )  # fmt: skip
    _emit(report.as_dict(), as_json, report.table())
