"""Marking a chunk job failed because its worker died or hung, without waiting for RQ's TTL rule.

Used by the pool (which sees its worker die within a second) and by the supervisor (which sees a
job whose heartbeat stopped). RQ itself only notices after job timeout + 60 s, and only when
something calls ``StartedJobRegistry.cleanup()``.
"""

from __future__ import annotations

import logging

import redis

from chunkq.jobs.contract.errors import ABANDONED
from chunkq.jobs.contract.events import announce_settled
from chunkq.jobs.queue import jobmeta
from chunkq.jobs.queue.rq_api import (
    WORKER_EXECUTIONS_KEY_TEMPLATE,
    Job,
    JobStatus,
    JSONSerializer,
    NoSuchJobError,
    SimpleWorker,
    StartedJobRegistry,
    record_job_failure,
)

log = logging.getLogger(__name__)


def mark_abandoned(connection: redis.Redis, job_id: str, reason: str) -> bool:
    """Move a still-started job to the failed registry with ``reason``; False if it was not started."""
    try:
        job = Job.fetch(job_id, connection=connection, serializer=JSONSerializer)
    except NoSuchJobError:
        return False
    if job.get_status(refresh=True) != JobStatus.STARTED:
        return False
    jobmeta.failed(job.meta, ABANDONED, reason)
    exc_string = f"chunkq.ChunkAbandonedError: {reason}"
    registry = StartedJobRegistry(job.origin, connection=connection, serializer=JSONSerializer)
    job.save_meta()  # type: ignore[no-untyped-call]
    with connection.pipeline() as pipe:
        registry.remove_executions(job, pipeline=pipe)
        record_job_failure(job, exc_string, pipe)
        pipe.execute()
    announce_settled(connection, job.origin, job_id)
    log.warning("job %s marked failed: %s", job_id, reason)
    return True


def running_job_ids(connection: redis.Redis, worker_name: str) -> list[str]:
    """The jobs a worker has registered as running (its RQ execution index)."""
    members = connection.smembers(WORKER_EXECUTIONS_KEY_TEMPLATE.format(worker_name))
    return sorted({(m.decode() if isinstance(m, bytes) else str(m)).split(":", 1)[0] for m in members})


def forget_worker(connection: redis.Redis, worker_name: str) -> None:
    """Unregister a dead worker so dashboards and ``rq info`` stop listing it."""
    worker = SimpleWorker.find_by_key(SimpleWorker.redis_worker_namespace_prefix + worker_name, connection)
    if worker is not None:
        worker.register_death()  # type: ignore[no-untyped-call]
