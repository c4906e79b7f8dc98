"""The statements of the durable quotas' export (`quota._limiter.export`), written once with ``?``.

Each statement reads one batch, picking up after the last row of the one
before (keyset pagination), so an export holds no transaction and no cursor
between batches and its memory does not grow with the tables. The columns a
statement reads are those of the export's column tables
(`quota._limiter.export.USAGE_COLUMNS`, `LEDGER_COLUMNS`), passed in.

Usage rows are read in primary-key order (subject, quota name, period
start); ledger entries in `id` order, within the ids the range holds
(`ledger_bounds`, found on the ``at`` index). The time filter of a ledger
batch is written ``+at`` so that neither SQLite nor PostgreSQL serves it
from the ``at`` index (then sorting the whole range for every batch): the
batch walks the primary key from the last id on instead. The subject filter
is written ``subject || ''`` for the same reason.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from quota._sql.statements import Statement

_USAGE_ORDER = " ORDER BY subject, name, period_start LIMIT ?"
_IN_PERIOD = "period_start >= ? AND period_start < ?"


@functools.cache
def usage_batch(columns: Sequence[str], *, subject: bool, first: bool) -> Statement:
    """The next batch of ``quota_usage`` rows whose period starts in a range.

    Params: [subject,] [after_subject, after_name, after_period_start (or, with
    `subject`, after_name, after_period_start),] start_from, start_before, limit.
    """
    where = []
    if subject:
        where.append("subject = ?")
    if not first:
        where.append(
            "(name, period_start) > (?, ?)"
            if subject
            else "(subject, name, period_start) > (?, ?, ?)"
        )
    where.append(_IN_PERIOD)
    name = "export_usage" + ("_subject" if subject else "") + ("" if first else "_after")
    sql = f"SELECT {', '.join(columns)} FROM quota_usage WHERE {' AND '.join(where)}{_USAGE_ORDER}"
    return Statement(name, sql)


@functools.cache
def ledger_bounds(*, subject: bool) -> Statement:
    """The lowest and the highest id of the ledger entries of a time range (NULLs when none).

    Params: [subject,] at_from, at_before.
    """
    where = ("subject = ? AND " if subject else "") + "at >= ? AND at < ?"
    return Statement(
        "export_ledger_bounds" + ("_subject" if subject else ""),
        f"SELECT min(id), max(id) FROM quota_ledger WHERE {where}",
    )


@functools.cache
def ledger_batch(columns: Sequence[str], *, subject: bool) -> Statement:
    """The next batch of ledger entries of a time range, by id.

    Params: after_id, last_id, [subject,] at_from, at_before, limit.
    """
    where = "id > ? AND id <= ?" + (" AND subject || '' = ?" if subject else "")
    return Statement(
        "export_ledger" + ("_subject" if subject else ""),
        f"SELECT {', '.join(columns)} FROM quota_ledger"
        f" WHERE {where} AND +at >= ? AND +at < ? ORDER BY id LIMIT ?",
    )
