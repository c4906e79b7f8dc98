"""Alembic environment for the quota tables.

Run from a checkout with ``alembic upgrade head`` (the URL comes from
``$QUOTA_DATABASE_URL``), or through ``quota migrate`` / ``quota.migrate()``,
which may hand in a connection via ``config.attributes["connection"]``.
Logging is left to the caller: no ``fileConfig`` here.
"""

from typing import TYPE_CHECKING, cast

from alembic import context

from quota._sql.migrate import run_env

if TYPE_CHECKING:
    from alembic.runtime.environment import EnvironmentContext

# ``alembic.context`` is a module that proxies the running EnvironmentContext's
# methods and ``config``: typed as that context.
run_env(cast("EnvironmentContext", context))
