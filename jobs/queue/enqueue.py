"""Enqueue chunk jobs idempotently: a chunk that is done or in flight is never queued twice.

Redis holds a window of a run's jobs, not all of them: every chunk's input is in the store, and
the supervisor queues the next chunks, in order, as the window frees (``window_size``). A finished
job is forgotten once its output is counted: the store is its record. So a run's memory in Redis
grows with its window and workers, not with its chunk count.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import islice
from typing import Any

import redis

from chunkq.jobs.contract import errors
from chunkq.jobs.contract.defaults import DEFAULT_WINDOW, WINDOW_PER_WORKER
from chunkq.jobs.contract.manifest import RunManifest
from chunkq.jobs.contract.run_files import RunLayout
from chunkq.jobs.contract.specs import chunk_job_id, chunk_job_prefix
from chunkq.jobs.contract.storage import list_names
from chunkq.jobs.queue import jobmeta, run_queues
from chunkq.jobs.queue.allowlist import EMBED_CHUNK, AllowListedJob
from chunkq.jobs.queue.attempt_records import RECORD_MARK, keep_failed_attempt
from chunkq.jobs.queue.rq_api import (
    DeserializationError,
    EnqueueData,
    FailedJobRegistry,
    FinishedJobRegistry,
    Job,
    JSONSerializer,
    NoSuchJobError,
    Queue,
    Result,
    Worker,
)

log = logging.getLogger(__name__)

BATCH = 1000
# A finished job is deleted by the supervisor once it has counted the chunk's output; this is the
# fallback when no supervisor runs (submit and pools alone), short because the store is the record.
RESULT_TTL = 3600
FAILURE_TTL = 30 * 24 * 3600
# RQ job statuses of a job that will still run: waiting for a worker, or running now.
QUEUED_STATUSES = frozenset({"queued", "deferred", "scheduled"})
LIVE_STATUSES = QUEUED_STATUSES | {"started"}


@dataclass
class EnqueueCounts:
    enqueued: int = 0
    requeued: int = 0
    in_flight: int = 0
    waiting: int = 0  # chunks left in the store for the supervisor to queue as the window frees

    @property
    def in_redis(self) -> int:
        return self.enqueued + self.requeued + self.in_flight


def window_size(connection: redis.Redis, queue_name: str, fixed: int | None = None) -> int:
    """How many of a run's jobs Redis may hold: ``fixed`` (``--queue-window``), or enough to keep
    every worker listening on the queue busy, and at least DEFAULT_WINDOW."""
    if fixed is not None:
        return fixed
    listening = Worker.count(connection=connection, queue=chunk_queue(connection, queue_name))
    return max(DEFAULT_WINDOW, WINDOW_PER_WORKER * listening)


def chunk_queue(connection: redis.Redis, name: str) -> Queue:
    return Queue(name, connection=connection, serializer=JSONSerializer, job_class=AllowListedJob)


def job_statuses(connection: redis.Redis, job_ids: list[str]) -> list[str | None]:
    """Each job's status straight from its hash (None where the job is gone), BATCH a round trip:
    one pipeline of 10^5 commands held ~60 MB of the supervisor at once."""
    statuses: list[str | None] = []
    for start in range(0, len(job_ids), BATCH):
        with connection.pipeline(transaction=False) as pipe:
            for job_id in job_ids[start : start + BATCH]:
                pipe.hget(Job.key_for(job_id), "status")
            raw = pipe.execute()
        statuses += [value.decode() if isinstance(value, bytes) else value for value in raw]
    return statuses


def try_again(
    job: Job, failed: FailedJobRegistry, layout: RunLayout, manifest: RunManifest, index: int
) -> None:
    """A failed (or quarantined) chunk's job queued again at the front with fresh attempts, its call
    restored from the manifest."""
    keep_failed_attempt(job.connection, job, jobmeta.attempt(job.meta))  # shown where the dashboard looks
    for key in jobmeta.RETRY_STATE:
        job.meta.pop(key, None)
    jobmeta.next_attempt(job.meta, new_round=True)  # numbered on: each attempt keeps its own record
    job.save_meta()  # type: ignore[no-untyped-call]
    restore_from_manifest(job, layout, manifest, index)
    failed.requeue(job.id, at_front=True)


def retry_quarantined(
    connection: redis.Redis, layout: RunLayout, manifest: RunManifest, room: int | None = None
) -> list[int]:
    """Give every chunk of the run quarantined for a reason the operator can fix outside the run (a
    model a pool did not allow, a GPU too small, a broken device, the store) new attempts; the
    chunks. Bad input is the corpus's own: the same rows fail the same way, and stay quarantined.
    ``room``: how many the queue window takes now; the others' jobs go, and they wait in the store
    for the window, in order, as every waiting chunk does (all were queued at once)."""
    queue = chunk_queue(connection, manifest.queue)
    failed = FailedJobRegistry(queue=queue)
    prefix = chunk_job_prefix(manifest.run_id)
    lifted: list[tuple[int, Job]] = []
    for job_id in failed.get_job_ids():
        if not (job_id.startswith(prefix) and job_id[len(prefix) :].isdigit()):  # a chunk's, not a record
            continue
        job = Job.fetch(job_id, connection=connection, serializer=JSONSerializer)
        if not jobmeta.quarantined(job.meta) or jobmeta.error_class(job.meta) == errors.BAD_INPUT:
            continue
        lifted.append((int(job_id[len(prefix) :]), job))
    lifted.sort(key=lambda found: found[0])
    for n, (index, job) in enumerate(lifted):
        if room is None or n < room:
            try_again(job, failed, layout, manifest, index)
        else:  # its next attempt is numbered from its records when the window queues it
            keep_failed_attempt(connection, job, jobmeta.attempt(job.meta))
            failed.remove(job, delete_job=True)
    return [index for index, _ in lifted]


def next_attempts(layout: RunLayout) -> dict[int, int]:
    """Each chunk's next attempt number, from the failed attempts recorded in the store (their
    names: ``failures/<chunk>-a<attempt>.json``), for a chunk whose job is made anew."""
    found: dict[int, int] = {}
    for name in list_names(layout.failures):
        chunk, sep, rest = name.partition("-a")
        number = rest.removesuffix(".json")
        if sep and chunk.isdigit() and number.isdigit():
            found[int(chunk)] = max(found.get(int(chunk), 1), int(number) + 1)
    return found


def enqueue_chunks(
    connection: redis.Redis,
    layout: RunLayout,
    manifest: RunManifest,
    indices: Iterable[int],
    limit: int | None = None,
    before_requeue: Callable[[Job, int], None] | None = None,
) -> EnqueueCounts:
    """Queue each chunk in ``indices`` (in order) unless its job is already queued or running;
    with ``limit``, stop once that many of them are in Redis and count the rest as waiting.
    ``before_requeue(job, chunk)``: given each failed job before it is queued again, while it still
    says how it failed (the supervisor records the attempt in the store)."""
    queue = chunk_queue(connection, manifest.queue)
    failed = FailedJobRegistry(queue=queue)
    counts = EnqueueCounts()
    run_queues.register(connection, manifest.pool_queue, manifest.queue, manifest.priority)  # served from now
    it = iter(indices)
    numbered = next_attempts(layout)
    while True:
        room = BATCH if limit is None else min(BATCH, limit - counts.in_redis)
        batch = list(islice(it, room)) if room > 0 else []
        if not batch:
            break
        ids = [chunk_job_id(manifest.run_id, i) for i in batch]
        statuses = job_statuses(connection, ids)
        _same_store(connection, layout, manifest, [j for j, st in zip(ids, statuses, strict=True) if st])
        fresh = []
        for index, job_id, status in zip(batch, ids, statuses, strict=True):
            if status in LIVE_STATUSES:
                counts.in_flight += 1
            elif status == "failed":
                # Submitting again is the user's "try these again": fresh attempts, no quarantine.
                job = Job.fetch(job_id, connection=connection, serializer=JSONSerializer)
                if before_requeue is not None:
                    before_requeue(job, index)
                try_again(job, failed, layout, manifest, index)
                counts.requeued += 1
            else:
                if status is not None:  # finished, stopped or canceled, yet its output is not in the store
                    Job(job_id, connection=connection, serializer=JSONSerializer).delete()
                fresh.append(_job_data(layout, manifest, index, job_id, numbered.get(index, 1)))
        if fresh:
            with connection.pipeline() as pipe:
                queue.enqueue_many(fresh, pipeline=pipe)
                pipe.execute()
            counts.enqueued += len(fresh)
    counts.waiting = sum(1 for _ in it)
    return counts


def _same_store(connection: redis.Redis, layout: RunLayout, manifest: RunManifest, found: list[str]) -> None:
    """RunConflictError where the run's jobs in Redis are another store's run of the same id: job ids
    are a run id and a chunk number, one namespace for a whole Redis, and two stores that shared one
    took each other's jobs for their own ("1 already had a job in Redis", a failed one requeued as
    this store's). One job of a batch tells: a run's jobs are all its store's."""
    if not found:
        return
    try:
        job = Job.fetch(found[0], connection=connection, serializer=JSONSerializer)
        theirs = str(job.args[0].get("store")) if job.args and isinstance(job.args[0], dict) else None
    except (NoSuchJobError, DeserializationError):  # gone meanwhile, or not a chunk job: nothing to compare
        return
    ours = manifest.chunk_spec(layout.store, 0).store
    if theirs is not None and theirs != ours:
        raise errors.RunConflictError(
            f"run {manifest.run_id}: this Redis holds jobs of a run of that id from another store "
            f"({theirs}); two stores cannot share a run id in one Redis. Give this run another "
            "--run-id, or its own Redis"
        )


