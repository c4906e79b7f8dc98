"""quota: exact rate limits kept in the SQL database your app already has.

    import quota
    limiter = quota.connect("sqlite:///quota.sqlite3")   # or postgresql://…
    decision = limiter.rate_limit("ip:203.0.113.7", limit=10, window=60)
    if not decision.allowed:
        ...  # 429, with decision.headers()

Durable quotas (money: LLM calls, paid API units) live apart from rate windows:
``limiter.consume_quota(subject, name, limit, "day", idempotency_key=...)``,
``refund_quota``, ``grant_quota``, ``reserve_quota`` then ``settle_quota``, ``ledger``, ``export`` (usage and ledger
for billing), and ``limiter.check(...)`` for several limits at once, all or nothing.
A quota's ``thresholds`` fire a ``ThresholdEvent`` once per period (``quota.notify``
delivers them to a webhook).

See the documentation (docs/) for the async face, migrations and the CLI.
"""

from __future__ import annotations

from quota._core.algorithms import ALGORITHMS, Rate
from quota._core.decision import Decision
from quota._core.errors import (
    ConfigurationError,
    Overloaded,
    QuotaError,
    RateLimitTimeout,
    ReservationNotFound,
    SchemaError,
    StorageError,
)
from quota._core.leases import ConcurrencyUsage
from quota._core.rates import parse_rates
from quota._core.url import default_url
from quota._limiter import AsyncLimiter, Limiter, Options, connect, connect_async
from quota._limiter.default import rate_limit, rate_limit_async
from quota._limiter.export import LedgerRecord, UsageRecord
from quota._limiter.quota_types import (
    CheckDecision,
    LedgerEntry,
    QuotaDecision,
    QuotaLimit,
    QuotaUsage,
    RateWindow,
    RefundResult,
    Reservation,
    ThresholdEvent,
)
from quota._sql.migrate import current_revision, downgrade, migrate
from quota._sql.ops import CleanupResult, Usage
from quota._tools.doctor import Finding, diagnose
from quota._wrappers.abuse import AbuseDetector
from quota._wrappers.fallback import Fallback
from quota._wrappers.metrics import Metrics
from quota._wrappers.telemetry import Telemetry

__version__ = "0.1.0"

__all__ = [
    "ALGORITHMS",
    "AbuseDetector",
    "AsyncLimiter",
    "CheckDecision",
    "CleanupResult",
    "ConcurrencyUsage",
    "ConfigurationError",
    "Decision",
    "Fallback",
    "Finding",
    "LedgerEntry",
    "LedgerRecord",
    "Limiter",
    "Metrics",
    "Options",
    "Overloaded",
    "QuotaDecision",
    "QuotaError",
    "QuotaLimit",
    "QuotaUsage",
    "Rate",
    "RateLimitTimeout",
    "RateWindow",
    "RefundResult",
    "Reservation",
    "ReservationNotFound",
    "SchemaError",
    "StorageError",
    "Telemetry",
    "ThresholdEvent",
    "Usage",
    "UsageRecord",
    "connect",
    "connect_async",
    "current_revision",
    "default_url",
    "diagnose",
    "downgrade",
    "migrate",
    "parse_rates",
    "rate_limit",
    "rate_limit_async",
]
