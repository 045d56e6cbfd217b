"""``chunkq run``: everything on one machine — embedded Redis, pool, submit, supervise, assemble."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import TracebackType

import redis

from chunkq.jobs.compute.runtime import POOL_FOR_RUN_ENV
from chunkq.jobs.contract.defaults import DEFAULT_BACKEND
from chunkq.jobs.contract.errors import StoreWriteError
from chunkq.jobs.contract.manifest import RunManifest
from chunkq.jobs.contract.release import chunkq_version
from chunkq.jobs.contract.run_files import RunLayout
from chunkq.jobs.contract.settings import DEVICES_JSON_ENV, SETTINGS_JSON_ENV, PoolSettings, env_of
from chunkq.jobs.contract.storage import OWNER_ONLY, is_local, remove_tree
from chunkq.jobs.queue import run_queues
from chunkq.jobs.queue.abandon import mark_abandoned
from chunkq.jobs.queue.enqueue import drop_run_jobs, enqueue_chunks, forget_run_finished, window_size
from chunkq.jobs.queue.queueing import fetch_job, started_job_ids
from chunkq.jobs.queue.redis_clients import connect
from chunkq.jobs.queue.run_queues import run_queue
from chunkq.queue_worker.devices.discovery import GpuInfo, devices_json
from chunkq.queue_worker.processes.lifeline import die_with_parent
from chunkq.queue_worker.processes.stopping import wait_or_kill
from chunkq.supervisor import stop_signals
from chunkq.supervisor.result.planned_rows import corpus_rows_of
from chunkq.supervisor.server.embedded_redis import EmbeddedRedis
from chunkq.supervisor.server.store_redis import embedded_redis_dir, local_state_dir, serve
from chunkq.supervisor.store.attempts import AttemptRecorder
from chunkq.supervisor.store.phases import IDENTIFY, QUEUE, SPLIT, Phases
from chunkq.supervisor.store.run_log import RunLog, log_path, relay
from chunkq.supervisor.store.start_marks import CHUNKS_QUEUED, POOL_STARTED, REDIS_READY, StartMarks
from chunkq.supervisor.store.store_lock import StoreLock
from chunkq.supervisor.submit.identity import Identified, SubmitRequest, identify
from chunkq.supervisor.submit.submission import SubmitResult, prepare, removed_on_failure, submit
from chunkq.supervisor.watch.display import ProgressDisplay
from chunkq.supervisor.watch.snapshot import store_snapshot
from chunkq.supervisor.watch.supervise import (
    Outcome,
    RedisGoneError,
    WatchSettings,
    redis_never_gone,
    supervise,
)

log = logging.getLogger(__name__)

POOL_STOP_SECONDS = 120.0  # workers finish the chunk in hand; after assembly they are idle
DRAIN_LOOK_SECONDS = 1.0  # while a pool drains, the progress bar is drawn from the store this often
RELAY_DRAIN_SECONDS = 10.0  # the pool has exited: what is left in its pipe is a few lines


@dataclass(frozen=True)
class RunRequest:
    submit: SubmitRequest
    redis_url: str | None = None
    pool: PoolSettings = field(default_factory=PoolSettings)  # run fills in Redis, queue, store, model
    devices: tuple[GpuInfo, ...] | None = None  # what the pool runs on, chosen once (None: it chooses)
    watch: WatchSettings = field(default_factory=WatchSettings)  # wait_for_owner: --wait
    log_file: bool = False  # the run's INFO lines, its pool's included, to runs/<run>/logs/run.log


@dataclass
class RunOutcome:
    submitted: SubmitResult
    outcome: Outcome | None  # None when the result was already published
    pool_died: bool = False
    pool_said: str | None = None  # why the pool ended, in its (or a worker's) own words
    forgotten: bool = False  # the pool died before any chunk was done: the run this command made is gone


class PoolProcess:
    """``chunkq pool`` as a child process, stopped (drained) on exit and never left behind."""

    def __init__(self, req: RunRequest, redis_url: str, run_id: str, run_log: RunLog | None = None) -> None:
        sub = req.submit
        settings = replace(
            req.pool,
            redis_url=redis_url,
            queue=sub.queue,
            # A preload is the default load of the model: with another revision, remote code or model
            # kwargs it would be a second, unused copy (or fail), so workers load it at their first chunk.
            preload=sub.model if sub.encode.default_load else None,
            allowed_models=(sub.model,),  # this run's model, whether preloaded or not
            # What its preload and memory sizing assume; OpenVINO's precision is each chunk's own
            # (its model is never preloaded, and its bf16 runs on CPU workers).
            precision=sub.encode.precision if sub.encode.backend == DEFAULT_BACKEND else req.pool.precision,
            trust_remote_code=sub.encode.trust_remote_code,  # this run's pool, for this run's model
            store=str(sub.store),
            log_level=logging.getLevelName(logging.getLogger().getEffectiveLevel()),
        )
        self.cmd = [sys.executable, "-m", "chunkq.queue_worker"]  # queue_worker.processes.pool.main
        # Whole, in the environment: the Redis password stays off the command line.
        self.env = dict(os.environ, **{SETTINGS_JSON_ENV: settings.to_json(), env_of("redis_url"): redis_url})
        self.env[POOL_FOR_RUN_ENV] = run_id  # its workers' start-up is this run's (the report shows it)
        if req.devices is not None:
            self.env[DEVICES_JSON_ENV] = devices_json(list(req.devices))
        self.run_log = run_log
        self._relay: threading.Thread | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at = time.monotonic()
        self.while_draining: Callable[[], None] = _nothing  # told every DRAIN_LOOK_SECONDS of a drain

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """Stop the pool and everything it started at once (its own session): for a pool that has
        taken no chunk, when the run it was started for cannot go ahead."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def __enter__(self) -> PoolProcess:
        # Through us to the run's log file (and the terminal from its level up), or straight out.
        output = subprocess.PIPE if self.run_log is not None else None
        # Its own session: a terminal's Ctrl+C reaches only us, and we decide what the pool hears.
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(
            self.cmd,
            env=self.env,
            stdout=output,
            stderr=subprocess.STDOUT if output is not None else None,
            start_new_session=True,
            preexec_fn=die_with_parent,
            umask=OWNER_ONLY,  # what the pool and its workers write, whatever the caller's umask
        )
        if self.run_log is not None and self.proc.stdout is not None:
            self._relay = relay(self.proc.stdout, self.run_log)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.proc is None:
            return
        if exc_type is KeyboardInterrupt and self.run_log is not None:
            self.run_log.terminal_muted = True
        if self.proc.poll() is None and exc_type is KeyboardInterrupt and stop_signals.stop_now_asked():
            self._stop_now(drained=False)  # the second came while the first's clean-up ran (Redis silent)
        if self.proc.poll() is None:
            if exc_type is KeyboardInterrupt:
                log.warning(
                    "stopping: each worker finishes the chunk in hand (at most %d s); press Ctrl+C again "
                    "to stop now (that chunk goes back to the queue). The store keeps every finished chunk.",
                    POOL_STOP_SECONDS,
                )
            self.proc.send_signal(signal.SIGTERM)  # drain: workers finish the chunk in hand
            try:
                self._drain(self.proc, time.monotonic() + POOL_STOP_SECONDS)
            except (subprocess.TimeoutExpired, KeyboardInterrupt):
                self._stop_now(drained=True)
        if self._relay is not None:
            self._relay.join(timeout=RELAY_DRAIN_SECONDS)  # the pool's last lines, before the log closes

    def _drain(self, proc: subprocess.Popen[bytes], deadline: float) -> None:
        """Wait for the pool to exit by ``deadline`` (TimeoutExpired if not), telling
        ``while_draining`` between waits."""
        while True:
            left = deadline - time.monotonic()
            try:
                proc.wait(timeout=max(0.0, min(left, DRAIN_LOOK_SECONDS)))
                return
            except subprocess.TimeoutExpired:
                if left <= DRAIN_LOOK_SECONDS:
                    raise
            self.while_draining()

    def _stop_now(self, drained: bool) -> None:
        """The pool's second signal, after the drain's (sent now if it was not): it stops at once,
        spacing the two itself (SIGNAL_REPEAT_SECONDS)."""
        if self.proc is None:
            return
        log.warning("stopping the pool now; interrupted chunks go back to the queue")
        for _ in range(1 if drained else 2):
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
        wait_or_kill(self.proc, 30)


