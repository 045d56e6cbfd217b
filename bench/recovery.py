"""Recovery times on a real pool and supervisor: after SIGKILL of a busy worker, and after a broken
CUDA context (injected).

    python bench/recovery.py [--repeats 3]

Runs everything on this machine (embedded Valkey, CPU workers, bundled model).
SIGKILL: for each repeat it starts a pool and a supervisor on a fresh run, waits until chunk 0 is
running, SIGKILLs the worker, and measures (a) until the pool has failed the job (released),
(b) until the chunk's second attempt is queued, (c) until a worker has started it again. The
baseline printed beside it is what RQ alone would wait before it even notices: the job timeout
+ 60 s.
Broken CUDA: chunk 0's first attempt raises the illegal-memory-access error (``CHUNKQ_FAULTS``);
the worker exits for a fresh process. Measured from the worker's "CUDA context broken" log line
to the fresh worker's first job, from the pool's log, with the fork server (the default) and,
as the baseline in the same run, with ``--no-fork-server`` (each worker a fresh interpreter).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import psutil
import redis
from rq.job import Job
from rq.serializers import JSONSerializer

from chunkq.jobs.compute.model_refs import BUNDLED_MODEL
from chunkq.jobs.contract.specs import chunk_job_id
from chunkq.queue_worker.worker_args import WORKER_MODULE
from chunkq.supervisor.server.embedded_redis import EmbeddedRedis

# One chunk: after a crash the fresh worker has nothing else to take first, so the figures measure
# recovery, not the queue order of the retried chunk.
ROWS, CHUNK = 200, 200


def _cli(log: Path, env: dict[str, str], *args: str) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "chunkq.cli", *args],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def _wait(predicate: object, timeout: float) -> float:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise TimeoutError
        time.sleep(0.01)
    return time.monotonic()


def _submit(work: Path, env: dict[str, str], run_id: str) -> None:
    corpus = work / f"{run_id}.jsonl"
    corpus.write_text(
        "".join(json.dumps({"id": i, "text": f"text {run_id} {i} " * 40}) + "\n" for i in range(ROWS))
    )
    cmd = [sys.executable, "-m", "chunkq.cli", "submit", str(corpus), "--chunk-size", str(CHUNK)]
    out = subprocess.run([*cmd, "--run-id", run_id], env=env, capture_output=True, text=True, check=True)
    assert "enqueued" in out.stdout


def _one(work: Path, url: str, repeat: int) -> tuple[float, float, float]:
    store = work / f"store{repeat}"
    env = dict(os.environ, CHUNKQ_REDIS_URL=url, CHUNKQ_STORE=str(store), HF_HUB_OFFLINE="1")
    _submit(work, env, f"bench{repeat}")
    conn = redis.Redis.from_url(url)
    pool = _cli(work / "pool.log", env, "pool", "--gpus", "none")
    sup = _cli(work / "sup.log", env, "supervise", f"bench{repeat}", "--poll", "0.2")
    job_id = chunk_job_id(f"bench{repeat}", 0)

    def job() -> Job:
        return Job.fetch(job_id, connection=conn, serializer=JSONSerializer)

    try:
        _wait(lambda: job().get_status() == "started", 120)
        (worker,) = [  # forked by the fork server: a grandchild of the pool
            p
            for p in psutil.Process(pool.pid).children(recursive=True)
            if WORKER_MODULE in " ".join(p.cmdline())
        ]
        killed = time.monotonic()
        worker.send_signal(signal.SIGKILL)
        released = _wait(
            lambda: (
                job().get_status() in ("failed", "queued", "started")
                and job().meta.get("error_class") == "abandoned"
            ),
            60,
        )
        queued = _wait(lambda: job().meta.get("attempt") == 2, 60)
        running = _wait(lambda: job().meta.get("attempt") == 2 and job().get_status() == "started", 120)
        assert sup.wait(timeout=300) == 0
        return released - killed, queued - killed, running - killed
    finally:
        for proc in (sup, pool):
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)


def _log_time(line: str) -> datetime:
    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")


def _broken_cuda_one(work: Path, url: str, run_id: str, *pool_args: str) -> float:
    """Seconds from a worker's broken-CUDA exit decision to a fresh worker taking a job."""
    faults = json.dumps([{"kind": "cuda_fatal", "chunks": [0], "attempts": [1]}])
    env = dict(os.environ, CHUNKQ_REDIS_URL=url, CHUNKQ_STORE=str(work / run_id), HF_HUB_OFFLINE="1")
    env["CHUNKQ_QUEUE"] = run_id
    _submit(work, env, run_id)
    log = work / f"{run_id}-pool.log"
    pool_env = dict(env, CHUNKQ_FAULTS=faults)
    pool = _cli(log, pool_env, "pool", "--gpus", "none", "--preload", BUNDLED_MODEL, *pool_args)
    sup = _cli(work / f"{run_id}-sup.log", env, "supervise", run_id, "--poll", "0.2")
    try:
        assert sup.wait(timeout=300) == 0, (work / f"{run_id}-sup.log").read_text()[-2000:]
    finally:
        pool.send_signal(signal.SIGTERM)
        pool.wait(timeout=120)
    broken_at, broken_worker = None, None
    for line in log.read_text().splitlines():
        if broken_at is None and "CUDA context broken" in line:
            broken_at, broken_worker = _log_time(line), line.split("Worker ", 1)[1].split(":", 1)[0]
        elif broken_at is None:
            continue
        elif f": {run_id}: chunkq run" in line and f"Worker {broken_worker}:" not in line:
            return (_log_time(line) - broken_at).total_seconds()
    raise AssertionError(f"no broken-CUDA recovery in {log}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        with EmbeddedRedis(work / "redis") as server:
            results = [_one(work, server.url, r) for r in range(args.repeats)]
            forked, fresh = [], []
            for r in range(args.repeats):
                forked.append(_broken_cuda_one(work, server.url, f"cudaf{r}"))
                fresh.append(_broken_cuda_one(work, server.url, f"cudan{r}", "--no-fork-server"))
    baseline = 600 + 60  # RQ alone: job timeout (600 s default for this chunk size) + 60 s, then a cleanup()
    for name, i in (
        ("released (job failed by the pool)", 0),
        ("second attempt queued", 1),
        ("chunk running again (fresh worker)", 2),
    ):
        values = [r[i] for r in results]
        print(
            f"SIGKILL -> {name}: {_seconds(values)}; "
            f"ratio to RQ's own abandoned-job rule ({baseline} s): {statistics.median(values) / baseline:.4f}"
        )

    ratios = [f / n for f, n in zip(forked, fresh, strict=True)]
    print(
        f"broken CUDA -> a fresh worker taking a job: {_seconds(forked)}; "
        f"with --no-fork-server (fresh interpreter) {_seconds(fresh)}; ratio {statistics.median(ratios):.3f}"
    )


def _seconds(values: list[float]) -> str:
    return f"median {statistics.median(values):.2f} s (runs: {', '.join(f'{v:.2f}' for v in values)})"


if __name__ == "__main__":
    main()
