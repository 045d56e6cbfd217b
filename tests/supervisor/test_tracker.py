"""The supervisor's look: incremental between full reconciles, and still right.

A real Redis and RQ, a real worker and the bundled model; Redis's own command statistics show how
much a look asked for.
"""

from __future__ import annotations

import subprocess
from datetime import UTC, datetime
from pathlib import Path

import pytest
import redis
from rq.job import Job

from chunkq.jobs.compute.model_refs import BUNDLED_MODEL
from chunkq.jobs.contract.manifest import load_manifest
from chunkq.jobs.contract.run_files import RunLayout, read_json
from chunkq.jobs.contract.specs import chunk_job_id
from chunkq.queue_worker import exit_codes
from chunkq.supervisor.corpus.records import CorpusOptions
from chunkq.supervisor.store.throughput import of_outputs
from chunkq.supervisor.submit.identity import SubmitRequest
from chunkq.supervisor.submit.submission import SubmitResult, submit
from chunkq.supervisor.watch.progress import Tracker
from chunkq.supervisor.watch.snapshot import store_snapshot
from tests.helpers import WORKER, cli_env, make_texts, write_corpus


def _submit(
    tmp_path: Path, store: Path, connection: redis.Redis, rows: int, chunk: int, queue: str
) -> SubmitResult:
    ids, texts = make_texts(rows, seed=61)
    corpus = write_corpus(tmp_path / "c.jsonl", ids, texts, "jsonl")
    request = SubmitRequest(
        corpus, store, BUNDLED_MODEL, CorpusOptions("jsonl"), chunk_size=chunk, queue=queue
    )
    return submit(request, connection)


def _calls(connection: redis.Redis, command: str) -> int:
    stats = connection.info("commandstats").get(f"cmdstat_{command}")
    return int(stats["calls"]) if stats else 0


def test_a_look_between_reconciles_reads_no_status_per_chunk(
    tmp_path: Path, store: Path, connection: redis.Redis
) -> None:
    run = _submit(tmp_path, store, connection, rows=400, chunk=1, queue="look")
    layout = RunLayout(store, run.run_id)
    tracker = Tracker(connection, layout, load_manifest(layout), min_reconcile_seconds=3600)
    before = _calls(connection, "hget")
    full = tracker.poll()
    assert _calls(connection, "hget") - before >= 400  # the reconcile reads every chunk's status
    assert full.chunks_queued == 400 and tracker.full_looks == 1
    before = _calls(connection, "hget")
    look = tracker.poll()
    assert _calls(connection, "hget") - before == 0
    assert tracker.full_looks == 1
    assert (look.chunks_queued, look.chunks_done, look.chunks_running) == (400, 0, 0)


