"""A worker's command line: what a pool passes each worker it starts, and how the worker reads it,
both from the settings schema (``jobs/contract/settings.py``: a setting marked ``worker``)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from chunkq.jobs.contract.settings import PoolSettings, flag, schema
from chunkq.queue_worker.processes.lifeline import PARENT_PID_ENV, POOL_PID_ENV

WORKER_MODULE = "chunkq.queue_worker.worker"  # what a pool runs: python -m WORKER_MODULE --name N ARGS


def worker_title(detail: str) -> str:
    """A worker's process title: its command line, which ps and the pool's tools look for, and for
    a worker forked by a fork server (a standing one serves many pools) the pool it works for,
    which its parent no longer shows."""
    pool = os.environ.get(POOL_PID_ENV)
    forked = pool is not None and os.environ.get(PARENT_PID_ENV) != pool
    return f"{sys.executable} -m {WORKER_MODULE} {detail}" + (f" [pool {pool}]" if forked else "")


def worker_argv(settings: PoolSettings, **overrides: Any) -> list[str]:
    """The worker's command-line arguments for ``settings`` (``overrides``: per-worker values)."""
    argv: list[str] = []
    for name, meta, _default in schema():
        if not meta.worker:
            continue
        value = overrides.get(name, getattr(settings, name))
        if meta.kind == "list":
            for item in value:
                argv += [flag(name, meta), str(item)]
        elif meta.kind == "flag":
            argv += [flag(name, meta)] if value else []
        elif value is not None and value != "":
            argv += [flag(name, meta), str(value)]
    return argv


def _zero_means_none(parse: Any) -> Any:
    def read(text: str) -> Any:
        value = parse(text)
        return None if value == 0 else value

    return read


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    """The parser side of ``worker_argv``: every setting a worker takes. Run by hand, a worker counts
    no chunks and no time unless told (the pool always tells it)."""
    types: dict[str, Any] = {"int": int, "float": float, "duration": float}
    for name, meta, default in schema():
        if not meta.worker:
            continue
        if meta.kind == "list":
            parser.add_argument(flag(name, meta), dest=name, action="append", default=[], help=meta.help)
        elif meta.kind == "flag":
            parser.add_argument(flag(name, meta), dest=name, action="store_true", help=meta.help)
        else:
            parse = types.get(meta.kind, str)
            if meta.zero_means_none:
                parse = _zero_means_none(parse)
            start = None if meta.unset_by_hand else default
            parser.add_argument(flag(name, meta), type=parse, default=start, help=meta.help)
