"""Putting a job that was taken but never started back on its queue, and the other moves of a job
between RQ's lists that the supervisor and the pool make: a failed chunk queued again at the front,
the jobs waiting in a set of queues, the workers listening on one, a job fetched by id.

A worker takes a job by moving its id from the queue into RQ's intermediate list; the job starts a
moment later. A worker stopped in between (or one that died) leaves the id there, where RQ looks
only during its ten-minute maintenance. Both the worker (a stop that came as it took the job) and
the supervisor (a worker that died) give such jobs back with this one step.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import redis

from chunkq.jobs.queue.rq_api import (
    FailedJobRegistry,
    Job,
    JSONSerializer,
    NoSuchJobError,
    Queue,
    SimpleWorker,
    StartedJobRegistry,
    Worker,
)


def give_back(connection: redis.Redis, queue: Queue, job_ids: Iterable[str], at_front: bool) -> None:
    """Move each job from the intermediate list back to ``queue`` in one transaction;
    ``at_front``: it was next, so it goes first."""
    ordered = list(job_ids)
    if at_front:  # each push goes before the last: push the last first, so the first is next
        ordered.reverse()
    with connection.pipeline(transaction=True) as pipe:
        for job_id in ordered:
            pipe.lrem(queue.intermediate_queue_key, 1, job_id)
            queue.push_job_id(job_id, pipeline=pipe, at_front=at_front)
        pipe.execute()


def requeue_failed_at_front(connection: redis.Redis, job: Job) -> None:
    """A failed job out of its queue's failed registry and back at its queue's front (with a bounded
    window, the back of the queue may be a window away)."""
    registry = FailedJobRegistry(job.origin, connection=connection, serializer=JSONSerializer)
    registry.requeue(job.id, at_front=True)


def any_waiting(connection: redis.Redis, queue_names: Iterable[str]) -> bool:
    """Whether a job waits in any of these queues."""
    return any(connection.llen(Queue(name, connection=connection).key) for name in queue_names)


def listening_workers(connection: redis.Redis, queue_name: str) -> list[str]:
    """The names of the workers that listen on ``queue_name``."""
    queue = Queue(queue_name, connection=connection, serializer=JSONSerializer)
    return [worker.name for worker in Worker.all(connection=connection, queue=queue)]


def started_job_ids(connection: redis.Redis) -> Iterator[str]:
    """Every job a worker has started, in every queue this Redis holds."""
    for queue in Queue.all(connection=connection, serializer=JSONSerializer):
        registry = StartedJobRegistry(queue.name, connection=connection, serializer=JSONSerializer)
        yield from registry.get_job_ids()


def fetch_job(connection: redis.Redis, job_id: str) -> Job | None:
    """The job ``job_id``; None when Redis no longer holds it."""
    try:
        return Job.fetch(job_id, connection=connection, serializer=JSONSerializer)
    except NoSuchJobError:
        return None


@dataclass(frozen=True)
class RegisteredWorker:
    """A worker as RQ registered it: its name, host and process id (None if RQ has none)."""

    name: str
    hostname: str | None
    pid: int | None


def workers_named(connection: redis.Redis, queue_name: str, prefix: str) -> Iterator[RegisteredWorker]:
    """Each worker registered on ``queue_name`` whose name starts with ``prefix``, dead or alive:
    RQ keeps a worker's record until its heartbeat expires."""
    namespace = SimpleWorker.redis_worker_namespace_prefix
    queue = Queue(queue_name, connection=connection)
    for key in SimpleWorker.all_keys(connection=connection, queue=queue):
        name = key.removeprefix(namespace)
        if not name.startswith(prefix):
            continue
        worker = SimpleWorker.find_by_key(key, connection, serializer=JSONSerializer)
        if worker is not None:
            yield RegisteredWorker(name, worker.hostname, worker.pid)
