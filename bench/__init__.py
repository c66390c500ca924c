"""Kettle's benchmarks, run from the repository root as `python -m bench NAME [options]` (bench/__main__.py)."""
