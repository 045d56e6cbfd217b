"""A process's start on the wall clock: the start-up figures subtract it from time.time()."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from chunkq.jobs.contract.process_clock import process_started_at


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="Linux's /proc only")
def test_a_process_start_is_read_on_the_clock_time_time_reads() -> None:
    """psutil's create_time() read 1.02 s early on the CI machine (the boot time it adds comes in
    whole seconds and drifts with uptime), so every step of `chunkq report`'s "before the first
    row" and each worker's "ready N s after its process started" read a second long."""
    tick = 1 / os.sysconf("SC_CLK_TCK")
    before = time.time()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        spawned = time.time()
        started = process_started_at(child.pid)
    finally:
        child.kill()
        child.wait(timeout=30)
    assert before - 3 * tick <= started <= spawned + 3 * tick, (before, started, spawned)
    assert process_started_at() <= time.time()  # this process's own, by default
