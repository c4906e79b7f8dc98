"""The limiter: waiting, leases, durable quotas, concurrency across processes (`quota/_limiter`)."""
