"""Failures as they happen: killed and hung workers, broken CUDA, crash loops, poison chunks.

Real processes, a real Redis and the real model; faults are injected with CHUNKQ_FAULTS.
"""

from __future__ import annotations

import gzip
import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
from rq.job import Job
from rq.serializers import JSONSerializer

from chunkq.jobs.compute.model_refs import BUNDLED_MODEL
from chunkq.jobs.contract.run_files import RunLayout, read_json
from chunkq.jobs.contract.specs import chunk_job_id
from chunkq.jobs.queue.enqueue import job_statuses
from chunkq.queue_worker import exit_codes
from chunkq.supervisor.corpus.records import CorpusOptions
from chunkq.supervisor.store.run_lock import RunLock, RunLockedError
from chunkq.supervisor.submit.identity import SubmitRequest
from chunkq.supervisor.submit.submission import SubmitResult, submit
from tests.helpers import (
    make_texts,
    max_abs_diff,
    run_cli,
    start_cli,
    stop_tree,
    wait_for,
    worker_processes,
    write_corpus,
)

# Real pools, workers and CLI runs as subprocesses: the slow tier.
pytestmark = pytest.mark.slow


@pytest.fixture
def procs() -> Iterator[list[Any]]:
    started: list[Any] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            stop_tree(proc)


def _submit(
    tmp_path: Path, store: Path, connection: redis.Redis, rows: int, chunk: int, **kw: Any
) -> SubmitResult:
    ids, texts = make_texts(rows, seed=40)
    corpus = write_corpus(tmp_path / "c.jsonl", ids, texts, "jsonl")
    req = SubmitRequest(
        corpus, store, BUNDLED_MODEL, CorpusOptions("jsonl"), chunk_size=chunk, queue="r", **kw
    )
    return submit(req, connection)


def _meta(connection: redis.Redis, job_id: str) -> dict[str, Any]:
    return dict(Job.fetch(job_id, connection=connection, serializer=JSONSerializer).meta)


def test_killed_worker_is_seen_at_once_and_its_chunk_runs_again(
    tmp_path: Path,
    store: Path,
    connection: redis.Redis,
    redis_url: str,
    procs: list[Any],
    reference_model: Any,
) -> None:
    run = _submit(tmp_path, store, connection, rows=400, chunk=200)
    env = {"CHUNKQ_REDIS_URL": redis_url, "CHUNKQ_QUEUE": "r", "CHUNKQ_STORE": str(store)}
    pool = start_cli(tmp_path / "pool.log", "pool", "--gpus", "none", **env)
    procs.append(pool)
    supervisor = start_cli(tmp_path / "sup.log", "supervise", run.run_id, "--poll", "0.2", **env)
    procs.append(supervisor)
    job_id = chunk_job_id(run.run_id, 0)
    wait_for(lambda: job_statuses(connection, [job_id]) == ["started"], 120, "chunk 0 to start")
    (worker,) = worker_processes(pool)
    worker.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    wait_for(lambda: _meta(connection, job_id).get("attempt") == 2, 30, "chunk 0's second attempt")
    requeued = time.monotonic() - killed
    assert supervisor.wait(timeout=180) == 0, (tmp_path / "sup.log").read_text()[-3000:]
    assert requeued < 5.0  # the pool released the job at once; RQ alone would wait timeout + 60 s
    pool_log = (tmp_path / "pool.log").read_text()
    assert "killed by SIGKILL; starting a fresh one" in pool_log
    assert f"job {job_id} marked failed: worker" in pool_log
    layout = RunLayout(store, run.run_id)
    assert read_json(layout.output_meta(0))["attempt"] == 2
    _, texts = make_texts(400, seed=40)
    assert max_abs_diff(np.load(layout.result / "embeddings.npy"), reference_model.encode(texts)) <= 1e-5


