"""``quota doctor``: check a database the way the limiter will use it, and say what to fix.

`diagnose` connects to a store URL, changes nothing, and returns a list
of `Finding`: connectivity, the schema revision against what this code
needs, drift of the live schema from what the migrations made (a dropped
table, column, index or primary key, with the statement that restores it),
SQLite's version and journal mode, the PostgreSQL settings of the hot
tables (UNLOGGED or logged, fillfactor, the share of HOT updates; read from
the partitions of a partitioned table), a PostgreSQL session that is
read-only, the skew between this host's clock and the database's; on Redis
(every master of a cluster), connectivity and the ``maxmemory-policy`` (any
but ``noeviction`` can evict counters). Database failures become findings, never
exceptions, so a broken setup still gets a full report. The assessments are pure
functions of the numbers read, so each threshold is tested without a database.

Severities: ``ok``; ``warn`` (works, but slower or riskier than it should
be); ``error`` (the limiter will fail or misbehave). Every finding that is
not ``ok`` carries a ``fix``.

One module per area: `runner` (`diagnose` and `PLANS`, the table of the checks each
kind of store gets), `connection` (opening SQLite and PostgreSQL), `schema` (the
revision), `drift` (the live schema against the migrations, read by `live_schema`;
the statements fixes quote come from `fixes`), `sqlite`, `postgres` (the hot tables'
settings and partitions), `redis`, `routes` (route classes) and `clock` (the skew).
"""

from __future__ import annotations

from quota._tools.doctor.base import ERROR, OK, SEVERITIES, WARN, Finding, display_url
from quota._tools.doctor.runner import diagnose

__all__ = ["ERROR", "OK", "SEVERITIES", "WARN", "Finding", "diagnose", "display_url"]