def _release_orphans(connection: redis.Redis, previous: str, store: Path) -> None:
    """The embedded server is private to the run that owns it, and each start gives it a new
    password: a job it shows as started belongs to a worker of an earlier owner, which can no longer
    report it, whether that owner was killed (``previous``: whose lock was taken over) or stopped
    with a chunk in hand (the store's disk full). Fail it as abandoned now, so it is retried at
    once instead of after its heartbeat goes stale (60 s: every resume after a full disk waited
    so), and record the attempt in its run's store: the resumed submit requeues the job before any
    supervisor sees it failed, and status and report said "failed attempts: 0" where the log had
    said it failed (issue 65.2)."""
    earlier = f"the previous chunkq run, {previous}" if previous else "the previous chunkq run of this store"
    why = f"its worker died with {earlier}"
    for job_id in list(started_job_ids(connection)):
        if mark_abandoned(connection, job_id, why):
            run_id, _, chunk = job_id.rpartition("__c")
            layout = RunLayout(store, run_id)
            if not layout.manifest.is_file():  # a run cleaned from the store: no folder made again
                continue
            try:
                job = fetch_job(connection, job_id)
                if job is not None:
                    AttemptRecorder(layout).record_job(job, int(chunk))
                    continue
                why_not = "Redis no longer holds the job"
            except (redis.RedisError, ValueError, OSError) as exc:
                why_not = str(exc)
            log.warning("the abandoned attempt of job %s is not recorded (%s)", job_id, why_not)


