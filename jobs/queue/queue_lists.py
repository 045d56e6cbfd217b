"""What the supervisor's tracker reads of one chunk queue, in bulk: RQ's finished and failed
registries (sorted sets, read by score from a cursor), its started registry, the queue and its
intermediate list (jobs a worker took and has not started), each job's status and heartbeat.

The tracker reads these every look, for thousands of chunks, so it reads RQ's keys in pipelines
rather than job by job through RQ's objects; this module is where those key names come from.
"""

from __future__ import annotations

from datetime import datetime

import redis

from chunkq.jobs.queue.enqueue import chunk_queue
from chunkq.jobs.queue.rq_api import (
    FailedJobRegistry,
    FinishedJobRegistry,
    IntermediateQueue,
    Job,
    JSONSerializer,
    StartedJobRegistry,
    str_to_date,
)


class ChunkQueueLists:
    """The lists and registries of the queue ``queue_name``, read through ``connection``."""

    def __init__(self, connection: redis.Redis, queue_name: str) -> None:
        self.connection = connection
        self._queue = chunk_queue(connection, queue_name)
        self.finished_key: str = FinishedJobRegistry(queue=self._queue).key
        self.failed_key: str = FailedJobRegistry(queue=self._queue).key
        self._started = StartedJobRegistry(queue=self._queue)
        self._intermediate = IntermediateQueue(self._queue.key, connection)

    def started_ids(self) -> list[str]:
        """The jobs a worker has started (RQ's clean-up left to RQ: a read, not a repair)."""
        return list(self._started.get_job_ids(cleanup=False))

    def taken_ids(self) -> list[str]:
        """The jobs in the intermediate list: taken by a worker, not started."""
        return list(self._intermediate.get_job_ids())

    def taken_since(self, job_id: str) -> datetime | None:
        """When this look's caller first saw ``job_id`` taken and not started (kept in Redis, so a
        restarted supervisor keeps counting); None when this is the first sight."""
        if self._intermediate.set_first_seen(job_id):
            return None
        return self._intermediate.get_first_seen(job_id)

    def held_and_statuses(self, job_ids: list[str]) -> tuple[set[str], list[bytes | None]]:
        """In one transaction: every job id on the queue or its intermediate list, and the raw
        status of each of ``job_ids``."""
        with self.connection.pipeline(transaction=True) as pipe:
            pipe.lrange(self._queue.key, 0, -1)
            pipe.lrange(self._queue.intermediate_queue_key, 0, -1)
            for job_id in job_ids:
                pipe.hget(Job.key_for(job_id), "status")
            listed, taken, *statuses = pipe.execute()
        return {bytes(x).decode() for x in (*listed, *taken)}, statuses

    def heartbeats(self, job_ids: list[str]) -> list[float | None]:
        """Each job's last heartbeat as a Unix time; None before its first (RQ writes an empty one
        until then, seen at 2,000+ chunks) or when the job is gone."""
        with self.connection.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.hget(Job.key_for(job_id), "last_heartbeat")
            beats = pipe.execute()
        return [str_to_date(beat).timestamp() if beat else None for beat in beats]

    def fetch(self, job_ids: list[str]) -> list[Job | None]:
        """The jobs ``job_ids`` in one round trip; None for each Redis no longer holds."""
        return list(Job.fetch_many(job_ids, self.connection, serializer=JSONSerializer))
