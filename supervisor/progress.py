"""Where a run stands: chunk states from the store (the truth) and from Redis (the queue)."""

from __future__ import annotations

import os
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

import redis
from rq.job import Job
from rq.serializers import JSONSerializer

from jobs.specs import chunk_job_id
from jobs.store import RunLayout
from supervisor.enqueue import job_statuses
from supervisor.manifest import RunManifest

RATE_WINDOW_SECONDS = 30.0


@dataclass
class Failure:
    chunk: int
    rows: int
    job_id: str
    error: str


@dataclass
class Snapshot:
    """One look at a run; ``to_json`` is what ``chunkq status --json`` prints."""

    run_id: str
    chunks: int
    rows: int
    chunks_done: int = 0
    rows_done: int = 0
    chunks_queued: int = 0
    chunks_running: int = 0
    chunks_failed: int = 0
    lost: list[int] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)
    rows_per_second: float | None = None
    eta_seconds: float | None = None
    result_published: bool = False

    @property
    def settled(self) -> bool:
        """Every chunk is either done or failed for good."""
        return self.chunks_done + self.chunks_failed == self.chunks

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["settled"] = self.settled
        return data


def _last_error(connection: redis.Redis, job_id: str) -> str:
    try:
        job = Job.fetch(job_id, connection=connection, serializer=JSONSerializer)
        result = job.latest_result()
        text = (result.exc_string if result is not None else None) or job.exc_info or ""
    except Exception as exc:  # a job we cannot read still counts as failed
        return f"(error unavailable: {exc})"
    lines = [line for line in str(text).strip().splitlines() if line.strip()]
    return lines[-1] if lines else "(no traceback recorded)"


def recent_rate(layout: RunLayout, manifest: RunManifest, window: float = 60.0) -> float | None:
    """Rows per second over the last ``window`` seconds, from when chunk outputs were committed.

    For a one-shot ``chunkq status``, which has no history of its own to measure a rate from.
    """
    if not layout.outputs.is_dir():
        return None
    since, rows = time.time() - window, 0
    for entry in os.scandir(layout.outputs):
        stem, _, ext = entry.name.partition(".")
        if ext == "json" and stem.isdigit() and entry.stat().st_mtime >= since:
            rows += manifest.chunk_rows(int(stem))
    return rows / window if rows else None


class Tracker:
    """Polls a run; work per poll grows with the chunks not yet done, not with the run's size."""

    def __init__(self, connection: redis.Redis, layout: RunLayout, manifest: RunManifest) -> None:
        self.connection, self.layout, self.manifest = connection, layout, manifest
        self.pending = set(range(manifest.chunks))
        self.rows_done = 0
        self.failures: dict[int, Failure] = {}
        self._history: deque[tuple[float, int]] = deque()

    def _mark_done(self, indices: set[int]) -> None:
        for index in indices:
            self.pending.discard(index)
            self.failures.pop(index, None)
            self.rows_done += self.manifest.chunk_rows(index)

    def poll_once(self) -> Snapshot:
        """A single look (``chunkq status``): the rate comes from the store's recent commits."""
        snap = self.poll()
        snap.rows_per_second = recent_rate(self.layout, self.manifest)
        if snap.rows_per_second:
            snap.eta_seconds = (snap.rows - snap.rows_done) / snap.rows_per_second
        return snap

    def poll(self, now: float | None = None) -> Snapshot:
        now = time.monotonic() if now is None else now
        self._mark_done(self.layout.done_chunks() & self.pending)
        snap = Snapshot(self.manifest.run_id, self.manifest.chunks, self.manifest.rows)
        order = sorted(self.pending)
        statuses = job_statuses(self.connection, [chunk_job_id(self.manifest.run_id, i) for i in order])
        finished_late = set()
        for index, status in zip(order, statuses, strict=True):
            if status == "failed":
                if index not in self.failures:
                    job_id = chunk_job_id(self.manifest.run_id, index)
                    error = _last_error(self.connection, job_id)
                    self.failures[index] = Failure(index, self.manifest.chunk_rows(index), job_id, error)
            else:
                self.failures.pop(index, None)
            if status == "queued" or status in ("deferred", "scheduled"):
                snap.chunks_queued += 1
            elif status == "started":
                snap.chunks_running += 1
            elif status == "finished" and self.layout.output_meta(index).is_file():
                finished_late.add(index)  # finished between the store listing and the status read
            elif status != "failed":
                snap.lost.append(index)  # no live job and no output: it must be queued again
        self._mark_done(finished_late)
        snap.chunks_done = self.manifest.chunks - len(self.pending)
        snap.rows_done = self.rows_done
        snap.failures = [self.failures[i] for i in sorted(self.failures)]
        snap.chunks_failed = len(snap.failures)
        snap.result_published = (self.layout.result / "manifest.json").is_file()
        self._rate(snap, now)
        return snap

    def _rate(self, snap: Snapshot, now: float) -> None:
        self._history.append((now, snap.rows_done))
        while len(self._history) > 2 and now - self._history[0][0] > RATE_WINDOW_SECONDS:
            self._history.popleft()
        start_time, start_rows = self._history[0]
        if now - start_time >= 1.0 and snap.rows_done > start_rows:
            snap.rows_per_second = (snap.rows_done - start_rows) / (now - start_time)
            snap.eta_seconds = (snap.rows - snap.rows_done) / snap.rows_per_second
