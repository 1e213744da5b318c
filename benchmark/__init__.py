"""Benchmarks (each prints a table last and writes JSON)."""

import specserve  # noqa: F401 - first: sets the OpenMP wait policy before torch loads
