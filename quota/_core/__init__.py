"""The pure decision core: window and bucket arithmetic, periods, rate strings, keys, the
allow/deny rule and the errors every layer raises. Nothing here touches a database, a
clock of its own or I/O.
"""
