"""The stores: memory, SQLite, PostgreSQL (direct and behind PgBouncer), Redis (`quota/_stores`)."""
