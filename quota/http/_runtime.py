"""Runtime policy: overrides kept in ``quota_policies``, settings in ``quota_settings``.

Both tables are read together, through a short cache (see "When a change
applies").

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
``exempt`` lets the caller through unlimited. A row with every field NULL
and ``exempt`` false overrides nothing: it is what `delete_policy` leaves
(a deletion stamped with its time, purged two hours later), and readers
treat it as no row.

When a change applies
---------------------

`RuntimePolicies` reads the table on the first request after each
wall-clock boundary: each multiple of the cache period (5 s by default)
since the epoch. At a boundary it applies the rows stamped (``updated_at``)
at least `MARGIN` (1 s) before it; a newer row waits for the next
boundary, the override it replaces staying in force meanwhile. So every
worker switches at the same boundary, whenever its own read happens: a
change written at time ``t`` applies everywhere at the first boundary at or
after ``t + 1 s``, and no request is decided with the old limits by one
worker and the new by another. ``updated_at`` comes from the clock of the
host that ran ``quota policy``, the boundaries from each worker's clock:
they need NTP-synchronised clocks (a row stamped in a worker's future waits
for that time, and is reported once).

Limits of the guarantee: a worker that starts (or has not yet read the
table) uses the newest rows at once, the others joining it at the next
boundary; a worker that cannot read the table keeps its last good
overrides; and an override changed twice within about one period can be
seen differently by workers for one period, until the later change
applies. A period of 0 reads the table on every request and applies every
row at once.

On any failure to read the table, the last good rows (or none: the code's
defaults) stay in force. Stores that keep no tables (memory, Redis) have no
runtime policies: `runtime_policies` returns None for them. The SQL lives
here and runs through the limiter's store.

Settings
--------

``quota_settings`` (revision 0005_settings) holds one value per name:

=============================  ================================================
name                           value
=============================  ================================================
``tier_multiplier.<tier>``     the scale of that tier's limits, as
                               `HttpConfig.tier_multipliers` (0.001 to 1000)
``abuse_threshold``            429s to one key within ``abuse_window`` that
                               raise an abuse alert; 0 turns alerts off
``route_class.<name>``         not a setting: ``served``, written by a
                               middleware serving that route class (see
                               `read_op`), so that an override of a class
                               nobody serves can be told (`served_routes`)
=============================  ================================================

It is read in the same refresh as the policies and a change applies at the
same boundaries, on the same rules. `RuntimeSettings` applies a value
through `Guard.set_tier_multiplier` or the guard's abuse detector, only when
it differs from the one in force; a deleted setting (`delete_setting` leaves
a stamped row whose value is NULL) gives back the configured value. The two
tables are read by two statements, each failing alone: a database not yet
migrated to 0005_settings keeps its runtime policies, and the configured
settings (logged once per failing streak). A malformed row (a value out of
bounds, a name this code does not know) counts as no row, and is logged
once.
"""

from __future__ import annotations

import difflib
import ipaddress
import logging
import math
import re
import threading
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from quota._core.algorithms import ALGORITHMS, Rate
from quota._core.errors import ConfigurationError, SchemaError, StorageError
from quota._core.rates import parse_rates
from quota._core.url import SCHEMALESS
from quota._sql.statements import Statement
from quota._stores.base import Op, Step
from quota._wrappers.abuse import AbuseDetector
from quota.http._config import HttpConfig
from quota.http._config import _check_factors as check_factors
from quota.http._env import apply_env
from quota.http._identity import Identity, client_ip, hashed_subject

if TYPE_CHECKING:
    from quota._limiter.sync_face import Limiter
    from quota.http._core import Guard

log = logging.getLogger("quota.http")

TABLE = "quota_policies"
ANY = "*"
#: A row stamped less than this many seconds before a boundary waits for the next one:
#: room for the write to commit and for the clocks of the hosts to differ a little.
MARGIN = 1.0
#: A row stamped this far (seconds) in a worker's future is reported: the clocks disagree.
AHEAD = 10.0
#: Deletion rows older than this (seconds) are purged when the table is next edited:
#: by then every worker has read them at a boundary (the cache period is at most an hour).
TOMBSTONE_SECONDS = 2 * 3600.0
#: Pending versions kept per override (changes written within a period or two).
_PENDING_MAX = 8

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