@contextlib.contextmanager
def _full_disk_is_a_storage_error(server: EmbeddedRedis) -> Iterator[None]:
    """The embedded server on a full disk closes connections or dies ("Connection closed by
    server."): what the user must fix is the disk, so say that, with exit 11, not "Redis unreachable"."""
    try:
        yield
    except (redis.RedisError, RedisGoneError) as exc:
        full = server.disk_full()
        if not full:
            raise
        raise StoreWriteError(
            f"the embedded Redis cannot write its data: {full}; make room and run the same command again"
        ) from exc


class _CreatedHere:
    """A folder this command may create (the embedded Redis's), removed with what is in it when
    ``remove_on_failure()`` was called and the block then fails: a command that stops before it
    queued anything leaves the disk as it found it."""

    def __init__(self, path: Path | None) -> None:
        self.path = path if path is not None and is_local(path) and not path.exists() else None
        self.armed = False

    def remove_on_failure(self) -> None:
        self.armed = True

    def __enter__(self) -> _CreatedHere:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        if exc_type is not None and self.armed and self.path is not None:
            shutil.rmtree(self.path, ignore_errors=True)


class _QueueWhileSplitting:
    """Where a new run's chunks go while its corpus is split (``streaming.SplitFeed``): the queue,
    within the run's window (the supervisor queues the rest once it watches)."""

    def __init__(
        self,
        connection: redis.Redis,
        layout: RunLayout,
        req: RunRequest,
        pool: PoolProcess,
        marks: StartMarks,
    ) -> None:
        self.connection, self.layout, self.pool, self.marks = connection, layout, pool, marks
        self.pool_queue = req.submit.queue
        self.room = window_size(connection, req.submit.queue, req.submit.queue_window)
        self.recorder = AttemptRecorder(layout)  # the failed jobs it queues again (enqueue_chunks)

    def queue(self, manifest: RunManifest, indices: list[int]) -> None:
        if self.room > 0:
            counts = enqueue_chunks(
                self.connection,
                self.layout,
                manifest,
                indices,
                limit=self.room,
                before_requeue=self.recorder.record_job,
            )
            self.room -= counts.in_redis
            self.marks.mark(CHUNKS_QUEUED)

    def restart(self) -> None:
        drop_run_jobs(self.connection, self.layout.run_id)

    def abandon(self) -> None:
        self.pool.kill()  # before the run's files go: no worker writes into them after
        _forget_queue(self.connection, self.pool_queue, self.layout.run_id)  # its queue's name too


def _nothing() -> None:
    return None


def _always() -> bool:
    return True


def _run_log(req: RunRequest, layout: RunLayout, stack: contextlib.ExitStack) -> RunLog | None:
    if not req.log_file:
        return None
    run_log = stack.enter_context(RunLog(log_path(local_state_dir(req.submit.store), layout.run_id)))
    log.info(
        "run %s: chunkq %s (pid %d); this log: %s",
        layout.run_id,
        chunkq_version(),
        os.getpid(),
        run_log.path,
    )
    return run_log


def _say_resumed(layout: RunLayout, manifest: RunManifest, submitted: SubmitResult) -> None:
    """A rerun of an interrupted run says what it found, on the terminal (a warning's level: the
    terminal shows warnings and the progress by default)."""
    done = corpus_rows_of(layout, manifest, layout.done_chunks(manifest.chunks))
    log.warning(
        "resuming run %s: %d of %d chunk(s) were done (%d of %d rows); encoding the other %d",
        layout.run_id,
        submitted.done,
        submitted.chunks,
        done,
        manifest.corpus_rows,
        submitted.chunks - submitted.done,
    )


def _forget_finished_jobs(url: str, run_id: str) -> None:
    """The run's finished jobs its pool left in Redis (``forget_run_finished``); a Redis gone by
    then keeps them until their TTL, as it keeps everything else."""
    with contextlib.suppress(redis.RedisError, OSError):
        forget_run_finished(connect(url), run_id)


def _start_redis(req: RunRequest, stack: contextlib.ExitStack) -> tuple[str, Callable[[], str | None]]:
    """The run's Redis: the user's, or the store's embedded server started under its lock; (URL, a
    callable that says why the server is gone for good, or None)."""
    if req.redis_url:
        return req.redis_url, redis_never_gone
    served = serve(req.submit.store, stack, wait=req.watch.wait_for_owner)
    stack.enter_context(_full_disk_is_a_storage_error(served.server))
    _release_orphans(connect(served.server.url), served.took_over, req.submit.store)
    return served.server.url, lambda: served.server.failure


