"""stagewise benchmark suite: `python -m benchmarks.run` (or `make bench`)."""
