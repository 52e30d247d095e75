"""Benchmarks and studies: they print figures, they never pass or fail on time."""
