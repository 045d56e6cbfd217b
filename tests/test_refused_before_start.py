"""Issue 43.9: options that made every attempt fail (and the run end quarantined, or say only "the
worker pool exited") are refused before anything starts, in one line, with nothing created."""

from __future__ import annotations

from pathlib import Path

import pytest

from chunkq.jobs.compute.model_info import describe
from chunkq.jobs.compute.models import BUNDLED_MODEL
from chunkq.jobs.contract.errors import ConfigError
from chunkq.queue_worker.exit_codes import EXIT_CONFIG
from chunkq.supervisor.request import build_run_request
from tests.helpers import make_texts, run_cli, write_corpus


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    ids, texts = make_texts(5, seed=2)
    return write_corpus(tmp_path / "c.jsonl", ids, texts, "jsonl")


def test_a_sequence_longer_than_the_models_positions_is_refused(tmp_path: Path, corpus: Path) -> None:
    """600 on a 512-position model: accepted before, every attempt failed and the chunk was
    quarantined. 512 itself is what the model takes."""
    assert describe(BUNDLED_MODEL).positions == 512
    with pytest.raises(ConfigError, match=r"--max-seq-length 600 is above model .* 512 positions"):
        build_run_request([corpus], store=tmp_path / "s", max_seq_length=600)
    build_run_request([corpus], store=tmp_path / "s", max_seq_length=512)
    assert not (tmp_path / "s").exists()


def test_half_precision_on_a_run_without_a_gpu_is_refused(tmp_path: Path, corpus: Path) -> None:
    """Before: the pool's CPU workers each refused the chunks, and the run said only "the worker
    pool exited" (exit 8), the reason in run.log."""
    with pytest.raises(ConfigError, match="--precision fp16 needs a GPU, and these workers run on the cpu"):
        build_run_request([corpus], store=tmp_path / "s", precision="fp16", gpus="none")


@pytest.mark.parametrize("option", ["window_tokens", "window_stride"])
def test_window_sizes_without_windows_are_refused(tmp_path: Path, corpus: Path, option: str) -> None:
    """Silently ignored before (as --pool was not: it was refused)."""
    flag = "--" + option.replace("_", "-")
    with pytest.raises(ConfigError, match=f"{flag} is for --long-texts window or late"):
        build_run_request([corpus], store=tmp_path / "s", **{option: 64})
    build_run_request([corpus], store=tmp_path / "s", long_texts="window", **{option: 64})


@pytest.mark.slow
def test_the_command_line_says_each_in_one_line_and_creates_nothing(tmp_path: Path, corpus: Path) -> None:
    store = tmp_path / "store"
    for args, said in (
        (["--max-seq-length", "600"], "--max-seq-length 600 is above model"),
        (["--precision", "fp16", "--gpus", "none"], "--precision fp16 needs a GPU"),
        (["--window-tokens", "64"], "--window-tokens is for --long-texts window or late"),
    ):
        refused = run_cli("run", str(corpus), "--store", str(store), *args)
        assert refused.returncode == EXIT_CONFIG, refused.stderr
        assert refused.stderr.count("\n") == 1 and said in refused.stderr, refused.stderr
        assert not store.exists()
