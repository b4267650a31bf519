"""Simulated replicas: the real worker, scheduler and block manager around a runner
that sleeps for a fitted step time and emits rule tokens (docs/benchmarks.md)."""
