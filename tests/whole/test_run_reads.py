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
# Measured at b6682ca (tests/whole/test_run_reads.py run against that tree) and now.
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


# Issue 66.1: the commands that read a run, each opening it once (``Run.open``) and its published
# result's manifest once. Measured at 3781510 and now.
COMMANDS = {
    "status": ("status", "r"),
    "report": ("report", "r"),
    "export": ("export", "r", "--out", "x.parquet"),
    "assemble --verify": ("assemble", "r", "--verify"),
}
MANIFESTS = {
    "manifest": KINDS["manifest"],
    "result manifest": r"store/runs/r/result/manifest\.json",
}
COMMANDS_BEFORE = {
    "status": {"manifest": 2, "result manifest": 3},
    "report": {"manifest": 3, "result manifest": 1},
    "export": {"manifest": 1, "result manifest": 2},
    "assemble --verify": {"manifest": 1, "result manifest": 3},
}


def _command_reads(tmp_path: Path) -> dict[str, Counter[str]]:
    counted = {}
    for name, args in COMMANDS.items():
        hook = tmp_path / f"hook-{name.replace(' ', '')}"
        done = run_cli(*args, "--store", "store", cwd=tmp_path, **reading_env(tmp_path, hook))
        assert done.returncode == 0, (name, done.stderr[-3000:])
        counted[name] = reads(hook / "reads.log", MANIFESTS)
    return counted


def _run(tmp_path: Path, name: str) -> Counter[str]:
    env = reading_env(tmp_path, tmp_path / f"hook-{name}")
    done = run_cli(
        "run", "c.jsonl", "--store", "store", "--run-id", "r", "--chunk-size", "20", "--keep-outputs",
        cwd=tmp_path, **env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return reads(tmp_path / f"hook-{name}" / "reads.log", KINDS)


@pytest.mark.slow
def test_a_fresh_and_a_resumed_run_and_the_commands_that_read_it_read_the_run_once(tmp_path: Path) -> None:
    with (tmp_path / "c.jsonl").open("w") as fh:
        for i in range(20 * CHUNKS):
            fh.write(json.dumps({"id": f"d{i}", "text": f"text number {i} " * (i % 5 + 1)}) + "\n")
    fresh = _run(tmp_path, "fresh")
    commands = _command_reads(tmp_path)
    layout = RunLayout(tmp_path / "store", "r")
    shutil.rmtree(layout.result)
    for path in (layout.output_meta(1), layout.output_npy(1)):
        path.unlink()
    resumed = _run(tmp_path, "resumed")
    for name, counted in (("fresh", fresh), ("resumed", resumed)):
        # Every kind is seen (the hook counts), none more often than now, each less than before.
        assert all(0 < counted[k] <= NOW[name][k] < BEFORE[name][k] for k in KINDS), (name, counted)
    for name, counted in commands.items():  # once each, where every one read more before
        assert dict(counted) == {"manifest": 1, "result manifest": 1}, (name, counted)
        assert sum(COMMANDS_BEFORE[name].values()) > 2, name
