# quota/admin/_sync.py is generated from quota/admin/_async.py by unasyncd
# ([tool.unasyncd] in pyproject.toml): edit the async file, then run `unasyncd`.
"""`AsyncAdmin`: the admin API over a `quota.AsyncLimiter`.

Each call is a thin step over the limiter: the SQL of the runtime policy
tables is in `quota._sql.policies`, what both faces share in
`quota.admin._common`.
"""

from __future__ import annotations

import time
from dataclasses import replace

from quota._core.decision import Decision, Duration, check_int
from quota._core.errors import ConfigurationError, QuotaError, SchemaError
from quota._core.leases import ConcurrencyUsage
from quota._limiter import AsyncLimiter
from quota._limiter.quota_types import LedgerEntry, QuotaUsage
from quota._sql import ops as _ops
from quota._sql import policies as _policies
from quota._sql.ops import Usage
from quota._sql.policies import (
    ABUSE_THRESHOLD,
    ANY,
    SETTINGS_TABLE,
    TABLE,
    TIER_MULTIPLIER,
    PolicyRow,
    SettingRow,
)
from quota.admin._common import Health, check_name, check_tables, health, probe_op

#: The most rows `top` and `top_leases` return.
MAX_TOP = 100_000


class AsyncAdmin:
    """Read and change what a limiter's store holds: the admin API for asyncio code.

    Route policies and settings (``quota_policies``, ``quota_settings``: the
    runtime overrides of the HTTP middleware, see docs/admin.md), the busiest
    keys, one key's windows and leases, durable quotas' usage and ledger,
    resetting a key, and the store's health. Each call runs on the limiter's
    store, with its clock; the admin holds nothing of its own, so it is as
    safe to share as the limiter.
    """

    def __init__(self, limiter: AsyncLimiter) -> None:
        if not isinstance(limiter, AsyncLimiter):
            raise ConfigurationError(
                f"limiter must be a quota.{AsyncLimiter.__name__}, got {limiter!r}"
            )
        self.limiter = limiter

    def _now(self) -> float:
        return float(self.limiter.options.app_clock())

    def _tables(self, table: str) -> None:
        check_tables(self.limiter.store.dialect, table)

    # -- route policies (quota_policies) --------------------------------------------------

    async def policies(self) -> list[PolicyRow]:
        """Every override in ``quota_policies``, by route class and subject (deletions not shown).

        `ConfigurationError` on a store that keeps no tables (memory, Redis).
        """
        self._tables(TABLE)
        return await self.limiter.run(_policies.list_policies())

    async def set_policy(self, row: PolicyRow) -> PolicyRow:
        """Insert or replace the override of (`row.route`, `row.subject`); returns it as stored.

        The row is stamped with the limiter's clock; every middleware applies it
        at the first boundary of its cache period at least one second later.
        `ConfigurationError` for a row that would change nothing (give at least
        one of `rates`, `cost`, `fail_open`, `exempt`; `algorithm` goes with
        `rates`), and for anything but a `PolicyRow`.
        """
        if not isinstance(row, PolicyRow):
            raise ConfigurationError(f"row must be a quota.admin.PolicyRow, got {row!r}")
        self._tables(TABLE)
        return await self.limiter.run(_policies.set_policy(row, self._now()))

    async def delete_policy(self, route: str, subject: str = ANY) -> bool:
        """Delete the override of (`route`, `subject`); True if there was one.

        The row stays a while as a stamped deletion (overriding nothing), so
        that every middleware drops the override at the same boundary, as it
        applies a change; deletions older than two hours are purged when the
        table is next edited.
        """
        check_name("route", route)
        check_name("subject", subject)
        self._tables(TABLE)
        return await self.limiter.run(_policies.delete_policy(route, subject, self._now()))

    async def served_routes(self) -> list[str]:
        """The route classes the middlewares on this database have said they serve, sorted.

        Each middleware records its classes at its first read of the runtime
        policies; empty when none has yet (or the database predates it).
        """
        self._tables(SETTINGS_TABLE)
        return await self.limiter.run(_policies.served_routes())

    async def unserved_route(self, route: str) -> str | None:
        """What is wrong with an override of `route` on this database, or None if nothing.

        A message when no middleware serves a route class `route` (naming the
        closest one served); None for ``*``, for a class served, and while no
        middleware has recorded its classes yet.
        """
        check_name("route", route)
        if route == ANY:
            return None
        return _policies.unserved_route(route, await self.served_routes())

    # -- settings (quota_settings) ---------------------------------------------------------

    async def settings(self) -> list[SettingRow]:
        """Every setting in ``quota_settings`` (deletions not shown), by name.

        Rows are listed as stored, malformed ones too (the middleware ignores
        those; `SettingRow.parsed` says why).
        """
        self._tables(SETTINGS_TABLE)
        return await self.limiter.run(_policies.list_settings())

    async def set_setting(
        self, name: str, value: float | int | str, *, note: str | None = None
    ) -> SettingRow:
        """Set `name` to `value`; returns the row as stored.

        `name` is ``tier_multiplier.<tier>`` (a number from 0.001 to 1000, as
        `HttpConfig.tier_multipliers`) or ``abuse_threshold`` (a whole number;
        0 turns alerts off). `ConfigurationError`, with `HttpConfig`'s message,
        for a value it would refuse. Stamped with the limiter's clock; every
        middleware applies it at the first boundary of its cache period at
        least one second later, as a policy change.
        """
        _policies.parse_setting(name, value)
        self._tables(SETTINGS_TABLE)
        return await self.limiter.run(_policies.set_setting(name, value, note, self._now()))

    async def set_tier_multiplier(
        self, tier: str, value: float, *, note: str | None = None
    ) -> SettingRow:
        """Scale `tier`'s limits by `value` (0.001 to 1000): ``set_setting("tier_multiplier.<tier>", ...)``."""
        check_name("tier", tier)
        return await self.set_setting(TIER_MULTIPLIER + tier, value, note=note)

    async def set_abuse_threshold(self, threshold: int, *, note: str | None = None) -> SettingRow:
        """Raise abuse alerts after `threshold` 429s to one key (0: none): ``set_setting("abuse_threshold", ...)``."""
        return await self.set_setting(ABUSE_THRESHOLD, threshold, note=note)

    async def delete_setting(self, name: str) -> bool:
        """Delete the setting `name`; True if there was one.

        The middlewares go back to their configured value at the same boundary,
        as for a change: the row stays a while as a stamped deletion (value
        NULL), purged two hours later when the table is next edited. Any name
        can be deleted, a malformed row's too.
        """
        check_name("name", name)
        self._tables(SETTINGS_TABLE)
        return await self.limiter.run(_policies.delete_setting(name, self._now()))

    # -- keys ------------------------------------------------------------------------------

    async def top(self, n: int = 10) -> list[Usage]:
        """The `n` busiest keys in fixed windows still running, busiest first."""
        check_int("n", n, maximum=MAX_TOP)
        return await self.limiter.top(n)

    async def windows(self, key: str) -> list[Usage]:
        """`key`'s fixed windows still running, whatever their limit, shortest first (none: [])."""
        return await self.limiter.run(_ops.windows(key, self._now()))

    async def peek(self, key: str, limit: int, window: Duration) -> Decision:
        """`key`'s fixed window under `limit` hits per `window`, as the next hit would see it,
        without counting one (`quota.AsyncLimiter.peek`)."""
        return await self.limiter.peek(key, limit, window)

    async def reset(self, key: str, window: Duration | None = None) -> int:
        """Forget `key`'s counts (only its windows of `window` if given); the rows deleted."""
        return await self.limiter.reset(key, window)

    # -- concurrency leases ------------------------------------------------------------------

    async def top_leases(self, n: int = 10) -> list[ConcurrencyUsage]:
        """The `n` concurrency keys with the most live leases, fullest first."""
        check_int("n", n, maximum=MAX_TOP)
        return await self.limiter.concurrency_top(n)

    async def leases(self, key: str, limit: int | None = None) -> ConcurrencyUsage:
        """Who holds `key`'s concurrency slots, and how many are free under `limit` (default:
        the limit they were taken under)."""
        return await self.limiter.concurrency_usage(key, limit)

    # -- durable quotas ----------------------------------------------------------------------

    async def usage(self, subject: str, *, include_ended: bool = False) -> list[QuotaUsage]:
        """`subject`'s durable quotas in their current periods (`include_ended`: ended ones too)."""
        return await self.limiter.quota_usage(subject, include_ended=include_ended)

    async def ledger(self, subject: str, since: float | None = None) -> list[LedgerEntry]:
        """`subject`'s ledger entries, oldest first; `since` (epoch seconds) filters."""
        return await self.limiter.ledger(subject, since)

    # -- health --------------------------------------------------------------------------------

    async def health(self, *, probe: bool = True) -> Health:
        """The store's state: up or down, and with a fallback what is owed to it.

        With `probe`, one cheap statement (the schema version read; ``PING`` on
        Redis) runs on the store, never answered from memory nor held to a
        fallback's time budget, and is timed:
        `Health.reachable`, `Health.latency`. A store that fails the probe is
        reported (`Health.probe_error`), not raised; a missing schema counts as
        reachable.
        """
        found = health(self.limiter.store)
        if not probe:
            return found
        started = time.perf_counter()
        try:
            await self.limiter.run(probe_op())
        except QuotaError as exc:
            return replace(
                found, reachable=isinstance(exc, SchemaError),
                probe_error=f"{type(exc).__name__}: {exc}",
            )  # fmt: skip
        return replace(found, reachable=True, latency=time.perf_counter() - started)
