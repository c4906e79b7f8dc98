"""The migration operation that brings quota's tables to one of quota's schema revisions.

quota's schema has its own revisions (``quota migrate``, Alembic, the version
table ``quota_alembic_version``). Each of the app's Django migrations holds one
`QuotaSchema` naming the revision it brings the schema to, so ``manage.py
migrate`` and ``quota migrate`` apply the same statements and never disagree:

* ``manage.py migrate`` upgrades through quota's own migration run (its own
  connection, lock and transaction): from whatever revision the database is
  at, so after ``quota migrate`` it applies nothing, and several processes
  migrating at once queue behind one another.
* ``manage.py sqlmigrate quota 0001`` prints the revision range's SQL as
  ``quota migrate --sql`` renders it for the database's dialect.
* ``manage.py migrate quota zero`` downgrades, refusing to drop tables holding
  durable quota data unless ``QUOTA["DROP_DATA"]`` is True.

quota's tables live in the database of the ``QUOTA["DATABASE"]`` alias
(``default``), or at ``QUOTA["URL"]``: a migration run on another alias does
nothing, and so does one on a store without SQL tables (``redis://``,
``memory://``).
"""

from __future__ import annotations

from typing import Any

import sqlparse
from django.core.management.base import CommandError
from django.db.migrations.operations.base import Operation

from quota._core.errors import ConfigurationError
from quota._core.url import SCHEMALESS, parse_url
from quota._sql import migrate as _migrate
from quota.contrib.django import conf

#: quota's revision below its first: no quota tables.
BASE = "base"


class QuotaSchema(Operation):  # type: ignore[misc]
    """Upgrade quota's tables from revision `previous` to `target` (and back)."""

    reversible = True
    reduces_to_sql = True
    atomic = False  # quota's own run holds its own transaction and lock

    def __init__(self, target: str, previous: str | None = None) -> None:
        self.target = target
        self.previous = previous

    def deconstruct(self) -> tuple[str, list[Any], dict[str, Any]]:
        kwargs: dict[str, Any] = {"target": self.target}
        if self.previous is not None:
            kwargs["previous"] = self.previous
        return (f"{__name__}.{type(self).__qualname__}", [], kwargs)

    def describe(self) -> str:
        return f"Bring quota's tables to revision {self.target}"

    @property
    def migration_name_fragment(self) -> str:
        return f"quota_{self.target}"

    def state_forwards(self, app_label: str, state: Any) -> None:
        """quota's tables are no Django models: the project state does not change."""

    def database_forwards(
        self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any
    ) -> None:
        url = _url_for(schema_editor.connection)
        if url is None:
            return
        schema = conf.quota_settings().limiter_options().schema
        if schema_editor.collect_sql:
            sql = _migrate.migration_sql(
                url, f"{self.previous or BASE}:{self.target}", upgrade=True, schema=schema
            )
            _collect(schema_editor, sql)
            return
        _migrate.migrate(url, revision=self.target, schema=schema)
        conf.reset()  # a limiter opened before reads the new schema

    def database_backwards(
        self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any
    ) -> None:
        url = _url_for(schema_editor.connection)
        if url is None:
            return
        settings = conf.quota_settings()
        schema = settings.limiter_options().schema
        previous = self.previous or BASE
        if schema_editor.collect_sql:
            _collect(
                schema_editor,
                _migrate.migration_sql(
                    url, f"{self.target}:{previous}", upgrade=False, schema=schema
                ),
            )
            return
        conf.reset()  # close quota's connections before its tables go
        try:
            _migrate.downgrade(url, revision=previous, drop_data=settings.drop_data, schema=schema)
        except ConfigurationError as exc:
            if settings.drop_data or "drop_data=True" not in str(exc):
                raise
            raise CommandError(
                f"{str(exc).split(' Back it up', 1)[0]} Back it up, then set"
                ' QUOTA["DROP_DATA"] = True in the settings and run the migration again'
                " (manage.py sqlmigrate quota <migration> --backwards prints the statements)"
            ) from exc


def _url_for(connection: Any) -> str | None:
    """The URL of quota's tables when `connection` is the alias holding them, else None."""
    settings = conf.quota_settings()
    if connection.alias != settings.database:
        return None
    url = conf.database_url()
    return None if parse_url(url).dialect in SCHEMALESS else url


def _collect(schema_editor: Any, sql: str) -> None:
    for statement in sqlparse.split(sql):
        if statement.strip():
            schema_editor.execute(statement, params=None)
