"""The supervisor's retry policy: attempts, exponential back-off with jitter, quarantine.

Every decision is written into the job's meta (``attempt``, ``retry_at``, ``quarantined``), so a
supervisor that is killed and restarted picks up exactly where the last one stopped.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import redis

from chunkq.jobs.contract import errors
from chunkq.jobs.contract.defaults import (
    BACKOFF_BASE_SECONDS,
    BACKOFF_CAP_SECONDS,
    BACKOFF_JITTER,
    DEFAULT_MAX_ATTEMPTS,
)
from chunkq.jobs.queue import jobmeta
from chunkq.jobs.queue.attempt_records import keep_failed_attempt
from chunkq.jobs.queue.queueing import requeue_failed_at_front

if TYPE_CHECKING:
    from chunkq.jobs.queue.rq_api import Job

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    backoff_base: float = BACKOFF_BASE_SECONDS
    backoff_cap: float = BACKOFF_CAP_SECONDS
    jitter: float = BACKOFF_JITTER

    def delay(self, attempt: int, rng: random.Random, error_class: str = errors.OTHER) -> float:
        if error_class in errors.NOT_THE_CHUNKS_FAULT:
            return 0.0  # the cure is the fresh worker that already replaced the dead one
        base = min(self.backoff_cap, self.backoff_base * 2.0 ** max(0, attempt - 1))
        return float(base * (1 + rng.uniform(-self.jitter, self.jitter)))

    def quarantine_reason(self, error_class: str, attempt: int) -> str | None:
        """Why a failed chunk must not be tried again, or None if it gets another attempt."""
        if error_class in errors.NEVER_RETRIED:
            return f"{error_class} errors are not retried"
        if attempt >= self.max_attempts:
            return f"failed {attempt} of {self.max_attempts} attempts"
        return None


def settle_failure(
    connection: redis.Redis, job: Job, policy: RetryPolicy, rng: random.Random, now: float | None = None
) -> str:
    """Act on one failed chunk job: 'quarantined', 'waiting' (back-off) or 'requeued'."""
    now = time.time() if now is None else now
    meta = job.meta
    if jobmeta.quarantined(meta):
        return "quarantined"
    attempt = jobmeta.in_round(meta)
    error_class = jobmeta.error_class(meta)
    reason = policy.quarantine_reason(error_class, attempt)
    if reason is not None:
        meta.update({jobmeta.QUARANTINED: True, jobmeta.QUARANTINE_REASON: reason})
        job.save_meta()  # type: ignore[no-untyped-call]
        log.error(
            "chunk job %s quarantined: %s; last error: %s",
            job.id,
            reason,
            errors.first_line(str(meta.get(jobmeta.ERROR, "?"))),  # torch's advice lines stay in the record
        )
        return "quarantined"
    due = jobmeta.retry_at(meta)
    if due is None:
        due = meta[jobmeta.RETRY_AT] = now + policy.delay(attempt, rng, error_class)
        job.save_meta()  # type: ignore[no-untyped-call]
        log.warning(
            "chunk job %s failed (%s, attempt %d); retrying in %.1f s",
            job.id,
            error_class,
            attempt,
            due - now,
        )
    if due > now:
        return "waiting"
    keep_failed_attempt(connection, job, jobmeta.attempt(meta))  # shown where the dashboard looks
    jobmeta.next_attempt(meta)
    meta.pop(jobmeta.RETRY_AT, None)
    job.save_meta()  # type: ignore[no-untyped-call]
    requeue_failed_at_front(connection, job)
    log.info("chunk job %s: attempt %d queued", job.id, jobmeta.attempt(meta))
    return "requeued"
