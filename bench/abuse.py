"""Figures for the abuse findings: a run of many small chunks, and the embedded server's death.

    python bench/abuse.py [--chunks 2000] [--chunk-size 10]

1. ``chunkq run`` over CHUNKS chunks of one-word texts (bundled model, CPU): wall time, and the
   peak RSS of the ``chunkq run`` process (it is the supervisor), sampled every 0.1 s with psutil.
2. The same command on a fresh store with one slow chunk; the embedded valkey-server is SIGKILLed
   while that chunk runs: seconds from the kill to the server answering again (the run's own log
   line), and whether the run then finished.
Figures, not goals: nothing is compared against a baseline here.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil


def _corpus(path: Path, rows: int) -> Path:
    words = "alpha beta gamma delta river mountain queue worker chunk embed".split()
    with open(path, "w", encoding="utf-8") as fh:
        for i in range(rows):
            fh.write(json.dumps({"id": f"w{i}", "text": f"{words[i % len(words)]} {i}"}) + "\n")
    return path


def _start(args: list[str], log: Path, **env: str) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "chunkq.cli", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=dict(os.environ, HF_HUB_OFFLINE="1", **env),
        )


def large_run(work: Path, chunks: int, chunk_size: int) -> None:
    corpus = _corpus(work / "many.jsonl", chunks * chunk_size)
    args = ["run", str(corpus), "--chunk-size", str(chunk_size), "--max-jobs", "1000"]
    proc = _start([*args, "--store", str(work / "store-many")], work / "many.log")
    me, peak, started = psutil.Process(proc.pid), 0, time.perf_counter()
    while proc.poll() is None:
        try:
            peak = max(peak, me.memory_info().rss)
        except psutil.Error:
            break
        time.sleep(0.1)
    wall = time.perf_counter() - started
    print(
        f"{chunks} chunks of {chunk_size} rows: exit {proc.returncode}, wall {wall:.1f} s, "
        f"supervisor (chunkq run) peak RSS {peak / 2**20:.0f} MiB"
    )


def server_death(work: Path) -> None:
    corpus = _corpus(work / "few.jsonl", 60)
    faults = json.dumps([{"kind": "slow", "chunks": [1], "attempts": [1], "seconds": 3}])
    log = work / "death.log"
    args = ["run", str(corpus), "--chunk-size", "20", "--store", str(work / "store-death")]
    proc = _start(args, log, CHUNKQ_FAULTS=faults)
    deadline = time.monotonic() + 300
    while "__c000001" not in log.read_text(errors="replace"):
        if time.monotonic() > deadline or proc.poll() is not None:
            raise SystemExit(f"chunk 1 never started; see {log}")
        time.sleep(0.05)
    (server,) = [p for p in psutil.Process(proc.pid).children(recursive=True) if "valkey" in p.name()]
    server.kill()
    code = proc.wait(timeout=300)
    back = re.findall(r"embedded Redis is back after ([0-9.]+) s", log.read_text(errors="replace"))
    print(f"embedded server SIGKILLed mid-run: back after {back[0] if back else '?'} s; run exit {code}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--chunks", type=int, default=2000)
    parser.add_argument("--chunk-size", type=int, default=10)
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="chunkq-abuse-") as tmp:
        large_run(Path(tmp), opts.chunks, opts.chunk_size)
        server_death(Path(tmp))


if __name__ == "__main__":
    main()
