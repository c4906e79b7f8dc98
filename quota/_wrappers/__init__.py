"""What wraps a store without leaking into it: the batcher (group commit), the fallback
(fail-open, health, write-back), metrics and abuse alerts.
"""
