"""Runs chunk jobs: the worker process at the top (``worker``, ``chunk_worker``, ``worker_args``,
``exit_codes``), the devices it may use (``devices/``, with NVML's stand-in in ``drills/``), and the
per-host pool with the processes it keeps (``processes/``). Imports ``jobs/`` only; the worker takes
its side of the pool's lifeline and standby from ``processes/``, which starts it.
"""
