"""Time from SIGKILL of a busy worker to its chunk running again, on a real pool and supervisor.

    python bench/recovery.py [--repeats 3]

Runs everything on this machine (embedded Valkey, CPU workers, bundled model). For each repeat it
starts a pool and a supervisor on a fresh run, waits until chunk 0 is running, SIGKILLs the
worker, and measures (a) until the pool has failed the job (released), (b) until the chunk's second
attempt is queued, (c) until a worker has started it again. The baseline printed beside it is what
RQ alone would wait before it even notices: the job timeout + 60 s.
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
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import psutil
import redis
from rq.job import Job
from rq.serializers import JSONSerializer

from jobs.specs import chunk_job_id
from supervisor.embedded_redis import EmbeddedRedis

ROWS, CHUNK = 400, 200


def _cli(log: Path, env: dict[str, str], *args: str) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "supervisor.cli", *args], env=env, stdout=out, stderr=subprocess.STDOUT
        )


def _wait(predicate: object, timeout: float) -> float:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise TimeoutError
        time.sleep(0.01)
    return time.monotonic()


def _one(work: Path, url: str, repeat: int) -> tuple[float, float, float]:
    corpus = work / f"c{repeat}.jsonl"
    corpus.write_text(
        "".join(json.dumps({"id": i, "text": f"text {repeat} {i} " * 40}) + "\n" for i in range(ROWS))
    )
    store = work / f"store{repeat}"
    env = dict(os.environ, CHUNKQ_REDIS_URL=url, CHUNKQ_STORE=str(store), HF_HUB_OFFLINE="1")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "supervisor.cli",
            "submit",
            str(corpus),
            "--chunk-size",
            str(CHUNK),
            "--run-id",
            f"bench{repeat}",
        ],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert "enqueued" in out.stdout
    conn = redis.Redis.from_url(url)
    pool = _cli(work / "pool.log", env, "pool", "--gpus", "none")
    sup = _cli(work / "sup.log", env, "supervise", f"bench{repeat}", "--poll", "0.2")
    job_id = chunk_job_id(f"bench{repeat}", 0)

    def job() -> Job:
        return Job.fetch(job_id, connection=conn, serializer=JSONSerializer)

    try:
        _wait(lambda: job().get_status() == "started", 120)
        (worker,) = [
            p for p in psutil.Process(pool.pid).children() if "queue_worker.worker" in " ".join(p.cmdline())
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        with EmbeddedRedis(work / "redis") as server:
            results = [_one(work, server.url, r) for r in range(args.repeats)]
    baseline = 600 + 60  # RQ alone: job timeout (600 s default for this chunk size) + 60 s, then a cleanup()
    for name, i in (
        ("released (job failed by the pool)", 0),
        ("second attempt queued", 1),
        ("chunk running again (fresh worker)", 2),
    ):
        values = [r[i] for r in results]
        print(
            f"SIGKILL -> {name}: median {statistics.median(values):.2f} s "
            f"(runs: {', '.join(f'{v:.2f}' for v in values)}); "
            f"ratio to RQ's own abandoned-job rule ({baseline} s): {statistics.median(values) / baseline:.4f}"
        )


if __name__ == "__main__":
    main()
