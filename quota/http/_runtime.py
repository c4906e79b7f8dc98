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
and ``exempt`` false overrides nothing: it is what `Admin.delete_policy` leaves
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
runtime policies: `runtime_policies` returns None for them. The tables'
rows, statements and operations (`read_op`, and the edits behind
`quota.admin`) are in `quota._sql.policies`; what is here is the in-request
cache, applied to a guard through its public methods (`Tunable`).

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
through `Guard.set_tier_multiplier` and `Guard.set_abuse_threshold`, only when
it differs from the one in force; a deleted setting (`delete_setting` leaves
a stamped row whose value is NULL) gives back the configured value. The two
tables are read by two statements, each failing alone: a database not yet
migrated to 0005_settings keeps its runtime policies, and the configured
settings (logged once per failing streak). A malformed row (a value out of
bounds, a name this code does not know) counts as no row, and is logged
once.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from quota._core.algorithms import Rate
from quota._core.errors import ConfigurationError
from quota._core.rates import parse_rates
from quota._core.url import SCHEMALESS
from quota._sql.policies import (
    ABUSE_THRESHOLD,
    ANY,
    ROUTE_CLASS,
    SETTINGS_TABLE,
    TABLE,
    TIER_MULTIPLIER,
    PolicyRow,
    Rows,
    Snapshot,
    overrides_nothing,
    policy_row,
    setting_row,
)
from quota.http._config import HttpConfig
from quota.http._identity import Identity

log = logging.getLogger("quota.http")


class Tunable(Protocol):
    """What the settings change on a guard (`quota.http._core.Guard`), through its public methods."""

    config: HttpConfig

    @property
    def abuse_threshold(self) -> int: ...

    def set_tier_multiplier(self, tier: str, value: float) -> None: ...

    def set_abuse_threshold(self, threshold: int) -> bool: ...


#: A row stamped less than this many seconds before a boundary waits for the next one:
#: room for the write to commit and for the clocks of the hosts to differ a little.
MARGIN = 1.0
#: A row stamped this far (seconds) in a worker's future is reported: the clocks disagree.
AHEAD = 10.0
#: Pending versions kept per override (changes written within a period or two).
_PENDING_MAX = 8


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
        self, read: Snapshot | Rows | BaseException, now: float, guard: Tunable | None = None
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
                row = policy_row(values)
                version = None if overrides_nothing(row) else Override(row, row.parsed_rates())
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
                row = setting_row(values)
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

    def apply(self, guard: Tunable) -> None:
        """Bring `guard` in line with the settings in force; never raises.

        A tier multiplier goes through `Guard.set_tier_multiplier`, the abuse
        threshold through `Guard.set_abuse_threshold`, each only when it
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

    def _apply(self, guard: Tunable) -> None:
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
            if guard.abuse_threshold == self._abuse:
                self._set_abuse(guard, guard.config.abuse_threshold)
            self._abuse = None

    def _set_abuse(self, guard: Tunable, threshold: int) -> None:
        if guard.set_abuse_threshold(threshold):
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