def test_broken_cuda_context_recycles_the_worker(
    tmp_path: Path, store: Path, connection: redis.Redis, redis_url: str, procs: list[Any]
) -> None:
    run = _submit(tmp_path, store, connection, rows=30, chunk=10)
    faults = json.dumps([{"kind": "cuda_fatal", "chunks": [1], "attempts": [1]}])
    env = {"CHUNKQ_REDIS_URL": redis_url, "CHUNKQ_QUEUE": "r", "CHUNKQ_STORE": str(store)}
    pool = start_cli(tmp_path / "pool.log", "pool", "--gpus", "none", CHUNKQ_FAULTS=faults, **env)
    procs.append(pool)
    supervised = run_cli("supervise", run.run_id, "--poll", "0.2", **env)
    assert supervised.returncode == 0, supervised.stderr[-3000:]
    pool_log = (tmp_path / "pool.log").read_text()
    assert "FAULT INJECTION IS ON" in pool_log
    assert "CUDA context broken" in pool_log and "hit a fatal CUDA error" in pool_log
    # The finished job is gone from Redis (the supervisor forgets it once counted): the store says it.
    layout = RunLayout(store, run.run_id)
    assert read_json(layout.failure_path(1, 1))["error_class"] == "cuda_fatal"
    assert read_json(layout.output_meta(1))["attempt"] == 2
    pids = {read_json(layout.output_meta(i))["pid"] for i in range(3)}
    assert len(pids) == 2  # chunk 0 on the first worker, which died on chunk 1; a fresh one did the rest


def test_hung_job_is_killed_by_the_pool_watchdog(
    tmp_path: Path, store: Path, connection: redis.Redis, redis_url: str, procs: list[Any]
) -> None:
    run = _submit(tmp_path, store, connection, rows=10, chunk=10, job_timeout=4)
    faults = json.dumps([{"kind": "hang", "attempts": [1]}])
    env = {"CHUNKQ_REDIS_URL": redis_url, "CHUNKQ_QUEUE": "r", "CHUNKQ_STORE": str(store)}
    pool = start_cli(
        tmp_path / "pool.log",
        "pool",
        "--gpus",
        "none",
        "--hung-grace",
        "1",
        "--preload",
        BUNDLED_MODEL,
        CHUNKQ_FAULTS=faults,
        **env,
    )
    procs.append(pool)
    job_id = chunk_job_id(run.run_id, 0)
    wait_for(lambda: job_statuses(connection, [job_id]) == ["failed"], 120, "the hung chunk to be failed")
    meta = _meta(connection, job_id)
    assert meta["error_class"] == "abandoned" and "hung on" in meta["error"]
    assert "for over 5 s; killed" in (tmp_path / "pool.log").read_text()


def test_crash_loop_takes_the_device_out(
    tmp_path: Path, store: Path, connection: redis.Redis, redis_url: str, procs: list[Any]
) -> None:
    _submit(tmp_path, store, connection, rows=50, chunk=10)
    faults = json.dumps([{"kind": "sigkill"}])
    env = {"CHUNKQ_REDIS_URL": redis_url, "CHUNKQ_QUEUE": "r", "CHUNKQ_STORE": str(store)}
    limits = ("--crash-limit", "3", "--crash-window", "120")
    pool = start_cli(tmp_path / "pool.log", "pool", "--gpus", "none", *limits, CHUNKQ_FAULTS=faults, **env)
    procs.append(pool)
    assert pool.wait(timeout=180) == exit_codes.EXIT_CONFIG
    text = (tmp_path / "pool.log").read_text()
    assert "CPU: 3 worker deaths within 120 s; taking it out of this pool" in text
    assert text.count("started worker") == 3 and text.count("marked failed: worker") == 3


