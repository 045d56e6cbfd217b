"""What chunkq costs against a plain ``SentenceTransformer.encode`` script, on one corpus in one run.

    python bench/overhead.py [--corpus stdlib|synthetic|PATH] [--repeats 3] [--all-configs]
                             [--chunk-size 1000] [--max-jobs 3] [--model REF] [--precision fp16]

The corpus (``--corpus``): by default real text of varied length, the Python standard library's
docstrings (840 of them, from one line to several KB, each 4 times with unique ids and each copy
made distinct, so the vector cache saves nothing: 3,360 rows),
built at run time; ``synthetic`` (8,000 rows of 10-120 random words); or a JSON Lines file with a
``text`` field. Each measurement is a fresh process on the same corpus and model:
- plain: a script that imports sentence-transformers, loads the model, reads the corpus, encodes it
  in one ``encode(texts, batch_size=32)`` call and saves the matrix (what a user would write);
- chunkq with its defaults (no option given); with ``--all-configs`` also workers recycled every
  ``--max-jobs`` chunks (standby on, off, no fork server) and never recycled.
The plain script runs before and after every chunkq run (alternating, so a drift of the shared
machine hits both sides), and each chunkq run is compared with the mean of the plain runs on either
side of it. Printed: the median over ``--repeats`` of those ratios, end to end (wall time of the
whole command: start-up, model load and assembly included) and in rate (rows per second between
the first chunk's start and the last chunk's end, against the plain encode call alone).
Goal: >= 1.0 for chunkq's defaults on the stdlib corpus at rest, both ways.
On a GPU host pass a larger model and ``--precision fp16``; on CPU the bundled model is used.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from chunkq.jobs.contract.defaults import DEFAULT_CHUNK_SIZE
from chunkq.supervisor.store.ledger import of_run

NEVER = 1_000_000  # --max-jobs for the run without recycling, which isolates the per-chunk cost
WORDS = "alpha beta gamma delta river mountain queue worker chunk embed vector model sentence graph".split()

PLAIN = """
import json, sys, time
t0 = time.perf_counter()
import numpy as np
from sentence_transformers import SentenceTransformer
from chunkq.jobs.compute.model_refs import resolve_model
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


STDLIB_MODULES = (
    "os json re collections itertools functools pathlib subprocess threading asyncio email http.client "
    "urllib.request argparse logging typing dataclasses datetime decimal fractions statistics random "
    "string textwrap shutil tempfile zipfile tarfile csv sqlite3 socket ssl select selectors signal "
    "inspect ast dis unittest doctest pdb pickle copy heapq bisect array enum contextlib abc io codecs "
    "unicodedata locale gettext calendar time math cmath hashlib hmac secrets uuid base64 binascii "
    "struct weakref types operator queue sched multiprocessing concurrent.futures"
).split()
STDLIB_DOCSTRINGS, STDLIB_COPIES = 840, 4


def stdlib_texts() -> list[str]:
    """The standard library's docstrings, in a fixed order: real text from one line to several KB."""
    import importlib
    import inspect

    seen: dict[str, None] = {}
    for name in STDLIB_MODULES:
        module = importlib.import_module(name)
        for attr, obj in sorted(vars(module).items()):
            if attr.startswith("_") or not (inspect.isroutine(obj) or inspect.isclass(obj)):
                continue
            doc = inspect.getdoc(obj)
            if doc and len(seen) < STDLIB_DOCSTRINGS:
                seen.setdefault(doc)
    if len(seen) < STDLIB_DOCSTRINGS:
        raise SystemExit(f"only {len(seen)} docstrings in {len(STDLIB_MODULES)} modules")
    return list(seen)


