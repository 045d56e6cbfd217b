"""Issue 54.2: a run is loaded once and each fact computed once. A fresh `chunkq run` and a resumed one
(a chunk's output lost, and the result with it) count their reads of the run's manifest, the corpus,
the chunk inputs and the chunk outputs, over every process (the command, its pool, the workers); the
counts may not grow again. ``BEFORE``: the same runs before this issue."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest

from chunkq.jobs.contract.run_files import RunLayout
from tests.file_reads import reading_env, reads
from tests.helpers import run_cli

CHUNKS = 3
KINDS = {
    "manifest": r"store/runs/r/manifest\.json",
    "corpus": r"c\.jsonl",
    "chunk inputs": r"store/runs/r/inputs/\d{6}\.jsonl\.gz",
    "chunk outputs": r"store/runs/r/outputs/\d{6}\.npy",
}
# Measured at b6682ca (tests/test_run_reads.py run against that tree) and now.
BEFORE = {
    "fresh": {"manifest": 7, "corpus": 7, "chunk inputs": 9, "chunk outputs": 12},
    "resumed": {"manifest": 8, "corpus": 5, "chunk inputs": 7, "chunk outputs": 12},
}
# Now: the manifest once per chunk in a worker (it checks the chunk's spec against it); the corpus at
# submit for its head, its hash (which names the run before anything is written) and its split; a
# chunk's input once by its worker and once by the text hashes at assembly; each output once.
NOW = {
    "fresh": {"manifest": 3, "corpus": 3, "chunk inputs": 6, "chunk outputs": 3},
    "resumed": {"manifest": 2, "corpus": 2, "chunk inputs": 4, "chunk outputs": 3},
}


def _run(tmp_path: Path, name: str) -> Counter[str]:
    env = reading_env(tmp_path, tmp_path / f"hook-{name}")
    done = run_cli(
        "run", "c.jsonl", "--store", "store", "--run-id", "r", "--chunk-size", "20", "--keep-outputs",
        cwd=tmp_path, **env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return reads(tmp_path / f"hook-{name}" / "reads.log", KINDS)


@pytest.mark.slow
def test_a_fresh_and_a_resumed_run_read_the_run_once(tmp_path: Path) -> None:
    with (tmp_path / "c.jsonl").open("w") as fh:
        for i in range(20 * CHUNKS):
            fh.write(json.dumps({"id": f"d{i}", "text": f"text number {i} " * (i % 5 + 1)}) + "\n")
    fresh = _run(tmp_path, "fresh")
    layout = RunLayout(tmp_path / "store", "r")
    shutil.rmtree(layout.result)
    for path in (layout.output_meta(1), layout.output_npy(1)):
        path.unlink()
    resumed = _run(tmp_path, "resumed")
    for name, counted in (("fresh", fresh), ("resumed", resumed)):
        # Every kind is seen (the hook counts), none more often than now, each less than before.
        assert all(0 < counted[k] <= NOW[name][k] < BEFORE[name][k] for k in KINDS), (name, counted)
