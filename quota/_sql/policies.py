"""The runtime policy tables: ``quota_policies`` (overrides) and ``quota_settings``.

The statements that read and edit both tables, the rows as stored
(`PolicyRow`, `SettingRow`) and how a setting's value is checked, and the
operations (`Op` generators) a store runs: `read_op`, the middleware's read
of both tables, and the edits behind `quota.admin`. What the rows mean to a
request, and when a change applies, is the HTTP layer's (`quota.http._runtime`).
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from quota._core.algorithms import ALGORITHMS, Rate
from quota._core.errors import ConfigurationError, SchemaError, StorageError
from quota._core.factors import check_factors
from quota._core.parsing import parse_decimal, parse_whole
from quota._core.rates import parse_rates
from quota._sql.statements import Statement
from quota._sql.steps import Op, Step

TABLE = "quota_policies"
ANY = "*"
#: Deletion rows older than this (seconds) are purged when the table is next edited:
#: by then every worker has read them at a boundary (the cache period is at most an hour).
TOMBSTONE_SECONDS = 2 * 3600.0

SELECT = Statement(
    "policies_select",
    "SELECT route, subject, rates, algorithm, cost, fail_open, exempt, note, updated_at"
    " FROM quota_policies ORDER BY route, subject",
)
UPSERT = Statement(
    "policies_upsert",
    "INSERT INTO quota_policies"
    " (route, subject, rates, algorithm, cost, fail_open, exempt, note, updated_at)"
    " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"
    " ON CONFLICT (route, subject) DO UPDATE SET rates = excluded.rates,"
    " algorithm = excluded.algorithm, cost = excluded.cost, fail_open = excluded.fail_open,"
    " exempt = excluded.exempt, note = excluded.note, updated_at = excluded.updated_at"
    " RETURNING 1",
)
_EMPTY = "rates IS NULL AND algorithm IS NULL AND cost IS NULL AND fail_open IS NULL AND exempt = ?"
#: A deletion: the row overrides nothing from now on (and says when it stopped).
DELETE = Statement(
    "policies_delete",
    "UPDATE quota_policies SET rates = NULL, algorithm = NULL, cost = NULL, fail_open = NULL,"
    " exempt = ?, note = NULL, updated_at = ?"
    f" WHERE route = ? AND subject = ? AND NOT ({_EMPTY}) RETURNING 1",
)
PURGE = Statement(
    "policies_purge", f"DELETE FROM quota_policies WHERE {_EMPTY} AND updated_at < ? RETURNING 1"
)

SETTINGS_TABLE = "quota_settings"
#: Name of the setting that scales one tier's limits: this prefix, then the tier.
TIER_MULTIPLIER = "tier_multiplier."
#: Name of the setting of the abuse alert threshold.
ABUSE_THRESHOLD = "abuse_threshold"
#: Name of the row recording that a middleware serves a route class: this prefix, then its
#: name. Not a setting: it changes nothing, it lets the CLI and doctor tell a misspelt class.
ROUTE_CLASS = "route_class."
#: The value of a ``route_class.<name>`` row.
SERVED = "served"
SELECT_SETTINGS = Statement(
    "settings_select", "SELECT name, value, note, updated_at FROM quota_settings ORDER BY name"
)
UPSERT_SETTING = Statement(
    "settings_upsert",
    "INSERT INTO quota_settings (name, value, note, updated_at) VALUES (?, ?, ?, ?)"
    " ON CONFLICT (name) DO UPDATE SET value = excluded.value, note = excluded.note,"
    " updated_at = excluded.updated_at RETURNING 1",
)
#: A deletion: the value is NULL from now on (and the row says when it stopped).
DELETE_SETTING = Statement(
    "settings_delete",
    "UPDATE quota_settings SET value = NULL, note = NULL, updated_at = ?"
    " WHERE name = ? AND value IS NOT NULL RETURNING 1",
)
PURGE_SETTINGS = Statement(
    "settings_purge",
    "DELETE FROM quota_settings WHERE value IS NULL AND updated_at < ? RETURNING 1",
)

Rows = Sequence[Sequence[Any]]


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What one refresh read: each table's rows, or the exception its read raised."""

    policies: Rows | BaseException
    settings: Rows | BaseException | None = None
    """None: not read (a driver of the policies alone)."""


def _unreachable(exc: BaseException) -> bool:
    """True when `exc` says the database cannot be reached: the next statement would fail too."""
    if isinstance(exc, SchemaError):
        return False  # a table missing: the other one may be there
    if isinstance(exc, StorageError):
        return exc.outage
    return True


