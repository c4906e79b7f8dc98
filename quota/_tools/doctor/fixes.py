"""The statements fixes quote: what the migrations run, rendered offline and parsed."""

from __future__ import annotations

import functools
import io
import re
from dataclasses import dataclass

from quota._sql.schema import REVISIONS


@dataclass(frozen=True, slots=True)
class MigrationDdl:
    """The statements the migrations run on one dialect, each with its revision."""

    statements: tuple[tuple[str, str], ...]
    """(revision, statement) in the order the migrations run them, on one line each."""

    @classmethod
    def parse(cls, script: str) -> MigrationDdl:
        """Split the SQL `quota migrate --sql` writes into statements tagged by revision."""
        revision = REVISIONS[0]
        statements = []
        for chunk in script.split(";\n"):
            lines = []
            for line in chunk.splitlines():
                running = re.match(r"-- Running upgrade \S* -> (\S+)", line.strip())
                if running:
                    revision = running[1]
                elif not line.strip().startswith("--"):
                    lines.append(line)
            text = " ".join(" ".join(lines).split())
            text = text.replace("( ", "(").replace(" )", ")")
            if text and text.upper() not in ("BEGIN", "COMMIT"):
                statements.append((revision, text))
        return cls(tuple(statements))

    def index(self, name: str) -> tuple[str, str] | None:
        """(revision, ``CREATE INDEX``) of the index `name`."""
        pattern = re.compile(rf"CREATE (UNIQUE )?INDEX {re.escape(name)} ON ")
        return next(((r, s) for r, s in self.statements if pattern.match(s)), None)

    def table(self, name: str) -> tuple[str, list[str]]:
        """(revision, statements) that make the table `name`: ``CREATE TABLE``, its
        indexes, its storage settings and its DEFAULT partition."""
        create = re.compile(rf"CREATE (UNLOGGED )?TABLE {re.escape(name)} \(")
        revision = ""
        found = []
        for rev, statement in self.statements:
            if create.match(statement):
                revision = rev
                found.append(statement)
            elif revision and (
                re.match(rf"CREATE (UNIQUE )?INDEX \w+ ON {re.escape(name)} ", statement)
                or statement.startswith(f"ALTER TABLE {name} SET (")
                or re.match(rf"CREATE (UNLOGGED )?TABLE \w+ PARTITION OF {name} DEFAULT", statement)
            ):
                found.append(statement)
        return revision, found


@functools.cache
def migration_ddl(dialect: str, *, logged: bool = False, partitioned: bool = False) -> MigrationDdl:
    """What ``quota migrate --sql`` writes for `dialect`, parsed (no database is touched)."""
    from quota._sql.migrate import migrate  # alembic: only when a fix needs the statements

    url = (
        "sqlite:///quota-offline.db" if dialect == "sqlite" else "postgresql://quota@offline/quota"
    )
    output = io.StringIO()
    migrate(url, sql=True, output=output, counters_logged=logged, counters_partitioned=partitioned)
    return MigrationDdl.parse(output.getvalue())
