"""Helpers for tests and benchmarks that start real components (etcd, free ports, polling)."""