@pytest.mark.slow
def test_incremental_looks_follow_a_run_and_the_reconcile_finds_what_they_cannot(
    tmp_path: Path, store: Path, connection: redis.Redis, redis_url: str
) -> None:
    run = _submit(tmp_path, store, connection, rows=12, chunk=2, queue="follow")
    layout = RunLayout(store, run.run_id)
    tracker = Tracker(connection, layout, load_manifest(layout), min_reconcile_seconds=3600)
    assert tracker.poll().chunks_queued == 6
    worker = subprocess.run(
        [*WORKER, "--queue", "follow", "--burst", "--store", str(store)],
        env=cli_env(
            CHUNKQ_REDIS_URL=redis_url,
            CHUNKQ_DEVICE="cpu",
            CHUNKQ_FAULTS='[{"kind": "cuda_fatal", "chunks": [5]}]',
        ),
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert worker.returncode == exit_codes.EXIT_CUDA_FATAL, worker.stderr
    look = tracker.poll()
    assert tracker.full_looks == 1  # what follows was learnt from the registries alone
    assert (look.chunks_done, look.rows_done, look.chunks_queued, look.chunks_running) == (5, 10, 0, 0)
    assert [(f.chunk, f.error_class) for f in look.failures] == [(5, "cuda_fatal")]
    # One rate for one run: the tracker (supervise, metrics) counts what the store alone gives
    # status and report, chunk for chunk, and measures it the same way.
    from_store = of_outputs(read_json(layout.output_meta(i)) for i in sorted(layout.done_chunks()))
    assert tracker.throughput == from_store and from_store.rows == 10
    moment = datetime.now(UTC)
    assert tracker.throughput.rows_per_second(True, moment) == from_store.rows_per_second(True, moment)
    assert look.rows_per_second and store_snapshot(layout, load_manifest(layout)).rows_per_second

    # A job hash that vanishes (a flushed or evicted Redis) leaves no trace in any registry: the
    # incremental look stops counting the chunk as failed, and only the reconcile calls it lost.
    Job(chunk_job_id(run.run_id, 5), connection=connection).delete()
    look = tracker.poll()
    assert (look.failures, look.lost, look.chunks_queued) == ([], [], 1)
    tracker.min_reconcile_seconds = 0
    tracker._next_full = 0
    look = tracker.poll()
    assert tracker.full_looks == 2
    assert (look.lost, look.chunks_done) == ([5], 5)

    # Issue 65.2: a chunk whose worker lost Redis as it finished is marked failed by whoever sees
    # it abandoned, though its output is in the store: it counts as done, and its job leaves RQ's
    # failed registry (the dashboard and `rq info` showed it failed for good, `ended_at` null).
    from rq.job import JobStatus
    from rq.registry import FailedJobRegistry

    from chunkq.jobs.queue.abandon import mark_abandoned
    from chunkq.jobs.queue.enqueue import chunk_queue, forget_finished

    manifest = load_manifest(layout)
    fresh = Tracker(connection, layout, manifest, min_reconcile_seconds=3600)
    job_id = chunk_job_id(run.run_id, 0)
    job = Job.fetch(job_id, connection=connection)
    job.set_status(JobStatus.STARTED)  # as its worker left it when Redis went away mid-report
    assert mark_abandoned(connection, job_id, "worker w1 lost Redis")
    failed = FailedJobRegistry(queue=chunk_queue(connection, manifest.queue))
    assert job_id in failed.get_job_ids()
    look = fresh.poll()  # a supervisor's first look: a full one
    assert 0 not in [f.chunk for f in look.failures] and look.chunks_done == 5
    forget_finished(connection, manifest.queue, fresh.take_finished())
    assert job_id not in failed.get_job_ids() and not connection.exists(Job.key_for(job_id))


def test_a_started_chunk_whose_job_has_an_empty_heartbeat_is_neither_stale_nor_a_crash(
    tmp_path: Path, store: Path, connection: redis.Redis
) -> None:
    """RQ stores ``last_heartbeat`` as an empty string until a job's first beat; the supervisor
    of a 5,000-chunk run died on it (``ValueError: Empty string or bytestring provided``)."""
    run = _submit(tmp_path, store, connection, rows=6, chunk=2, queue="emptybeat")
    layout = RunLayout(store, run.run_id)
    tracker = Tracker(connection, layout, load_manifest(layout))
    connection.hset(Job.key_for(chunk_job_id(run.run_id, 1)), "last_heartbeat", "")
    assert connection.hget(Job.key_for(chunk_job_id(run.run_id, 0)), "last_heartbeat") is not None
    stale, silent = tracker._stale([0, 1, 2])
    assert stale == [] and 1 in silent  # no beat yet: looked at for a worker gone (worker_place)


def test_a_heartbeat_is_stale_past_the_stale_after_the_supervisor_was_given(
    tmp_path: Path, store: Path, connection: redis.Redis
) -> None:
    """``--stale-after``: a beat 20 s old is stale to a supervisor told 15 s, not to the default 60 s."""
    from datetime import UTC, datetime, timedelta

    from rq.utils import utcformat

    run = _submit(tmp_path, store, connection, rows=6, chunk=2, queue="stalebeat")
    layout = RunLayout(store, run.run_id)
    old = utcformat(datetime.now(UTC) - timedelta(seconds=20))
    connection.hset(Job.key_for(chunk_job_id(run.run_id, 1)), "last_heartbeat", old)
    connection.hset(Job.key_for(chunk_job_id(run.run_id, 0)), "last_heartbeat", utcformat(datetime.now(UTC)))
    assert Tracker(connection, layout, load_manifest(layout))._stale([0, 1]) == ([], [1])  # a missed beat
    assert Tracker(connection, layout, load_manifest(layout), stale_after=15)._stale([0, 1]) == ([1], [])


def test_a_stranded_chunk_is_counted_once_not_also_as_queued(
    tmp_path: Path, store: Path, connection: redis.Redis
) -> None:
    """Issue 44.8: after a worker took a chunk and died before starting it (its id left in RQ's
    intermediate list), `status` said `1 queued` and `1 stranded` for that one chunk."""
    from datetime import timedelta

    from rq.intermediate_queue import IntermediateQueue

    from chunkq.jobs.queue.enqueue import chunk_queue
    from chunkq.supervisor.watch.display import describe
    from chunkq.supervisor.watch.progress import STRANDED_SECONDS

    run = _submit(tmp_path, store, connection, rows=6, chunk=2, queue="strand")
    layout = RunLayout(store, run.run_id)
    queue = chunk_queue(connection, load_manifest(layout).queue)  # the run's own
    taken = connection.lmove(queue.key, queue.intermediate_queue_key, "LEFT", "RIGHT")  # as a worker takes it
    intermediate = IntermediateQueue(queue.key, connection)
    seen = datetime.now(UTC) - timedelta(seconds=STRANDED_SECONDS + 5)  # taken, then its worker died
    connection.set(intermediate.get_first_seen_key(taken.decode()), seen.timestamp())
    tracker = Tracker(connection, layout, load_manifest(layout), min_reconcile_seconds=3600)
    for look in (tracker.poll(), tracker.poll()):  # a full look, then an incremental one
        assert look.stranded == [0] and look.chunks_queued == 2
        said = describe(look)
        assert "2 queued" in said and "1 stranded (taken by a worker that died) (chunk 0)" in said


def test_a_runs_finished_jobs_left_in_redis_are_forgotten_and_nothing_else(
    tmp_path: Path, store: Path, connection: redis.Redis
) -> None:
    """A chunk counted from its output before RQ marked its job finished settles the run with the
    job still to come: once the pool has stopped, the run forgets it (seen as a job left behind in
    ``test_a_run_never_holds_more_than_its_window_in_redis_and_forgets_finished_jobs``). A job not
    finished, and a failed attempt's record, stay."""
    from rq.job import JobStatus
    from rq.serializers import JSONSerializer

    from chunkq.jobs.queue.attempt_records import keep_failed_attempt
    from chunkq.jobs.queue.enqueue import forget_run_finished

    run = _submit(tmp_path, store, connection, rows=6, chunk=2, queue="leftfinished")
    finished, queued, failed = (
        Job.fetch(chunk_job_id(run.run_id, i), connection=connection, serializer=JSONSerializer)
        for i in range(3)
    )
    finished.set_status(JobStatus.FINISHED)
    keep_failed_attempt(connection, failed, 1)
    kept = {key.decode() for key in connection.scan_iter(f"rq:job:{run.run_id}__*")}
    assert forget_run_finished(connection, run.run_id) == 1
    assert {key.decode() for key in connection.scan_iter(f"rq:job:{run.run_id}__*")} == kept - {finished.key}
    assert connection.exists(queued.key) and len(kept) == 4  # three chunk jobs and the attempt's record