def run(req: RunRequest, display: ProgressDisplay) -> RunOutcome:
    """Submit, work and assemble on this machine; resumable from whatever the store already holds.

    A new run's corpus is split into chunk inputs while the pool starts (its fork server imports
    torch and loads the model meanwhile): the first chunk waits for the longer of the two, not
    both. If the corpus turns out bad (a bad row far into it, no row at all), the pool is killed
    before it took anything and every file and folder this command created is removed.
    """
    marks, phases = StartMarks(), Phases()
    store = req.submit.store
    with phases.phase(IDENTIFY):
        identified = identify(req.submit)
    layout = RunLayout(store, identified.run_id)
    try:
        return _run(req, display, marks, phases, identified, layout)
    finally:
        if layout.manifest.is_file():
            phases.write(layout)


def _run(
    req: RunRequest,
    display: ProgressDisplay,
    marks: StartMarks,
    phases: Phases,
    identified: Identified,
    layout: RunLayout,
) -> RunOutcome:
    store = req.submit.store
    with (
        removed_on_failure(store, store / "runs", layout.root),
        _CreatedHere(None if req.redis_url else embedded_redis_dir(store)) as redis_dir,
        contextlib.ExitStack() as stack,
    ):
        # The run's lock first: a run refused because another process owns it has started,
        # written and queued nothing.
        owner = stack.enter_context(StoreLock(layout.owner, f"run {layout.run_id}"))
        owner.acquire(req.watch.wait_for_owner)
        run_log = _run_log(req, layout, stack)
        with phases.phase(SPLIT):
            prepared = prepare(req.submit, identified) if layout.manifest.is_file() else None
        if prepared is not None and prepared.published:
            log.info("run %s: result already published in %s", layout.run_id, layout.result)
            return RunOutcome(SubmitResult.already_published(prepared.manifest), None)
        url, redis_gone = _start_redis(req, stack)
        marks.mark(REDIS_READY)
        stack.callback(_forget_finished_jobs, url, layout.run_id)  # after the pool has stopped, before Redis
        pool = None
        if prepared is None:  # a new run: its corpus is split while the pool loads the model
            pool = stack.enter_context(PoolProcess(req, url, layout.run_id, run_log))
            marks.mark(POOL_STARTED)
            feed = _QueueWhileSplitting(connect(url), layout, req, pool, marks)
            try:
                with phases.phase(SPLIT):
                    prepared = prepare(req.submit, identified, feed)
            except BaseException:
                pool.kill()  # it has taken nothing: nothing was queued
                redis_dir.remove_on_failure()  # it holds nothing of the run yet
                raise
        connection = connect(url)
        with phases.phase(QUEUE):
            submitted = submit(req.submit, connection, identified, prepared)
        if prepared.created:  # a resumed run's first rows were a first command's
            marks.mark(CHUNKS_QUEUED)
            marks.write(layout)
        if submitted.published:  # checked whole by submit, under the run's lock since before it
            log.info("run %s: result already published in %s", submitted.run_id, layout.result)
            return RunOutcome(submitted, None)
        if not prepared.created:
            _say_resumed(layout, prepared.manifest, submitted)
        if pool is None and submitted.done < submitted.chunks:  # resumed with chunks left to encode
            pool = stack.enter_context(PoolProcess(req, url, layout.run_id, run_log))
        keep_going = _always if pool is None else pool.alive
        display.follow(functools.partial(store_snapshot, layout, prepared.manifest))
        if pool is not None:
            pool.while_draining = display.tick
        watch = req.watch if pool is None else replace(req.watch, own_pool_started=pool.started_at)
        outcome = supervise(
            connection, layout, display, watch, keep_going, redis_gone, owner, prepared.manifest, phases
        )
        died = not keep_going()
        said = run_log.why_the_pool_ended() if died and run_log is not None else None
        if died and prepared.created and not layout.done_chunks(prepared.manifest.chunks):
            # Nothing was done (a model its workers could not load): kept, the run held the broken
            # model's identity and refused the same command once the model was mended.
            _forget_queue(connection, req.submit.queue, layout.run_id)
            remove_tree(layout.root)
            return RunOutcome(submitted, outcome, pool_died=True, pool_said=said, forgotten=True)
        return RunOutcome(submitted, outcome, pool_died=died, pool_said=said)


def _forget_queue(connection: redis.Redis, pool_queue: str, run_id: str) -> None:
    """Every job of a run this command made and is giving up, and its queue's name in the lists."""
    drop_run_jobs(connection, run_id)
    queue = run_queue(pool_queue, run_id)
    run_queues.unregister(connection, pool_queue, queue)
    run_queues.retire(connection, pool_queue, queue)
