"""Peak memory of submit and assemble against the corpus size: it must stay flat.

    python bench/memory.py [--sizes 10000,100000,1000000] [--chunk-size 1000] [--dim 384]

For each size: write a JSONL corpus, ``chunkq submit`` it (embedded Valkey started here), write
every chunk's output as the job would (random float32 rows: the model is not what is measured),
then ``chunkq assemble``. Each command runs in a fresh interpreter that reports its own peak RSS
(``ru_maxrss``); printed per size with the ratio to the smallest size.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from chunkq.jobs.contract.manifest import load_manifest
from chunkq.jobs.contract.run_files import RunLayout, write_output
from chunkq.supervisor.server.embedded_redis import EmbeddedRedis

MEASURE = """
import resource, runpy, sys
sys.argv = ["chunkq", *sys.argv[1:]]
try:
    runpy.run_module("chunkq.cli", run_name="__main__")
except SystemExit as exc:
    if exc.code:
        raise
print("PEAK_KB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)
"""


def _peak_mb(args: list[str], env: dict[str, str]) -> float:
    done = subprocess.run(
        [sys.executable, "-c", MEASURE, *args],
        capture_output=True,
        text=True,
        env=dict(os.environ, **env),
        check=True,
    )
    line = [x for x in done.stderr.splitlines() if x.startswith("PEAK_KB")][-1]
    return int(line.split()[1]) / 1024


def _fake_outputs(layout: RunLayout, dim: int) -> None:
    manifest = load_manifest(layout)
    rng = np.random.default_rng(0)
    for index in range(manifest.chunks):
        rows = manifest.chunk_rows(index)
        meta = {"run_id": layout.run_id, "chunk": index, "worker": "bench", "device": "cpu", "seconds": 0.0}
        write_output(layout, index, rng.standard_normal((rows, dim), dtype=np.float32), meta)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="10000,100000,1000000")
    parser.add_argument("--chunk-size", type=int, default=1000)
    parser.add_argument("--dim", type=int, default=384)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    results = []
    with tempfile.TemporaryDirectory() as tmp, EmbeddedRedis(Path(tmp) / "redis") as server:
        work = Path(tmp)
        env = {"CHUNKQ_REDIS_URL": server.url, "CHUNKQ_STORE": str(work / "store")}
        for size in sizes:
            corpus = work / f"corpus-{size}.jsonl"
            with open(corpus, "w", encoding="utf-8") as fh:
                for i in range(size):
                    fh.write(json.dumps({"id": f"doc-{i}", "text": f"text number {i} " * 8}) + "\n")
            run_id = f"mem-{size}"
            submit_mb = _peak_mb(
                [
                    "--log-level",
                    "WARNING",
                    "submit",
                    str(corpus),
                    "--run-id",
                    run_id,
                    "--chunk-size",
                    str(args.chunk_size),
                    "--queue",
                    run_id,
                ],
                env,
            )
            _fake_outputs(RunLayout(work / "store", run_id), args.dim)
            assemble_mb = _peak_mb(["--log-level", "WARNING", "assemble", run_id], env)
            results.append((size, submit_mb, assemble_mb))
            print(
                f"{size} rows: submit peak RSS {submit_mb:.1f} MB, assemble peak RSS {assemble_mb:.1f} MB "
                f"(matrix {size * args.dim * 4 / 2**20:.0f} MB)",
                flush=True,
            )
    base = results[0]
    for size, submit_mb, assemble_mb in results[1:]:
        ratios = f"submit x{submit_mb / base[1]:.2f}, assemble x{assemble_mb / base[2]:.2f}"
        print(f"{size} vs {base[0]} rows: {ratios}")


if __name__ == "__main__":
    main()
