"""``chunkq supervise``: watch a run until every chunk is settled, re-queue lost chunks, assemble."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis

from jobs.store import RunLayout
from supervisor.assemble import assemble
from supervisor.display import ProgressDisplay
from supervisor.enqueue import enqueue_chunks
from supervisor.manifest import load_manifest
from supervisor.progress import Failure, Snapshot, Tracker

log = logging.getLogger(__name__)

POLL_SECONDS = 1.0


@dataclass
class Outcome:
    snapshot: Snapshot
    result: dict[str, Any] | None  # the published result manifest, when the run is whole

    @property
    def failures(self) -> list[Failure]:
        return self.snapshot.failures


def failure_report(failures: list[Failure]) -> str:
    lines = [f"{len(failures)} chunk(s) failed:"]
    lines += [f"  chunk {f.chunk} ({f.rows} rows, job {f.job_id}): {f.error}" for f in failures]
    return "\n".join(lines)


def supervise(
    connection: redis.Redis,
    layout: RunLayout,
    display: ProgressDisplay,
    poll_seconds: float = POLL_SECONDS,
    keep_going: Callable[[], bool] = lambda: True,
) -> Outcome:
    """Poll until every chunk is done or has failed for good, then assemble when all are done.

    ``keep_going`` lets a caller stop the watch early (``chunkq run`` when its pool has died).
    """
    manifest = load_manifest(layout)
    tracker = Tracker(connection, layout, manifest)
    while True:
        snap = tracker.poll()
        if snap.lost:
            counts = enqueue_chunks(connection, layout, manifest, snap.lost)
            log.warning(
                "run %s: %d chunk(s) had no job and no output; queued again",
                manifest.run_id,
                counts.enqueued + counts.requeued,
            )
        display.update(snap)
        if snap.settled or not keep_going():
            break
        time.sleep(poll_seconds)
    if not snap.settled or snap.failures:
        return Outcome(snap, None)
    return Outcome(snap, assemble(layout))