def write_corpus(kind: str, path: Path, rows: int) -> None:
    """``stdlib``, ``synthetic``, or a JSON Lines file to copy."""
    if kind not in ("stdlib", "synthetic"):
        path.write_bytes(Path(kind).read_bytes())
        return
    rng = random.Random(0)
    with open(path, "w", encoding="utf-8") as fh:
        if kind == "stdlib":
            texts = stdlib_texts()
            for copy in range(STDLIB_COPIES):
                for i, text in enumerate(texts):
                    # each copy distinct: the vector cache would encode a repeated text once
                    shown = f"{text} (copy {copy})" if copy else text
                    fh.write(json.dumps({"id": f"{copy}-{i}", "text": shown}) + "\n")
            return
        for i in range(rows):
            fh.write(
                json.dumps({"id": i, "text": " ".join(rng.choices(WORDS, k=rng.randint(10, 120)))}) + "\n"
            )


def _device() -> str:
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "cpu"


def _plain(work: Path, corpus: Path, model: str, precision: str) -> tuple[float, float, int]:
    """(wall seconds, seconds in encode, rows) of the plain script."""
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
    cmd = [sys.executable, "-m", "chunkq.cli", "--log-level", "WARNING", "run", str(corpus)]
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
    return wall, of_run(store, run_dir.name).seconds(running=False) or 0.0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--corpus", default="stdlib", help="stdlib (default), synthetic, or a JSONL file")
    parser.add_argument("--rows", type=int, default=8000, help="rows of the synthetic corpus")
    parser.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK_SIZE)
    parser.add_argument("--max-jobs", type=int, default=3)
    parser.add_argument("--model", default="bundled:all-MiniLM-L6-v2")
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--all-configs", action="store_true", help="also recycling, standby, fork server")
    args = parser.parse_args()
    configs: dict[str, tuple[bool, int | None, bool]] = {
        "the defaults (recycled after 600 s of work, workers per GPU auto)": (True, None, True),
    }
    if args.all_configs:
        configs |= {
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
        write_corpus(args.corpus, corpus, args.rows)
        _plain(work, corpus, args.model, args.precision)  # warm-up: page cache, .pyc files
        before = _plain(work, corpus, args.model, args.precision)
        plain.append(before[:2])
        for _ in range(args.repeats):
            for label, (standby, max_jobs, fork_server) in configs.items():
                wall, span = _chunkq(work, corpus, args, standby, max_jobs, fork_server)
                after = _plain(work, corpus, args.model, args.precision)
                plain.append(after[:2])
                # Against the plain runs on either side: the machine's drift hits both.
                plain_wall, plain_encode = (before[0] + after[0]) / 2, (before[1] + after[1]) / 2
                ratios[label].append((plain_wall / wall, plain_encode / span))
                print(
                    f"{label}: chunkq {wall:.1f} s (span {span:.1f} s), plain {plain_wall:.1f} s "
                    f"(encode {plain_encode:.1f} s)",
                    flush=True,
                )
                before = after
    rows = before[2]
    chunks = -(-rows // args.chunk_size)
    print(f"corpus {args.corpus}: {rows} rows, {chunks} chunks of {args.chunk_size}")
    print(
        f"model {args.model} ({args.precision}) on {_device()}, {os.cpu_count()} CPU cores, "
        f"{args.repeats} repeat(s)"
    )
    walls, encodes = zip(*plain, strict=True)
    print(
        f"plain encode: {_summary(walls, 1)} s end to end, {_summary(encodes, 1)} s in encode "
        f"({rows / statistics.median(encodes):.1f} rows/s)"
    )
    print("chunkq, ratios against the plain runs either side of it (median, then each repeat):")
    for label, pairs in ratios.items():
        e2e, steady = zip(*pairs, strict=True)
        print(f"  {label}: end to end {_summary(e2e, 3)}, rate {_summary(steady, 3)}")


def _summary(values: tuple[float, ...], digits: int) -> str:
    """The median, then each repeat's value when there was more than one."""
    each = f" ({', '.join(f'{v:.{digits}f}' for v in values)})" if len(values) > 1 else ""
    return f"{statistics.median(values):.{digits}f}{each}"


if __name__ == "__main__":
    main()
