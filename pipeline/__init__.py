"""Typed configs, the ``specray`` CLI, job drivers and benchmarks."""
