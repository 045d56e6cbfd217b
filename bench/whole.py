"""The whole command against the whole script it replaces, phase by phase (issue 64.1).

    python bench/whole.py [--sizes 10000 100000 1000000] [--models static minilm] [--repeats 2]
                          [--minilm-sizes 10000] [--run-args "--cpu-workers 2"] [--out whole.json]

A user times ``chunkq run corpus`` against the script they would otherwise write, start to end, so
both run here as whole processes, in pairs whose order turns each round (plain first, then chunkq
first), on every text distinct (``bench/gpu.py``'s docstring corpus: the cache saves nothing):
- ``plain``: a fresh interpreter imports sentence-transformers, loads the model, reads the JSON
  Lines corpus, ``encode(texts, batch_size=32)`` and ``np.save``. With the static model in one
  thread (``torch.set_num_threads(1)``, the issue's baseline); MiniLM with torch's own threads. It
  says when its load ended and when its first batch of 32 was encoded;
- ``chunkq``: ``chunkq run corpus --store S --model M`` with the defaults (and ``--run-args``).

For each: wall seconds, CPU seconds of the whole process tree (``RUSAGE_CHILDREN``), the peak of the
tree's summed PSS (sampled every 0.2 s), the store's bytes after publish, and the load average at
the start. For chunkq, where its time went (``runs/RUN/phases.json``: identify, split, queue, watch,
verify, write, cache, publish; the first-row marks; the workers' chunks): seconds, CPU seconds and
CPU microseconds per row of each phase, and ratios against plain: the whole command (plain's wall
over chunkq's), first rows (chunkq's first rows against plain's first batch), the last chunk to
the published result. A growth table across sizes shows any phase whose cost per row grows.

Models: ``static`` (sentence-transformers' StaticEmbedding over the bundled model's tokenizer,
random weights: its forward costs nothing, so what is left is chunkq: ``tests/tiny_models.py``) and
``minilm`` (the bundled all-MiniLM-L6-v2), by default at 10^4 only.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu import docstring_corpus
from bench.tree_memory import TreeMemory
from chunkq.jobs.compute.model_refs import BUNDLED_MODEL, resolve_model
from chunkq.jobs.contract.run import Run
from chunkq.jobs.contract.run_files import RunLayout, read_json
from chunkq.tools import first_row
from chunkq.tools.run_facts import gather

PLAIN = """
import json, sys, time
t0 = time.time()
import numpy as np, torch
from sentence_transformers import SentenceTransformer
corpus, model_path, out, threads = sys.argv[1:5]
if threads != "auto":
    torch.set_num_threads(int(threads))
model = SentenceTransformer(model_path, device="cpu")
loaded = time.time()
texts = [json.loads(line)["text"] for line in open(corpus, encoding="utf-8")]
first = model.encode(texts[:32], batch_size=32)
first_batch = time.time()
rest = model.encode(texts[32:], batch_size=32)
np.save(out, np.concatenate([first, rest]).astype(np.float32))
print(json.dumps({"started": t0, "loaded": loaded, "first_batch": first_batch, "end": time.time(),
                  "rows": len(texts)}))