def read_op(register: Sequence[str] = (), now: float = 0.0) -> Op[Snapshot]:
    """The read of both tables as a store operation (``store.run(read_op(), transaction=False)``).

    Two statements, each failing on its own: a missing ``quota_settings``
    (a database not migrated to 0005_settings) leaves the policies read, and
    the other way round. When the database cannot be reached the exception
    is raised, the second statement not tried. Without a fallback it runs as
    above; under one the middleware drives it over the store's
    ``execute_strict`` (``limiter.run(read_op(), strict=True)``): never from memory, each
    statement held to the fallback's budget, refused at once while the
    database is down (the last good overrides and settings stay in force).

    `register` names the route classes the middleware serves: each one not
    yet recorded in ``quota_settings`` (a ``route_class.<name>`` row stamped
    `now`) is written there, so that ``quota policy set`` and ``quota
    doctor`` can tell a misspelt route class. A write that fails (a
    read-only role) is left for the next read; the snapshot is unchanged.
    """
    policies: Rows | BaseException
    settings: Rows | BaseException
    try:
        policies = yield SELECT, ()
    except Exception as exc:
        if _unreachable(exc):
            raise
        policies = exc
    try:
        settings = yield SELECT_SETTINGS, ()
    except Exception as exc:
        settings = exc
    if register and not isinstance(settings, BaseException):
        recorded = {str(row[0]) for row in settings if row[1] is not None}
        for route in register:
            name = ROUTE_CLASS + route
            if name in recorded:
                continue
            try:
                yield UPSERT_SETTING, (name, SERVED, None, now)
            except Exception:
                break  # not writable (or gone): the next read tries again
    return Snapshot(policies, settings)


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


def overrides_nothing(row: PolicyRow) -> bool:
    return (
        row.rates is None and row.algorithm is None and row.cost is None
        and row.fail_open is None and not row.exempt
    )  # fmt: skip


def policy_row(values: Sequence[Any]) -> PolicyRow:
    route, subject, rates, algorithm, cost, fail_open, exempt, note, updated_at = values
    return PolicyRow(
        route=route, subject=subject, rates=rates, algorithm=algorithm,
        cost=None if cost is None else int(cost),
        fail_open=None if fail_open is None else bool(fail_open),
        exempt=bool(exempt), note=note, updated_at=float(updated_at or 0.0),
    )  # fmt: skip


# -- settings ----------------------------------------------------------------------------


def _tier(name: str) -> str:
    """The tier a ``tier_multiplier.<tier>`` setting names; `ConfigurationError` for another name."""
    if not isinstance(name, str) or not name.startswith(TIER_MULTIPLIER):
        raise ConfigurationError(
            f"unknown setting {name!r}: the settings are {TIER_MULTIPLIER}<tier> and"
            f" {ABUSE_THRESHOLD}"
        )
    tier = name[len(TIER_MULTIPLIER) :]
    if not tier or len(tier) > 200 or not tier.isprintable() or any(c.isspace() for c in tier):
        raise ConfigurationError(
            f"tier must be a non-empty name without blanks (at most 200 characters), got {tier!r}"
        )
    return tier


def parse_setting(name: str, value: object) -> float | int:
    """The value of setting `name` given as `value`: a number, or its text as stored.

    Checked as `HttpConfig` checks the field, with its message:
    ``tier_multiplier.<tier>`` as ``tier_multipliers`` (0.001 to 1000),
    ``abuse_threshold`` as ``abuse_threshold`` (a whole number, 0 for no
    alerts). `ConfigurationError` for a bad value or an unknown name.
    """
    if name == ABUSE_THRESHOLD:
        number = value
        if isinstance(value, str) and (whole := parse_whole(value)) is not None:
            number = whole
        if type(number) is not int or not 0 <= number <= 2**62:
            raise ConfigurationError(
                f"abuse_threshold must be a whole number 0..2**62 (0: off), got {value!r}"
            )
        return number
    tier = _tier(name)
    if isinstance(value, str) and (decimal := parse_decimal(value)) is not None:
        value = decimal
    return check_factors("tier_multipliers", {tier: value})[tier]


