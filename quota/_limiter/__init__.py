"""The limiters and the two ways to get one: `connect` (sync) and `connect_async`.

`Limiter` and `AsyncLimiter` are thin drivers around the decision core. The
async face is written once, in `quota._limiter.async_face`; the sync face,
`quota._limiter.sync_face`, is generated from it by unasyncd (``[tool.unasyncd]``
in pyproject.toml; run ``unasyncd`` after an edit). What never awaits, both
call from `quota._limiter.base`: `Options`, the metrics and failing open, and
opening a URL's store where its declaration (`quota._core.url.DIALECTS`) says.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from quota._core.url import parse_url
from quota._limiter.async_face import AsyncLimiter, open_async_store
from quota._limiter.base import Options, OptionsDict, options_from
from quota._limiter.sync_face import Limiter, open_sync_store

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = [
    "AsyncLimiter",
    "Limiter",
    "Options",
    "OptionsDict",
    "connect",
    "connect_async",
    "open_async_store",
    "open_sync_store",
]


def connect(
    url: str, *, options: Options | None = None, **settings: Unpack[OptionsDict]
) -> Limiter:
    """A synchronous `Limiter` for the database at `url`.

    ``sqlite:///path.db`` (sqlite3) or ``postgresql://…`` (psycopg 3, from the
    ``postgres`` extra); ``memory://`` (in this process) or ``redis://…`` (the
    ``redis`` extra) for every algorithm but no durable quotas. Connections open
    on first use. Raises
    `ConfigurationError` for an unknown scheme (listing the known ones) or an
    async driver (``+aiosqlite``, ``+asyncpg``: use `connect_async`).

    The settings are the fields of `quota.Options`, given as keywords
    (``connect(url, pool_size=5)``) or as one ``options=Options(...)``, not
    both (a `ConfigurationError` names the keywords given beside it); a bad
    or unknown one is a `ConfigurationError` naming it.

    With ``fallback=True`` (or a `quota.Fallback`) the limiter never raises
    for the database: an in-memory store decides while it errors, times out
    or is unreachable, a background probe switches back when it answers, and
    the fixed-window hits of the outage are written back after (at most
    ``max_keys`` windows of them). Use it in request
    paths; `fail_closed=True` on a call denies instead while the store is down.

    With ``record_rate_denials=True`` every rate-limit denial also appends a
    ``rate_denied`` entry to the quota ledger (allowed hits never do).

    With ``batching=True`` concurrent fixed-window hits from threads share one
    statement (group commit, at most `max_batch` hits, and never more than
    4,096 on SQLite), each still getting its exact count; a lone call goes
    out at once. ``durability="relaxed"`` lets
    PostgreSQL commit the limiter's statements without waiting for the WAL
    flush; durable quotas stay synchronous. See the README for both.

    `metrics` (a `quota.Metrics`) counts decisions by source (store,
    fallback, fail_open), store errors and store latency; `abuse` (a
    `quota.AbuseDetector`) hears of every denial.

    With ``telemetry=True`` (the ``otel`` extra: ``pip install 'quota[otel]'``) the
    limiter reports through the global OpenTelemetry meter and tracer providers
    (scope ``quota``): the counter ``quota.decisions`` (attributes ``outcome``,
    ``algorithm``, ``store``), the histogram ``quota.store.duration`` (seconds, by
    ``store`` and ``operation``), the gauge ``quota.fallback.active``, and a span
    ``quota.<operation>`` per store call; never a key. A `quota.Telemetry` passes
    providers of its own. Telemetry never raises into the call (its failures are
    logged); without the extra, ``telemetry=True`` is a `ConfigurationError`.
    """
    built = options_from(options, settings)
    return Limiter(open_sync_store(parse_url(url), built), built)


def connect_async(
    url: str, *, options: Options | None = None, **settings: Unpack[OptionsDict]
) -> AsyncLimiter:
    """An `AsyncLimiter` for the database at `url`.

    ``sqlite:///path.db`` or ``sqlite+aiosqlite:///…`` (aiosqlite),
    ``postgresql://…`` or ``postgresql+asyncpg://…`` (asyncpg pool of at most
    `pool_size` connections); ``memory://`` or ``redis://…`` (redis.asyncio).
    Connections open on first use. The settings (keywords or ``options=``),
    `batching`, `max_batch` and `durability` as for `connect`; batching
    gathers the hits of concurrent tasks.
    """
    built = options_from(options, settings)
    return AsyncLimiter(open_async_store(parse_url(url), built), built)
