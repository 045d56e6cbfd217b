"""Putting a job that was taken but never started back on its queue.

A worker takes a job by moving its id from the queue into RQ's intermediate list; the job starts a
moment later. A worker stopped in between (or one that died) leaves the id there, where RQ looks
only during its ten-minute maintenance. Both the worker (a stop that came as it took the job) and
the supervisor (a worker that died) give such jobs back with this one step.
"""

from __future__ import annotations

from collections.abc import Iterable

import redis

from chunkq.jobs.queue.rq_api import Queue


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
