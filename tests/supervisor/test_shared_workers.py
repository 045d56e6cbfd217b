"""Issue 65.1: runs that share workers take turns. A run of 10,000 three-text chunks took every
worker for five minutes while a run submitted beside it waited behind its whole backlog (one FIFO
queue for every run)."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import redis

from chunkq.jobs.contract.run_files import RunLayout, read_json
from chunkq.jobs.queue.run_queues import listed, serving_order
from tests.helpers import make_texts, result_matches, run_cli, start_cli, stop_tree, write_corpus


def test_the_order_gives_each_run_its_turns_by_priority() -> None:
    runs = [("q.a", 1), ("q.b", 3)]
    firsts = [serving_order(runs, turn, "q")[0] for turn in range(8)]
    assert firsts.count("q.b") == 6 and firsts.count("q.a") == 2  # 3 turns to 1
    assert all(serving_order(runs, turn, "q")[-1] == "q" for turn in range(4))  # the pools' own, last
    assert serving_order([], 5, "q") == ["q"]


def _finished(layout: RunLayout) -> list[datetime]:
    return sorted(
        datetime.fromisoformat(read_json(layout.output_meta(i))["finished_at"]) for i in layout.done_chunks()
    )


@pytest.mark.slow
def test_a_flood_run_does_not_keep_a_small_run_waiting_behind_its_backlog(
    tmp_path: Path, redis_url: str, connection: redis.Redis, reference_model: Any
) -> None:
    store = tmp_path / "store"
    env = {"CHUNKQ_REDIS_URL": redis_url, "CHUNKQ_STORE": str(store), "CHUNKQ_QUEUE": "shared"}
    runs = {"flood": make_texts(160, seed=65), "small": make_texts(12, seed=66)}
    corpora = {
        name: write_corpus(tmp_path / f"{name}.jsonl", *texts, "jsonl") for name, texts in runs.items()
    }
    flood = ["--chunk-size", "1", "--queue-window", "160"]  # every chunk in Redis at once, as the night's
    small = ["--chunk-size", "2", "--priority", "2"]
    for name, extra in (("flood", flood), ("small", small)):  # the flood first: FIFO served it whole
        done = run_cli("submit", str(corpora[name]), "--run-id", name, *extra, **env)
        assert done.returncode == 0, done.stderr[-3000:]
    assert [name for name, _ in listed(connection, "shared")] == ["shared.flood", "shared.small"]
    procs = [start_cli(tmp_path / "pool.log", "pool", "--gpus", "none", "--cpu-workers", "2", **env)]
    procs += [start_cli(tmp_path / f"{n}.log", "supervise", n, "--poll", "0.2", **env) for n in runs]
    try:
        for name, proc in zip(runs, procs[1:], strict=True):
            assert proc.wait(timeout=300) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                stop_tree(proc)
    layouts = {name: RunLayout(store, name) for name in runs}
    for name, (_, texts) in runs.items():
        assert result_matches(layouts[name], texts, reference_model), name
    small_done = _finished(layouts["small"])[-1]
    flood_before = sum(1 for t in _finished(layouts["flood"]) if t < small_done)
    # Two workers taking turns, the small run two of every three: its 6 chunks finish beside ~3-5 of
    # the flood's, not after its 160.
    assert flood_before <= 20, flood_before
    assert listed(connection, "shared") == []  # settled runs leave the rotation
    from rq import Queue

    # and RQ's list of queues (`rq info`, the dashboard): nothing failed, nothing left in them
    assert not {q.name for q in Queue.all(connection=connection)} & {"shared.flood", "shared.small"}


def test_a_settled_runs_queue_leaves_rqs_list_unless_something_is_left_in_it(connection: redis.Redis) -> None:
    """One RQ queue a run, kept for good, piled up in `rq info` and the dashboard a line a run; a
    queue with failed chunks (their tracebacks) or a job in it stays."""
    from rq import Queue
    from rq.registry import FailedJobRegistry
    from rq.serializers import JSONSerializer

    from chunkq.jobs.queue.run_queues import retire

    def names() -> set[str]:
        return {q.name for q in Queue.all(connection=connection)}

    queues = {n: Queue(f"rq1.{n}", connection=connection, serializer=JSONSerializer) for n in "abc"}
    for name, queue in queues.items():
        queue.enqueue_call("chunkq.jobs.embed.embed_chunk", job_id=f"{name}__c000001")
    queues["a"].remove("a__c000001")
    failed = queues["b"].fetch_job("b__c000001")
    assert failed is not None
    queues["b"].remove(failed.id)
    FailedJobRegistry(queue=queues["b"]).add(failed, ttl=60)
    assert {"rq1.a", "rq1.b", "rq1.c"} <= names()
    assert [retire(connection, "rq1", f"rq1.{n}") for n in "abc"] == [True, False, False]
    assert "rq1.a" not in names() and {"rq1.b", "rq1.c"} <= names()
    assert not retire(connection, "rq1", "rq1")  # the pools' own queue is never retired


def test_a_waiting_run_is_told_what_the_workers_are_busy_with(
    connection: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """The starved run's supervisor said "start one: chunkq pool --queue chunkq" while both workers
    were busy with the other run's chunks."""
    import logging

    from rq import Queue
    from rq.serializers import JSONSerializer
    from rq.worker import Worker

    from chunkq.jobs.contract.manifest import RunManifest
    from chunkq.jobs.queue.enqueue import chunk_queue
    from chunkq.supervisor.watch.idle import warn_idle
    from chunkq.supervisor.watch.snapshot import Snapshot

    workers = [
        Worker([chunk_queue(connection, "busyq")], connection=connection, name=f"w{i}") for i in range(2)
    ]
    flood = Queue("busyq.flood", connection=connection, serializer=JSONSerializer)
    for worker, chunk in zip(workers, (7, 8), strict=True):
        worker.register_birth()
        job = flood.enqueue_call("chunkq.jobs.embed.embed_chunk", job_id=f"flood__c00000{chunk}")
        worker.prepare_execution(job)  # as RQ records a job in a worker's hands
    manifest = RunManifest({"run_id": "small", "queue": "busyq", "run_queue": "busyq.small"})
    try:
        with caplog.at_level(logging.WARNING):
            warn_idle(connection, manifest, Snapshot("small", chunks=6, rows=12, chunks_queued=6), 242.0)
    finally:
        for worker in workers:
            worker.register_death()
    (line,) = [r.getMessage() for r in caplog.records]
    assert "the 2 worker(s) on queue 'busyq' are busy with run flood (2)" in line and "start one" not in line
