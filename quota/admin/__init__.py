"""The admin API: read and change what a limiter's store holds.

    import quota
    from quota.admin import Admin, PolicyRow

    with quota.connect("postgresql://app@db/app") as limiter:
        admin = Admin(limiter)
        admin.set_policy(PolicyRow(route="search", subject="tier:anon", rates="10/minute"))
        for usage in admin.top(5):
            print(usage.key, usage.count)

`Admin` wraps a `quota.Limiter`, `AsyncAdmin` a `quota.AsyncLimiter`, with
the same methods: the runtime route policies and settings the HTTP
middlewares apply (``quota_policies``, ``quota_settings``), the busiest keys,
one key's windows and leases, durable quotas' usage and ledger, resetting a
key, and the store's health. The ``quota`` command line and the Django
integration go through it. Bad arguments raise `quota.ConfigurationError`
naming the argument and its value. See docs/admin.md.
"""

from __future__ import annotations

from quota._sql.policies import (
    ABUSE_THRESHOLD,
    ANY,
    TIER_MULTIPLIER,
    PolicyRow,
    SettingRow,
    parse_setting,
)
from quota.admin._async import AsyncAdmin
from quota.admin._common import Health
from quota.admin._sync import Admin

__all__ = [
    "ABUSE_THRESHOLD",
    "ANY",
    "TIER_MULTIPLIER",
    "Admin",
    "AsyncAdmin",
    "Health",
    "PolicyRow",
    "SettingRow",
    "parse_setting",
]
