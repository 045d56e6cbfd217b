"""Failed attempts recorded in the store, so they outlive the Redis of the run.

``chunkq run`` stops its embedded Redis when it ends, and RQ keeps only a job's last ten results:
the store is what ``chunkq report`` and ``chunkq status`` read failures from. One small file per
(chunk, attempt), written whole, so a supervisor killed and restarted records nothing twice.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from chunkq.jobs.contract import errors
from chunkq.jobs.contract.run_files import RunLayout, atomic_write_json, read_json
from chunkq.jobs.contract.storage import list_with_mtime
from chunkq.jobs.queue import jobmeta

if TYPE_CHECKING:
    from chunkq.jobs.queue.rq_api import Job

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FailedAttempt:
    """One failed attempt at a chunk: where it ran, what class of error ended it, and its first line."""

    chunk: int
    attempt: int
    error_class: str
    error: str
    worker: str
    host: str
    device: str
    gpu: str | None
    at: str  # ISO time the attempt ended
    quarantined: bool = False  # this attempt was the chunk's last
    reason: str = ""
    started: str | None = None  # ISO time the attempt started (None: recorded before it was kept)

    @property
    def when(self) -> datetime:
        return datetime.fromisoformat(self.at)

    @classmethod
    def from_job(cls, job: Job, chunk: int, attempt: int, quarantine_reason: str | None) -> FailedAttempt:
        meta = job.meta
        ended = job.ended_at or datetime.now(UTC)
        return cls(
            chunk=chunk,
            attempt=attempt,
            error_class=jobmeta.error_class(meta),
            error=errors.first_line(str(meta.get(jobmeta.ERROR) or job.exc_info or "")),
            worker=str(meta.get(jobmeta.WORKER, "?")),
            host=str(meta.get(jobmeta.HOST, "?")),
            device=str(meta.get(jobmeta.DEVICE, "?")),
            gpu=None if meta.get(jobmeta.GPU) is None else str(meta[jobmeta.GPU]),
            at=ended.replace(tzinfo=ended.tzinfo or UTC).isoformat(),
            quarantined=quarantine_reason is not None,
            reason=quarantine_reason or "",
            started=_iso(job.started_at),
        )


def _iso(moment: datetime | None) -> str | None:
    return None if moment is None else moment.replace(tzinfo=moment.tzinfo or UTC).isoformat()


class AttemptRecorder:
    """Writes each failed attempt once; remembers what it wrote so a look costs no store read."""

    def __init__(self, layout: RunLayout) -> None:
        self.layout = layout
        self._written: set[tuple[int, int]] = set()

    def record(self, attempt: FailedAttempt) -> None:
        key = (attempt.chunk, attempt.attempt)
        if key in self._written:
            return
        path = self.layout.failure_path(*key)
        if not path.exists():
            atomic_write_json(path, asdict(attempt))
        self._written.add(key)

    def record_job(self, job: Job, chunk: int) -> None:
        """A failed job's attempt as its meta says it ended (quarantined or not). What a submit does
        before it queues a failed job again (``enqueue_chunks``' ``before_requeue``): a run stopped
        before its supervisor settled a failure (a worker's own write on a full disk, Ctrl-C then
        kill -9 during the drain) left the job failed in Redis, and the next submit requeued it
        unrecorded: `status` said "failed attempts: 0" where the log had said it failed."""
        reason = str(job.meta.get(jobmeta.QUARANTINE_REASON, "")) if jobmeta.quarantined(job.meta) else None
        self.record(FailedAttempt.from_job(job, chunk, jobmeta.attempt(job.meta), reason))


def failed_attempts(layout: RunLayout) -> list[FailedAttempt]:
    """Every failed attempt recorded for the run, oldest first."""
    found = []
    for name, _mtime in list_with_mtime(layout.failures):
        if not name.endswith(".json"):
            continue
        try:
            data: dict[str, Any] = read_json(layout.failures / name)
            found.append(FailedAttempt(**data))
        except (OSError, ValueError, TypeError) as exc:  # a damaged record is reported, not fatal
            log.warning("skipping failure record %s: %s", name, exc)
    return sorted(found, key=lambda a: (a.at, a.chunk, a.attempt))


def by_class(attempts: list[FailedAttempt]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for attempt in attempts:
        counts[attempt.error_class] = counts.get(attempt.error_class, 0) + 1
    return dict(sorted(counts.items()))


def describe_attempts(attempts: list[FailedAttempt]) -> str:
    """One line: how many attempts failed, by class."""
    if not attempts:
        return "failed attempts: 0"
    classes = ", ".join(f"{name}: {count}" for name, count in by_class(attempts).items())
    return f"failed attempts: {len(attempts)} ({classes})"


def to_json(attempts: list[FailedAttempt]) -> list[dict[str, Any]]:
    return [asdict(a) for a in attempts]
