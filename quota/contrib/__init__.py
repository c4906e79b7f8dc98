"""Bridges from `quota` to other libraries; each module is optional and imported on its own.

`quota.contrib.limits`: `quota` as a storage backend for the `limits` library
(and so for flask-limiter and slowapi). Needs the ``limits`` extra.
"""
