"""The worker process's start: its flags, its device and context, its log lines, then one
``ChunkWorker`` (``chunk_worker.py``) until it ends, and the named exit code that says why.

Run as ``python -m chunkq.queue_worker.worker`` by the pool, with the Redis URL in ``CHUNKQ_REDIS_URL``
(never on the command line, where ``ps`` would show its password) and the device pinned through
``CUDA_VISIBLE_DEVICES`` before torch is imported.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import signal
import socket
import sys
import time
import traceback
from dataclasses import replace
from types import FrameType
from typing import Any

import redis

from chunkq.jobs import kinds
from chunkq.jobs.compute import cuda, model_refs, models, runtime
from chunkq.jobs.compute.model_info import describe
from chunkq.jobs.compute.model_reads import no_working_directory_imports
from chunkq.jobs.contract import environment
from chunkq.jobs.contract.defaults import DEFAULT_KIND, DEFAULT_STORE
from chunkq.jobs.contract.errors import CUDA_FATAL, ConfigError, classify, first_line
from chunkq.jobs.contract.process_clock import process_started_at
from chunkq.jobs.contract.redaction import guard_process
from chunkq.jobs.contract.settings import env_of, truthy
from chunkq.jobs.contract.specs import EncodeOptions
from chunkq.jobs.contract.storage import open_store
from chunkq.jobs.contract.units import parse_size, size_text
from chunkq.jobs.drills import faults
from chunkq.jobs.embed import warm_up
from chunkq.jobs.queue.allowlist import AllowListedJob
from chunkq.jobs.queue.nopickle import forbid_pickle
from chunkq.jobs.queue.redis_clients import connect
from chunkq.jobs.queue.rq_api import JSONSerializer, StopRequested
from chunkq.queue_worker.chunk_worker import (
    ENDING_CODES,
    ChunkWorker,
)
from chunkq.queue_worker.devices import utilisation
from chunkq.queue_worker.exit_codes import (
    EXIT_CONFIG,
    EXIT_CUDA_FATAL,
    EXIT_ERROR,
    EXIT_MAX_JOBS,
    EXIT_NO_CONTEXT,
    EXIT_ORPHANED,
    EXIT_REDIS,
    EXIT_STOPPED,
)
from chunkq.queue_worker.processes.lifeline import PARENT_PID_ENV, STOP_SIGNALS
from chunkq.queue_worker.processes.standby import announce_model_loaded, wait_for_predecessor
from chunkq.queue_worker.worker_args import WORKER_MODULE, add_worker_arguments

log = logging.getLogger(__name__)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=f"python -m {WORKER_MODULE}")
    parser.add_argument("--name", default=None)
    parser.add_argument("--burst", action="store_true", help="exit once the queue is empty")
    add_worker_arguments(parser)  # queue, max jobs, recycle-after, preload, precision, store, models...
    args = parser.parse_args(argv)
    # Started by hand rather than by a pool: the store and models from the environment, like the CLI.
    args.store = args.store or os.environ.get(env_of("store"), DEFAULT_STORE)
    args.allowed_models += [m for m in os.environ.get(env_of("allowed_models"), "").split(",") if m]
    args.trust_remote_code = args.trust_remote_code or truthy(os.environ.get(env_of("trust_remote_code")))
    return args


def _limit_gpu_memory(ctx: runtime.WorkerContext, limit_text: str | None) -> None:
    limit = parse_size(limit_text or "0")
    share = cuda.limit_memory(ctx.device, limit)
    if share is not None:
        log.info("at most %s of GPU %s's memory (%.1f %%)", size_text(limit), ctx.gpu, 100 * share)


def _context(name: str, args: argparse.Namespace) -> runtime.WorkerContext:
    """Who this worker is; a GPU worker never falls back to the CPU: it fails loudly instead."""
    device = os.environ.get(runtime.DEVICE_ENV, "cpu")
    gpu = os.environ.get(runtime.GPU_ENV)
    kind = "cpu"
    if device != "cpu":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(
                f"worker {name} was given GPU {gpu} but torch sees no CUDA device (CUDA_VISIBLE_DEVICES="
                f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}); refusing to run on the CPU"
            )
        device, kind = "cuda:0", torch.cuda.get_device_name(0)  # the one GPU left visible
    named = [*args.allowed_models, *([args.preload] if args.preload else [])]
    allowed = {model_refs.BUNDLED_MODEL, *(model_refs.canonical_model(m) for m in named)}
    return runtime.WorkerContext(
        name=name,
        host=socket.gethostname(),
        pid=os.getpid(),
        device=device,
        gpu=gpu,
        device_kind=kind,
        store=str(open_store(args.store)),
        models=frozenset(allowed),
        remote_code=bool(args.trust_remote_code),
        pool_started_at=_float_env(runtime.POOL_STARTED_ENV),
        pool_for_run=os.environ.get(runtime.POOL_FOR_RUN_ENV) or None,
        process_started_at=process_started_at(),
        utilisation=utilisation.reader(gpu) if device != "cpu" else None,
    )


def _float_env(name: str) -> float | None:
    try:
        return float(os.environ[name])
    except (KeyError, ValueError):
        return None


def _exit_code(worker: ChunkWorker, max_jobs: int | None, connection: redis.Redis) -> int:
    if worker.ending:
        return ENDING_CODES[worker.ending]
    if worker.recycled or (max_jobs is not None and worker.jobs_run >= max_jobs):
        return EXIT_MAX_JOBS
    if worker.stop_signalled:
        return EXIT_STOPPED
    try:
        connection.ping()
    except redis.RedisError:
        return EXIT_REDIS
    return EXIT_ERROR


class _PreloadFailed(Exception):
    """The model the pool named would not load: said in one line its pool passes on (a worker's
    traceback alone left the run's last line at "no device left to run workers on")."""

    def __init__(self, cause: Exception) -> None:
        super().__init__(str(cause))
        self.cause = cause


def _preload(ctx: Any, model: str, precision: str) -> Any:
    """``ctx`` with the model loaded and warmed up on its device; _PreloadFailed if it cannot be."""
    kind = describe(model).kind
    kind = kind if kind in kinds.KINDS else DEFAULT_KIND  # a run of it is refused at submit
    try:
        loaded = models.get_model(model, ctx.device, precision, EncodeOptions(kind=kind))
        announce_model_loaded(loaded.load_seconds)
        lengths, seconds = warm_up(loaded, ctx.device, kind)
    except (ConfigError, redis.RedisError):
        raise
    except Exception as exc:  # whatever transformers or the model's code raised: one line, then exit
        raise _PreloadFailed(exc) from exc
    log.info("warm-up encode at %s tokens on %s in %.2f s", lengths, ctx.device, seconds)
    return replace(ctx, warm_up_seconds=seconds)


class _EarlyStop:
    """Until RQ installs its handlers, a stop signal only sets a flag checked after start-up."""

    def __init__(self) -> None:
        self.requested = False
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._on_signal)
        # A forked worker starts with them held (lifeline.STOP_SIGNALS): one sent since arrives now.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True


