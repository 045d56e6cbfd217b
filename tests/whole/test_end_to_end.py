"""The CLI end to end as subprocesses: real Valkey, real pool, real model, verified result."""

from __future__ import annotations

import itertools
import json
import re
import signal
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from chunkq.jobs.contract.run_files import RunLayout, read_json
from tests.helpers import CLI, cli_env, make_texts, max_abs_diff, only_run, run_cli, write_corpus

# Real pools, workers and CLI runs as subprocesses: the slow tier.
pytestmark = pytest.mark.slow


def _check_result(
    layout: RunLayout, ids: list[str], texts: list[str], reference_model: Any
) -> dict[str, Any]:
    matrix = np.load(layout.result / "embeddings.npy")
    assert max_abs_diff(matrix, reference_model.encode(texts)) <= 1e-5
    assert [json.loads(line) for line in (layout.result / "ids.jsonl").read_text().splitlines()] == ids
    result: dict[str, Any] = read_json(layout.result / "manifest.json")
    return result


def test_run_matches_plain_encode_and_reruns_from_the_store(tmp_path: Path, reference_model: Any) -> None:
    ids, texts = make_texts(300, seed=1)
    corpus = write_corpus(tmp_path / "corpus.jsonl", ids, texts, "jsonl")
    store = tmp_path / "store"
    first = run_cli("run", str(corpus), "--chunk-size", "25", "--max-jobs", "2", "--store", str(store))
    assert first.returncode == 0, first.stderr[-3000:]
    layout = only_run(store)
    result = _check_result(layout, ids, texts, reference_model)
    metas = [read_json(layout.output_meta(i)) for i in range(12)]
    pids = {m["pid"] for m in metas}
    # 12 chunks, 2 per worker process: six fresh processes (seen once as 7 under the full suite's load)
    assert len(pids) == 6, [(m["chunk"], m["pid"], m["attempt"], m["worker"]) for m in metas]
    assert len(result["workers"]) == 6 and result["devices"] == ["cpu"]
    # Warm standby: each replacement loaded while its predecessor worked, yet never computed beside it.
    spans = sorted((m["started_at"], m["finished_at"]) for m in metas)
    assert all(later[0] >= earlier[1] for earlier, later in itertools.pairwise(spans))
    assert "recycled: ran its max jobs" in first.stderr and "takes over" in first.stderr
    assert (store / "redis" / "appendonlydir").is_dir()  # the embedded server persisted the queue

    stamps = {p.name: p.stat().st_mtime_ns for p in layout.outputs.iterdir()}
    again = run_cli("run", str(corpus), "--chunk-size", "25", "--max-jobs", "2", "--store", str(store))
    assert again.returncode == 0, again.stderr[-3000:]
    assert "already complete" in again.stdout
    assert "started worker" not in again.stderr  # nothing to do, so no pool was started
    assert {p.name: p.stat().st_mtime_ns for p in layout.outputs.iterdir()} == stamps


@pytest.mark.parametrize("fmt", ["csv", "parquet", "txt"])
def test_every_input_format(tmp_path: Path, fmt: str, reference_model: Any) -> None:
    ids, texts = make_texts(45, seed=9)
    corpus = write_corpus(tmp_path / f"corpus.{fmt}", ids, texts, fmt)
    store = tmp_path / "store"
    done = run_cli("run", str(corpus), "--chunk-size", "20", "--max-jobs", "2", "--store", str(store))
    assert done.returncode == 0, done.stderr[-3000:]
    want_ids = [str(i) for i in range(1, 46)] if fmt == "txt" else ids  # plain text: ids are line numbers
    _check_result(only_run(store), want_ids, texts, reference_model)


