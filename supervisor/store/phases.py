"""Where a run's command spent its time: each phase's wall and CPU seconds, kept beside the manifest
(``phases.json``) for ``bench/whole.py`` and the report.

A user compares ``chunkq run corpus`` with the script it replaces, start to end; a steady rate hides
what is serial around the encode. The command marks each phase it runs (identifying the corpus,
splitting it into chunk inputs, queueing, watching the workers, and assembly's own steps:
verifying the outputs, writing the result, filling the vector cache, publishing) with the wall
clock, the seconds it took and the CPU this process spent in it. A phase entered twice (a resumed
run) adds up. Nothing here can fail a run: a store that refuses the file loses a figure.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

from chunkq.jobs.contract.run_files import RunLayout, atomic_write_json, read_json

log = logging.getLogger(__name__)

IDENTIFY = "identify"  # the corpus files read for their checksums, the model's bytes hashed
SPLIT = "split"  # the corpus read, hashed, deduplicated, looked up in the cache, written as chunk inputs
QUEUE = "queue"  # the chunks enqueued
WATCH = "watch"  # the workers at work, the supervisor watching: until every chunk settled
BUILD = "build"  # during the watch: the result written as the chunks land (supervisor/result/building.py)
VERIFY = "verify"  # assembly: the chunk outputs' records checked
WRITE = "write"  # assembly: the result written from the chunk outputs (each read once, checksummed)
CACHE = "cache"  # assembly: the run's encoded vectors added to the store's cache
PUBLISH = "publish"  # assembly: the result put in place


class Phases:
    """The phases of one command, in the order first entered."""

    def __init__(self) -> None:
        self.entries: dict[str, dict[str, float]] = {}
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        wall, cpu, started = time.perf_counter(), time.process_time(), time.time()
        try:
            yield
        finally:
            self.add(name, started, time.perf_counter() - wall, time.process_time() - cpu)

    def add(self, name: str, started: float, seconds: float, cpu: float) -> None:
        with self._lock:
            entry = self.entries.setdefault(name, {"started": started, "seconds": 0.0, "cpu_seconds": 0.0})
            entry["seconds"] += seconds
            entry["cpu_seconds"] += cpu

    def write(self, layout: RunLayout) -> None:
        """Merge into the run's phases.json (a resumed run's phases add to the first command's)."""
        try:
            kept: dict[str, Any] = read_json(layout.phases) if layout.phases.is_file() else {}
        except (OSError, ValueError):
            kept = {}
        for name, entry in self.entries.items():
            before = kept.get(name) or {}
            kept[name] = {
                "started": before.get("started", round(entry["started"], 3)),
                "seconds": round(float(before.get("seconds", 0.0)) + entry["seconds"], 3),
                "cpu_seconds": round(float(before.get("cpu_seconds", 0.0)) + entry["cpu_seconds"], 3),
            }
        try:
            atomic_write_json(layout.phases, kept)
        except OSError as exc:
            log.warning("run %s: its phase figures were not kept (%s)", layout.run_id, exc)


NONE = Phases()  # for callers that keep no figures: phases are timed and dropped


def timed(phases: Phases | None, name: str) -> contextlib.AbstractContextManager[None]:
    return (phases or NONE).phase(name)
