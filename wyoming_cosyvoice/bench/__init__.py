"""The server's benchmark: ``python -m wyoming_cosyvoice.bench`` (see docs/benchmark.md)."""
