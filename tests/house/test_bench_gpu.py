"""bench/gpu.py must work unchanged on a GPU host: its help is tried here, and its CPU path through
`make gpu-check --device cpu` (tests/house/test_gpu_check.py), which runs it."""

from __future__ import annotations

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
