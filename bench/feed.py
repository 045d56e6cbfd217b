"""The work around the forward, measured on the CPU with a model whose forward costs nothing.

    python bench/feed.py [--rows 20000] [--chunk-size 1000] [--small-chunk 250] [--repeats 3]
                         [--out feed.json]

A GPU waits on the CPU work around its forward: reading a chunk, tokenising, copies, hashing,
writing the output, the queue (issue 52). That work is the same on a CPU, so it is measured here,
with a static-embedding model (sentence-transformers' StaticEmbedding over the bundled model's
tokenizer, random weights: a token lookup and a mean, ~free), on real text: paragraphs of the
standard library's docstrings, every text distinct (``bench/gpu.py``'s corpus).

Every party runs in fresh processes with one thread each (OMP_NUM_THREADS, MKL_NUM_THREADS and
RAYON_NUM_THREADS=1, TOKENIZERS_PARALLELISM=false), side by side in this one run:
- ``tokenizer``: the model's own preprocessing alone, over batches of 32 (its tokenizer);
- ``plain``: ``SentenceTransformer.encode(texts, batch_size=32)``, the model loaded first (not timed);
- ``chunkq``: ``chunkq run --cpu-workers 1`` (pool, supervisor and Redis beside it, as users run it).
  Steady rows/s: the rows after each worker's first chunk, over the span from that chunk's end to
  its last chunk's end (each cycle: the encode and everything between two encodes). Per chunk, the
  cycle less the model's forward (the chunks record their forward share, ``device_busy``): chunkq's
  CPU outside the forward, per row. Its fixed cost per chunk: the intercept of the cycle against the
  chunk's rows, from ``--chunk-size`` and ``--small-chunk``;
- two at once: two plain processes each encoding half, and ``chunkq run --cpu-workers 2``;
- threads against processes: one chunkq worker whose tokenizer splits each chunk over two threads
  (RAYON_NUM_THREADS=2, TOKENIZERS_PARALLELISM=true: what a worker forked by the fork server gets
  from the tokenizers library), against the two workers above.
Each party ``--repeats`` times, in rounds whose order turns; medians. Printed as a table and written
to ``--out`` as JSON, every sample kept.

Goals (issue 52.1): chunkq's steady rows/s >= 0.9x plain in one process; its fixed cost per chunk
<= 20 ms; two workers >= 1.8x one; what chunkq adds per row outside the forward cheaper than
tokenising the row.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu import docstring_corpus
from tests.tiny_models import static_embedding

ONE_THREAD = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "RAYON_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
}

# One process: the model loaded (not timed), then the corpus (or its half) through one call.
PLAIN = """
import json, sys, time
from sentence_transformers import SentenceTransformer
corpus, model_path, what, part, parts = sys.argv[1:6]
texts = [json.loads(line)["text"] for line in open(corpus, encoding="utf-8")]
texts = texts[int(part) :: int(parts)]
model = SentenceTransformer(model_path, device="cpu")
model.encode(texts[:64], batch_size=32)  # warm
started = time.perf_counter()
if what == "tokenizer":
    for i in range(0, len(texts), 32):
        model.preprocess(texts[i : i + 32])
else:
    model.encode(texts, batch_size=32, convert_to_numpy=True)
seconds = time.perf_counter() - started
print(json.dumps({"rows": len(texts), "seconds": seconds, "rows_per_s": len(texts) / seconds}))
"""


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, **ONE_THREAD, **extra}


def plain(corpus: Path, model: Path, what: str, processes: int = 1) -> dict[str, Any]:
    """``what`` (plain or tokenizer) in ``processes`` processes at once, each its share of the rows."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", PLAIN, str(corpus), str(model), what, str(part), str(processes)],
            stdout=subprocess.PIPE,
            text=True,
            env=_env(),
        )
        for part in range(processes)
    ]
    found = [json.loads(proc.communicate()[0].strip().splitlines()[-1]) for proc in procs]
    return {
        "rows_per_s": sum(f["rows_per_s"] for f in found),
        "rows": sum(f["rows"] for f in found),
        "processes": processes,
    }


def _time(value: str) -> float:
    return datetime.fromisoformat(value).timestamp()


