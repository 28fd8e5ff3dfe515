"""The performance benchmark: ``python -m engine.bench`` (see docs/benchmark.md)."""
