"""The worker process: an RQ SimpleWorker that keeps the model loaded, runs at most N chunks, exits.

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
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import replace
from types import FrameType
from typing import Any

import psutil
import redis
import setproctitle
from rq.exceptions import StopRequested
from rq.serializers import JSONSerializer
from rq.worker import SimpleWorker, WorkerStatus

from chunkq.jobs import kinds
from chunkq.jobs.compute import cuda, faults, models, runtime
from chunkq.jobs.compute.model_info import describe
from chunkq.jobs.contract import errors
from chunkq.jobs.contract.allowlist import AllowListedJob
from chunkq.jobs.contract.errors import ConfigError
from chunkq.jobs.contract.events import announce_settled
from chunkq.jobs.contract.nopickle import forbid_pickle
from chunkq.jobs.contract.queueing import give_back
from chunkq.jobs.contract.specs import DEFAULT_KIND, EncodeOptions
from chunkq.jobs.contract.storage import open_store
from chunkq.jobs.embed import warm_up
from chunkq.queue_worker import utilisation
from chunkq.queue_worker.exit_codes import (
    EXIT_CONFIG,
    EXIT_CUDA_FATAL,
    EXIT_DEVICE_UNSUPPORTED,
    EXIT_ERROR,
    EXIT_MAX_JOBS,
    EXIT_NO_CONTEXT,
    EXIT_ORPHANED,
    EXIT_REDIS,
    EXIT_STOPPED,
)
from chunkq.queue_worker.lifeline import ORPHANED_SIGNAL, PARENT_PID_ENV, pool_alive
from chunkq.queue_worker.settings import (
    DEFAULT_STORE,
    SIGNAL_REPEAT_SECONDS,
    WORKER_MODULE,
    add_worker_arguments,
    env_of,
    truthy,
)
from chunkq.queue_worker.standby import announce_last_job, announce_model_loaded, wait_for_predecessor

log = logging.getLogger(__name__)

# What a job's verdict on this process (runtime.end_after_job) makes the worker exit with.
ENDING_CODES = {
    runtime.BROKEN_CONTEXT: EXIT_CUDA_FATAL,
    runtime.DEVICE_UNSUPPORTED: EXIT_DEVICE_UNSUPPORTED,
}
ENDING_WORDS = {
    runtime.BROKEN_CONTEXT: "CUDA context broken",
    runtime.DEVICE_UNSUPPORTED: "this GPU cannot run the model",
}

HEARTBEAT_SECONDS = 5.0
STOP_POLL_SECONDS = 1  # the longest an idle worker waits for a job before it looks for a stop


class Heartbeat:
    """Keeps a running job's heartbeat going from a thread: SimpleWorker sends none while a job runs,
    so without it a long chunk would look abandoned to anyone watching."""

    def __init__(
        self, worker: ChunkWorker, job: Any, execution: Any, interval: float = HEARTBEAT_SECONDS
    ) -> None:
        self.worker, self.job, self.execution, self.interval = worker, job, execution, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chunkq-heartbeat", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.worker.maintain_heartbeats(self.job, self.execution)
            except Exception as exc:  # Redis away for a moment: the next beat tries again
                log.warning("heartbeat for %s failed: %s", self.job.id, exc)

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


class RedisGoneWhileStopping(Exception):
    """Redis cannot be reached and this idle worker was asked to stop: it stops, not waits."""


class ChunkWorker(SimpleWorker):
    """SimpleWorker (no fork: the model stays loaded) that counts jobs, beats while busy, exits at
    once when the CUDA context broke, and honours a second signal."""

    # RQ retries a lost Redis with a back-off that grows to a minute; a stop that comes meanwhile is
    # only seen between tries, so a short cap keeps a drain short (Kubernetes deletes Redis and the
    # pools together; Slurm's supervisor job stops its Redis before the pools' jobs end).
    max_connection_wait_time = 5.0

    def procline(self, message: str) -> None:
        # RQ's title drops the command line; ps and the pool's tools look for the module and name.
        setproctitle.setproctitle(f"{sys.executable} -m {WORKER_MODULE} --name {self.name}: {message}")

    def __init__(
        self,
        *args: Any,
        max_jobs: int | None = None,
        recycle_after: float | None = None,
        stopped_before_start: Callable[[], bool] = lambda: False,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.max_jobs = max_jobs
        self.recycle_after = recycle_after  # seconds of work after which the worker recycles
        self.worked = 0.0  # seconds spent running jobs, idle time not counted
        self.last_job_seconds = 0.0
        self.recycled = False
        self.stopped_before_start = stopped_before_start
        self.jobs_run = 0
        self.stop_signalled = False
        self._first_signal_at = -SIGNAL_REPEAT_SECONDS
        self.ending: str | None = None  # why a job said this process must end (runtime.ending)
        self.jobs_given_back = 0
        self._taking_job = False  # from waiting for a job until it is started: a stop only marks

    def _shutdown(self) -> None:
        # RQ raises StopRequested from the signal handler when the worker is not busy. Once Redis has
        # moved a job to this worker and before it starts, that raise strands the job in RQ's
        # intermediate list until a supervisor or RQ's ten-minute maintenance repairs it (seen in
        # a test: a pool stopped as its workers took their first chunks).
        if self._taking_job:
            self._stop_requested = True
            return
        super()._shutdown()  # type: ignore[no-untyped-call]

    def heartbeat(self, timeout: int | None = None, pipeline: Any = None) -> None:
        try:
            super().heartbeat(timeout, pipeline)
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
            # RQ's wait for a job retries a lost Redis forever; asked to stop, with nothing in hand,
            # there is nothing to wait for (a chunk in hand finishes without Redis: its output is in
            # the store, and the next supervisor reads it there).
            # (The state, not the current job: RQ reads that from Redis.)
            if self._stop_requested and self.get_state() != WorkerStatus.BUSY:
                raise RedisGoneWhileStopping(str(exc)) from exc
            raise

    def dequeue_job_and_maintain_ttl(self, timeout: int | None, max_idle_time: int | None = None) -> Any:
        self._taking_job = True
        try:
            if timeout is None or max_idle_time is not None:  # burst: one look, no wait
                result = super().dequeue_job_and_maintain_ttl(timeout, max_idle_time)
            else:
                # Short waits, since a signal no longer interrupts one: a stop is seen within a wait.
                result = None
                while result is None and not self._stop_requested:
                    result = super().dequeue_job_and_maintain_ttl(STOP_POLL_SECONDS, STOP_POLL_SECONDS)
        except RedisGoneWhileStopping as exc:
            self.log.warning("Worker %s: stopping as asked; Redis cannot be reached (%s)", self.name, exc)
            result = None
        if result is None:
            self._taking_job = False
            if self._stop_requested:
                self.log.info("Worker %s: stopping on request", self.name)
        return result

    def execute_job(self, job: Any, queue: Any) -> None:
        if self._stop_requested:  # the stop came while this worker took the job: it goes back, unstarted
            self._give_back(job, queue)
            self._taking_job = False
            raise StopRequested
        execution = self.prepare_execution(job)  # busy from here: RQ's own stop handling is right
        self._taking_job = False
        self.jobs_run += 1
        by_count = self.max_jobs is not None and self.jobs_run >= self.max_jobs
        by_time = self._time_is_up_after_this_job()
        if by_count or by_time:
            announce_last_job()  # the pool starts our replacement now, to load while we compute
        started = time.monotonic()
        with Heartbeat(self, job, execution):
            self.perform_job(job, queue, execution)
        self.last_job_seconds = time.monotonic() - started
        self.worked += self.last_job_seconds
        if by_time or (self.recycle_after is not None and self.worked >= self.recycle_after):
            # Announced or not, the time is up: RQ's own max-jobs check covers only the count.
            self.recycled = self._stop_requested = True
            self.log.info(
                "Worker %s: recycling after %.1f s of work in %d chunk(s)",
                self.name,
                self.worked,
                self.jobs_run,
            )
        announce_settled(self.connection, queue.name, job.id)  # the supervisor looks now, not in a second
        self.set_state(WorkerStatus.IDLE)
        ending = runtime.ending()
        if ending:
            # No empty_cache() or model reload repairs a sticky CUDA error, nor vouches for an
            # allocator that failed in its own OOM path; a fresh process does.
            self.ending = ending[0]
            self._stop_requested = True
            # One line: torch's four lines of CUDA advice stay in the job's record.
            said = errors.first_line(ending[1])
            self.log.error("Worker %s: %s (%s); exiting", self.name, ENDING_WORDS[ending[0]], said)

    def _time_is_up_after_this_job(self) -> bool:
        """Whether the job about to start is the last: the work so far plus one more like the last
        reaches --recycle-after. Known before it starts, so the standby loads while it runs."""
        return self.recycle_after is not None and self.worked + self.last_job_seconds >= self.recycle_after

    def _give_back(self, job: Any, queue: Any) -> None:
        give_back(self.connection, queue, [job.id], at_front=True)
        self.jobs_given_back += 1
        self.log.info(
            "Worker %s: stop requested; gave job %s back to %s unstarted", self.name, job.id, queue.name
        )

    def unsubscribe(self) -> None:
        # RQ sends UNSUBSCRIBE before it stops its listener thread. When the reply wakes the thread
        # first, the thread goes back to a 60 s wait and RQ's join(timeout=1) sits it out: up to a
        # second added to every recycle. Stopped first, the thread ends on that reply; but a thread
        # woken by anything else in between ends at once and closes the connection under us (seen
        # in CI: "Error 9 while writing to socket"), which ends the subscription just as well.
        if not self.pubsub_thread:
            super().unsubscribe()  # type: ignore[no-untyped-call]
            return
        self.log.info("Worker %s: unsubscribing from channel %s", self.name, self.pubsub_channel_name)
        self.pubsub_thread.stop()
        with contextlib.suppress(
            redis.RedisError, OSError, ValueError
        ):  # a closed socket, or a failed reconnect
            self.pubsub.unsubscribe()
        self.pubsub_thread.join(timeout=1)
        self.pubsub.close()

    def _install_signal_handlers(self) -> None:
        super()._install_signal_handlers()  # type: ignore[no-untyped-call]
        signal.signal(ORPHANED_SIGNAL, self._orphaned)
        # A signal that reached main()'s start-up handler after its last look would otherwise be
        # lost: a worker whose fork server or pool died then would work on as an orphan (seen in CI).
        if self.stopped_before_start():
            self.stop_signalled = True
            self._stop_requested = True

    def request_stop(self, signum: int, frame: FrameType | None) -> None:
        self.stop_signalled = True
        self._first_signal_at = time.monotonic()
        super().request_stop(signum, frame)  # type: ignore[no-untyped-call]

    def _orphaned(self, signum: int, frame: FrameType | None) -> None:
        if pool_alive():  # only the fork server died: the pool watches on and replaces this worker
            self.request_stop(signum, frame)
            return
        self.stop_signalled = True
        self._stop_requested = True  # RQ fails the job in hand on the raise below, then would go on
        self.log.error(
            "Worker %s: its pool is gone; stopping now (a chunk in hand fails, to be retried)", self.name
        )
        raise SystemExit(EXIT_ORPHANED)

    def request_force_stop(self, signum: int, frame: FrameType | None) -> None:
        # Ours run in their own session, but a batch system signals every process of its job and
        # the pool relays the same request: a repeat that soon is that one stop, not "stop now"
        # (the pool sends its "stop now" no sooner than this after its drain).
        if time.monotonic() - self._first_signal_at < SIGNAL_REPEAT_SECONDS:
            self.log.info("Worker %s: the stop signal again (delivered twice); still draining", self.name)
            return
        self.log.warning("Worker %s: second signal, stopping now", self.name)
        raise SystemExit(EXIT_STOPPED)


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
    allowed = {models.BUNDLED_MODEL, *(models.canonical_model(m) for m in named)}
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
        process_started_at=psutil.Process().create_time(),
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


class _EarlyStop:
    """Until RQ installs its handlers, a stop signal only sets a flag checked after start-up."""

    def __init__(self) -> None:
        self.requested = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)

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
        with contextlib.suppress(Exception):
            why = f"{type(exc).__name__}: {exc}"
            sys.stderr.write(f"chunkq: a worker log line was lost ({why}): {record.msg}\n")


def main(argv: list[str] | None = None) -> int:
    early_stop = _EarlyStop()
    forbid_pickle()
    args = _parse(argv)
    name = args.name or f"cq-{socket.gethostname()}-{os.getpid()}"
    where = f"{name} gpu={os.environ.get('CHUNKQ_GPU', '-')}"
    handler = OneLineHandler(sys.stderr)
    line_format = f"%(asctime)s %(levelname)s [{where}] %(name)s: %(message)s"
    debug = args.log_level.upper() == "DEBUG"
    handler.setFormatter(logging.Formatter(line_format) if debug else OneLineErrors(line_format))
    logging.basicConfig(level=args.log_level.upper(), handlers=[handler])
    if faults.active():
        log.warning("FAULT INJECTION IS ON (%s); this worker will fail on purpose", faults.ENV)
    parent = os.environ.get(PARENT_PID_ENV)
    if parent and os.getppid() != int(parent):
        log.error("parent %s (the pool or its fork server) is gone before this worker started", parent)
        return EXIT_ORPHANED
    url = os.environ.get(env_of("redis_url"))
    if not url:
        log.error("%s is not set", env_of("redis_url"))
        return EXIT_CONFIG
    try:
        ctx = _context(name, args)
        runtime.set_context(ctx)
        unusable = cuda.open_context(ctx.device)
        if unusable is not None:
            log.error("worker %s cannot create its CUDA context on GPU %s: %s", name, ctx.gpu, unusable)
            return EXIT_NO_CONTEXT
        connection = redis.Redis.from_url(url)
        connection.ping()
        if args.preload:
            kind = describe(args.preload).kind
            kind = kind if kind in kinds.KINDS else DEFAULT_KIND  # a run of it is refused at submit
            loaded = models.get_model(args.preload, ctx.device, args.precision, EncodeOptions(kind=kind))
            announce_model_loaded(loaded.load_seconds)
            lengths, seconds = warm_up(loaded, ctx.device, kind)
            log.info("warm-up encode at %s tokens on %s in %.2f s", lengths, ctx.device, seconds)
            ctx = replace(ctx, warm_up_seconds=seconds)
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
        log.error("worker %s lost Redis: %s", name, exc)
        return ENDING_CODES[worker.ending] if worker.ending else EXIT_REDIS
    code = _exit_code(worker, args.max_jobs, connection)
    if args.burst and code == EXIT_ERROR:  # burst: an empty queue is the normal end
        code = EXIT_STOPPED
    log.info("worker %s exiting after %d job(s) with code %d", name, worker.jobs_run, code)
    return code


if __name__ == "__main__":
    sys.exit(main())
