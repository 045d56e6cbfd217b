"""Issue 65.2: one truth for failures. After a night, chunks that failed and were retried had
vanished from the dashboard (RQ's failed registry, where the design says an operator inspects
them) while `chunkq status` listed them; every view now tells the same failure events."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import redis
from rq.job import Job
from rq.registry import FailedJobRegistry
from rq.serializers import JSONSerializer

from chunkq.jobs.contract.manifest import load_manifest
from chunkq.jobs.contract.specs import chunk_job_id
from chunkq.jobs.queue.attempt_records import record_id
from tests.helpers import cli_env, make_texts, only_run, result_matches, run_cli, write_corpus


@pytest.mark.slow
def test_status_report_rq_and_the_dashboards_registry_count_the_same_failed_attempts(
    tmp_path: Path, redis_url: str, connection: redis.Redis, reference_model: Any
) -> None:
    ids, texts = make_texts(50, seed=67)
    store = tmp_path / "store"
    corpus = write_corpus(tmp_path / "c.jsonl", ids, texts, "jsonl")
    # A CUDA error that breaks the worker's context on chunk 1's first attempt, a worker killed
    # with chunk 3 in hand (the pool sees it die and fails the job as abandoned).
    faults = [
        {"kind": "cuda_fatal", "chunks": [1], "attempts": [1]},
        {"kind": "sigkill", "chunks": [3], "attempts": [1]},
    ]
    done = run_cli("run", str(corpus), "--store", str(store), "--chunk-size", "10", "--redis-url", redis_url,
                   "--queue", "night", CHUNKQ_FAULTS=json.dumps(faults), timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    layout = only_run(store)
    assert result_matches(layout, texts, reference_model)
    events = [(1, "cuda_fatal"), (3, "abandoned")]

    status = json.loads(run_cli("status", layout.run_id, "--store", str(store), "--json").stdout)
    assert sorted((f["chunk"], f["error_class"]) for f in status["failed_attempts"]) == events
    report = run_cli("report", layout.run_id, "--store", str(store))
    assert "2 failed attempt(s)" in report.stdout, report.stdout

    queue = load_manifest(layout).queue
    registry = FailedJobRegistry(queue, connection=connection, serializer=JSONSerializer)
    kept = sorted(registry.get_job_ids())
    assert kept == [record_id(chunk_job_id(layout.run_id, chunk), 1) for chunk, _ in events]
    for (chunk, error_class), job_id in zip(events, kept, strict=True):
        record = Job.fetch(job_id, connection=connection, serializer=JSONSerializer)
        assert record.meta["error_class"] == error_class and record.meta["chunk"] == chunk
        failed = record.latest_result()  # the traceback, where RQ and the dashboard read it
        said = {"cuda_fatal": "Traceback", "abandoned": "ChunkAbandonedError: worker"}[error_class]
        assert failed is not None and said in (failed.exc_string or ""), job_id
        assert f"queued again as {chunk_job_id(layout.run_id, chunk)}" in record.description
    info = subprocess.run(
        [str(Path(sys.executable).parent / "rq"), "info", "-u", redis_url, "-S", "json", queue],
        capture_output=True, text=True, timeout=60, check=False, env=cli_env(forks=False),
    )  # fmt: skip
    assert info.returncode == 0 and "0 finished, 2 failed" in info.stdout, info.stdout + info.stderr
