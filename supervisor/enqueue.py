"""Enqueue chunk jobs idempotently: a chunk that is done or in flight is never queued twice."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import islice

import redis
from rq import Queue
from rq.job import Job
from rq.queue import EnqueueData
from rq.registry import FailedJobRegistry
from rq.serializers import JSONSerializer

from chunkq.jobs import jobmeta
from chunkq.jobs.allowlist import EMBED_CHUNK, AllowListedJob
from chunkq.jobs.manifest import RunManifest
from chunkq.jobs.specs import chunk_job_id
from chunkq.jobs.store import RunLayout

log = logging.getLogger(__name__)

BATCH = 1000
RESULT_TTL = 7 * 24 * 3600  # results are tiny JSON; keep them as long as a run may take
FAILURE_TTL = 30 * 24 * 3600
IN_FLIGHT = {"queued", "started", "deferred", "scheduled"}


@dataclass
class EnqueueCounts:
    enqueued: int = 0
    requeued: int = 0
    in_flight: int = 0


def chunk_queue(connection: redis.Redis, name: str) -> Queue:
    return Queue(name, connection=connection, serializer=JSONSerializer, job_class=AllowListedJob)


def _batches(items: Iterable[int], size: int) -> Iterator[list[int]]:
    it = iter(items)
    while batch := list(islice(it, size)):
        yield batch


def job_statuses(connection: redis.Redis, job_ids: list[str]) -> list[str | None]:
    """Each job's status straight from its hash, in one round trip (None where the job is gone)."""
    with connection.pipeline(transaction=False) as pipe:
        for job_id in job_ids:
            pipe.hget(Job.key_for(job_id), "status")
        raw = pipe.execute()
    return [value.decode() if isinstance(value, bytes) else value for value in raw]


def enqueue_chunks(
    connection: redis.Redis, layout: RunLayout, manifest: RunManifest, indices: Iterable[int]
) -> EnqueueCounts:
    """Queue each chunk in ``indices`` unless its job is already queued or running."""
    queue = chunk_queue(connection, manifest.queue)
    failed = FailedJobRegistry(queue=queue)
    counts = EnqueueCounts()
    for batch in _batches(indices, BATCH):
        ids = [chunk_job_id(manifest.run_id, i) for i in batch]
        fresh = []
        for index, job_id, status in zip(batch, ids, job_statuses(connection, ids), strict=True):
            if status in IN_FLIGHT:
                counts.in_flight += 1
            elif status == "failed":
                # Submitting again is the user's "try these again": fresh attempts, no quarantine.
                job = Job.fetch(job_id, connection=connection, serializer=JSONSerializer)
                for key in jobmeta.RETRY_STATE:
                    job.meta.pop(key, None)
                job.meta[jobmeta.ATTEMPT] = 1
                job.save_meta()  # type: ignore[no-untyped-call]
                restore_from_manifest(job, layout, manifest, index)
                failed.requeue(job_id)
                counts.requeued += 1
            else:
                if status is not None:  # finished, stopped or canceled, yet its output is not in the store
                    Job(job_id, connection=connection, serializer=JSONSerializer).delete()
                fresh.append(_job_data(layout, manifest, index, job_id))
        if fresh:
            with connection.pipeline() as pipe:
                queue.enqueue_many(fresh, pipeline=pipe)
                pipe.execute()
            counts.enqueued += len(fresh)
    return counts


def restore_from_manifest(job: Job, layout: RunLayout, manifest: RunManifest, index: int) -> bool:
    """Make a failed chunk job call what the manifest says before it is queued again; True if it
    had been changed. A Redis writer may have rewritten the job (the worker refused it as
    tampered); requeueing it as it stands would only be refused again."""
    spec = manifest.chunk_spec(layout.store, index).to_dict()
    if (job.func_name, list(job.args), job.kwargs, job.timeout) == (
        EMBED_CHUNK,
        [spec],
        {},
        manifest.job_timeout,
    ):
        return False
    job.func_name, job.args, job.kwargs, job.timeout = EMBED_CHUNK, [spec], {}, manifest.job_timeout
    job.save()
    log.warning("chunk job %s did not call what the run's manifest says; restored from the manifest", job.id)
    return True


def _job_data(layout: RunLayout, manifest: RunManifest, index: int, job_id: str) -> EnqueueData:
    spec = manifest.chunk_spec(layout.store, index)
    return Queue.prepare_data(
        EMBED_CHUNK,
        args=(spec.to_dict(),),
        job_id=job_id,
        timeout=manifest.job_timeout,
        result_ttl=RESULT_TTL,
        failure_ttl=FAILURE_TTL,
        description=f"chunkq run {manifest.run_id} chunk {index} ({spec.rows} rows)",
        meta=jobmeta.initial(manifest.run_id, index, spec.rows, spec.first_row),
    )
