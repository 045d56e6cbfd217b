"""What a run whose chunks wait and none runs is told, and what it is told to do.

"No worker has taken a job for 242 s (2 worker(s) listen on it); start one" was wrong advice where
both workers were busy with another run's chunks (issue 65.1): the line now says what the workers
on the run's queue are doing. Runs take turns at shared workers (jobs/queue/run_queues.py), so
a run waits at most for the chunks in hand; a long wait with every worker busy is chunks that each
take that long, or one run given a far higher --priority.
"""

from __future__ import annotations

import logging
from collections import Counter

import redis

from chunkq.jobs.contract.manifest import RunManifest
from chunkq.jobs.queue.abandon import running_job_ids
from chunkq.jobs.queue.queueing import listening_workers
from chunkq.supervisor.watch.snapshot import Snapshot

log = logging.getLogger("chunkq.supervisor.watch.supervise")  # the watch's own lines, under one name


def busy_with(connection: redis.Redis, pool_queue: str) -> tuple[int, Counter[str]]:
    """How many workers listen on ``pool_queue``, and the runs whose chunks they hold, by count."""
    workers = listening_workers(connection, pool_queue)
    runs: Counter[str] = Counter()
    for worker in workers:
        for job_id in running_job_ids(connection, worker):
            if "__c" in job_id:
                runs[job_id.rpartition("__c")[0]] += 1
    return len(workers), runs


def warn_idle(connection: redis.Redis, manifest: RunManifest, snap: Snapshot, idle: float) -> None:
    """One warning line: the run's chunks have waited ``idle`` seconds with none running."""
    queue = manifest.pool_queue
    workers, runs = busy_with(connection, queue)
    held = sum(runs.values())
    if workers and held >= workers:
        busy = ", ".join(f"run {run} ({n})" for run, n in runs.most_common())
        log.warning(
            "run %s: its chunks have waited %.0f s: the %d worker(s) on queue %r are busy with %s; runs "
            "take turns, so it gets a worker as each finishes its chunk (--priority gives a run more turns)",
            manifest.run_id,
            idle,
            workers,
            queue,
            busy,
        )
    elif snap.own_pool_seconds is not None:
        log.warning(
            "run %s: the pool chunkq started %.0f s ago has taken no job from queue %r for %.0f s "
            "(%d worker(s) listen on it)%s",
            manifest.run_id,
            snap.own_pool_seconds,
            queue,
            idle,
            workers,
            "" if workers else "; its workers are still starting (importing torch, loading the model)",
        )
    else:
        log.warning(
            "run %s: no worker has taken a job from queue %r for %.0f s (%d worker(s) listen on it); "
            "start one: chunkq pool --queue %s (with this Redis)",
            manifest.run_id,
            queue,
            idle,
            workers,
            queue,
        )
