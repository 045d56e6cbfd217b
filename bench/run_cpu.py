"""A small run's own cost: the CPU of a minimal ``chunkq run`` (50 texts, the CPU, a new store) against
a plain sentence-transformers script doing the same, as whole processes, paired.

    python bench/run_cpu.py [--repeats 5] [--texts 50] [--out FILE]

Each round runs both, in an order that turns each round. A command's CPU is the user and system time
of every process it started and waited for (``RUSAGE_CHILDREN`` before and after it: the CLI, Redis,
the pool, its fork server and workers, each reaped by its parent). Beside it, the run's CPU by process,
read by polling the process tree with psutil every 20 ms (a process's last 20 ms can be missed, so
these may sum a little under the whole). Goal (issue 55.3): chunkq / plain <= 1.0.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from chunkq.jobs.compute.models import BUNDLED_MODEL, resolve_model

CHUNKQ = str(Path(sys.executable).parent / "chunkq")
MODEL = str(resolve_model(BUNDLED_MODEL))  # the folder: the plain script imports nothing of chunkq
PLAIN = """
import json, sys
import numpy as np
from sentence_transformers import SentenceTransformer
texts = [json.loads(line)["text"] for line in open(sys.argv[1])]
model = SentenceTransformer(sys.argv[3], device="cpu")
np.save(sys.argv[2], model.encode(texts))
"""
KINDS = (
    ("fork server", "queue_worker.fork_server"),
    ("worker", "queue_worker.worker"),
    ("pool", "chunkq.queue_worker"),
    ("redis", "valkey-server"),
    ("cuda question", "cuda_devices"),
)


def _kind(cmdline: list[str]) -> str:
    text = " ".join(cmdline)
    return next((name for name, mark in KINDS if mark in text), "command (CLI, supervisor)")


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _measured(cmd: list[str], cwd: Path) -> tuple[float, float, dict[str, float]]:
    """(CPU seconds of the whole tree, wall seconds, CPU by kind of process)."""
    before, started = _children_cpu(), time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    root = psutil.Process(proc.pid)
    seen: dict[int, tuple[str, float]] = {}
    while proc.poll() is None:
        try:
            tree = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            break
        for p in tree:
            try:
                with p.oneshot():
                    cpu = p.cpu_times()
                    # Named once, while it has a command line (an exiting process's is empty).
                    kind = seen[p.pid][0] if p.pid in seen else _kind(p.cmdline())
                    seen[p.pid] = (kind, cpu.user + cpu.system)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                pass
        time.sleep(0.02)
    _, err = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)[:100]} failed: {err.decode(errors='replace')[-2000:]}")
    wall, whole = time.perf_counter() - started, _children_cpu() - before
    by_kind: dict[str, float] = {}
    for kind, cpu in seen.values():
        by_kind[kind] = by_kind.get(kind, 0.0) + cpu
    return whole, wall, by_kind


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--texts", type=int, default=50)
    parser.add_argument("--out", type=Path, default=None, help="also write every round as JSON here")
    args = parser.parse_args()
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        corpus = work / "c.jsonl"
        with corpus.open("w") as fh:
            for i in range(args.texts):
                fh.write(
                    json.dumps({"id": f"t{i}", "text": f"a short text, number {i}, about queues"}) + "\n"
                )
        for r in range(args.repeats):
            store = work / f"store-{r}"
            run = [CHUNKQ, "run", str(corpus), "--store", str(store), "--log-level", "WARNING"]
            plain = [sys.executable, "-c", PLAIN, str(corpus), str(work / f"plain-{r}.npy"), MODEL]
            order = [("chunkq", run), ("plain", plain)]
            measured: dict[str, Any] = {}
            for name, cmd in order if r % 2 == 0 else order[::-1]:
                whole, wall, by_kind = _measured(cmd, work)
                measured[name] = {"cpu_s": whole, "wall_s": wall, "by_process": by_kind}
            measured["ratio"] = measured["chunkq"]["cpu_s"] / measured["plain"]["cpu_s"]
            rounds.append(measured)
            print(
                f"round {r + 1}: chunkq {measured['chunkq']['cpu_s']:.2f} s CPU, plain "
                f"{measured['plain']['cpu_s']:.2f} s: {measured['ratio']:.3f}x  "
                + ", ".join(f"{k} {v:.2f}" for k, v in sorted(measured["chunkq"]["by_process"].items())),
                flush=True,
            )
    kinds = sorted({k for r in rounds for k in r["chunkq"]["by_process"]})
    summary = {
        "chunkq_cpu_s": statistics.median(r["chunkq"]["cpu_s"] for r in rounds),
        "plain_cpu_s": statistics.median(r["plain"]["cpu_s"] for r in rounds),
        "ratio": statistics.median(r["ratio"] for r in rounds),
        "by_process": {
            k: statistics.median(r["chunkq"]["by_process"].get(k, 0.0) for r in rounds) for k in kinds
        },
    }
    print(json.dumps(summary, indent=2))
    if args.out is not None:  # not by default: a bench run from the checkout wrote into the tree
        args.out.write_text(json.dumps({"summary": summary, "rounds": rounds}, indent=2))


if __name__ == "__main__":
    main()
