"""bench/gpu.py must work unchanged on a GPU host: its help and its CPU path are tried here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import cli_env

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu.py"


def test_its_help_works_without_a_gpu() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "--large" in done.stdout and "plain" in done.stdout


@pytest.mark.slow
def test_on_a_host_without_cuda_it_says_so_unless_asked_for_the_cpu() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120, env=cli_env()
    )
    assert done.returncode == 2 and "no GPU this process may use" in done.stderr


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_its_cpu_path_measures_plain_and_chunkq_on_one_corpus(tmp_path: Path) -> None:
    out = tmp_path / "figures.json"
    # One configuration: each is a chunkq run of its own (~30 s here), and they share the script's path.
    cmd = [sys.executable, str(SCRIPT), "--device", "cpu", "--rows", "60", "--configs", "one", "--baselines"]
    cmd += ["--repeats", "2"]  # both orders of the once/twice round
    done = subprocess.run(
        [*cmd, "--out", str(out)], capture_output=True, text=True, timeout=560, env=cli_env()
    )
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(out.read_text())["minilm"]
    assert set(figures) == {"plain", "plain_tuned", "st_pool", "ceiling", "one", "tokenisation"}
    tokenisation = figures["tokenisation"]
    assert tokenisation["rows"] == 60 and set(tokenisation) == {"rows", "chunk_size", "batch 32"}
    for mode in ("once", "twice"):  # a GPU adds the budget's batching; the CPU has none
        figure = tokenisation["batch 32"]
        assert figure[f"{mode}_seconds"] > 0 and len(figure["samples"][mode]) == 2
    for baseline in ("plain", "plain_tuned", "st_pool", "ceiling"):
        assert figures[baseline]["rows"] == 60 and figures[baseline]["rows_per_s"] > 0, baseline
    one = figures["one"]
    assert one["rows_per_s"] > 0 and one["steady_ratio"] > 0 and 0 < one["share_of_ceiling"]
    # what the run's own records say: how busy the device was, when the first rows came, no token budget
    assert one["busy"]["source"] == "cpu-forward" and one["batch_tokens"] == [0]
    assert 0 < one["first_rows_seconds"] < one["wall"] and one["last_chunk_to_result_seconds"] >= 0
    assert "chunkq one" in done.stdout and "x plain" in done.stdout and "forward alone" in done.stdout
    assert "batch 32, in-process: tokenised once" in done.stdout
