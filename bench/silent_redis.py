"""How long ``chunkq run`` takes to stop (SIGTERM) while its Redis answers nothing, against the same
stop with Redis answering, measured in the same session; and whether the chunk in hand was kept.

    python bench/silent_redis.py [--repeats 2] [--out silent_redis.json]

Each case starts ``chunkq run`` over 60 texts in chunks of 20 whose chunk 0 takes 15 s longer on its
first attempt (``CHUNKQ_FAULTS``'s ``slow``). Once that chunk has started it waits a second, stops
the embedded Redis with SIGSTOP (a paused server keeps its connections open: nothing fails, nothing
answers, as behind a network partition), waits the case's silence, sends the run SIGTERM (a drain:
the chunk in hand is finished) and times it until it exits (at most 300 s, then everything is
killed). "kept" is whether chunk 0's output reached the store.
Before the eighteenth session a worker's progress report and RQ's note of the stop each waited on
the silent server for RQ's 415 s: the run ended 165 s after its SIGTERM, the chunk lost.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import psutil
from resume import corpus_file, run_command  # bench/, the script's folder, is on the path

ROOT = Path(__file__).resolve().parents[1]
SLOW_SECONDS = 15.0
SLOW = json.dumps([{"kind": "slow", "chunks": [0], "attempts": [1], "seconds": SLOW_SECONDS}])
LIMIT_SECONDS = 300.0
# (name, seconds after chunk 0 started at which Redis goes silent (None: it keeps answering), seconds
# of silence before the SIGTERM)
CASES = [
    ("Redis answering", None, 0.0),
    ("silent 1 s into the chunk, SIGTERM then", 1.0, 0.0),
    ("silent 1 s into the chunk, SIGTERM 30 s later", 1.0, 30.0),
]


def _wait_for(
    predicate: Callable[[], bool], seconds: float, proc: subprocess.Popen[bytes], log: Path
) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            raise SystemExit(f"chunk 0 never started: {log.read_text(errors='replace')[-2000:]}")
        time.sleep(0.05)


def _one(
    tmp: Path, corpus: Path, env: dict[str, str], after: float | None, silence: float
) -> tuple[float, bool]:
    """Seconds from SIGTERM to the run's exit, and whether chunk 0's output reached the store."""
    store = tmp / f"store-{time.monotonic_ns()}"
    log = tmp / "run.log"
    cmd = run_command(corpus, store, chunk_size=20)
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env={**env, "CHUNKQ_FAULTS": SLOW}, stdout=out, stderr=subprocess.STDOUT)
    _wait_for(lambda: "FAULT slow" in log.read_text(errors="replace"), 300, proc, log)
    family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    server = next(p for p in family if "valkey" in p.name() or "redis" in p.name())
    try:
        if after is not None:
            time.sleep(after)
            server.suspend()
            time.sleep(silence)
        asked = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=LIMIT_SECONDS)
        except subprocess.TimeoutExpired:
            pass
        took = time.monotonic() - asked
    finally:
        for member in family:  # as it was once chunk 0 ran: the run, its server, pool and workers
            try:
                member.resume()
                member.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(family, timeout=60)
    kept = any(store.glob("runs/*/outputs/000000.npy"))
    return took, kept


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    samples: dict[str, list[tuple[float, bool]]] = {name: [] for name, _, _ in CASES}
    loads = []
    with tempfile.TemporaryDirectory(prefix="chunkq-silent-") as tmp:
        corpus = corpus_file(Path(tmp) / "corpus.jsonl", 60)
        for _ in range(args.repeats):
            for name, after, silence in CASES:
                samples[name].append(_one(Path(tmp), corpus, env, after, silence))
            loads.append(os.getloadavg()[0])
    answering = statistics.median(s for s, _ in samples["Redis answering"])
    print(
        f"{args.repeats} repeats, load {min(loads):.2f}-{max(loads):.2f}; "
        f"SIGTERM to exit, limit {LIMIT_SECONDS:.0f} s"
    )
    print("| case | median s | samples | chunk 0 kept | against Redis answering |\n|---|---|---|---|---|")
    for name, runs in samples.items():
        median = statistics.median(s for s, _ in runs)
        shown = ", ".join(f"{s:.1f}" for s, _ in runs)
        kept = f"{sum(k for _, k in runs)}/{len(runs)}"
        print(f"| {name} | {median:.1f} | {shown} | {kept} | {median / answering:.2f}x |")
    if args.out:
        args.out.write_text(json.dumps({"samples": samples, "loads": loads}, indent=2) + "\n")


if __name__ == "__main__":
    main()