def _run_job_ids(connection: redis.Redis, run_id: str) -> list[str]:
    """The ids of the run's chunk jobs Redis holds (not their results streams)."""
    prefix = f"rq:job:{chunk_job_prefix(run_id)}"
    ids = [key.decode()[len("rq:job:") :] for key in connection.scan_iter(match=f"{prefix}*", count=1000)]
    return [i for i in ids if ":" not in i]


def forget_run_finished(connection: redis.Redis, run_id: str) -> int:
    """Delete the run's finished chunk jobs, once no worker of the run is left to touch them: the
    supervisor forgets each as it counts it, but a chunk whose output it counted before RQ marked
    its job finished settles the run with that job still to come (it would wait out its TTL);
    how many there were. Failed attempts' records stay (the dashboard shows them)."""
    ids = [i for i in _run_job_ids(connection, run_id) if RECORD_MARK not in i]
    with connection.pipeline(transaction=False) as pipe:
        for job_id in ids:
            pipe.hmget(Job.key_for(job_id), ["status", "origin"])
        found = pipe.execute()
    by_queue: dict[str, list[str]] = {}
    for job_id, (status, origin) in zip(ids, found, strict=True):
        if status == b"finished" and origin:
            by_queue.setdefault(origin.decode(), []).append(job_id)
    for queue_name, finished in by_queue.items():
        forget_finished(connection, queue_name, finished)
    return sum(map(len, by_queue.values()))


