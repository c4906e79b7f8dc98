"""Alembic environment for the quota tables.

Run from a checkout with ``alembic upgrade head`` (the URL comes from
``$QUOTA_DATABASE_URL``), or through ``quota migrate`` / ``quota.migrate()``,
which may hand in a connection via ``config.attributes["connection"]``.
Logging is left to the caller: no ``fileConfig`` here.
"""

from alembic import context

from quota._migrate import run_env

run_env(context)
