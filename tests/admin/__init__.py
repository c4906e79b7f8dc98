"""The admin API (quota.admin)."""
