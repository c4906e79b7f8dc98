"""Runtime policy: overrides kept in the ``quota_policies`` table, read through a short cache.

A row overrides a route class (``route``, or ``*`` for every class) for a
``subject``:

==================  ==========================================================
subject             applies to
==================  ==========================================================
``*``               everyone on the route: `rates` replace the class's base
                    rates and still go through tier, plan and pressure scaling
``tier:<name>``     every caller of that tier: `rates` are exact
``tenant:<id>``     every caller of that tenant (from the app's identify hook)
``ip:<hash>``,      one caller (``quota policy set --ip/--token`` computes the
``tok:<hash>``,     hash with ``$QUOTA_HASH_SECRET``; raw IPs and tokens are
``key:<key id>``    never stored); `rates` are exact
==================  ==========================================================

The most specific row wins: a caller's own subject before its tenant,
before its tier, before ``*``; for each, the named route before ``*``. Its
non-NULL fields replace the class's.
``exempt`` lets the caller through unlimited.

The table is read through `RuntimePolicies`, a cache refreshed at most once
per period (5 s by default); on any failure to read it, the last good rows
(or none: the code's defaults) stay in force. The SQL lives here and runs
through the limiter's store.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any

from quota._algorithms import ALGORITHMS, Rate
from quota._errors import ConfigurationError
from quota._policy import parse_rates
from quota.http._identity import Identity

log = logging.getLogger("quota.http")

TABLE = "quota_policies"
ANY = "*"

SELECT = (
    "SELECT route, subject, rates, algorithm, cost, fail_open, exempt, note, updated_at"
    " FROM quota_policies ORDER BY route, subject"
)
UPSERT = (
    "INSERT INTO quota_policies"
    " (route, subject, rates, algorithm, cost, fail_open, exempt, note, updated_at)"
    " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"
    " ON CONFLICT (route, subject) DO UPDATE SET rates = excluded.rates,"
    " algorithm = excluded.algorithm, cost = excluded.cost, fail_open = excluded.fail_open,"
    " exempt = excluded.exempt, note = excluded.note, updated_at = excluded.updated_at"
    " RETURNING 1"
)
DELETE = "DELETE FROM quota_policies WHERE route = ? AND subject = ? RETURNING 1"


def read_op() -> Generator[tuple[str, tuple[()]], Sequence[Sequence[Any]], Sequence[Sequence[Any]]]:
    """The read of the table as a store operation (``store.run(read_op(), transaction=False)``).

    Used without a fallback. Under one the middleware reads with the store's
    ``execute_strict`` instead: never from memory, held to the fallback's
    budget, refused at once while the database is down (the last good
    overrides stay in force).
    """
    rows = yield SELECT, ()
    return rows


@dataclass(frozen=True, kw_only=True)
class PolicyRow:
    """One row of ``quota_policies``, as stored."""

    route: str
    """Route class name, or ``*`` for all."""
    subject: str = ANY
    """``*``, ``tier:<name>``, ``tenant:<id>``, or a caller's subject (``ip:<hash>``…)."""
    rates: str | None = None
    """Rate string replacing the class's rates; None keeps them."""
    algorithm: str | None = None
    """Algorithm for `rates`; None keeps the class's."""
    cost: int | None = None
    """Hits per request; None keeps the class's."""
    fail_open: bool | None = None
    """Fail-open (True) or closed (False); None keeps the class's."""
    exempt: bool = False
    """Let the subject through unlimited."""
    note: str | None = None
    """Why the row exists, for the next person to read it."""
    updated_at: float = 0.0
    """When the row was last set (epoch seconds)."""

    def __post_init__(self) -> None:
        for name in ("route", "subject"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value or len(value) > 200:
                raise ConfigurationError(f"{name} must be a non-empty string, got {value!r}")
        if self.algorithm is not None and self.algorithm not in ALGORITHMS:
            raise ConfigurationError(
                f"algorithm must be one of {', '.join(ALGORITHMS)}, got {self.algorithm!r}"
            )
        if self.rates is not None:
            parse_rates(self.rates, algorithm=self.algorithm)
        if self.cost is not None and (type(self.cost) is not int or self.cost < 1):
            raise ConfigurationError(f"cost must be a positive integer, got {self.cost!r}")

    @property
    def exact(self) -> bool:
        """Whether the rates are one caller's (or tier's) own, not the class's base to scale."""
        return self.subject != ANY

    def parsed_rates(self) -> tuple[Rate, ...] | None:
        if self.rates is None:
            return None
        return tuple(parse_rates(self.rates, algorithm=self.algorithm))


@dataclass(frozen=True, slots=True)
class Override:
    """A `PolicyRow` prepared for the hot path."""

    row: PolicyRow
    rates: tuple[Rate, ...] | None


def _row(values: Sequence[Any]) -> PolicyRow:
    route, subject, rates, algorithm, cost, fail_open, exempt, note, updated_at = values
    return PolicyRow(
        route=route, subject=subject, rates=rates, algorithm=algorithm,
        cost=None if cost is None else int(cost),
        fail_open=None if fail_open is None else bool(fail_open),
        exempt=bool(exempt), note=note, updated_at=float(updated_at or 0.0),
    )  # fmt: skip


class RuntimePolicies:
    """The ``quota_policies`` rows, cached for `ttl` seconds; see the module docstring.

    Sans-I/O: the driver asks `claim` whether to read the table now (only one
    caller is told yes per period), runs `SELECT`, and hands the rows to
    `load` or the exception to `failed`.
    """

    def __init__(self, ttl: float, *, metrics: Callable[[str], None] | None = None) -> None:
        self.ttl = ttl
        self._rows: dict[tuple[str, str], Override] = {}
        self._next = -math.inf
        self._failing = False
        self._count = metrics or (lambda _name: None)
        self.loaded_at: float | None = None

    def claim(self, now: float) -> bool:
        """True when the table should be read now; pushes the next read a period ahead."""
        if now < self._next:
            return False
        self._next = now + self.ttl
        return True

    def load(self, rows: Sequence[Sequence[Any]], now: float) -> None:
        """Replace the cached overrides with `rows` (a malformed row is skipped and logged)."""
        fresh: dict[tuple[str, str], Override] = {}
        for values in rows:
            try:
                row = _row(values)
                fresh[(row.route, row.subject)] = Override(row, row.parsed_rates())
            except (ConfigurationError, ValueError, TypeError) as exc:
                self._count("policy_invalid")
                log.warning("quota: skipping malformed row of %s %r: %s", TABLE, list(values), exc)
        self._rows = fresh
        self.loaded_at = now
        if self._failing:
            log.warning("quota: %s readable again; %d override(s) in force", TABLE, len(fresh))
        self._failing = False

    def failed(self, exc: BaseException) -> None:
        """Reading failed: keep the last good overrides; log once per failing streak."""
        self._count("policy_refresh_failed")
        if not self._failing:
            log.warning(
                "quota: cannot read %s (%s: %s); keeping %d last-good override(s)",
                TABLE, type(exc).__name__, exc, len(self._rows),
            )  # fmt: skip
        self._failing = True

    def __len__(self) -> int:
        return len(self._rows)

    def lookup(self, route: str, identity: Identity) -> Override | None:
        """The most specific override for `identity` on `route`, or None."""
        rows = self._rows
        if not rows:
            return None
        subjects = [identity.subject]
        if identity.tenant is not None:
            subjects.append("tenant:" + identity.tenant)
        subjects += ["tier:" + identity.tier, ANY]
        for subject in subjects:
            found = rows.get((route, subject)) or rows.get((ANY, subject))
            if found is not None:
                return found
        return None


# -- editing the table (the ``quota policy`` commands) -------------------------------


def list_policies(limiter: Any) -> list[PolicyRow]:
    """Every row of ``quota_policies`` on a sync `quota.Limiter`."""
    return [_row(values) for values in limiter.store.execute(SELECT, ())]


def set_policy(limiter: Any, row: PolicyRow) -> PolicyRow:
    """Insert or replace the row for (`row.route`, `row.subject`); returns it as stored."""
    stamped = PolicyRow(**{**row.__dict__, "updated_at": time.time()})
    limiter.store.execute(UPSERT, (
        stamped.route, stamped.subject, stamped.rates, stamped.algorithm, stamped.cost,
        stamped.fail_open, stamped.exempt, stamped.note, stamped.updated_at,
    ))  # fmt: skip
    return stamped


def delete_policy(limiter: Any, route: str, subject: str = ANY) -> bool:
    """Delete the row for (`route`, `subject`); True if there was one."""
    return bool(limiter.store.execute(DELETE, (route, subject)))
