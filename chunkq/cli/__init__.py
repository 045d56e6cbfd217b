"""The ``chunkq`` command line, a module per group of commands: ``work`` (run, submit, pool,
supervise), ``look`` (status, report, model, doctor, dashboard), ``results`` (runs, assemble,
export, clean), ``cache``, ``serve`` (serve-redis, serve-forks), ``rerank``, ``quantize``. Options
that read an environment variable show it in ``--help``."""

from __future__ import annotations

import os

from chunkq.cli import cache, look, quantize, rerank, results, serve, work
from chunkq.cli.group import cli
from chunkq.jobs.compute.model_refs import assume_offline
from chunkq.jobs.contract import storage
from chunkq.jobs.contract.redaction import guard_process
from chunkq.jobs.contract.storage import OWNER_ONLY
from chunkq.jobs.queue.nopickle import forbid_pickle
from chunkq.supervisor import stop_signals

__all__ = ["cli", "main"]
COMMAND_MODULES = (
    work,
    look,
    results,
    cache,
    serve,
    rerank,
    quantize,
)  # imported for their commands, which join the group


def main() -> None:
    guard_process()  # before anything is written: no password reaches the terminal, a log or a file
    # Stored texts, embeddings and the append-only file (which holds tracebacks that quote them) are
    # the user's data: one mode for all of them, whoever creates them (children inherit the mask).
    storage.caller_umask = os.umask(OWNER_ONLY)
    forbid_pickle()
    assume_offline()  # models load from folders and the cache; HF_HUB_OFFLINE=0 allows downloads
    stop_signals.install()  # SIGTERM as Ctrl+C, each counted (the pool has its own, which drain alike)
    cli(prog_name="chunkq")
