"""The engines of the user commands: `quota demo`, `quota doctor` and `quota bench` (rates
and quotas); the CLI in cli/ stays thin around them.
"""
