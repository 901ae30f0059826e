"""Benchmarks of the notes in README.md, each run from the repository root as ``python -m benchmarks.NAME``."""
