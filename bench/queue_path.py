"""The queue path without the model: no-op jobs, submit, Redis memory, the supervisor's look.

    python bench/queue_path.py [--jobs 1000] [--chunks 100000]

All against one embedded Valkey started here, in one run:
- no-op jobs (``os.getpid``) through chunkq's worker (JSON, allow-listed job class, heartbeat) and
  through a bare RQ ``SimpleWorker`` (``rq worker -w rq.worker.SimpleWorker -S json``): jobs per
  second per worker, from the jobs' own start and end times (worker start-up excluded), and the ratio;
- ``chunkq submit`` of a corpus of ``--chunks`` rows at one row per chunk: chunks per second, and
  Redis memory per queued chunk;
- one supervisor look (``Tracker.poll``) with every chunk still queued, at a tenth of the chunks
  and at all of them, nothing having changed between looks: how the cost grows with the run's size.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis
from rq import Queue
from rq.job import Job
from rq.serializers import JSONSerializer

from chunkq.jobs.contract.manifest import load_manifest
from chunkq.jobs.contract.run_files import RunLayout
from chunkq.jobs.queue.allowlist import AllowListedJob
from chunkq.queue_worker.worker_args import WORKER_MODULE
from chunkq.supervisor.server.embedded_redis import EmbeddedRedis
from chunkq.supervisor.watch.progress import Tracker


def _noop_rate(
    connection: redis.Redis, url: str, queue: str, jobs: int, cmd: list[str], env: dict[str, str]
) -> float:
    q = Queue(queue, connection=connection, serializer=JSONSerializer, job_class=AllowListedJob)
    ids = [q.enqueue("os.getpid", job_timeout=60).id for _ in range(jobs)]
    subprocess.run(cmd, check=True, capture_output=True, env=dict(os.environ, CHUNKQ_REDIS_URL=url, **env))
    done = [j for j in Job.fetch_many(ids, connection, serializer=JSONSerializer) if j is not None]
    assert all(j.get_status() == "finished" for j in done) and len(done) == jobs, (
        "not every no-op job finished"
    )
    span = max(j.ended_at for j in done) - min(j.started_at for j in done)  # type: ignore[type-var,operator]
    return jobs / span.total_seconds()


def _submit(work: Path, url: str, chunks: int, run_id: str) -> float:
    corpus = work / f"{run_id}.jsonl"
    with open(corpus, "w", encoding="utf-8") as fh:
        for i in range(chunks):
            fh.write(json.dumps({"id": i, "text": f"text number {i}"}) + "\n")
    cmd = [sys.executable, "-m", "chunkq.cli", "--log-level", "WARNING", "submit", str(corpus)]
    cmd += ["--store", str(work / "store"), "--chunk-size", "1", "--run-id", run_id, "--queue", run_id]
    started = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, env=dict(os.environ, CHUNKQ_REDIS_URL=url))
    return time.perf_counter() - started


def _look_seconds(
    connection: redis.Redis, store: Path, run_id: str, repeats: int = 5
) -> tuple[float, float, float]:
    """(first look, which is a full reconcile; median later look; seconds until the next reconcile)."""
    layout = RunLayout(store, run_id)
    tracker = Tracker(connection, layout, load_manifest(layout))
    started = time.perf_counter()
    tracker.poll()
    full = time.perf_counter() - started
    interval = tracker._next_full - time.monotonic()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        tracker.poll()
        times.append(time.perf_counter() - started)
    assert tracker.full_looks == 1, "a later look reconciled in full: the bench measured the wrong thing"
    return full, statistics.median(times), interval


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--chunks", type=int, default=100_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, EmbeddedRedis(Path(tmp) / "redis") as server:
        work = Path(tmp)
        connection = redis.Redis.from_url(server.url)
        chunkq_worker = [
            sys.executable,
            "-m",
            WORKER_MODULE,
            "--queue",
            "noop-chunkq",
            "--burst",
        ]
        chunkq_worker += ["--store", str(work / "store"), "--log-level", "WARNING"]
        bare_worker = [str(Path(sys.executable).parent / "rq"), "worker", "-w", "rq.worker.SimpleWorker"]
        bare_worker += [
            "-S",
            "rq.serializers.JSONSerializer",
            "--burst",
            "-q",
            "--url",
            server.url,
            "noop-bare",
        ]
        chunkq_rate = _noop_rate(
            connection,
            server.url,
            "noop-chunkq",
            args.jobs,
            chunkq_worker,
            {"CHUNKQ_ALLOWED_JOBS": "os.getpid", "CHUNKQ_DEVICE": "cpu"},
        )
        bare_rate = _noop_rate(connection, server.url, "noop-bare", args.jobs, bare_worker, {})
        print(
            f"no-op jobs ({args.jobs}): chunkq worker {chunkq_rate:.0f} jobs/s, bare RQ SimpleWorker "
            f"{bare_rate:.0f} jobs/s, ratio {chunkq_rate / bare_rate:.2f}"
        )

        small = max(1, args.chunks // 10)
        memory_before = int(connection.info("memory")["used_memory"])
        small_seconds = _submit(work, server.url, small, "small")
        seconds = _submit(work, server.url, args.chunks, "large")
        memory_after = int(connection.info("memory")["used_memory"])
        per_chunk = (memory_after - memory_before) / (small + args.chunks)
        print(
            f"submit: {small} chunks in {small_seconds:.1f} s ({small / small_seconds:.0f} chunks/s), "
            f"{args.chunks} chunks in {seconds:.1f} s ({args.chunks / seconds:.0f} chunks/s); "
            f"Redis memory {per_chunk:.0f} bytes per queued chunk"
        )

        small_full, small_look, _ = _look_seconds(connection, work / "store", "small")
        large_full, large_look, interval = _look_seconds(connection, work / "store", "large")
        print(
            f"supervisor look with every chunk queued, nothing changed: {small} chunks "
            f"{small_look * 1000:.1f} ms, {args.chunks} chunks {large_look * 1000:.1f} ms "
            f"(ratio {large_look / small_look:.1f} for {args.chunks / small:.0f}x the chunks)"
        )
        print(
            f"full reconcile: {small} chunks {small_full * 1000:.0f} ms, {args.chunks} chunks "
            f"{large_full * 1000:.0f} ms, repeated every {interval:.0f} s at that size "
            f"({large_full / (interval + large_full):.1%} of the supervisor's time)"
        )


if __name__ == "__main__":
    main()
