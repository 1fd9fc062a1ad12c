"""Benchmarks: one module per benchmark, each a `sled bench NAME` command on the shared harness."""