def chunkq_run(
    work: Path, corpus: Path, model: Path, chunk_size: int, workers: int, tokenizer_threads: int = 1
) -> dict[str, Any]:
    """``chunkq run`` as users run it; its figures from the chunk outputs it wrote."""
    store = work / f"store-{chunk_size}-{workers}-{time.monotonic_ns()}"
    cmd = [sys.executable, "-m", "chunkq.cli", "--log-level", "WARNING", "run", str(corpus)]
    cmd += ["--store", str(store), "--model", str(model), "--chunk-size", str(chunk_size)]
    cmd += ["--cpu-workers", str(workers), "--gpus", "none", "--no-cache"]
    started = time.perf_counter()
    threads = {"RAYON_NUM_THREADS": str(tokenizer_threads), "TOKENIZERS_PARALLELISM": "true"}
    subprocess.run(
        cmd, check=True, capture_output=True, env=_env(**(threads if tokenizer_threads > 1 else {}))
    )
    wall = time.perf_counter() - started
    (run_dir,) = (store / "runs").iterdir()
    metas = [json.loads(p.read_text()) for p in (run_dir / "outputs").glob("*.json")]
    by_worker: dict[int, list[dict[str, Any]]] = {}
    for meta in metas:
        by_worker.setdefault(int(meta["pid"]), []).append(meta)
    steady_rate, cycles, outside, forward_rows = 0.0, [], [], 0
    for chunks in by_worker.values():
        chunks.sort(key=lambda m: _time(m["finished_at"]))
        if len(chunks) < 2:
            continue
        span = _time(chunks[-1]["finished_at"]) - _time(chunks[0]["finished_at"])
        rows = sum(int(m["rows"]) for m in chunks[1:])
        steady_rate += rows / span if span > 0 else 0.0
        for before, this in itertools.pairwise(chunks):
            cycle = _time(this["finished_at"]) - _time(before["finished_at"])
            share = float((this.get("busy") or {}).get("share") or 0.0)
            forward = share * float(this["seconds"])
            cycles.append(cycle)
            outside.append(cycle - forward)
            forward_rows += int(this["rows"])
    counted_rows = forward_rows or 1
    return {
        "chunk_size": chunk_size,
        "workers": workers,
        "tokenizer_threads": tokenizer_threads,
        "wall": round(wall, 3),
        "rows": sum(int(m["rows"]) for m in metas),
        "chunks": len(metas),
        "steady_rows_per_s": steady_rate,
        "cycle_seconds_median": statistics.median(cycles) if cycles else None,
        "outside_forward_seconds_per_row": sum(outside) / counted_rows,
        "encode_seconds_median": statistics.median(float(m["seconds"]) for m in metas),
    }


def fixed_cost(small: dict[str, Any], large: dict[str, Any]) -> float | None:
    """Seconds per chunk whatever its rows: the intercept of the median cycle against chunk rows."""
    a, b = small["cycle_seconds_median"], large["cycle_seconds_median"]
    if a is None or b is None or large["chunk_size"] == small["chunk_size"]:
        return None
    slope = (b - a) / (large["chunk_size"] - small["chunk_size"])
    return float(a - slope * small["chunk_size"])


PARTIES: dict[str, Any] = {
    "tokenizer": lambda w, c, m, a: plain(c, m, "tokenizer"),
    "plain": lambda w, c, m, a: plain(c, m, "plain"),
    "chunkq": lambda w, c, m, a: chunkq_run(w, c, m, a.chunk_size, 1),
    "chunkq_small_chunks": lambda w, c, m, a: chunkq_run(w, c, m, a.small_chunk, 1),
    "plain_2": lambda w, c, m, a: plain(c, m, "plain", 2),
    "chunkq_2": lambda w, c, m, a: chunkq_run(w, c, m, a.chunk_size, 2),
    "chunkq_2_threads": lambda w, c, m, a: chunkq_run(w, c, m, a.chunk_size, 1, tokenizer_threads=2),
}
RATE = {"tokenizer": "rows_per_s", "plain": "rows_per_s", "plain_2": "rows_per_s"}  # else steady