def drop_run_jobs(connection: redis.Redis, run_id: str) -> int:
    """Delete every job of the run Redis holds, from its queue and registries (those of a split cut
    short or abandoned: their chunks are to be made again, or never); how many there were."""
    ids = _run_job_ids(connection, run_id)
    jobs = Job.fetch_many(ids, connection=connection, serializer=JSONSerializer)
    for job in jobs:
        if job is not None:
            job.delete()
    return sum(job is not None for job in jobs)


def forget_finished(connection: redis.Redis, queue_name: str, job_ids: list[str]) -> None:
    """Delete finished jobs whose outputs the supervisor has counted: the job hash, its results
    stream and its entry in the finished registry, or the failed one for a job marked failed after
    its output was written (what RQ's own ``Job.delete`` removes for them)."""
    if not job_ids:
        return
    finished_key = FinishedJobRegistry(queue_name, connection=connection, serializer=JSONSerializer).key
    failed_key = FailedJobRegistry(queue_name, connection=connection, serializer=JSONSerializer).key
    with connection.pipeline(transaction=False) as pipe:
        for job_id in job_ids:
            pipe.delete(Job.key_for(job_id), Result.get_key(job_id))  # type: ignore[no-untyped-call]
        pipe.zrem(finished_key, *job_ids)
        pipe.zrem(failed_key, *job_ids)
        pipe.execute()


def restore_from_manifest(job: Job, layout: RunLayout, manifest: RunManifest, index: int) -> bool:
    """Make a failed chunk job call what the manifest says before it is queued again; True if it
    had been changed. A Redis writer may have rewritten the job (the worker refused it as
    tampered); requeueing it as it stands would only be refused again."""
    wanted: tuple[str, list[dict[str, Any]], dict[str, Any], int] = (
        EMBED_CHUNK,
        [manifest.chunk_spec(layout.store, index).to_dict()],
        {},
        manifest.job_timeout,
    )
    if (job.func_name, list(job.args), job.kwargs, job.timeout) == wanted:
        return False
    job.func_name, job.args, job.kwargs, job.timeout = wanted
    job.save()
    log.warning("chunk job %s did not call what the run's manifest says; restored from the manifest", job.id)
    return True


def _job_data(
    layout: RunLayout, manifest: RunManifest, index: int, job_id: str, attempt: int = 1
) -> EnqueueData:
    spec = manifest.chunk_spec(layout.store, index)
    meta = jobmeta.initial(manifest.run_id, index, spec.rows, spec.first_row)
    if attempt > 1:  # a chunk tried before: its attempts go on numbering, a new round begins
        meta[jobmeta.ATTEMPT] = meta[jobmeta.ROUND] = attempt
    return Queue.prepare_data(
        EMBED_CHUNK,
        args=(spec.to_dict(),),
        job_id=job_id,
        timeout=manifest.job_timeout,
        result_ttl=RESULT_TTL,
        failure_ttl=FAILURE_TTL,
        description=f"chunkq run {manifest.run_id} chunk {index} ({spec.rows} rows)",
        meta=meta,
    )
