"""Helpers of `make bench-serve` (benchmarks/bench_serve.py): model, cluster, servers, load, report."""
