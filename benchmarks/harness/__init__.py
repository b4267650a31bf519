"""Benchmark harness: load generation against a live Quadriga router, metrics, plots,
capacity search and hardware limits. Entry point: python -m benchmarks."""
