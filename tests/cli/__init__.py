"""The `quota` command (`cli/`)."""
