"""The worker process: an RQ SimpleWorker that keeps the model loaded, runs at most N chunks, exits.

Run as ``python -m queue_worker.worker`` by the pool, with the Redis URL in ``CHUNKQ_REDIS_URL``
(never on the command line, where ``ps`` would show its password) and the device pinned through
``CUDA_VISIBLE_DEVICES`` before torch is imported.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
from types import FrameType
from typing import Any

import redis
from rq.serializers import JSONSerializer
from rq.worker import SimpleWorker

from jobs import models, runtime
from jobs.allowlist import AllowListedJob
from jobs.errors import ConfigError
from queue_worker.exit_codes import (
    EXIT_CONFIG,
    EXIT_ERROR,
    EXIT_MAX_JOBS,
    EXIT_ORPHANED,
    EXIT_REDIS,
    EXIT_STOPPED,
)

log = logging.getLogger(__name__)

DEFAULT_QUEUE = "chunkq"


class ChunkWorker(SimpleWorker):
    """SimpleWorker (no fork: the model stays loaded) that counts jobs and honours a second signal."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.jobs_run = 0
        self.stop_signalled = False

    def execute_job(self, job: Any, queue: Any) -> None:
        self.jobs_run += 1
        super().execute_job(job, queue)

    def request_stop(self, signum: int, frame: FrameType | None) -> None:
        self.stop_signalled = True
        super().request_stop(signum, frame)  # type: ignore[no-untyped-call]

    def request_force_stop(self, signum: int, frame: FrameType | None) -> None:
        # RQ ignores a second signal within a second of the first because a terminal's Ctrl+C can
        # reach a worker twice. Ours run in their own session and only the pool signals them, so
        # a second signal is always a deliberate "stop now".
        self.log.warning("Worker %s: second signal, stopping now", self.name)
        raise SystemExit(EXIT_STOPPED)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m queue_worker.worker")
    parser.add_argument("--queue", default=DEFAULT_QUEUE)
    parser.add_argument("--max-jobs", type=int, default=None)
    parser.add_argument("--name", default=None)
    parser.add_argument("--preload", default=None, help="model reference to load before the first job")
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--burst", action="store_true", help="exit once the queue is empty")
    return parser.parse_args(argv)


def _context(name: str) -> runtime.WorkerContext:
    device = os.environ.get("CHUNKQ_DEVICE", "cpu")
    return runtime.WorkerContext(
        name=name, host=socket.gethostname(), pid=os.getpid(), device=device, gpu=os.environ.get("CHUNKQ_GPU")
    )


def _check_device(ctx: runtime.WorkerContext) -> None:
    """A worker given a GPU never falls back to the CPU: it fails loudly instead."""
    if ctx.device == "cpu":
        return
    import torch

    if not torch.cuda.is_available():
        raise ConfigError(
            f"worker {ctx.name} was given GPU {ctx.gpu} but torch sees no CUDA device "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); refusing to run on the CPU"
        )


def _exit_code(worker: ChunkWorker, max_jobs: int | None, connection: redis.Redis) -> int:
    if max_jobs is not None and worker.jobs_run >= max_jobs:
        return EXIT_MAX_JOBS
    if worker.stop_signalled:
        return EXIT_STOPPED
    try:
        connection.ping()
    except redis.RedisError:
        return EXIT_REDIS
    return EXIT_ERROR


class _EarlyStop:
    """Until RQ installs its handlers, a stop signal only sets a flag checked after start-up."""

    def __init__(self) -> None:
        self.requested = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True


def main(argv: list[str] | None = None) -> int:
    early_stop = _EarlyStop()
    args = _parse(argv)
    name = args.name or f"cq-{socket.gethostname()}-{os.getpid()}"
    ctx = _context(name)
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s %(levelname)s [{name} gpu={ctx.gpu or '-'}] %(name)s: %(message)s",
        stream=sys.stderr,
    )
    pool_pid = os.environ.get("CHUNKQ_POOL_PID")
    if pool_pid and os.getppid() != int(pool_pid):
        log.error("pool %s is gone before this worker started; exiting", pool_pid)
        return EXIT_ORPHANED
    url = os.environ.get("CHUNKQ_REDIS_URL")
    if not url:
        log.error("CHUNKQ_REDIS_URL is not set")
        return EXIT_CONFIG
    try:
        _check_device(ctx)
        runtime.set_context(ctx)
        connection = redis.Redis.from_url(url)
        connection.ping()
        if args.preload:
            models.get_model(args.preload, ctx.device, args.precision)
    except ConfigError as exc:
        log.error("%s", exc)
        return EXIT_CONFIG
    except redis.RedisError as exc:
        log.error("cannot reach Redis: %s", exc)
        return EXIT_REDIS

    if early_stop.requested:
        log.info("worker %s: stop requested during start-up; exiting before taking a job", name)
        return EXIT_STOPPED
    worker = ChunkWorker(
        [args.queue], connection=connection, name=name, serializer=JSONSerializer, job_class=AllowListedJob
    )
    worker.work(burst=args.burst, max_jobs=args.max_jobs, logging_level=args.log_level.upper())
    code = (
        EXIT_STOPPED
        if args.burst and not worker.stop_signalled
        else _exit_code(worker, args.max_jobs, connection)
    )
    log.info("worker %s exiting after %d job(s) with code %d", name, worker.jobs_run, code)
    return code


if __name__ == "__main__":
    sys.exit(main())
