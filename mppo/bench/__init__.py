"""Benchmarks run by `mppo bench NAME` (not tests: they measure, they do not assert)."""
