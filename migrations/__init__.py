"""The Alembic environment of `quota` (installed as ``quota._migrations``)."""