def _overrides_nothing(row: PolicyRow) -> bool:
    return (
        row.rates is None and row.algorithm is None and row.cost is None
        and row.fail_open is None and not row.exempt
    )  # fmt: skip


@dataclass(frozen=True, slots=True)
class Override:
    """A `PolicyRow` prepared for the hot path."""

    row: PolicyRow
    rates: tuple[Rate, ...] | None
    """The row's rates parsed with its own algorithm (or the default one)."""
    _by_algorithm: dict[str, tuple[Rate, ...]] = field(default_factory=dict, compare=False)

    def rates_for(self, algorithm: str | None) -> tuple[Rate, ...] | None:
        """The rates as a route class whose algorithm is `algorithm` applies them.

        A row that names no algorithm keeps the class's: its rate strings are
        read with `algorithm`, once per algorithm (a row for ``*`` serves
        classes of several).
        """
        if self.rates is None or self.row.algorithm is not None or algorithm is None:
            return self.rates
        found = self._by_algorithm.get(algorithm)
        if found is None:
            assert self.row.rates is not None
            found = self._by_algorithm[algorithm] = tuple(
                parse_rates(self.row.rates, algorithm=algorithm)
            )
        return found


def _row(values: Sequence[Any]) -> PolicyRow:
    route, subject, rates, algorithm, cost, fail_open, exempt, note, updated_at = values
    return PolicyRow(
        route=route, subject=subject, rates=rates, algorithm=algorithm,
        cost=None if cost is None else int(cost),
        fail_open=None if fail_open is None else bool(fail_open),
        exempt=bool(exempt), note=note, updated_at=float(updated_at or 0.0),
    )  # fmt: skip


Key = tuple[str, str]
#: One observed state of an override: its stamp, and what it says (None: no override).
Version = tuple[float, Override | None]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


def _boundary(now: float, ttl: float) -> float:
    """The latest boundary at or before `now` (a multiple of `ttl` since the epoch)."""
    return math.floor(now / ttl) * ttl if ttl > 0 else now


def _due(
    versions: Iterable[tuple[K, float, V | None]],
    previous: Mapping[K, V],
    pending: Mapping[K, list[tuple[float, V | None]]],
    *,
    cutoff: float,
    cold: bool,
    now: float,
    ahead: Callable[[K, float], None],
) -> tuple[dict[K, V], dict[K, list[tuple[float, V | None]]]]:
    """What is in force for each key after a read, and the versions still waiting.

    `versions` holds each key's row as read: its stamp and what it says (None:
    nothing). A version stamped at or before `cutoff` applies (every one, when
    `cold`); a newer one waits, and the latest version seen earlier that is now
    due (or else `previous`, the one in force) stays for its key.
    """
    fresh: dict[K, V] = {}
    waiting: dict[K, list[tuple[float, V | None]]] = {}
    for key, stamp, version in versions:
        if cold or stamp <= cutoff:
            if version is not None:
                fresh[key] = version
            continue
        if stamp > now + AHEAD:
            ahead(key, stamp)
        seen = dict(pending.get(key, ()))
        seen[stamp] = version
        due = [s for s in seen if s <= cutoff]
        chosen = seen[max(due)] if due else previous.get(key)
        if chosen is not None:
            fresh[key] = chosen
        waiting[key] = sorted(
            ((s, v) for s, v in seen.items() if s > cutoff), key=lambda sv: sv[0]
        )[-_PENDING_MAX:]
    return fresh, waiting


