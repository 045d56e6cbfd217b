"""The retry policy against a real Redis: a failed chunk job's meta decides back-off, requeue or
quarantine, and meta written by someone else never crashes the supervisor (issue 21.14)."""

from __future__ import annotations

import random
from pathlib import Path

import redis
from rq.job import Job
from rq.registry import FailedJobRegistry
from rq.serializers import JSONSerializer

from chunkq.jobs.compute.model_refs import BUNDLED_MODEL
from chunkq.jobs.contract.specs import chunk_job_id
from chunkq.jobs.queue import jobmeta
from chunkq.jobs.queue.enqueue import chunk_queue
from chunkq.supervisor.corpus.records import CorpusOptions
from chunkq.supervisor.submit.identity import SubmitRequest
from chunkq.supervisor.submit.submission import submit
from chunkq.supervisor.watch.retry import RetryPolicy, settle_failure
from tests.helpers import make_texts, write_corpus


def _failed_job(tmp_path: Path, store: Path, connection: redis.Redis, meta: dict[str, object]) -> Job:
    ids, texts = make_texts(5)
    corpus = write_corpus(tmp_path / "c.jsonl", ids, texts, "jsonl")
    request = SubmitRequest(corpus, store, BUNDLED_MODEL, CorpusOptions("jsonl"), chunk_size=5, queue="r")
    run_id = submit(request, connection).run_id
    queue = chunk_queue(connection, f"r.{run_id}")  # the run's own queue (jobs/queue/run_queues.py)
    job = Job.fetch(chunk_job_id(run_id, 0), connection=connection, serializer=JSONSerializer)
    queue.remove(job.id)
    job.meta.update(meta)
    job.save_meta()  # type: ignore[no-untyped-call]
    FailedJobRegistry(queue=queue).add(job, exc_string="RuntimeError: boom")
    return job


def test_unreadable_attempt_and_retry_at_count_as_a_first_attempt_not_a_crash(
    tmp_path: Path, store: Path, connection: redis.Redis
) -> None:
    job = _failed_job(
        tmp_path,
        store,
        connection,
        {jobmeta.ATTEMPT: "x", jobmeta.RETRY_AT: "soon", jobmeta.ERROR_CLASS: "other"},
    )
    policy, rng, now = RetryPolicy(max_attempts=3), random.Random(0), 1_000_000.0
    assert settle_failure(connection, job, policy, rng, now=now) == "waiting"
    assert isinstance(job.meta[jobmeta.RETRY_AT], float) and job.meta[jobmeta.RETRY_AT] > now
    assert settle_failure(connection, job, policy, rng, now=now + 3600) == "requeued"
    assert Job.fetch(job.id, connection=connection, serializer=JSONSerializer).meta[jobmeta.ATTEMPT] == 2
    assert job.id in chunk_queue(connection, job.origin).job_ids


def test_a_numeric_string_attempt_is_read_as_its_number() -> None:
    assert jobmeta.attempt({jobmeta.ATTEMPT: "3"}) == 3
    assert [jobmeta.attempt({jobmeta.ATTEMPT: v}) for v in (0, -2, True, 2.5, None, [1])] == [1] * 6


def test_a_retried_chunk_goes_to_the_front_of_the_queue(
    tmp_path: Path, store: Path, connection: redis.Redis
) -> None:
    """With a bounded window the back of the queue is a window away: a chunk that failed (or whose
    worker was killed) is the next one taken, not the last."""
    job = _failed_job(tmp_path, store, connection, {jobmeta.ERROR_CLASS: "abandoned"})
    queue = chunk_queue(connection, job.origin)
    queue.enqueue("chunkq.jobs.embed.embed_chunk", {}, job_id="someone-else")
    assert settle_failure(connection, job, RetryPolicy(), random.Random(0), now=0.0) == "requeued"
    assert queue.job_ids[0] == job.id


def test_a_quarantine_line_is_the_errors_first_line_not_torchs_advice() -> None:
    """Issue 37.17: each quarantine line repeated torch's four lines of CUDA advice."""
    from chunkq.supervisor.result.assemble import Failure
    from chunkq.supervisor.watch.supervise import failure_report

    advice = (
        "\nCUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace "
        "below might be incorrect.\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1\n"
    )
    failure = Failure(
        chunk=3,
        first_row=30,
        rows=10,
        job_id="r__c000003",
        error_class="cuda_fatal",
        attempt=3,
        error="chunk r__c000003: CUDA error: an illegal memory access was encountered" + advice,
        traceback="",
        quarantined=True,
        reason="failed 3 of 3 attempts",
    )
    report = failure_report([failure])
    assert report.splitlines()[1].endswith("CUDA error: an illegal memory access was encountered")
    # torch's advice is left out; what follows is chunkq's own: how to try the chunk again
    assert "CUDA_LAUNCH_BLOCKING" not in report and len(report.splitlines()) == 3
    assert report.splitlines()[2].startswith("Fix the cause above")