def test_poison_chunk_is_quarantined_and_reported(tmp_path: Path) -> None:
    ids, texts = make_texts(30, seed=41)
    corpus = write_corpus(tmp_path / "c.jsonl", ids, texts, "jsonl")
    faults = json.dumps([{"kind": "oom", "chunks": [1]}])
    args = ("run", str(corpus), "--chunk-size", "10", "--store", str(tmp_path / "s"), "--max-attempts", "2")
    started = time.monotonic()
    failed = run_cli(*args, "--poll", "0.2", CHUNKQ_FAULTS=faults)
    assert failed.returncode == 1, failed.stderr[-3000:]
    assert time.monotonic() - started < 120
    assert "1 chunk(s) quarantined:" in failed.stderr
    assert (
        "chunk 1 (rows 10-19" in failed.stderr and "oom, attempt 2, failed 2 of 2 attempts" in failed.stderr
    )
    assert "out of memory even at batch size 1" in failed.stderr
    (run_dir,) = (tmp_path / "s" / "runs").iterdir()
    assert not (run_dir / "result").exists()

    partial = run_cli(*args, "--poll", "0.2", "--allow-partial", CHUNKQ_FAULTS=faults)
    assert partial.returncode == 9, partial.stderr[-3000:]
    assert "PARTIAL result: 20 of 30 rows" in partial.stderr
    manifest = read_json(run_dir / "result" / "manifest.json")
    assert manifest["complete"] is False and manifest["rows"] == 20
    assert [(m["chunk"], m["first_row"], m["rows"], m["error_class"]) for m in manifest["missing"]] == [
        (1, 10, 10, "oom")
    ]
    kept = [json.loads(line) for line in (run_dir / "result" / "ids.jsonl").read_text().splitlines()]
    assert kept == ids[:10] + ids[20:]
    # Issue 37.15: what reads a partial result says so, with the partial exit code.
    store = str(tmp_path / "s")
    verify = run_cli("assemble", run_dir.name, "--verify", "--store", store)
    assert verify.returncode == 9 and "PARTIAL: the result holds 20 of 30 rows" in verify.stdout
    exported = run_cli(
        "export", run_dir.name, "--format", "jsonl", "--out", str(tmp_path / "p.jsonl"), "--store", store
    )
    assert exported.returncode == 9 and "PARTIAL: the result holds 20 of 30 rows" in exported.stderr
    assert len((tmp_path / "p.jsonl").read_text().splitlines()) == 20


def test_bad_row_in_the_store_is_quarantined_without_retry(
    tmp_path: Path, store: Path, connection: redis.Redis, redis_url: str, procs: list[Any]
) -> None:
    run = _submit(tmp_path, store, connection, rows=20, chunk=10)
    bad = RunLayout(store, run.run_id).input_path(1)
    lines = gzip.decompress(bad.read_bytes()).decode().splitlines()
    lines[4] = json.dumps({"id": "x", "text": 5})
    bad.write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))
    env = {"CHUNKQ_REDIS_URL": redis_url, "CHUNKQ_QUEUE": "r", "CHUNKQ_STORE": str(store)}
    procs.append(start_cli(tmp_path / "pool.log", "pool", "--gpus", "none", **env))
    supervised = run_cli("supervise", run.run_id, "--poll", "0.2", **env)
    assert supervised.returncode == 1
    assert "chunk 1 (rows 10-19" in supervised.stderr and "bad_input, attempt 1" in supervised.stderr
    assert "000001.jsonl.gz:5: text is int, not a string" in supervised.stderr
    status = json.loads(run_cli("status", run.run_id, "--json", **env).stdout)
    (failure,) = status["failures"]
    assert failure["quarantined"] and "Traceback" in failure["traceback"]


def test_a_second_supervisor_is_refused(connection: redis.Redis) -> None:
    first = RunLock(connection, "locked-run")
    first.acquire()
    try:
        with pytest.raises(RunLockedError, match="another supervisor is watching run locked-run"):
            RunLock(connection, "locked-run", wait=0.3).acquire()
    finally:
        first.release()
    RunLock(connection, "locked-run", wait=0.3).acquire()  # free again once released
