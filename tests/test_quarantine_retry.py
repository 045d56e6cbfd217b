"""Issue 45.2: a pool started without `--allow-model` quarantined every chunk of a non-bundled model;
after the pool was restarted with it, `chunkq supervise RUN` exited 1 at once with the same list and
only a second `chunkq submit` (said nowhere) requeued them. A new supervisor now gives chunks
quarantined for a reason the operator can fix new attempts, and the quarantine says so."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import redis

from chunkq.jobs.contract.run_files import RunLayout
from chunkq.queue_worker.exit_codes import EXIT_CHUNKS_FAILED
from tests.helpers import make_texts, max_abs_diff, result_of, run_cli, start_cli, stop_tree, write_corpus
from tests.tiny_models import bundled_copy


@pytest.mark.slow
def test_a_chunk_quarantined_for_a_fixed_cause_is_tried_again_by_the_next_supervisor(
    tmp_path: Path, redis_url: str, connection: redis.Redis, reference_model: Any
) -> None:
    model = bundled_copy(tmp_path / "model")
    ids, texts = make_texts(30, seed=52)
    corpus = write_corpus(tmp_path / "c.jsonl", ids, texts, "jsonl")
    store = tmp_path / "store"
    env = {"CHUNKQ_REDIS_URL": redis_url, "CHUNKQ_STORE": str(store), "CHUNKQ_QUEUE": "fixable"}
    submitted = run_cli("submit", str(corpus), "--model", str(model), "--chunk-size", "10", **env)
    assert submitted.returncode == 0, submitted.stderr
    run_id = submitted.stdout.strip()
    pool = start_cli(tmp_path / "pool.log", "pool", "--gpus", "none", **env)  # the bundled model only
    try:
        refused = run_cli("supervise", run_id, "--poll", "0.2", **env, timeout=180)
    finally:
        stop_tree(pool)
    assert refused.returncode == EXIT_CHUNKS_FAILED, refused.stderr[-3000:]
    assert "3 chunk(s) quarantined:" in refused.stderr and "which this worker may not load" in refused.stderr
    assert f"then `chunkq supervise {run_id}` or the same `chunkq run` command" in refused.stderr
    pool = start_cli(tmp_path / "pool2.log", "pool", "--gpus", "none", "--allow-model", str(model), **env)
    try:
        done = run_cli("supervise", run_id, "--poll", "0.2", **env, timeout=240)
    finally:
        stop_tree(pool)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "chunk(s) [0, 1, 2] were quarantined by an earlier supervisor" in done.stderr
    got, got_ids = result_of(RunLayout(store, run_id))
    assert got_ids == ids and max_abs_diff(got, reference_model.encode(texts)) <= 1e-5