def setting_text(value: float | int) -> str:
    """A setting's value as stored: ``2`` rather than ``2.0``; every digit of a fraction."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return repr(value)


@dataclass(frozen=True, kw_only=True)
class SettingRow:
    """One row of ``quota_settings``, as stored."""

    name: str
    """``tier_multiplier.<tier>`` or ``abuse_threshold``."""
    value: str | None
    """The value as text; None: a deletion (the configured value again)."""
    note: str | None = None
    """Why the value was set, for the next person to read it."""
    updated_at: float = 0.0
    """When the row was last set (epoch seconds)."""

    def parsed(self) -> float | int:
        """The value, checked (`ConfigurationError` for a malformed row)."""
        if self.value is None:
            raise ConfigurationError(f"setting {self.name!r} was deleted")
        return parse_setting(self.name, self.value)


def setting_row(values: Sequence[Any]) -> SettingRow:
    name, value, note, updated_at = values
    return SettingRow(
        name=str(name), value=None if value is None else str(value), note=note,
        updated_at=float(updated_at or 0.0),
    )  # fmt: skip


def unserved_route(route: str, served: Sequence[str]) -> str | None:
    """What is wrong with an override of `route` when the middlewares serve `served`; None if
    nothing (``*``, a class served, or no class recorded yet to compare with)."""
    if route == ANY or not served or route in served:
        return None
    closest = difflib.get_close_matches(route, served, n=1)
    return (
        f"no middleware on this database serves a route class {route!r}, so its overrides"
        f" change nothing (the classes served: {', '.join(served)})"
        + (f"; did you mean {closest[0]!r}?" if closest else "")
    )


# -- editing the tables ----------------------------------------------------------------


def _statements(*steps: Step) -> Op[Rows]:
    """Run `steps` one after the other (each commits on its own); the rows of the last."""
    rows: Rows = ()
    for step in steps:
        rows = yield step
    return rows


def list_policies() -> Op[list[PolicyRow]]:
    """Every override in ``quota_policies``, by route and subject (deletions not shown)."""
    rows = yield SELECT, ()
    found = (policy_row(values) for values in rows)
    return [row for row in found if not overrides_nothing(row)]


def set_policy(row: PolicyRow, now: float) -> Op[PolicyRow]:
    """Insert or replace the row for (`row.route`, `row.subject`), stamped `now`; the row stored.

    `ConfigurationError` for a row that would change nothing (give at least
    one of `rates`, `cost`, `fail_open`, `exempt`; `algorithm` goes with
    `rates`), before any statement runs.
    """
    if row.algorithm is not None and row.rates is None:
        raise ConfigurationError("algorithm applies to the override's rates: give rates with it")
    if overrides_nothing(row):
        raise ConfigurationError(
            "an override must change something: give at least one of rates, cost,"
            " fail_open, exempt (to remove one, use delete_policy)"
        )
    stamped = PolicyRow(**{**row.__dict__, "updated_at": now})
    yield from _statements((PURGE, (False, now - TOMBSTONE_SECONDS)), (UPSERT, (
        stamped.route, stamped.subject, stamped.rates, stamped.algorithm, stamped.cost,
        stamped.fail_open, stamped.exempt, stamped.note, stamped.updated_at,
    )))  # fmt: skip
    return stamped


def delete_policy(route: str, subject: str, now: float) -> Op[bool]:
    """Delete the override of (`route`, `subject`) as of `now`; True if there was one.

    The row stays a while as a stamped deletion (overriding nothing), so that
    every middleware drops the override at the same boundary; deletions older
    than `TOMBSTONE_SECONDS` are purged when the table is next edited.
    """
    rows = yield from _statements(
        (PURGE, (False, now - TOMBSTONE_SECONDS)), (DELETE, (False, now, route, subject, False))
    )
    return bool(rows)


def list_settings() -> Op[list[SettingRow]]:
    """Every setting in ``quota_settings`` as stored, malformed ones too (deletions and the
    ``route_class.<name>`` records not shown)."""
    rows = yield SELECT_SETTINGS, ()
    found = (setting_row(values) for values in rows)
    return [row for row in found if row.value is not None and not row.name.startswith(ROUTE_CLASS)]


def served_routes() -> Op[list[str]]:
    """The route classes the middlewares have recorded (``route_class.<name>`` rows), sorted."""
    rows = yield SELECT_SETTINGS, ()
    found = (setting_row(values) for values in rows)
    return sorted(
        row.name[len(ROUTE_CLASS) :]
        for row in found
        if row.value is not None and row.name.startswith(ROUTE_CLASS)
    )


def set_setting(name: str, value: object, note: str | None, now: float) -> Op[SettingRow]:
    """Set `name` to `value` (checked by `parse_setting`), stamped `now`; the row stored."""
    parsed = parse_setting(name, value)
    if note is not None and not isinstance(note, str):
        raise ConfigurationError(f"note must be a string or None, got {note!r}")
    row = SettingRow(name=name, value=setting_text(parsed), note=note, updated_at=now)
    yield from _statements(
        (PURGE_SETTINGS, (now - TOMBSTONE_SECONDS,)),
        (UPSERT_SETTING, (row.name, row.value, row.note, row.updated_at)),
    )
    return row


def delete_setting(name: str, now: float) -> Op[bool]:
    """Delete the setting `name` as of `now` (a stamped row whose value is NULL); True if there
    was one. Any name can be deleted, a malformed row's too."""
    if not isinstance(name, str) or not name:
        raise ConfigurationError(f"name must be a non-empty string, got {name!r}")
    rows = yield from _statements(
        (PURGE_SETTINGS, (now - TOMBSTONE_SECONDS,)), (DELETE_SETTING, (now, name))
    )
    return bool(rows)
