"""What chunkq costs against a plain ``SentenceTransformer.encode`` loop, on one corpus in one run.

    python bench/overhead.py [--rows 8000] [--chunk-size 1000] [--max-jobs 3] [--repeats 3]
                             [--model REF] [--precision fp16]

The measurements, each a fresh process, the same corpus and model:
- plain: a script that imports sentence-transformers, loads the model, reads the corpus, encodes it
  in one ``encode`` call and saves the matrix (the baseline a user would write);
- chunkq run, workers recycled every ``--max-jobs`` chunks, warm standby on;
- the same with ``--no-standby``, and with ``--no-fork-server`` (each worker a fresh interpreter);
- the same never recycled (one worker process serves every chunk), which separates what recycling
  costs from what running a chunk through the queue costs;
- chunkq's defaults, no option given (recycled after 600 s of work: on this corpus, never).
Printed as ratios against plain: end to end (wall time of the whole command, start-up, model load
and assembly included; goal >= 0.95) and steady state (rows per second between the first chunk's
start and the last chunk's end, against the plain encode call alone; goal >= 0.98).
On a GPU host pass a larger model and ``--precision fp16``; on CPU the bundled model is used.
"""

from __future__ import annotations

import sys

# Run as a file, Python puts bench/ first on sys.path, where bench/queue.py would shadow the
# standard library's queue module that redis imports.
if not __package__:
    sys.path.pop(0)

import argparse
import json
import os
import random
import statistics
import subprocess
import tempfile
import time
from datetime import datetime
from pathlib import Path

from chunkq.supervisor.submit import DEFAULT_CHUNK_SIZE

NEVER = 1_000_000  # --max-jobs for the run without recycling, which isolates the per-chunk cost
WORDS = "alpha beta gamma delta river mountain queue worker chunk embed vector model sentence graph".split()

PLAIN = """
import json, sys, time
t0 = time.perf_counter()
import numpy as np
from sentence_transformers import SentenceTransformer
from chunkq.jobs.models import resolve_model
model = SentenceTransformer(resolve_model(sys.argv[2]), device=sys.argv[4])
if sys.argv[5] != "fp32":
    import torch
    model = model.to({"fp16": torch.float16, "bf16": torch.bfloat16}[sys.argv[5]])
texts = [json.loads(line)["text"] for line in open(sys.argv[1], encoding="utf-8")]
t1 = time.perf_counter()
matrix = model.encode(texts, batch_size=32, convert_to_numpy=True)
t2 = time.perf_counter()
np.save(sys.argv[3], matrix.astype(np.float32))
print(json.dumps({"encode_seconds": t2 - t1, "setup_seconds": t1 - t0, "rows": len(texts)}))
"""


def _device() -> str:
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "cpu"


def _plain(work: Path, corpus: Path, model: str, precision: str) -> tuple[float, float, int]:
    started = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", PLAIN, str(corpus), model, str(work / "plain.npy"), _device(), precision],
        check=True,
        capture_output=True,
        text=True,
        env=dict(os.environ, HF_HUB_OFFLINE="1"),
    )
    wall = time.perf_counter() - started
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    return wall, figures["encode_seconds"], figures["rows"]


def _chunkq(
    work: Path,
    corpus: Path,
    args: argparse.Namespace,
    standby: bool,
    max_jobs: int | None,
    fork_server: bool = True,
) -> tuple[float, float]:
    store = work / f"store-{standby}-{time.monotonic_ns()}"
    cmd = [sys.executable, "-m", "chunkq.supervisor.cli", "--log-level", "WARNING", "run", str(corpus)]
    cmd += ["--store", str(store), "--chunk-size", str(args.chunk_size)]
    cmd += ["--model", args.model, "--precision", args.precision]
    if max_jobs is not None:  # None: chunkq's defaults, untouched
        cmd += ["--max-jobs", str(max_jobs), "--max-jobs-jitter", "0"]
        cmd += ["--standby" if standby else "--no-standby"]
        cmd += ["--fork-server" if fork_server else "--no-fork-server"]
    started = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    wall = time.perf_counter() - started
    (run_dir,) = (store / "runs").iterdir()
    metas = [json.loads(p.read_text()) for p in (run_dir / "outputs").glob("*.json")]
    first = min(datetime.fromisoformat(m["started_at"]) for m in metas)
    last = max(datetime.fromisoformat(m["finished_at"]) for m in metas)
    return wall, (last - first).total_seconds()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=8000)  # plain encode: over a minute here
    parser.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK_SIZE)
    parser.add_argument("--max-jobs", type=int, default=3)
    parser.add_argument("--model", default="bundled:all-MiniLM-L6-v2")
    parser.add_argument("--precision", default="fp32")
    # Each repeat measures plain and then every configuration, and its ratios pair them: a shared
    # two-core machine drifts by a few percent over minutes, as much as the goals' margins.
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    rng = random.Random(0)
    configs: dict[str, tuple[bool, int | None, bool]] = {
        "the defaults (recycled after 600 s of work, workers per GPU auto)": (True, None, True),
        f"recycled every {args.max_jobs}, standby on": (True, args.max_jobs, True),
        f"recycled every {args.max_jobs}, standby off": (False, args.max_jobs, True),
        f"recycled every {args.max_jobs}, standby on, no fork server": (True, args.max_jobs, False),
        "never recycled": (True, NEVER, True),
    }
    plain: list[tuple[float, float]] = []
    ratios: dict[str, list[tuple[float, float]]] = {label: [] for label in configs}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        corpus = work / "corpus.jsonl"
        with open(corpus, "w", encoding="utf-8") as fh:
            for i in range(args.rows):
                fh.write(
                    json.dumps({"id": i, "text": " ".join(rng.choices(WORDS, k=rng.randint(10, 120)))}) + "\n"
                )
        _plain(work, corpus, args.model, args.precision)  # warm-up: page cache, .pyc files
        for _ in range(args.repeats):
            plain_wall, plain_encode, rows = _plain(work, corpus, args.model, args.precision)
            plain.append((plain_wall, plain_encode))
            for label, (standby, max_jobs, fork_server) in configs.items():
                wall, span = _chunkq(work, corpus, args, standby, max_jobs, fork_server)
                ratios[label].append((plain_wall / wall, plain_encode / span))
    chunks = -(-rows // args.chunk_size)
    print(
        f"{rows} rows, {chunks} chunks of {args.chunk_size}, workers recycled every {args.max_jobs} chunks,"
    )
    print(
        f"model {args.model} ({args.precision}) on {_device()}, {os.cpu_count()} CPU cores, "
        f"{args.repeats} repeat(s)"
    )
    walls, encodes = zip(*plain, strict=True)
    print(
        f"plain encode: {_summary(walls, 1)} s end to end, {_summary(encodes, 1)} s in encode "
        f"({rows / statistics.median(encodes):.0f} rows/s)"
    )
    print("chunkq, ratios against plain in the same repeat (median, then each repeat):")
    for label, pairs in ratios.items():
        e2e, steady = zip(*pairs, strict=True)
        print(f"  {label}: end to end {_summary(e2e, 3)}, steady state {_summary(steady, 3)}")


def _summary(values: tuple[float, ...], digits: int) -> str:
    """The median, then each repeat's value when there was more than one."""
    each = f" ({', '.join(f'{v:.{digits}f}' for v in values)})" if len(values) > 1 else ""
    return f"{statistics.median(values):.{digits}f}{each}"


if __name__ == "__main__":
    main()