class RuntimePolicies:
    """The ``quota_policies`` rows, read once per wall-clock period; see the module docstring.

    Sans-I/O: the driver asks `claim` whether to read the tables now (only
    one caller is told yes per period), runs `read_op`, and hands what it
    read (or the exception) to `refresh` with the same ``now``. `settings`
    keeps the ``quota_settings`` rows of the same reads.
    """

    def __init__(
        self, ttl: float, *, metrics: Callable[[str], None] | None = None, margin: float = MARGIN
    ) -> None:
        self.ttl = ttl
        self.margin = margin if ttl > 0 else 0.0
        self._rows: dict[Key, Override] = {}
        # Versions read but not yet applied, oldest first: stamped after their boundary's cutoff.
        self._pending: dict[Key, list[Version]] = {}
        self._next = -math.inf
        self._loaded_boundary = -math.inf
        self._lock = threading.Lock()
        self._failing = False
        self._reported: set[tuple[Key, float]] = set()
        self._malformed_seen: set[str] = set()
        self._count = metrics or (lambda _name: None)
        self.loaded_at: float | None = None
        #: The runtime settings (``quota_settings``), read with the policies.
        self.settings = RuntimeSettings(ttl, metrics=metrics, margin=margin)

    def boundary(self, now: float) -> float:
        """The latest boundary at or before `now` (a multiple of the period since the epoch)."""
        return _boundary(now, self.ttl)

    def claim(self, now: float) -> bool:
        """True on the first call after each boundary: the table should be read now."""
        if now < self._next:
            return False
        with self._lock:
            if now < self._next:
                return False
            if self.ttl > 0:
                self._next = self.boundary(now) + self.ttl
            return True

    def refresh(
        self, read: Snapshot | Rows | BaseException, now: float, guard: Guard | None = None
    ) -> None:
        """Take in what a read at `now` brought back, and apply the settings to `guard`.

        `read` is `read_op`'s `Snapshot`, the policy rows alone, or the
        exception the read raised (then both tables keep their last good
        rows). Never raises.
        """
        if isinstance(read, BaseException):
            self.failed(read)
            return
        if not isinstance(read, Snapshot):
            read = Snapshot(read)
        if isinstance(read.policies, BaseException):
            self.failed(read.policies)
        else:
            self.load(read.policies, now)
        settings = self.settings
        if read.settings is None:
            return
        if isinstance(read.settings, BaseException):
            settings.failed(read.settings)
        else:
            settings.load(read.settings, now)
        if guard is not None:
            settings.apply(guard)

    def load(self, rows: Rows, now: float) -> None:
        """Apply `rows`, read at `now`, as of the boundary `now` falls in.

        A row stamped at least the margin before the boundary applies; a
        newer one is kept pending, and the latest version seen earlier that
        is now due (or else the override in force) stays for its key. A
        malformed row is skipped and logged.
        """
        boundary = self.boundary(now)
        if boundary < self._loaded_boundary:  # a slow read overtaken by a later one
            return
        self._loaded_boundary = boundary
        cutoff = boundary - self.margin if self.ttl > 0 else math.inf
        versions: list[tuple[Key, float, Override | None]] = []
        for values in rows:
            try:
                row = _row(values)
                version = None if _overrides_nothing(row) else Override(row, row.parsed_rates())
            except (ConfigurationError, ValueError, TypeError) as exc:
                self._skip_malformed(values, exc)
                continue
            versions.append(((row.route, row.subject), row.updated_at, version))
        fresh, waiting = _due(
            versions, self._rows, self._pending, cutoff=cutoff, cold=self.loaded_at is None,
            now=now, ahead=lambda key, stamp: self._report_ahead(key, stamp, now),
        )  # fmt: skip
        self._rows, self._pending = fresh, waiting
        self.loaded_at = now
        if self._failing:
            log.warning("quota: %s readable again; %d override(s) in force", TABLE, len(fresh))
        self._failing = False

    def _skip_malformed(self, values: Sequence[Any], exc: Exception) -> None:
        """Count and log a malformed row once, not at every read while it stays."""
        seen = repr(tuple(values))
        if seen in self._malformed_seen:
            return
        if len(self._malformed_seen) > 1024:
            self._malformed_seen.clear()
        self._malformed_seen.add(seen)
        self._count("policy_invalid")
        log.warning("quota: skipping malformed row of %s %r: %s", TABLE, list(values), exc)

    def _report_ahead(self, key: Key, stamp: float, now: float) -> None:
        if (key, stamp) in self._reported:
            return
        if len(self._reported) > 1024:
            self._reported.clear()
        self._reported.add((key, stamp))
        log.warning(
            "quota: the override of %s for %s in %s is stamped %.0f s ahead of this host's"
            " clock; it applies when this clock is past its stamp. Are the clocks of the"
            " workers and of the host running `quota policy` synchronised (NTP)?",
            key[0], key[1], TABLE, stamp - now,
        )  # fmt: skip

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


