"""A run's footprint in Redis is its window, not its chunk count (issue 22.1): submit queues at most
the window, the supervisor tops it up in chunk order as chunks finish, requeues go to the front,
and finished jobs are forgotten once their outputs are counted."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import redis
from rq.registry import FailedJobRegistry, StartedJobRegistry

from chunkq.jobs.compute.model_refs import BUNDLED_MODEL
from chunkq.jobs.contract.manifest import load_manifest
from chunkq.jobs.queue.attempt_records import RECORD_MARK
from chunkq.jobs.queue.enqueue import chunk_queue
from chunkq.jobs.queue.run_queues import listed, run_queue
from chunkq.supervisor.corpus.records import CorpusOptions
from chunkq.supervisor.store.ledger import read_ledger
from chunkq.supervisor.submit.identity import SubmitRequest
from chunkq.supervisor.submit.submission import submit
from tests.helpers import make_texts, only_run, result_matches, run_cli, write_corpus


def test_submit_queues_at_most_the_window_and_says_how_many_wait(
    tmp_path: Path, store: Path, connection: redis.Redis
) -> None:
    ids, texts = make_texts(30)
    corpus = write_corpus(tmp_path / "c.jsonl", ids, texts, "jsonl")
    request = SubmitRequest(
        corpus, store, BUNDLED_MODEL, CorpusOptions("jsonl"), chunk_size=1, queue="win", queue_window=5
    )
    first = submit(request, connection)
    assert (first.counts.enqueued, first.counts.waiting) == (5, 25)
    queue = chunk_queue(connection, run_queue("win", first.run_id))  # the run's own queue
    assert queue.count == 5 and [j[-2:] for j in queue.job_ids] == ["00", "01", "02", "03", "04"]
    again = submit(request, connection)  # idempotent: the window is full of this run's jobs already
    assert (again.counts.in_flight, again.counts.enqueued, again.counts.waiting) == (5, 0, 25)
    assert queue.count == 5
    # Issue 37.16: a later `chunkq supervise` without --queue-window keeps the one submit was given.
    from chunkq.jobs.contract.run_files import RunLayout
    from chunkq.supervisor.watch.supervise import submitted_window

    layout = RunLayout(store, first.run_id)
    assert submitted_window(layout) == 5
    layout.queue_window.write_text("not json")
    assert submitted_window(layout) is None  # a damaged record: the window is worked out again


@pytest.mark.slow
def test_a_run_never_holds_more_than_its_window_in_redis_and_forgets_finished_jobs(
    tmp_path: Path, connection: redis.Redis, redis_url: str, reference_model: Any
) -> None:
    ids, texts = make_texts(36, seed=71)
    corpus = write_corpus(tmp_path / "c.jsonl", ids, texts, "jsonl")
    store, window, queue_name = tmp_path / "store", 4, "window"
    peak, done = [0], threading.Event()

    def sample() -> None:  # what Redis holds of the run's live jobs, as often as it can be read
        while not done.is_set():
            names = [name for name, _ in listed(connection, queue_name)] + [queue_name]
            with connection.pipeline(transaction=False) as pipe:
                for queue in (chunk_queue(connection, name) for name in names):
                    pipe.lrange(queue.key, 0, -1)
                    pipe.zrange(StartedJobRegistry(queue=queue).key, 0, -1)
                    pipe.zrange(FailedJobRegistry(queue=queue).key, 0, -1)
                # a failed attempt's record (jobs/queue/attempt_records.py) is not a job of the run
                held = sum(1 for ids in pipe.execute() for job in ids if RECORD_MARK.encode() not in job)
            peak[0] = max(peak[0], held)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        # A worker killed with its chunk in hand: the chunk comes back at the front of the queue.
        faults = '[{"kind": "sigkill", "chunks": [9], "attempts": [1]}]'
        args = ("run", str(corpus), "--chunk-size", "2", "--store", str(store), "--redis-url", redis_url)
        done_run = run_cli(
            *args, "--queue", queue_name, "--queue-window", str(window), timeout=300, CHUNKQ_FAULTS=faults
        )
    finally:
        done.set()
        sampler.join(timeout=10)
    assert done_run.returncode == 0, done_run.stderr[-3000:]
    assert 0 < peak[0] <= window, peak[0]
    layout = only_run(store)
    assert result_matches(layout, texts, reference_model)
    assert (layout.failures / "000009-a1.json").is_file()  # it was killed once, and done on its second try
    # Finished jobs are forgotten: the store is their record, and its ledger has every chunk once.
    # What stays: the record of chunk 9's failed attempt, where the dashboard shows it (issue 65.2).
    kept = [key.decode() for key in connection.scan_iter(f"rq:job:{layout.run_id}__*")]
    assert kept == [f"rq:job:{layout.run_id}__c000009{RECORD_MARK}1"], kept
    assert sorted(r["chunk"] for r in read_ledger(layout, load_manifest(layout))) == list(range(18))


def test_queued_jobs_in_no_queue_list_are_queued_again(
    tmp_path: Path, store: Path, connection: redis.Redis
) -> None:
    """Issue 37.12: `DEL rq:queue:chunkq` mid-run left 4 chunks "queued" for ever, a restarted
    supervisor too: their jobs said queued, but no list held them for a worker to take."""
    from chunkq.jobs.contract.manifest import load_manifest
    from chunkq.jobs.contract.run_files import RunLayout
    from chunkq.supervisor.watch.progress import Tracker

    ids, texts = make_texts(8)
    corpus = write_corpus(tmp_path / "c.jsonl", ids, texts, "jsonl")
    request = SubmitRequest(corpus, store, BUNDLED_MODEL, CorpusOptions("jsonl"), chunk_size=2, queue="gone")
    run = submit(request, connection)
    layout = RunLayout(store, run.run_id)
    manifest = load_manifest(layout)
    queue = chunk_queue(connection, manifest.queue)
    assert Tracker(connection, layout, manifest).poll().unlisted == []  # listed: nothing to do
    connection.delete(queue.key)
    restarted = Tracker(connection, layout, manifest, min_reconcile_seconds=0)  # every look a full one
    assert restarted.poll().unlisted == []  # its first look only notes them: a worker may be taking one
    restarted._next_full = 0  # the next look is a full one now, not after its cost-based gap
    look = restarted.poll()  # the second finds them in no list still
    assert look.unlisted == [0, 1, 2, 3] and look.chunks_queued == 4
    from chunkq.queue_worker.chunk_worker import ChunkWorker  # noqa: F401 - the job class's functions import
    from chunkq.supervisor.store.run_lock import RunLock
    from chunkq.supervisor.store.store_lock import StoreLock
    from chunkq.supervisor.watch.supervise import Supervisor, WatchSettings

    with StoreLock(layout.owner, "run") as owner:
        owner.acquire()
        watch = Supervisor(
            connection, layout, manifest, WatchSettings(), RunLock(connection, run.run_id), owner
        )
        watch._act(look)
    assert [j[-2:] for j in queue.job_ids] == ["00", "01", "02", "03"]
    assert Tracker(connection, layout, manifest).poll().unlisted == []
