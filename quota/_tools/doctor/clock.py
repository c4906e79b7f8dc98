"""The ``clock_skew`` check: this host's clock against the database's."""

from __future__ import annotations

from quota._sql.statements import DB_NOW
from quota._tools.doctor.base import ERROR, OK, WARN, Finding, Session

#: Clock skew (seconds, beyond the measurement's own uncertainty) that gets a warning.
SKEW_WARN = 1.0
#: Clock skew that is an error: a cleanup on this host with the default
#: grace (60 s) could delete windows that are still running.
SKEW_ERROR = 60.0


def clock_skew(session: Session) -> list[Finding]:
    """The ``clock_skew`` finding: the database's time read between two readings of the
    app clock."""
    before = session.clock()
    db_time = float(session.query(f"SELECT {DB_NOW[session.dialect]}")[0][0])
    after = session.clock()
    return [skew_finding(((before + after) / 2) - db_time, (after - before) / 2)]


def skew_finding(skew: float, uncertainty: float) -> Finding:
    """The app clock minus the database clock, in seconds, measured to ± `uncertainty`."""
    way = "ahead of" if skew > 0 else "behind"
    said = f"the app clock is {abs(skew):.3f}s {way} the database clock (±{uncertainty:.3f}s)"
    beyond = abs(skew) - uncertainty
    if beyond <= SKEW_WARN:
        return Finding("clock_skew", OK, said)
    fix = (
        "synchronise this host's clock (chrony or systemd-timesyncd), or connect with"
        " clock='database' so every decision takes the database's time"
    )
    if beyond < SKEW_ERROR:
        return Finding(
            "clock_skew", WARN,
            f"{said}: app servers whose clocks disagree count hits in different windows", fix,
        )  # fmt: skip
    return Finding(
        "clock_skew", ERROR,
        f"{said}: more than cleanup's default grace of {SKEW_ERROR:.0f}s, so a cleanup run"
        " from a host this far ahead deletes windows that are still running",
        fix,
    )  # fmt: skip
