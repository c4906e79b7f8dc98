"""The algorithms and their exactness, rates, and the checks of input (`quota/_core`)."""
