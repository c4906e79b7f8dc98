"""The ``route_classes`` check: overrides of route classes no middleware serves.

The one module of the doctor that reads the HTTP runtime's names.
"""

from __future__ import annotations

from collections.abc import Sequence

from quota._sql.policies import ANY, ROUTE_CLASS, unserved_route
from quota._tools.doctor.base import OK, WARN, Finding, Session

_OVERRIDE_ROUTES = (
    "SELECT route, rates, algorithm, cost, fail_open, exempt FROM quota_policies ORDER BY route"
)
_SETTING_NAMES = "SELECT name, value FROM quota_settings ORDER BY name"


def route_classes(session: Session) -> list[Finding]:
    """The ``route_classes`` finding; none when the tables cannot be read (the schema
    findings say why)."""
    try:
        rows = session.query(_OVERRIDE_ROUTES)
        overrides = [str(row[0]) for row in rows if any(row[1:5]) or row[5]]
        names = [str(row[0]) for row in session.query(_SETTING_NAMES) if row[1] is not None]
    except Exception:
        return []
    served = [n[len(ROUTE_CLASS) :] for n in names if n.startswith(ROUTE_CLASS)]
    return route_class_findings(overrides, served)


def route_class_findings(overrides: Sequence[str], served: Sequence[str]) -> list[Finding]:
    """Overrides (their route names) against the route classes the middlewares serve.

    An override of a class no middleware serves changes nothing: a warning
    naming the classes served and the closest one. Nothing is said when no
    override names a class, or when no middleware has recorded its classes.
    """
    named = sorted({route for route in overrides if route != ANY})
    if not named:
        return []
    if not served:
        return [
            Finding(
                "route_classes", OK,
                f"{len(named)} route class(es) overridden; no middleware has recorded the"
                " classes it serves yet (each does at its first request), so they were not"
                " checked",
            )
        ]  # fmt: skip
    served = sorted(set(served))
    problems = [message for route in named if (message := unserved_route(route, served))]
    if not problems:
        return [
            Finding(
                "route_classes", OK,
                f"every overridden route class is served ({', '.join(named)})",
            )
        ]  # fmt: skip
    unknown = [route for route in named if route not in served]
    return [
        Finding(
            "route_classes", WARN, problem,
            f"check the spelling: `quota policy delete {route}` (with its --subject), then"
            " set it again under the name of a class served",
        )
        for route, problem in zip(unknown, problems, strict=True)
    ]  # fmt: skip
