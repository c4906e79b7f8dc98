"""Django migrations of quota's tables: each brings them to one quota schema revision."""
