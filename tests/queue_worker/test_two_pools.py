"""Two pools (two "hosts") on one Redis and one store; one is killed mid-run; the run finishes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis

from chunkq.jobs.contract.run_files import RunLayout, read_json
from tests.helpers import make_texts, max_abs_diff, run_cli, start_cli, stop_tree, wait_for, write_corpus

# Real pools, workers and CLI runs as subprocesses: the slow tier.
pytestmark = pytest.mark.slow


def _pools_seen(layout: RunLayout) -> set[str]:
    seen = set()
    for index in layout.done_chunks():
        seen.add(str(read_json(layout.output_meta(index))["worker"]).split("-")[0])
    return seen


def test_two_pools_share_a_run_and_survive_losing_one(
    tmp_path: Path, redis_url: str, connection: redis.Redis, reference_model: Any
) -> None:
    ids, texts = make_texts(200, seed=60)
    corpus = write_corpus(tmp_path / "corpus.jsonl", ids, texts, "jsonl")
    store = tmp_path / "store"
    env = {"CHUNKQ_REDIS_URL": redis_url, "CHUNKQ_STORE": str(store), "CHUNKQ_QUEUE": "hosts"}
    assert run_cli("submit", str(corpus), "--chunk-size", "5", "--run-id", "shared", **env).returncode == 0
    layout = RunLayout(store, "shared")
    pools = {
        name: start_cli(
            tmp_path / f"{name}.log", "pool", "--gpus", "none", "--name", name, "--max-jobs", "5", **env
        )
        for name in ("hostA", "hostB")
    }
    supervisor = start_cli(tmp_path / "supervisor.log", "supervise", "shared", "--poll", "0.2", **env)
    try:
        wait_for(lambda: _pools_seen(layout) == {"hostA", "hostB"}, 180, "both pools to finish a chunk")
        pools["hostA"].kill()  # the whole "host" goes; its worker drains (parent-death SIGTERM)
        pools["hostA"].wait(timeout=30)
        assert supervisor.wait(timeout=300) == 0, (tmp_path / "supervisor.log").read_text()[-3000:]
    finally:
        for proc in (*pools.values(), supervisor):
            if proc.poll() is None:
                stop_tree(proc)
    matrix = np.load(layout.result / "embeddings.npy")
    assert max_abs_diff(matrix, reference_model.encode(texts)) <= 1e-5
    assert [json.loads(line) for line in (layout.result / "ids.jsonl").read_text().splitlines()] == ids
    workers = read_json(layout.result / "manifest.json")["workers"]
    assert {w.split("-")[0] for w in workers} == {"hostA", "hostB"}
    late = [read_json(layout.output_meta(i))["worker"] for i in range(35, 40)]
    assert all(w.startswith("hostB") for w in late)  # after hostA died, hostB did the rest
