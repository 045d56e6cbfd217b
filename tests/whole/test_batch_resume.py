"""Issue 54.5: the same `chunkq run` with another --batch-size resumes the run (the batch settings say
how fast, not what), the chunks left are encoded with the new one, and the result still equals
sentence-transformers' encode."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from chunkq.jobs.contract.run_files import read_json
from tests.helpers import make_texts, only_run, result_matches, run_cli, write_corpus


@pytest.mark.slow
def test_a_run_resumed_with_another_batch_size_is_the_same_run_and_the_same_vectors(
    tmp_path: Path, reference_model: Any
) -> None:
    ids, texts = make_texts(60)
    write_corpus(tmp_path / "c.jsonl", ids, texts, "jsonl")
    args = ("run", "c.jsonl", "--store", "store", "--chunk-size", "20")
    first = run_cli(*args, "--batch-size", "4", "--keep-outputs", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    layout = only_run(tmp_path / "store")
    shutil.rmtree(layout.result)  # the last chunk's output lost with the result: one chunk to encode
    for path in (layout.output_meta(2), layout.output_npy(2)):
        path.unlink()
    again = run_cli(*args, "--batch-size", "2", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert only_run(tmp_path / "store").run_id == layout.run_id  # resumed, not a second run
    assert "resumed with --batch-size 2" in again.stderr and "resuming run" in again.stderr
    asked = [read_json(layout.output_meta(i))["batch_size_requested"] for i in range(3)]
    assert asked == [4, 4, 2]
    assert result_matches(layout, texts, reference_model)