"""
PHASES = ("identify", "split", "queue", "watch", "verify", "write", "cache", "publish")


def _measured(cmd: list[str], env: dict[str, str]) -> dict[str, Any]:
    """Run ``cmd``; its wall and CPU seconds (its whole tree), peak PSS and last stdout line."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    load = os.getloadavg()[0]
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    memory = TreeMemory(proc.pid)
    out, err = proc.communicate()
    wall = time.perf_counter() - started
    peak = memory.stop()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} exited {proc.returncode}: {err[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    last = out.strip().splitlines()[-1] if out.strip() else "{}"
    return {
        "wall": round(wall, 3),
        "cpu": round(cpu, 3),
        "peak_pss": peak,
        "load_at_start": load,
        "said": last,
    }


def _folder_bytes(path: Path) -> int:
    """The bytes the folder's files hold, a file under two names (a hard link) once, as ``du`` counts."""
    sizes = {
        (s.st_dev, s.st_ino): s.st_size
        for p in path.rglob("*")
        if p.is_file() and not p.is_symlink()
        for s in [p.stat()]
    }
    return sum(sizes.values())


def plain(work: Path, corpus: Path, model: str, threads: str) -> dict[str, Any]:
    out = work / f"plain-{time.monotonic_ns()}.npy"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    found = _measured([sys.executable, "-c", PLAIN, str(corpus), model, str(out), threads], env)
    said = json.loads(found.pop("said"))
    out.unlink(missing_ok=True)
    return {
        **found,
        "rows": said["rows"],
        "load_seconds": round(said["loaded"] - said["started"], 3),
        "first_batch_seconds": round(said["first_batch"] - said["started"], 3),
        "encode_seconds": round(said["end"] - said["first_batch"], 3),
    }


def chunkq(work: Path, corpus: Path, model: str, rows: int, run_args: list[str]) -> dict[str, Any]:
    store = work / f"store-{time.monotonic_ns()}"
    cmd = [sys.executable, "-m", "chunkq.cli", "--log-level", "WARNING", "run", str(corpus)]
    cmd += ["--store", str(store), "--model", model, *run_args]
    found = _measured(cmd, dict(os.environ, HF_HUB_OFFLINE="1"))
    found.pop("said")
    (run_dir,) = (store / "runs").iterdir()
    layout = RunLayout(store, run_dir.name)
    phases = read_json(layout.phases) if layout.phases.is_file() else {}
    run = Run.of(layout)
    facts = gather(run)
    before = first_row.breakdown(run, facts.first, facts.throughput.last_end)
    metas = [json.loads(p.read_text()) for p in layout.outputs.glob("*.json")]
    encoded = [m for m in metas if m.get("source") != "cache"]
    first, last = facts.throughput.first_start, facts.throughput.last_end
    span = (last - first).total_seconds() if first is not None and last is not None else None
    found.update(
        {
            "rows": rows,
            "store_bytes": _folder_bytes(store),
            "result_bytes": _folder_bytes(layout.result),
            "vector_bytes": rows * _dim(layout) * 4,
            "phases": {
                name: {**phases[name], "cpu_us_per_row": round(1e6 * phases[name]["cpu_seconds"] / rows, 2)}
                for name in PHASES
                if name in phases
            },
            "first_rows_seconds": before["first_row_seconds"],
            "marks": before["marks"],
            "last_chunk_to_result_seconds": before["last_chunk_to_result_seconds"],
            "encode_span_seconds": span,
            "steady_rows_per_s": rows / span if span else None,
            "worker_processes": len({m.get("pid") for m in encoded}),
            "chunk_seconds_sum": round(sum(float(m.get("seconds") or 0) for m in encoded), 3),
        }
    )
    return found


def _dim(layout: RunLayout) -> int:
    try:
        return int(read_json(layout.result_manifest).get("dim") or 0)
    except (OSError, ValueError):
        return 0


def _ratios(pair: dict[str, Any]) -> dict[str, Any]:
    p, c = pair["plain"], pair["chunkq"]
    return {
        "whole": round(p["wall"] / c["wall"], 3),
        "cpu": round(c["cpu"] / max(p["cpu"], 1e-9), 3),
        "first_rows_minus_plain_first_batch": (
            None
            if c["first_rows_seconds"] is None
            else round(c["first_rows_seconds"] - p["first_batch_seconds"], 3)
        ),
        "store_over_vectors": round(c["store_bytes"] / max(c["vector_bytes"], 1), 3),
        "peak_pss_over_plain": round(c["peak_pss"] / max(p["peak_pss"], 1), 3),
    }


def rounds(work: Path, model: str, label: str, rows: int, args: argparse.Namespace) -> dict[str, Any]:
    corpus = docstring_corpus(work / f"corpus-{rows}.jsonl", rows)
    threads = "1" if label == "static" else "auto"
    pairs = []
    for round_ in range(args.repeats):
        pair: dict[str, Any] = {}
        order = ("plain", "chunkq") if round_ % 2 == 0 else ("chunkq", "plain")
        for who in order:
            if who == "plain":
                pair["plain"] = plain(work, corpus, model, threads)
            else:
                pair["chunkq"] = chunkq(work, corpus, model, rows, args.run_args)
        pair["ratios"] = _ratios(pair)
        pairs.append(pair)
        print(f"  {label} {rows:>9,} round {round_ + 1}: {_line(pair)}", flush=True)
    medians = {key: statistics.median(p["ratios"][key] for p in pairs if p["ratios"][key] is not None)
               for key in pairs[0]["ratios"] if any(p["ratios"][key] is not None for p in pairs)}  # fmt: skip
    return {"model": label, "rows": rows, "pairs": pairs, "median_ratios": medians}


def _line(pair: dict[str, Any]) -> str:
    p, c, r = pair["plain"], pair["chunkq"], pair["ratios"]
    phases = " ".join(f"{k} {v['seconds']:.1f}" for k, v in c["phases"].items())
    return (
        f"plain {p['wall']:.1f} s, chunkq {c['wall']:.1f} s = {r['whole']:.2f}x "
        f"(load {p['load_at_start']:.2f}); "
        f"first rows {c['first_rows_seconds']} s vs plain's first batch {p['first_batch_seconds']} s; "
        f"last chunk to result {c['last_chunk_to_result_seconds']} s; store {r['store_over_vectors']:.2f}x "
        f"the vectors; peak PSS {c['peak_pss'] / 2**30:.2f} GiB vs {p['peak_pss'] / 2**30:.2f}; {phases}"
    )


def growth(results: list[dict[str, Any]]) -> list[str]:
    """Each phase's CPU microseconds per row at each size (median over rounds), one line a phase."""
    lines = []
    for label in sorted({r["model"] for r in results}):
        mine = sorted((r for r in results if r["model"] == label), key=lambda r: r["rows"])
        lines.append(f"{label}: phase CPU us/row at " + ", ".join(f"{r['rows']:,}" for r in mine))
        for name in PHASES:
            cells = []
            for r in mine:
                values = [p["chunkq"]["phases"].get(name, {}).get("cpu_us_per_row") for p in r["pairs"]]
                known = [v for v in values if v is not None]
                cells.append(f"{statistics.median(known):.1f}" if known else "-")
            lines.append(f"  {name:8s} " + " | ".join(cells))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--minilm-sizes", type=int, nargs="+", default=[10_000])
    parser.add_argument("--models", nargs="+", choices=("static", "minilm"), default=["static", "minilm"])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--run-args", default="", help="options added to chunkq run's defaults")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    args.run_args = shlex.split(args.run_args)
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="chunkq-whole-") as tmp:
        work = Path(tmp)
        models = {}
        if "static" in args.models:
            from tests.tiny_models import static_embedding

            models["static"] = (str(static_embedding(work / "static")), args.sizes)
        if "minilm" in args.models:
            models["minilm"] = (resolve_model(BUNDLED_MODEL), args.minilm_sizes)
        print(f"{os.cpu_count()} cores; chunkq run {shlex.join(args.run_args) or '(defaults)'}", flush=True)
        for label, (model, sizes) in models.items():
            for rows in sizes:
                results.append(rounds(work, model, label, rows, args))
                if args.out:
                    args.out.write_text(json.dumps({"cores": os.cpu_count(), "results": results}, indent=2))
    print("\n".join(growth(results)))
    for r in results:
        print(
            f"{r['model']} {r['rows']:,}: median "
            + ", ".join(f"{k} {v}" for k, v in r["median_ratios"].items())
        )


if __name__ == "__main__":
    main()