# -- settings --------------------------------------------------------------------------


#: The abuse detector's threshold standing for "no alerts" (its own floor is 1).
_NO_ALERTS = 2**62
_DECIMAL = re.compile(r"(?:[0-9]{1,15}(?:\.[0-9]{0,15})?|\.[0-9]{1,15})(?:[eE][+-]?[0-9]{1,3})?")
_WHOLE = re.compile(r"[0-9]{1,19}")


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
        if isinstance(value, str) and _WHOLE.fullmatch(value.strip()):
            number = int(value.strip())
        if type(number) is not int or not 0 <= number <= 2**62:
            raise ConfigurationError(
                f"abuse_threshold must be a whole number 0..2**62 (0: off), got {value!r}"
            )
        return number
    tier = _tier(name)
    if isinstance(value, str) and _DECIMAL.fullmatch(value.strip()):
        value = float(value.strip())
    return check_factors("tier_multipliers", {tier: value})[tier]


def _text(value: float | int) -> str:
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


def _setting(values: Sequence[Any]) -> SettingRow:
    name, value, note, updated_at = values
    return SettingRow(
        name=str(name), value=None if value is None else str(value), note=note,
        updated_at=float(updated_at or 0.0),
    )  # fmt: skip


class RuntimeSettings:
    """The ``quota_settings`` rows, read with the policies, and what they change on a guard.

    `load` keeps, for each name, the value in force under the same boundary
    rules as the policies; `apply` brings a `Guard` in line with them,
    touching only what changed, and gives a setting that is gone the value
    it displaced. Sans-I/O, like `RuntimePolicies`, which owns one.
    """

    def __init__(
        self, ttl: float, *, metrics: Callable[[str], None] | None = None, margin: float = MARGIN
    ) -> None:
        self.ttl = ttl
        self.margin = margin if ttl > 0 else 0.0
        self._values: dict[str, float | int] = {}
        self._pending: dict[str, list[tuple[float, float | int | None]]] = {}
        self._loaded_boundary = -math.inf
        self._failing = False
        self._failed_before = False
        self._reported: set[tuple[str, str | None, float]] = set()
        self._count = metrics or (lambda _name: None)
        self.loaded_at: float | None = None
        self._lock = threading.Lock()
        # What `apply` set on the guard, and the configured values it displaced.
        self._multipliers: dict[str, tuple[float, float]] = {}
        self._abuse: int | None = None
        self._apply_failing = False

    @property
    def values(self) -> dict[str, float | int]:
        """The settings in force, by name (the configured values are not listed)."""
        return dict(self._values)

    def load(self, rows: Rows, now: float) -> None:
        """Take in `rows`, read at `now`, as of the boundary `now` falls in (see `RuntimePolicies.load`).

        A malformed row counts as no row (a deletion at its stamp), and is
        logged once.
        """
        boundary = _boundary(now, self.ttl)
        if boundary < self._loaded_boundary:  # a slow read overtaken by a later one
            return
        self._loaded_boundary = boundary
        cutoff = boundary - self.margin if self.ttl > 0 else math.inf
        versions: list[tuple[str, float, float | int | None]] = []
        for values in rows:
            try:
                row = _setting(values)
            except (ValueError, TypeError) as exc:
                self._malformed(repr(list(values)), None, 0.0, exc)
                continue
            if row.name.startswith(ROUTE_CLASS):
                continue  # what the middlewares serve: no setting
            value: float | int | None = None
            if row.value is not None:
                try:
                    value = row.parsed()
                except ConfigurationError as exc:
                    self._malformed(row.name, row.value, row.updated_at, exc)
            versions.append((row.name, row.updated_at, value))
        cold = self.loaded_at is None and not self._failed_before
        fresh, waiting = _due(
            versions, self._values, self._pending, cutoff=cutoff, cold=cold, now=now,
            ahead=lambda name, stamp: self._report_ahead(name, stamp, now),
        )  # fmt: skip
        self._values, self._pending = fresh, waiting
        self.loaded_at = now
        if self._failing:
            log.warning(
                "quota: %s readable again; %d setting(s) in force", SETTINGS_TABLE, len(fresh)
            )
        self._failing = False

    def _malformed(self, name: str, value: str | None, stamp: float, exc: Exception) -> None:
        if (name, value, stamp) in self._reported:
            return
        if len(self._reported) > 1024:
            self._reported.clear()
        self._reported.add((name, value, stamp))
        self._count("setting_invalid")
        log.warning(
            "quota: ignoring the row %r = %r of %s: %s; the setting keeps the value the"
            " code gives it (`quota policy settings` lists the rows, `quota policy unset`"
            " removes one)",
            name, value, SETTINGS_TABLE, exc,
        )  # fmt: skip

    def _report_ahead(self, name: str, stamp: float, now: float) -> None:
        if (name, "ahead", stamp) in self._reported:
            return
        self._reported.add((name, "ahead", stamp))
        log.warning(
            "quota: the setting %s in %s is stamped %.0f s ahead of this host's clock; it"
            " applies when this clock is past its stamp. Are the clocks of the workers and"
            " of the host running `quota policy` synchronised (NTP)?",
            name, SETTINGS_TABLE, stamp - now,
        )  # fmt: skip

    def failed(self, exc: BaseException) -> None:
        """Reading failed: keep the last good settings; log once per failing streak."""
        self._count("settings_refresh_failed")
        if not self._failing:
            log.warning(
                "quota: cannot read %s (%s: %s); keeping %d last-good setting(s)",
                SETTINGS_TABLE, type(exc).__name__, exc, len(self._values),
            )  # fmt: skip
        self._failing = self._failed_before = True

    def apply(self, guard: Guard) -> None:
        """Bring `guard` in line with the settings in force; never raises.

        A tier multiplier goes through `Guard.set_tier_multiplier`, the abuse
        threshold to the guard's `AbuseDetector` (made when the guard was
        built with alerts off; 0 puts it out of reach), each only when it
        differs from the value in force. A setting that is gone gives back the
        value it displaced, unless something else changed it meanwhile.
        """
        try:
            with self._lock:
                self._apply(guard)
        except Exception:
            if not self._apply_failing:
                log.exception("quota: applying the settings of %s failed", SETTINGS_TABLE)
            self._apply_failing = True
        else:
            self._apply_failing = False

    def _apply(self, guard: Guard) -> None:
        values = self._values
        wanted = {
            name[len(TIER_MULTIPLIER) :]: float(value)
            for name, value in values.items()
            if name.startswith(TIER_MULTIPLIER)
        }
        applied = self._multipliers
        for tier, value in wanted.items():
            current = guard.config.tier_multipliers.get(tier, 1.0)
            configured = applied[tier][1] if tier in applied else current
            if current != value:
                guard.set_tier_multiplier(tier, value)
                log.info("quota: tier %r now scaled by %g (%s)", tier, value, SETTINGS_TABLE)
            applied[tier] = (value, configured)
        for tier in [t for t in applied if t not in wanted]:
            value, configured = applied.pop(tier)
            current = guard.config.tier_multipliers.get(tier, 1.0)
            if current == value and current != configured:
                guard.set_tier_multiplier(tier, configured)
                log.info("quota: tier %r scaled by %g again, as configured", tier, configured)
        threshold = values.get(ABUSE_THRESHOLD)
        if threshold is not None:
            self._set_abuse(guard, int(threshold))
            self._abuse = int(threshold)
        elif self._abuse is not None:
            detector = guard.abuse
            if detector is None or detector.threshold == (self._abuse or _NO_ALERTS):
                self._set_abuse(guard, guard.config.abuse_threshold)
            self._abuse = None

    def _set_abuse(self, guard: Guard, threshold: int) -> None:
        detector = guard.abuse
        # Never set back to None: a request may be between its check and its call.
        if detector is None:
            if threshold == 0:
                return
            config = guard.config
            guard.abuse = AbuseDetector(
                threshold, config.abuse_window, config.abuse_interval,
                callback=guard._abuse_alert, clock=guard.clock, metrics=guard.metrics.sink,
            )  # fmt: skip
        elif detector.threshold != (threshold or _NO_ALERTS):
            detector.threshold = threshold or _NO_ALERTS
        else:
            return
        log.info(
            "quota: abuse alerts %s (%s)",
            f"after {threshold} 429s to one key" if threshold else "off", SETTINGS_TABLE,
        )  # fmt: skip


