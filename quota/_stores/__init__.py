"""Stores, one file per backend: the store protocol and the driver of operations (`base`),
URL parsing, SQLite, PostgreSQL (and the sync stores' connection pool), memory and Redis
(its Lua scripts in `lua/`).
"""
