"""The integrations: the `limits` storages and the Django app (`quota.contrib`)."""