def runtime_policies(
    config: HttpConfig, dialect: str, metrics: Callable[[str], None] | None = None
) -> RuntimePolicies | None:
    """The cache of runtime policies for a middleware on a `dialect` store, or None for none.

    None when `config` turns them off, and on a store that keeps no tables
    (memory, Redis): there is no ``quota_policies`` to read, so the
    middleware never tries; one info line at startup says so.
    """
    if not config.runtime_policies:
        return None
    if dialect in SCHEMALESS:
        log.info(
            "quota: runtime policies are off: the %s store keeps no %s table (they need"
            " sqlite:// or postgresql://); set runtime_policies=False (QUOTA_RUNTIME_POLICIES=0)"
            " to silence this line",
            dialect, TABLE,
        )  # fmt: skip
        return None
    return RuntimePolicies(config.policy_cache_seconds, metrics=metrics)


# -- naming one caller, as the middleware does ---------------------------------------


def hash_secret_from_env(env: Mapping[str, str]) -> bytes | None:
    """``$QUOTA_HASH_SECRET`` (alias ``$RATE_LIMIT_SECRET``) as `HttpConfig.from_env` reads it.

    None when neither is set; `ConfigurationError`, with the middleware's
    message, for one it would refuse (under 16 bytes, not UTF-8).
    """
    names = ("QUOTA_HASH_SECRET", "RATE_LIMIT_SECRET")
    secret = apply_env({n: env[n] for n in names if n in env}, {}).get("hash_secret")
    if secret is None:
        return None
    key: bytes = secret.encode() if isinstance(secret, str) else secret
    return key


