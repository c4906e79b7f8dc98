"""``quota demo``: a realistic burst through the real engine, on the embedded default.

Simulated time (an injected clock) lets the demo show a window ending in a
second or two, instead of waiting a minute.

The demo may be pointed at a live database, so it touches only its own rows:
every key it counts starts with `KEY_PREFIX` and a fresh run id, it never runs
a cleanup (a cleanup on its clock, ahead of real time, would delete other
clients' windows that are still running), and at the end it resets exactly
the keys it used, leaving nothing behind.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from quota._core.decision import Decision
from quota._core.redaction import redact
from quota._limiter import connect
from quota._sql.migrate import migrate

WINDOW = 60
ANON_LIMIT = 10
AUTH_LIMIT = 30
#: The start of every key the demo counts under (then a run id, a tier and a client).
KEY_PREFIX = "quota-demo"


@dataclass
class _Client:
    name: str
    tier: str
    requests: int
    allowed: int = 0
    denied: int = 0
    last: Decision | None = field(default=None, repr=False)

    @property
    def limit(self) -> int:
        return AUTH_LIMIT if self.tier == "auth" else ANON_LIMIT


class _SimClock:
    """Real time, shifted by however far the demo has jumped ahead."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.time() + self.offset


_CLIENTS = [
    ("203.0.113.7", "anon", 6),  # a person browsing
    ("198.51.100.23", "anon", 40),  # a scraper
    ("alice (API key)", "auth", 20),  # a normal integration
    ("agent-in-a-loop", "auth", 90),  # a runaway agent
    ("192.0.2.44", "anon", 12),  # a little over
    ("leaked key", "auth", 250),  # a leaked key hammering
]


def run_demo(url: str, *, clients: int = 6, echo: Callable[[str], None] = print) -> None:
    """Migrate `url`, run the burst, print a table per phase, then remove the demo's own rows."""
    started = time.perf_counter()
    migrate(url)
    echo(f"database: {redact(url)} (migrated)\n")
    clock = _SimClock()
    run = uuid.uuid4().hex[:12]  # keeps repeated (and concurrent) demos on one database apart
    roster = [
        _Client(name, tier, n)
        for name, tier, n in (_CLIENTS * (clients // len(_CLIENTS) + 1))[:clients]
    ]
    keys = {f"{KEY_PREFIX}:{run}:{c.tier}:{c.name}:{i}": c for i, c in enumerate(roster)}
    with connect(url, clock=clock) as limiter:

        def drive(key: str, client: _Client, count: int) -> None:
            for _ in range(count):
                decision = limiter.rate_limit(key, client.limit, WINDOW)
                client.allowed += decision.allowed
                client.denied += not decision.allowed
                client.last = decision

        def phase(title: str, counts: list[int]) -> None:
            for client in roster:
                client.allowed = client.denied = 0
            threads = [
                threading.Thread(target=drive, args=(key, client, n))
                for (key, client), n in zip(keys.items(), counts, strict=True)
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            _table(title, roster, clock(), echo)

        echo(
            f"limits: anonymous {ANON_LIMIT}/{WINDOW}s per IP, authenticated {AUTH_LIMIT}/{WINDOW}s per key"
        )
        live = [min(c.requests, 5) for c in roster]
        try:
            phase("burst: every client at once", [c.requests for c in roster])
            clock.offset += WINDOW
            phase(f"{WINDOW}s later (simulated): fresh windows", live)
        finally:
            # Only this run's keys, whatever happened: never a cleanup, which would
            # sweep other clients' windows by the demo's clock, a minute ahead.
            deleted = sum(limiter.reset(key) for key in keys)
        running = sum(1 for n in live if n)
        echo(
            f"\ncleanup: deleted {deleted - running} ended window(s) from the burst and"
            f" {running} live one(s); only this demo's keys ({KEY_PREFIX}:{run}:…) were touched"
        )
    echo(f"done in {time.perf_counter() - started:.1f}s")


def _table(title: str, roster: list[_Client], now: float, echo: Callable[[str], None]) -> None:
    echo(f"\n{title}")
    header = f"  {'client':<18} {'tier':<5} {'limit':>8} {'sent':>5} {'allowed':>8} {'denied':>7} {'remaining':>10} {'resets in':>10}"
    echo(header)
    echo("  " + "-" * (len(header) - 2))
    for c in roster:
        last = c.last
        remaining = last.remaining if last else 0
        resets = f"{max(0, int(last.reset_at - now))}s" if last else "-"
        echo(
            f"  {c.name:<18} {c.tier:<5} {f'{c.limit}/{WINDOW}s':>8} {c.allowed + c.denied:>5}"
            f" {c.allowed:>8} {c.denied:>7} {remaining:>10} {resets:>10}"
        )
