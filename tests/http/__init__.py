"""The HTTP layer: middlewares, headers, identity, runtime policies, shedding (`quota.http`)."""
