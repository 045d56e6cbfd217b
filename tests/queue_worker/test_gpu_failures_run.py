"""Issue 31's runs through ``chunkq run``: the seeds' NVML assert on every chunk's first attempt, and
a NaN row, each finishing exact with nothing wrong published (real pool, Redis and model, CPU)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from chunkq.jobs.contract.run_files import RunLayout, non_finite_rows, read_json
from tests.helpers import make_texts, max_abs_diff, run_cli, write_corpus

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ROWS, CHUNK = 120, 30


def _run(tmp_path: Path, faults: list[dict[str, Any]]) -> tuple[RunLayout, list[str], list[str], str]:
    ids, texts = make_texts(ROWS, seed=31)
    corpus = write_corpus(tmp_path / "c.jsonl", ids, texts, "jsonl")
    store = tmp_path / "store"
    args = ["--chunk-size", str(CHUNK), "--batch-size", "32", "--store", str(store), "--run-id", "review"]
    done = run_cli("run", str(corpus), *args, timeout=500, CHUNKQ_FAULTS=json.dumps(faults))
    assert done.returncode == 0, done.stderr[-4000:]
    return RunLayout(store, "review"), ids, texts, done.stderr


def _report(layout: RunLayout, out: Path) -> dict[str, Any]:
    done = run_cli("report", layout.run_id, "--store", str(layout.store), "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    numbers: dict[str, Any] = json.loads((out / "report.json").read_text())
    return numbers


def _check_exact(layout: RunLayout, ids: list[str], texts: list[str], reference_model: Any) -> None:
    got = np.load(layout.result / "embeddings.npy")
    assert max_abs_diff(got, reference_model.encode(texts)) <= 1e-5 and not len(non_finite_rows(got))
    got_ids = [json.loads(line) for line in (layout.result / "ids.jsonl").read_text().splitlines()]
    assert got_ids == ids  # each row once, in order


def test_the_allocators_nvml_assert_is_halved_in_process_and_a_nan_row_retried_and_both_finish_exact(
    tmp_path: Path, reference_model: Any
) -> None:
    """Issue 31's two must-shows in one run, with issue 44.2's cure: chunks 0-2 raise torch 2.11's
    NVML assert above batch 8 and halve in the same process, on their first attempt (before, each
    halving was an attempt in a fresh process); chunk 3 comes out with a NaN row on its first
    attempt. The report says how many halvings each chunk took and where."""
    faults = [
        {"kind": "nvml_assert", "variant": "init_2_11", "chunks": [0, 1, 2], "above_batch": 8},
        {"kind": "non_finite", "chunks": [3], "attempts": [1], "rows": [4]},
    ]
    layout, ids, texts, log = _run(tmp_path, faults)
    _check_exact(layout, ids, texts, reference_model)  # nothing wrong published, each row once
    metas = [read_json(layout.output_meta(i)) for i in range(ROWS // CHUNK)]
    assert [m["attempt"] for m in metas] == [1, 1, 1, 2]
    assert [m["batch_size"] for m in metas[:3]] == [8, 8, 8]
    assert [b["report_failed"] for b in metas[0]["oom_backoffs"]] == [True, True]
    assert [m["batch_start"] for m in metas[1:3]] == [8, 8]  # what chunk 0 learned: no halving again
    assert "hit a fatal CUDA error" not in log and "taking it out of this pool" not in log  # nothing retired
    numbers = _report(layout, tmp_path / "report")
    assert numbers["failures_by_class"] == {"non_finite": 1}
    (nan,) = numbers["failures"]
    assert "NaN or infinite values in fp32 (corpus rows 94)" in nan["error"]
    (halving,) = numbers["oom_halvings"]
    assert halving["chunk"] == 0 and halving["sizes"] == [32, 16, 8] and halving["by_nvml_assert"] == 2
    batches = numbers["batches"]
    assert batches["requested"] == 32 and sum(batches["chunks_at"].values()) == ROWS // CHUNK
    shown = (tmp_path / "report" / "report.md").read_text()
    assert "| batch size | requested 32; chunks ran at" in shown
    assert "| out-of-memory halvings (in the process) | 2 in 1 chunk(s): chunk 0 on cpu, " in shown
    assert "(32 -> 16 -> 8; 2 by the NVML assert)" in shown


def test_a_device_that_cannot_run_the_model_stops_the_run_in_one_line(tmp_path: Path) -> None:
    """On this host the only device is the CPU: once it is retired no device is left, and the run
    stops (the chunk waits in the store for a host that can run it)."""
    ids, texts = make_texts(30, seed=32)
    corpus = write_corpus(tmp_path / "c.jsonl", ids, texts, "jsonl")
    faults = json.dumps([{"kind": "unsupported", "variant": "no_kernel_image"}])
    args = ["--chunk-size", "30", "--store", str(tmp_path / "store"), "--cpu-workers", "1"]
    done = run_cli("run", str(corpus), *args, timeout=300, CHUNKQ_FAULTS=faults)
    assert done.returncode == 8, done.stderr[-3000:]  # the pool ended before the run did
    assert "cpu cannot run model bundled:all-MiniLM-L6-v2 (fp32): CUDA error: no kernel image" in done.stderr
    assert "found that its GPU cannot run the model; taking it out of this pool" in done.stderr
    assert "Traceback" not in done.stderr
