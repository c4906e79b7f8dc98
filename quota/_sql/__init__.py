"""SQL: the text of every statement (one atomic statement per algorithm and dialect,
quotas' statements), the operations written once for both faces (cleanup, usage,
partitions), the schema the migrations make and running them.
"""
