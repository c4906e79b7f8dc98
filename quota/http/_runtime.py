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
"""

from __future__ import annotations

import ipaddress
import logging
import math
import threading
import time
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from quota._algorithms import ALGORITHMS, Rate
from quota._errors import ConfigurationError
from quota._policy import parse_rates
from quota._url import SCHEMALESS
from quota.http._identity import Identity, client_ip, hashed_subject
from quota.http._policy import HttpConfig, apply_env

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
_EMPTY = "rates IS NULL AND algorithm IS NULL AND cost IS NULL AND fail_open IS NULL AND exempt = ?"
#: A deletion: the row overrides nothing from now on (and says when it stopped).
DELETE = (
    "UPDATE quota_policies SET rates = NULL, algorithm = NULL, cost = NULL, fail_open = NULL,"
    " exempt = ?, note = NULL, updated_at = ?"
    f" WHERE route = ? AND subject = ? AND NOT ({_EMPTY}) RETURNING 1"
)
PURGE = f"DELETE FROM quota_policies WHERE {_EMPTY} AND updated_at < ? RETURNING 1"


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


class RuntimePolicies:
    """The ``quota_policies`` rows, read once per wall-clock period; see the module docstring.

    Sans-I/O: the driver asks `claim` whether to read the table now (only one
    caller is told yes per period), runs `SELECT`, and hands the rows to
    `load` (with the same ``now``) or the exception to `failed`.
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
        self._count = metrics or (lambda _name: None)
        self.loaded_at: float | None = None

    def boundary(self, now: float) -> float:
        """The latest boundary at or before `now` (a multiple of the period since the epoch)."""
        ttl = self.ttl
        return math.floor(now / ttl) * ttl if ttl > 0 else now

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

    def load(self, rows: Sequence[Sequence[Any]], now: float) -> None:
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
        cold = self.loaded_at is None
        previous, pending = self._rows, self._pending
        fresh: dict[Key, Override] = {}
        waiting: dict[Key, list[Version]] = {}
        for values in rows:
            try:
                row = _row(values)
                version = None if _overrides_nothing(row) else Override(row, row.parsed_rates())
            except (ConfigurationError, ValueError, TypeError) as exc:
                self._count("policy_invalid")
                log.warning("quota: skipping malformed row of %s %r: %s", TABLE, list(values), exc)
                continue
            key, stamp = (row.route, row.subject), row.updated_at
            if cold or stamp <= cutoff:
                if version is not None:
                    fresh[key] = version
                continue
            if stamp > now + AHEAD:
                self._report_ahead(key, stamp, now)
            seen = {s: v for s, v in pending.get(key, ())}
            seen[stamp] = version
            due = [s for s in seen if s <= cutoff]
            chosen = seen[max(due)] if due else previous.get(key)
            if chosen is not None:
                fresh[key] = chosen
            waiting[key] = sorted(
                ((s, v) for s, v in seen.items() if s > cutoff), key=lambda sv: sv[0]
            )[-_PENDING_MAX:]
        self._rows, self._pending = fresh, waiting
        self.loaded_at = now
        if self._failing:
            log.warning("quota: %s readable again; %d override(s) in force", TABLE, len(fresh))
        self._failing = False

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


def _now(limiter: Any) -> float:
    """The limiter's clock (`time.time` unless one was injected)."""
    options = getattr(limiter, "options", None)
    clock = getattr(options, "app_clock", None) or time.time
    return float(clock())


def list_policies(limiter: Any) -> list[PolicyRow]:
    """Every override in ``quota_policies`` on a sync `quota.Limiter` (deletions not shown)."""
    rows = (_row(values) for values in limiter.store.execute(SELECT, ()))
    return [row for row in rows if not _overrides_nothing(row)]


def set_policy(limiter: Any, row: PolicyRow) -> PolicyRow:
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
    store = limiter.store
    store.execute(PURGE, (False, now - TOMBSTONE_SECONDS))
    store.execute(UPSERT, (
        stamped.route, stamped.subject, stamped.rates, stamped.algorithm, stamped.cost,
        stamped.fail_open, stamped.exempt, stamped.note, stamped.updated_at,
    ))  # fmt: skip
    return stamped


def delete_policy(limiter: Any, route: str, subject: str = ANY) -> bool:
    """Delete the override of (`route`, `subject`); True if there was one.

    The row stays a while as a stamped deletion (overriding nothing), so
    that every middleware drops the override at the same boundary, as it
    applies a change; deletions older than two hours are purged when the
    table is next edited.
    """
    now = _now(limiter)
    store = limiter.store
    store.execute(PURGE, (False, now - TOMBSTONE_SECONDS))
    return bool(store.execute(DELETE, (False, now, route, subject, False)))
