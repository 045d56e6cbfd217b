"""Runs chunk jobs: the worker process, GPU discovery and pinning, and the per-host pool."""
