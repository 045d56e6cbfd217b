"""Cost of recycling workers, with and without warm standby, on one corpus in one run.

    python bench/recycling.py [--rows 2000] [--chunk-size 100]

Four `chunkq run`s of the same corpus (bundled model, CPU unless a GPU is present, a fresh store
and embedded Valkey each): --max-jobs 1000 (the baseline: one worker process for the whole run)
and --max-jobs 1 (a fresh process for every chunk), each with --standby and --no-standby. Prints
wall times and the ratio of each to the baseline with the same standby setting.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORDS = "alpha beta gamma delta river mountain queue worker chunk embed vector model sentence graph".split()


def _run(work: Path, corpus: Path, chunk_size: int, max_jobs: int, standby: bool) -> float:
    store = work / f"store-{max_jobs}-{standby}-{time.monotonic_ns()}"
    cmd = [
        sys.executable,
        "-m",
        "chunkq.cli",
        "--log-level",
        "WARNING",
        "run",
        str(corpus),
        "--store",
        str(store),
        "--chunk-size",
        str(chunk_size),
        "--max-jobs",
        str(max_jobs),
        "--max-jobs-jitter",
        "0",
        "--standby" if standby else "--no-standby",
    ]
    started = time.perf_counter()
    subprocess.run(cmd, check=True, env=dict(os.environ, HF_HUB_OFFLINE="1"), capture_output=True)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--chunk-size", type=int, default=100)
    args = parser.parse_args()
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        corpus = work / "corpus.jsonl"
        corpus.write_text(
            "".join(
                json.dumps({"id": i, "text": " ".join(rng.choices(WORDS, k=rng.randint(10, 120)))}) + "\n"
                for i in range(args.rows)
            )
        )
        _run(work, corpus, args.chunk_size, 1000, False)  # warm-up: page cache and .pyc files
        times = {
            (mj, sb): _run(work, corpus, args.chunk_size, mj, sb) for sb in (True, False) for mj in (1000, 1)
        }
    chunks = -(-args.rows // args.chunk_size)
    print(f"{args.rows} rows, {chunks} chunks of {args.chunk_size}")
    for standby in (True, False):
        base, every = times[(1000, standby)], times[(1, standby)]
        label = "standby on " if standby else "standby off"
        print(f"{label}: max-jobs 1000 {base:.1f} s | max-jobs 1 {every:.1f} s | ratio {every / base:.2f}")
    print(
        f"max-jobs 1, standby on vs off: {times[(1, True)]:.1f} s vs {times[(1, False)]:.1f} s "
        f"(ratio {times[(1, True)] / times[(1, False)]:.2f})"
    )


if __name__ == "__main__":
    main()