def _median(samples: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """The sample whose rate is the median (its other figures with it), and every sample's rate."""
    rate = RATE.get(key, "steady_rows_per_s")
    ordered = sorted(samples, key=lambda s: s[rate])
    return {**ordered[len(ordered) // 2], "samples": [round(s[rate], 1) for s in samples]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--chunk-size", type=int, default=1000)
    parser.add_argument("--small-chunk", type=int, default=250)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    figures: dict[str, Any] = {"rows": args.rows, "cpus": os.cpu_count(), "repeats": args.repeats}
    samples: dict[str, list[dict[str, Any]]] = {key: [] for key in PARTIES}
    with tempfile.TemporaryDirectory(prefix="chunkq-feed-") as scratch:
        work = Path(scratch)
        corpus = docstring_corpus(work / "corpus.jsonl", args.rows)
        model = static_embedding(work / "static")
        for round_ in range(args.repeats):
            keys = list(PARTIES) if round_ % 2 == 0 else list(reversed(PARTIES))
            for key in keys:
                samples[key].append(PARTIES[key](work, corpus, model, args))
    figures.update({key: _median(found, key) for key, found in samples.items()})
    one, two = figures["chunkq"], figures["chunkq_2"]
    tokenize_per_row = 1 / figures["tokenizer"]["rows_per_s"]
    figures["summary"] = {
        "chunkq_to_plain": one["steady_rows_per_s"] / figures["plain"]["rows_per_s"],
        "fixed_cost_per_chunk_ms": 1000 * (fixed_cost(figures["chunkq_small_chunks"], one) or float("nan")),
        "two_workers_to_one": two["steady_rows_per_s"] / one["steady_rows_per_s"],
        "two_workers_to_two_plain": two["steady_rows_per_s"] / figures["plain_2"]["rows_per_s"],
        "two_threads_to_one": figures["chunkq_2_threads"]["steady_rows_per_s"] / one["steady_rows_per_s"],
        "outside_forward_us_per_row": 1e6 * one["outside_forward_seconds_per_row"],
        "tokenize_us_per_row": 1e6 * tokenize_per_row,
        "chunkq_own_us_per_row": 1e6 * (one["outside_forward_seconds_per_row"] - tokenize_per_row),
    }
    _print(figures)
    if args.out is not None:
        args.out.write_text(json.dumps(figures, indent=2) + "\n")


def _print(f: dict[str, Any]) -> None:
    s = f["summary"]
    print(
        f"static-embedding model, {f['rows']:,} docstring rows, one thread per process, {f['cpus']} CPUs, "
        f"medians of {f['repeats']}"
    )
    print(f"  tokenizer alone (batches of 32)      {f['tokenizer']['rows_per_s']:>9,.0f} rows/s")
    print(f"  plain encode (batch 32)              {f['plain']['rows_per_s']:>9,.0f} rows/s")
    labels = (("chunkq", "chunkq, 1 worker"), ("chunkq_small_chunks", "chunkq, 1 worker, small chunks"))
    for key, label in labels:
        c = f[key]
        print(
            f"  {label:<36} {c['steady_rows_per_s']:>9,.0f} rows/s steady (chunks of {c['chunk_size']}, "
            f"cycle {1000 * (c['cycle_seconds_median'] or 0):.1f} ms, command {c['wall']:.1f} s)"
        )
    print(f"  plain, 2 processes                   {f['plain_2']['rows_per_s']:>9,.0f} rows/s")
    print(f"  chunkq, 2 workers                    {f['chunkq_2']['steady_rows_per_s']:>9,.0f} rows/s steady")
    print(
        f"  chunkq, 1 worker, 2 tokenizer threads {f['chunkq_2_threads']['steady_rows_per_s']:>8,.0f} rows/s "
        f"steady ({s['two_threads_to_one']:.2f}x one thread)"
    )
    print(
        f"chunkq / plain {s['chunkq_to_plain']:.2f}x (goal >= 0.9); fixed cost per chunk "
        f"{s['fixed_cost_per_chunk_ms']:.1f} ms (goal <= 20); 2 workers / 1 {s['two_workers_to_one']:.2f}x "
        f"(goal >= 1.8); 2 workers / 2 plain {s['two_workers_to_two_plain']:.2f}x"
    )
    print(
        f"per row: outside the forward {s['outside_forward_us_per_row']:.1f} us, of which tokenising "
        f"{s['tokenize_us_per_row']:.1f} us and chunkq's own {s['chunkq_own_us_per_row']:.1f} us "
        "(goal: chunkq's own below tokenising)"
    )


if __name__ == "__main__":
    main()
