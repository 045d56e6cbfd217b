"""When the ``chunkq run`` command that created a run reached each step before its workers took
over: its process start, its imports and options done, Redis up, the pool started, the chunks
queued. Written once, beside the manifest (``start.json``); ``chunkq report`` puts them before the
workers' own start-up (process, model load, warm-up) and the first rows, so a user sees where the
seconds before the first row went. Wall-clock (epoch) seconds, as the workers record."""

from __future__ import annotations

import logging
import time

from chunkq.jobs.contract.process_clock import process_started_at
from chunkq.jobs.contract.run_files import RunLayout, atomic_write_json

log = logging.getLogger(__name__)

COMMAND_STARTED = "command_started"  # the process's own start, before any import
OPTIONS_READY = "options_ready"  # imports done, options checked, the model named: run() entered
REDIS_READY = "redis_ready"
POOL_STARTED = "pool_started"
CHUNKS_QUEUED = "chunks_queued"  # the corpus split into chunk inputs and every chunk enqueued
ORDER = (COMMAND_STARTED, OPTIONS_READY, REDIS_READY, POOL_STARTED, CHUNKS_QUEUED)


class StartMarks:
    def __init__(self) -> None:
        self.marks: dict[str, float] = {COMMAND_STARTED: process_started_at()}
        self.mark(OPTIONS_READY)

    def mark(self, name: str, at: float | None = None) -> None:
        self.marks.setdefault(name, time.time() if at is None else at)

    def write(self, layout: RunLayout) -> None:
        """Kept for the report only: a store that cannot take it loses a figure, never the run."""
        try:
            atomic_write_json(
                layout.start_marks, {name: self.marks[name] for name in ORDER if name in self.marks}
            )
        except OSError as exc:
            log.warning("run %s: its start-up figures were not kept (%s)", layout.run_id, exc)