_TRACEBACK = "\nTraceback (most recent call last):"


_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit|Warning)?: ")


class OneLineErrors(logging.Formatter):
    """A job's traceback as its last line. RQ logs a failed job's whole traceback in the message;
    it is kept in the job's record (``chunkq status``, the dashboard), so the log that reaches a
    user's terminal says what failed in one line. ``--log-level DEBUG`` keeps tracebacks whole."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        head, found, rest = text.partition(_TRACEBACK)
        if not found:
            return text
        lines = rest.strip().splitlines()
        # The exception's own line ("module.Class: message"), not the last line of a message that
        # runs on (torch's CUDA errors end in four lines of advice).
        named = [line for line in lines if _EXCEPTION_LINE.match(line)]
        last = named[-1] if named else (lines[-1] if lines else "")
        return f"{head} {last} (the traceback is in the job's record)"

    def formatException(self, ei: Any) -> str:
        return "".join(traceback.format_exception_only(ei[1])).strip()


class OneLineHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """A log line that cannot be written costs one line on stderr, not logging's traceback dump
    (whose call stack through the CLI reads like chunkq crashing)."""

    def handleError(self, record: logging.LogRecord) -> None:
        exc = sys.exc_info()[1]
        if isinstance(exc, StopRequested):
            # RQ's stop, raised by its signal handler while a line was being written: kept here, the
            # worker would wait for work after it was told to stop (seen: a pool's drain waiting on a
            # worker signalled as it logged "cleaning registries").
            raise exc
        with contextlib.suppress(Exception):
            why = f"{type(exc).__name__}: {exc}"
            sys.stderr.write(f"chunkq: a worker log line was lost ({why}): {record.msg}\n")


def _lost_redis(worker: ChunkWorker, exc: redis.RedisError) -> int:
    """The exit code of a worker whose Redis went away."""
    if worker.stop_signalled and not worker.in_job and not worker.ending:
        # What the wait cutter concludes too, had its thread been first: asked to stop with no chunk
        # in hand, a Redis that is gone is no failure (a job it moved meanwhile is one the supervisor
        # finds lost and queues again). Seen under load: the main thread first.
        log.warning("Worker %s: stopping as asked; Redis cannot be reached (%s)", worker.name, exc)
        return EXIT_STOPPED
    log.error("worker %s lost Redis: %s", worker.name, exc)
    return ENDING_CODES[worker.ending] if worker.ending else EXIT_REDIS


def _parent_and_redis() -> tuple[str, int | None]:
    """The Redis URL, and an exit code where the worker cannot start (its parent gone, no URL)."""
    parent = os.environ.get(PARENT_PID_ENV)
    if parent and os.getppid() != int(parent):
        log.error("parent %s (the pool or its fork server) is gone before this worker started", parent)
        return "", EXIT_ORPHANED
    url = os.environ.get(env_of("redis_url"))
    if not url:
        log.error("%s is not set", env_of("redis_url"))
        return "", EXIT_CONFIG
    return url, None


def main(argv: list[str] | None = None) -> int:
    early_stop = _EarlyStop()
    guard_process()  # its Redis URL is in its environment: never in a line it writes
    no_working_directory_imports()  # a model's code imports nothing from where the pool was started
    forbid_pickle()
    args = _parse(argv)
    name = args.name or f"cq-{socket.gethostname()}-{os.getpid()}"
    where = f"{name} gpu={os.environ.get(environment.GPU, '-')}"
    handler = OneLineHandler(sys.stderr)
    line_format = f"%(asctime)s %(levelname)s [{where}] %(name)s: %(message)s"
    debug = args.log_level.upper() == "DEBUG"
    handler.setFormatter(logging.Formatter(line_format) if debug else OneLineErrors(line_format))
    logging.basicConfig(level=args.log_level.upper(), handlers=[handler])
    if faults.active():
        log.warning("FAULT INJECTION IS ON (%s); this worker will fail on purpose", faults.ENV)
    url, refused = _parent_and_redis()
    if refused is not None:
        return refused
    try:
        ctx = _context(name, args)
        runtime.set_context(ctx)
        unusable = cuda.open_context(ctx.device)
        if unusable is not None:
            log.error("worker %s cannot create its CUDA context on GPU %s: %s", name, ctx.gpu, unusable)
            return EXIT_NO_CONTEXT
        _limit_gpu_memory(ctx, args.gpu_memory_limit)
        # Named, every connection: a stop finds this worker's wait for a job by it, and cuts it short.
        connection = connect(url, client_name=name)
        connection.ping()
        if args.preload:
            ctx = _preload(ctx, args.preload, args.precision)
    except _PreloadFailed as failed:
        why = f"{type(failed.cause).__name__}: {first_line(str(failed.cause))}"
        log.error("worker %s could not load model %s: %s", name, args.preload, why)
        log.debug("the load's traceback", exc_info=failed.cause)
        return EXIT_CUDA_FATAL if classify(failed.cause) == CUDA_FATAL else EXIT_ERROR
    except ConfigError as exc:
        log.error("%s", exc)
        return EXIT_CONFIG
    except redis.RedisError as exc:
        log.error("cannot reach Redis: %s", exc)
        return EXIT_REDIS

    # Start to ready (model on its device), before any wait for a predecessor: what a recycle costs.
    ready_at = time.time()
    ctx = replace(ctx, ready_at=ready_at)
    runtime.set_context(ctx)
    log.info(
        "worker %s ready %.2f s after its process started", name, ready_at - (ctx.process_started_at or 0)
    )
    wait_for_predecessor(lambda: early_stop.requested)
    if early_stop.requested:
        log.info("worker %s: stop requested during start-up; exiting before taking a job", name)
        return EXIT_STOPPED
    worker = ChunkWorker(
        [args.queue],
        connection=connection,
        name=name,
        serializer=JSONSerializer,
        job_class=AllowListedJob,
        max_jobs=args.max_jobs,
        recycle_after=args.recycle_after,
        stopped_before_start=lambda: early_stop.requested,
    )
    try:
        worker.work(burst=args.burst, max_jobs=args.max_jobs, logging_level=args.log_level.upper())
    except StopRequested:  # a signal between RQ installing its handler and entering its loop
        log.info("worker %s: stop requested while starting its loop", name)
        return EXIT_STOPPED
    except redis.RedisError as exc:  # Redis went away mid-job or at teardown: not this GPU's fault
        return _lost_redis(worker, exc)
    code = _exit_code(worker, args.max_jobs, connection)
    if args.burst and code == EXIT_ERROR:  # burst: an empty queue is the normal end
        code = EXIT_STOPPED
    log.info("worker %s exiting after %d job(s) with code %d", name, worker.jobs_run, code)
    return code


if __name__ == "__main__":
    sys.exit(main())
