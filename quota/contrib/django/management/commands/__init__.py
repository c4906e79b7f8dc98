"""The commands themselves: quota (the quota CLI on the Django database) and quota_cleanup."""
