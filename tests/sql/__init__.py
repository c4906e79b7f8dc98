"""Schema, migrations, engines, partitions and cleanup (`quota/_sql`)."""