def ip_subject(ip: str, secret: bytes, *, ipv6_prefix: int = 64) -> str:
    """The subject the middleware keys a client at `ip` under (with `ipv6_prefix` as its own).

    Normalised as the middleware normalises a client's address: blanks and
    brackets stripped, an IPv4-mapped IPv6 address read as the IPv4 one, an
    IPv6 address keyed by its /`ipv6_prefix` network. `ConfigurationError`
    when `ip` is not an IP address.
    """
    address = client_ip(ip, {}, ())
    try:
        ipaddress.ip_address(address or "")
    except ValueError:
        raise ConfigurationError(f"not an IP address: {ip!r}") from None
    assert address is not None
    return hashed_subject("ip", address, secret, ipv6_prefix=ipv6_prefix)


# -- editing the table (the ``quota policy`` commands) -------------------------------


def _now(limiter: Limiter) -> float:
    """The limiter's clock (`time.time` unless one was injected)."""
    return float(limiter.options.app_clock())


def _statements(*steps: Step) -> Op[Rows]:
    """Run `steps` one after the other (each commits on its own); the rows of the last."""
    rows: Rows = ()
    for step in steps:
        rows = yield step
    return rows


def list_policies(limiter: Limiter) -> list[PolicyRow]:
    """Every override in ``quota_policies`` on a sync `quota.Limiter` (deletions not shown)."""
    rows = (_row(values) for values in limiter.run(_statements((SELECT, ()))))
    return [row for row in rows if not _overrides_nothing(row)]


