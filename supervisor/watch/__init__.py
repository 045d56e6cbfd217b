"""A run watched to its end: its progress read from Redis and the store, failed attempts retried
or quarantined, dead and stuck workers' chunks requeued, the terminal's display and the metrics,
the wake-up when a chunk settles, then the assembly.

Imports ``store/``, ``result/`` and ``submit/``.
"""
