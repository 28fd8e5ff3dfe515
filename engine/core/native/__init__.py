"""The engine's compiled kernels (built by setup.py on x86-64; see docs/dev/int8-kernel.md)."""
