"""`quota doctor`, `quota bench` and `quota demo` (`quota/_tools`)."""
