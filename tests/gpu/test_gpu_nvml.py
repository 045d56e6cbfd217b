"""Issue 44.4 on a real GPU: NVML failing for real, as on the seeds' host (a driver updated under a
running system), through a stand-in ``libnvidia-ml.so.1`` built here with the host's C compiler
(tests/nvml_standin.py): every NVML entry point PyTorch and nvidia-ml-py look up returns
NVML_ERROR_LIB_RM_VERSION_MISMATCH. CUDA itself still works.

(a) With it on LD_LIBRARY_PATH for the whole run, chunkq finds the GPU through CUDA (before: no GPU,
CPU workers) and runs on it; the result equals a plain encode.
(b) In the workers, PyTorch's own caching allocator then raises the seeds' assert at its first real
out-of-memory (past the worker's --gpu-memory-limit; its reportProcessMemoryInfo cannot initialise
NVML); the chunk halves in the same process and the run finishes. The stand-in is loaded by every
process of the run here, the pool's included (the seeds' host has one driver for all); a
worker-only variant needs a hook in the pool this test does not add.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from chunkq.jobs.contract.run_files import read_json
from tests.gpu.test_gpu_faults import (
    CAP,
    MIN_COSINE,
    _check_result,
    _min_cosine,
    _only_run,
    _plain,
    oversized_corpus,
)
from tests.helpers import make_texts, run_cli, write_corpus
from tests.nvml_standin import MESSAGE, build, compiler

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(1800),
    pytest.mark.skipif(
        compiler() is None, reason="no C compiler on this GPU host to build the stand-in NVML"
    ),
]


@pytest.fixture(scope="module")
def failing_nvml(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return {"LD_LIBRARY_PATH": str(build(tmp_path_factory.mktemp("nvml")))}


def test_a_failing_nvml_finds_the_gpu_through_cuda_and_the_run_uses_it(
    tmp_path: Path, gpu_model: str, gpu: Any, cuda_device: str, failing_nvml: dict[str, str]
) -> None:
    doctor = run_cli("doctor", "--json", "--store", str(tmp_path / "s"), **failing_nvml)
    report = json.loads(doctor.stdout)
    assert report["nvml"]["error"] == MESSAGE, report["nvml"]
    listed = {g["uuid"]: g for g in report["gpus"]}
    assert gpu.uuid in listed and listed[gpu.uuid]["source"] == "cuda", report["gpus"]
    assert any(p.startswith(f"NVML cannot initialise ({MESSAGE})") for p in report["problems"])
    ids, texts = make_texts(200, seed=21)
    corpus = write_corpus(tmp_path / "c.jsonl", ids, texts, "jsonl")
    store = tmp_path / "store"
    args = ["--model", gpu_model, "--chunk-size", "50", "--gpus", str(gpu.index), "--store", str(store)]
    done = run_cli("run", str(corpus), *args, timeout=900, **failing_nvml)
    assert done.returncode == 0, done.stderr[-4000:]
    layout = _only_run(store)
    assert any(d.startswith("cuda") for d in read_json(layout.result_manifest)["devices"])
    _check_result(layout, ids, _plain(gpu_model, texts, cuda_device))


def test_torchs_own_allocator_raises_the_seeds_assert_and_the_chunk_halves_in_process(
    tmp_path: Path, gpu_model: str, gpu: Any, cuda_device: str, failing_nvml: dict[str, str]
) -> None:
    """No injected fault: one batch larger than the worker's 2 GiB (--gpu-memory-limit), and NVML
    failing for real. A block past the cap fails in the allocator as one past the GPU's end does, and
    takes the same out-of-memory branch, where reportProcessMemoryInfo asks NVML and asserts; rows
    for the whole GPU (~25,000 of 512 tokens) ran past 150 s on an H100, ~700 fit a lease."""
    rows = int(2 * CAP / (2 * 512 * 1536 * 4)) + 1
    ids, texts = oversized_corpus(rows)
    corpus = write_corpus(tmp_path / "long.jsonl", ids, texts, "jsonl")
    store = tmp_path / "store"
    args = [
        "--model",
        gpu_model,
        "--chunk-size",
        str(rows),
        "--batch-size",
        str(rows),
        "--max-seq-length",
        "512",
    ]
    args += ["--gpus", str(gpu.index), "--store", str(store), "--job-timeout", "3000"]
    args += ["--gpu-memory-limit", str(CAP)]
    done = run_cli("run", str(corpus), *args, timeout=1700, **failing_nvml)
    assert done.returncode == 0, done.stderr[-4000:]
    meta = read_json(_only_run(store).output_meta(0))
    assert meta["attempt"] == 1 and meta["oom_backoffs"], meta  # every halving in the one process
    asserted = [b for b in meta["oom_backoffs"] if b.get("report_failed")]
    assert asserted and "nvmlInit_v2_() INTERNAL ASSERT FAILED" in asserted[0]["error"], meta["oom_backoffs"]
    assert "hit a fatal CUDA error" not in done.stderr
    import numpy as np

    sample = slice(0, 256)
    got = np.load(_only_run(store).result / "embeddings.npy", mmap_mode="r")[sample]
    assert _min_cosine(np.asarray(got), _plain(gpu_model, texts[sample], cuda_device, 512)) >= MIN_COSINE
