"""A failed attempt stays where an operator looks for it after its chunk is queued again.

RQ keeps one job per chunk (its id is the chunk's, so a resubmit finds it), and requeueing a failed
job takes it out of the failed registry: a chunk that failed and was retried showed nowhere in the
dashboard or `rq info`, while `chunkq status` listed the attempt (issue 65.2). So before the job
goes back, a record of the attempt as it failed joins the same failed registry, under
``<job id>__a<attempt>``: its traceback, meta and times, and which job runs the chunk now. A record
runs nothing: its call names a function on no allow-list. Requeued by hand (the dashboard's
"Requeue", `rq requeue --all`), a worker that takes it puts it back as it was (``put_back``),
where it used to fail again as "not on the allow-list", its own traceback lost. It expires with
RQ's failed-job TTL, and goes with the run's jobs.
"""

from __future__ import annotations

import logging

import redis

from chunkq.jobs.queue.rq_api import (
    DEFAULT_FAILURE_TTL,
    FailedJobRegistry,
    Job,
    JobStatus,
    JSONSerializer,
    Result,
)

log = logging.getLogger(__name__)

RECORD_MARK = "__a"
RECORD_CALL = "chunkq.failed_attempt_record"  # not a function: a record requeued by hand is refused
RECORD_TTL = DEFAULT_FAILURE_TTL  # RQ's own for a failed job (a year)


def record_id(job_id: str, attempt: int) -> str:
    return f"{job_id}{RECORD_MARK}{attempt}"


def keep_failed_attempt(connection: redis.Redis, job: Job, attempt: int) -> None:
    """Add a record of ``job`` as it failed on ``attempt`` to its queue's failed registry."""
    record = Job.create(
        RECORD_CALL,
        connection=connection,
        id=record_id(job.id, attempt),
        serializer=JSONSerializer,
        origin=job.origin,
        description=f"{job.description}: attempt {attempt} failed; the chunk was queued again as {job.id}",
        meta=dict(job.meta),
        status=JobStatus.FAILED,
    )
    record.enqueued_at, record.started_at, record.ended_at = job.enqueued_at, job.started_at, job.ended_at
    failed = job.latest_result()  # its traceback, as RQ (and the dashboard) keep it: a result
    traceback = failed.exc_string if failed is not None and failed.exc_string else ""
    registry = FailedJobRegistry(job.origin, connection=connection, serializer=JSONSerializer)
    with connection.pipeline() as pipe:
        record.save(pipeline=pipe)  # the meta too: the registry's own save leaves it out
        registry.add(record, ttl=RECORD_TTL, exc_string=traceback, pipeline=pipe)
        Result.create_failure(
            record, RECORD_TTL, traceback, worker_name=str(job.meta.get("worker", "")), pipeline=pipe
        )
        pipe.execute()


def is_record(job: Job) -> bool:
    try:
        return job.func_name == RECORD_CALL
    except Exception:  # a job whose data cannot be read is no record: RQ's own path fails it, named
        return False


def put_back(connection: redis.Redis, job: Job, worker: str) -> None:
    """A record ``worker`` took (it was requeued by hand) back in its failed registry, with the
    traceback of the attempt it records: nothing ran, no attempt is counted."""
    log.warning(
        "Worker %s: %s is the record of a failed attempt, not a job (requeued by hand?); put back in the "
        "failed registry as it was (the chunk's own job is %s)",
        worker,
        job.id,
        job.id.rpartition(RECORD_MARK)[0],
    )
    failed = job.latest_result()
    traceback = failed.exc_string if failed is not None and failed.exc_string else ""
    registry = FailedJobRegistry(job.origin, connection=connection, serializer=JSONSerializer)
    with connection.pipeline() as pipe:
        job.set_status(JobStatus.FAILED, pipeline=pipe)
        registry.add(job, ttl=RECORD_TTL, exc_string=traceback, pipeline=pipe)
        pipe.execute()