def set_policy(limiter: Limiter, row: PolicyRow) -> PolicyRow:
    """Insert or replace the row for (`row.route`, `row.subject`); returns it as stored.

    The row is stamped with the limiter's clock; every middleware applies it
    at the first boundary of its cache period at least one second later.
    `ConfigurationError` for a row that would change nothing (give at least
    one of `rates`, `cost`, `fail_open`, `exempt`; `algorithm` goes with
    `rates`).
    """
    if row.algorithm is not None and row.rates is None:
        raise ConfigurationError("algorithm applies to the override's rates: give rates with it")
    if _overrides_nothing(row):
        raise ConfigurationError(
            "an override must change something: give at least one of rates, cost,"
            " fail_open, exempt (to remove one, use delete_policy)"
        )
    now = _now(limiter)
    stamped = PolicyRow(**{**row.__dict__, "updated_at": now})
    limiter.run(_statements((PURGE, (False, now - TOMBSTONE_SECONDS)), (UPSERT, (
        stamped.route, stamped.subject, stamped.rates, stamped.algorithm, stamped.cost,
        stamped.fail_open, stamped.exempt, stamped.note, stamped.updated_at,
    ))))  # fmt: skip
    return stamped


def delete_policy(limiter: Limiter, route: str, subject: str = ANY) -> bool:
    """Delete the override of (`route`, `subject`); True if there was one.

    The row stays a while as a stamped deletion (overriding nothing), so
    that every middleware drops the override at the same boundary, as it
    applies a change; deletions older than two hours are purged when the
    table is next edited.
    """
    now = _now(limiter)
    return bool(limiter.run(_statements(
        (PURGE, (False, now - TOMBSTONE_SECONDS)), (DELETE, (False, now, route, subject, False))
    )))  # fmt: skip


def list_settings(limiter: Limiter) -> list[SettingRow]:
    """Every setting in ``quota_settings`` on a sync `quota.Limiter` (deletions not shown).

    Rows are listed as stored, malformed ones too (the middleware ignores
    those; `SettingRow.parsed` says why).
    """
    rows = (_setting(values) for values in limiter.run(_statements((SELECT_SETTINGS, ()))))
    return [row for row in rows if row.value is not None and not row.name.startswith(ROUTE_CLASS)]


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


def served_routes(limiter: Limiter) -> list[str]:
    """The route classes the middlewares on this database have said they serve, sorted.

    Each middleware records its classes at its first read of the runtime
    policies; empty when none has yet (or the database predates it).
    """
    rows = (_setting(values) for values in limiter.run(_statements((SELECT_SETTINGS, ()))))
    return sorted(
        row.name[len(ROUTE_CLASS) :]
        for row in rows
        if row.value is not None and row.name.startswith(ROUTE_CLASS)
    )


def set_setting(
    limiter: Limiter, name: str, value: float | int | str, *, note: str | None = None
) -> SettingRow:
    """Set `name` to `value`; returns the row as stored.

    `name` is ``tier_multiplier.<tier>`` (a number from 0.001 to 1000, as
    `HttpConfig.tier_multipliers`) or ``abuse_threshold`` (a whole number;
    0 turns alerts off). `ConfigurationError`, with `HttpConfig`'s message,
    for a value it would refuse. Stamped with the limiter's clock; every
    middleware applies it at the first boundary of its cache period at least
    one second later, as a policy change.
    """
    parsed = parse_setting(name, value)
    if note is not None and not isinstance(note, str):
        raise ConfigurationError(f"note must be a string or None, got {note!r}")
    now = _now(limiter)
    row = SettingRow(name=name, value=_text(parsed), note=note, updated_at=now)
    limiter.run(_statements(
        (PURGE_SETTINGS, (now - TOMBSTONE_SECONDS,)),
        (UPSERT_SETTING, (row.name, row.value, row.note, row.updated_at)),
    ))  # fmt: skip
    return row


def delete_setting(limiter: Limiter, name: str) -> bool:
    """Delete the setting `name`; True if there was one.

    The middlewares go back to their configured value at the same boundary,
    as for a change: the row stays a while as a stamped deletion (value
    NULL), purged two hours later when the table is next edited. Any name
    can be deleted, a malformed row's too.
    """
    if not isinstance(name, str) or not name:
        raise ConfigurationError(f"name must be a non-empty string, got {name!r}")
    now = _now(limiter)
    return bool(limiter.run(_statements(
        (PURGE_SETTINGS, (now - TOMBSTONE_SECONDS,)), (DELETE_SETTING, (now, name))
    )))  # fmt: skip