def test_submit_pool_supervise_status_on_a_shared_redis(
    tmp_path: Path, redis_url: str, reference_model: Any
) -> None:
    ids, texts = make_texts(40, seed=2)
    corpus = write_corpus(tmp_path / "corpus.jsonl", ids, texts, "jsonl")
    store = str(tmp_path / "store")
    env = {"CHUNKQ_REDIS_URL": redis_url, "CHUNKQ_STORE": store, "CHUNKQ_QUEUE": "e2e"}
    submitted = run_cli(
        "submit", str(corpus), "--chunk-size", "10", "--run-id", "shared-run", "--json", **env
    )
    assert submitted.returncode == 0, submitted.stderr
    figures = json.loads(submitted.stdout)
    assert (figures["run_id"], figures["rows"], figures["chunks"], figures["enqueued"]) == (
        "shared-run",
        40,
        4,
        4,
    )
    before = json.loads(run_cli("status", "shared-run", "--json", **env).stdout)
    assert (before["chunks_done"], before["chunks_queued"], before["settled"]) == (0, 4, False)

    pool = subprocess.Popen(
        [*CLI, "pool", "--gpus", "none", "--max-jobs", "3"],
        env=cli_env(**env),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        watched = run_cli("supervise", "shared-run", "--poll", "0.2", **env)
    finally:
        pool.send_signal(signal.SIGTERM)
        pool.wait(timeout=120)
    assert watched.returncode == 0, watched.stderr[-3000:]
    assert "chunks 4/4 done" in watched.stderr
    _check_result(RunLayout(store, "shared-run"), ids, texts, reference_model)
    after = json.loads(run_cli("status", "shared-run", "--json", **env).stdout)
    assert (after["chunks_done"], after["rows_done"], after["result_published"]) == (4, 40, True)
    assert after["rows_per_second"] > 0 and after["eta_seconds"] is None  # settled: nothing left
    resubmitted = run_cli(
        "submit", str(corpus), "--chunk-size", "10", "--run-id", "shared-run", "--json", **env
    )
    again = json.loads(resubmitted.stdout)
    assert (again["done"], again["in_flight"], again["enqueued"]) == (4, 0, 0)


def test_cli_errors_are_clear_with_named_exit_codes(tmp_path: Path, redis_url: str) -> None:
    corpus = tmp_path / "bad.jsonl"
    corpus.write_text('{"id": 1, "text": "fine"}\n{"id": 2, "text": 3}\n')
    env = {"CHUNKQ_REDIS_URL": redis_url, "CHUNKQ_STORE": str(tmp_path / "store")}
    bad = run_cli("submit", str(corpus), **env)
    assert bad.returncode == 3
    assert "bad.jsonl:2: text field 'text' is int, not a string" in bad.stderr
    assert "Traceback" not in bad.stderr
    corpus.write_text('{"id": 1, "text": "fine"}\n')
    assert run_cli("submit", str(corpus), "--run-id", "taken", **env).returncode == 0
    clash = run_cli("submit", str(corpus), "--run-id", "taken", "--chunk-size", "5", **env)
    assert clash.returncode == 4 and "run taken already exists" in clash.stderr
    missing_gpu = run_cli("run", str(corpus), "--gpus", "3", "--store", str(tmp_path / "s2"))
    assert missing_gpu.returncode == 6 and "GPU 3 does not exist; GPUs present: none" in missing_gpu.stderr


def test_failures_outlive_the_runs_redis_and_the_report_lists_them_by_class(
    tmp_path: Path, reference_model: Any
) -> None:
    """A broken CUDA context (a device-side assert, torch's wording) and a SIGKILLed worker during
    ``chunkq run``; the report made afterwards, with the run's embedded Redis gone, names both."""
    ids, texts = make_texts(80, seed=4)
    corpus = write_corpus(tmp_path / "corpus.jsonl", ids, texts, "jsonl")
    store = tmp_path / "store"
    faults = json.dumps(
        [
            {"kind": "device_assert", "chunks": [1], "attempts": [1]},
            {"kind": "sigkill", "chunks": [3], "attempts": [1]},
        ]
    )
    done = run_cli("run", str(corpus), "--chunk-size", "20", "--store", str(store), CHUNKQ_FAULTS=faults)
    assert done.returncode == 0, done.stderr[-3000:]
    layout = only_run(store)
    _check_result(layout, ids, texts, reference_model)

    out = tmp_path / "report"
    report = run_cli("report", layout.run_id, "--store", str(store), "--out", str(out))
    assert report.returncode == 0, report.stderr[-3000:]
    assert "2 failed attempt(s)" in report.stdout
    numbers = json.loads((out / "report.json").read_text())
    assert numbers["failures_by_class"] == {"abandoned": 1, "cuda_fatal": 1}
    by_chunk = {(f["chunk"], f["attempt"]): f for f in numbers["failures"]}
    assert set(by_chunk) == {(1, 1), (3, 1)}
    assert by_chunk[(1, 1)]["error_class"] == "cuda_fatal"
    assert "CUDA error: device-side assert triggered" in by_chunk[(1, 1)]["error"]
    assert by_chunk[(3, 1)]["error_class"] == "abandoned" and "SIGKILL" in by_chunk[(3, 1)]["error"]
    assert all(
        f["worker"] != "?" and f["device"] == "cpu" and not f["quarantined"] for f in by_chunk.values()
    )
    assert "| failed attempts | 2 (abandoned: 1, cuda_fatal: 1) |" in (out / "report.md").read_text()


def test_workers_recycle_on_work_time_and_each_successor_is_warm_before_its_first_chunk(
    tmp_path: Path, reference_model: Any
) -> None:
    """--recycle-after 15 with every chunk taking 10 s and more, and --max-jobs far away: each worker
    does two chunks (it knows the second is its last, so its successor loads meanwhile). The margins
    (10 s + encoding < 15 s, 20 s > 15 s) hold while encoding a chunk of 10 texts takes under 5 s: at
    load 15 on this 2-core machine it took over 2 s, which the former 3 s / 5 s margins could not
    absorb (issue 37.1: [1, 1, 2] instead of [2, 2])."""
    ids, texts = make_texts(40, seed=5)
    corpus = write_corpus(tmp_path / "corpus.jsonl", ids, texts, "jsonl")
    store = tmp_path / "store"
    faults = json.dumps([{"kind": "slow", "seconds": 10.0}])
    args = ["--chunk-size", "10", "--max-jobs", "1000", "--recycle-after", "15", "--max-jobs-jitter", "0"]
    done = run_cli("run", str(corpus), *args, "--store", str(store), CHUNKQ_FAULTS=faults)
    assert done.returncode == 0, done.stderr[-3000:]
    layout = only_run(store)
    _check_result(layout, ids, texts, reference_model)
    per_process: dict[int, list[int]] = {}
    for index in range(4):
        per_process.setdefault(read_json(layout.output_meta(index))["pid"], []).append(index)
    assert sorted(len(chunks) for chunks in per_process.values()) == [2, 2], per_process
    assert done.stderr.count("recycling after") == 2 and "takes over" in done.stderr
    # The second worker's last chunk was the run's last: with nothing queued no standby loads beside
    # it (issue 37.17: on a CPU it competed for the cores and took nothing).
    assert done.stderr.count("started standby") == 1
    # Each successor ran its warm-up encode before its predecessor exited and it took a job.
    for name in set(re.findall(r"\[(\S+-g\d+) gpu=-\] \S+: predecessor \d+ exited", done.stderr)):
        lines = [line for line in done.stderr.splitlines() if f"[{name} gpu=-]" in line]
        warm = next(i for i, line in enumerate(lines) if "warm-up encode at [16, 64] tokens" in line)
        waited = next(i for i, line in enumerate(lines) if "predecessor" in line and "exited" in line)
        assert warm < waited, lines
    seconds = [
        float(s)
        for s in re.findall(r"warm-up encode at \[16, 64\] tokens on cpu in ([0-9.]+) s", done.stderr)
    ]
    assert len(seconds) >= 2 and all(s < 5 for s in seconds)


def test_log_level_reaches_the_workers(tmp_path: Path) -> None:
    ids, texts = make_texts(10, seed=6)
    corpus = write_corpus(tmp_path / "corpus.jsonl", ids, texts, "jsonl")
    done = run_cli("--log-level", "DEBUG", "run", str(corpus), "--store", str(tmp_path / "store"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r" DEBUG \[pool-\S+-cpu-w0-g1 gpu=-\] ", done.stderr)  # a worker's own DEBUG line
    quiet = run_cli("--log-level", "WARNING", "run", str(corpus), "--store", str(tmp_path / "quiet"))
    assert quiet.returncode == 0 and " INFO [pool-" not in quiet.stderr
