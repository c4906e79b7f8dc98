"""Batching, the fallback, metrics and abuse detection (`quota/_wrappers`)."""
