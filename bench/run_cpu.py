"""A small run's own cost: the CPU of a minimal ``chunkq run`` (50 texts, the CPU, a new store) against
a plain sentence-transformers script doing the same, as whole processes, paired.

    python bench/run_cpu.py [--repeats 5] [--texts 50] [--out FILE]

Each round runs both, in an order that turns each round. A command's CPU is the user and system time
of every process it started and waited for (``RUSAGE_CHILDREN`` before and after it: the CLI, Redis,
the pool, its fork server and workers, each reaped by its parent). Beside it, the run's CPU by process,
read by polling the process tree with psutil every 20 ms (a process's last 20 ms can be missed, so
these may sum a little under the whole). Goal (issue 55.3): chunkq / plain <= 1.0.

A third party, ``chunkq, warm``: the same run on a host that keeps a standing fork server
(``chunkq serve-forks``, started once before the rounds; its start is reported, not counted per
run). Its workers are the server's children, so their CPU is read from the server's own counters
(its children's times, its own forking) before and after each run, and added to the command's.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from chunkq.jobs.compute.model_refs import BUNDLED_MODEL, resolve_model
from chunkq.jobs.contract.settings import env_of

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
SOCKET_ENV = env_of("fork_server_socket")
WARM = "warm fork server (its workers)"
KINDS = (
    ("fork server", "queue_worker.processes.fork_server"),
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


def _server_cpu(server: psutil.Process | None) -> float:
    """A standing fork server's CPU with its reaped children's (the workers it forked)."""
    if server is None:
        return 0.0
    t = server.cpu_times()
    return t.user + t.system + t.children_user + t.children_system


def _measured(
    cmd: list[str], cwd: Path, env: dict[str, str], server: psutil.Process | None = None
) -> tuple[float, float, dict[str, float]]:
    """(CPU seconds of the whole tree, wall seconds, CPU by kind of process); with ``server``, the
    workers that standing fork server forked meanwhile are counted too."""
    before, started, served = _children_cpu(), time.perf_counter(), _server_cpu(server)
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
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
    if server is not None:
        by_kind[WARM] = _server_cpu(server) - served
        whole += by_kind[WARM]
    return whole, wall, by_kind


def _standing_server(path: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """``chunkq serve-forks PATH --preload`` the bundled model, returned once it serves."""
    proc = subprocess.Popen(
        [CHUNKQ, "serve-forks", str(path), "--preload", BUNDLED_MODEL], env=env, stdout=subprocess.PIPE
    )
    assert proc.stdout is not None
    if b"serving at" not in proc.stdout.readline():
        proc.kill()
        raise SystemExit("chunkq serve-forks did not start")
    return proc


def _round(
    r: int, work: Path, corpus: Path, cold: dict[str, str], warm: dict[str, str], server: psutil.Process
) -> dict[str, Any]:
    """One round: the three parties in an order that turns each round."""
    parties = [
        ("chunkq", [CHUNKQ, "run", str(corpus), "--store", str(work / f"store-{r}")], cold, None),
        ("chunkq, warm", [CHUNKQ, "run", str(corpus), "--store", str(work / f"warm-{r}")], warm, server),
        (
            "plain",
            [sys.executable, "-c", PLAIN, str(corpus), str(work / f"plain-{r}.npy"), MODEL],
            cold,
            None,
        ),
    ]
    measured: dict[str, Any] = {}
    for name, cmd, env, standing in parties[r % 3 :] + parties[: r % 3]:
        if name != "plain":
            cmd = [*cmd, "--log-level", "WARNING"]
        whole, wall, by_kind = _measured(cmd, work, env, standing)
        measured[name] = {"cpu_s": whole, "wall_s": wall, "by_process": by_kind}
    plain = measured["plain"]["cpu_s"]
    print(
        f"round {r + 1}: plain {plain:.2f} s CPU; "
        + "; ".join(
            f"{name} {measured[name]['cpu_s']:.2f} s, {measured[name]['cpu_s'] / plain:.3f}x ("
            + ", ".join(f"{k} {v:.2f}" for k, v in sorted(measured[name]["by_process"].items()))
            + ")"
            for name in ("chunkq", "chunkq, warm")
        ),
        flush=True,
    )
    return measured


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
        cold = {k: v for k, v in os.environ.items() if k != SOCKET_ENV}
        warm = dict(cold, **{SOCKET_ENV: str(work / "forks.sock")})
        server = _standing_server(work / "forks.sock", cold)
        serving = psutil.Process(server.pid)
        started_cpu = _server_cpu(serving)
        print(f"the standing fork server's start: {started_cpu:.2f} s CPU (once, not counted per run)")
        try:
            for r in range(args.repeats):
                rounds.append(_round(r, work, corpus, cold, warm, serving))
        finally:
            server.terminate()
            server.wait(30)
    summary: dict[str, Any] = {"standing_server_start_cpu_s": started_cpu}
    for party in ("chunkq", "chunkq, warm"):
        kinds = sorted({k for r in rounds for k in r[party]["by_process"]})
        summary[party] = {
            "cpu_s": statistics.median(r[party]["cpu_s"] for r in rounds),
            "ratio": statistics.median(r[party]["cpu_s"] / r["plain"]["cpu_s"] for r in rounds),
            "by_process": {
                k: statistics.median(r[party]["by_process"].get(k, 0.0) for r in rounds) for k in kinds
            },
        }
    summary["plain_cpu_s"] = statistics.median(r["plain"]["cpu_s"] for r in rounds)
    print(json.dumps(summary, indent=2))
    if args.out is not None:  # not by default: a bench run from the checkout wrote into the tree
        args.out.write_text(json.dumps({"summary": summary, "rounds": rounds}, indent=2))


if __name__ == "__main__":
    main()
