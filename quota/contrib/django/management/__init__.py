"""quota's management commands (manage.py quota …, manage.py quota_cleanup)."""
