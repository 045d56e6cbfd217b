"""``chunkq supervise``: watch a run until every chunk is settled, act on failures, assemble.

Each look: chunks with no job and no output are queued again; chunks whose worker stopped beating
are failed as abandoned; failed chunks get their next attempt after a back-off, or are quarantined.
Nothing lives only in this process: attempts, back-off deadlines and quarantines are in job meta.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import redis

from chunkq.jobs.compute import chunk_progress
from chunkq.jobs.contract import errors
from chunkq.jobs.contract.defaults import (
    DEFAULT_POLL_SECONDS,
    DEFAULT_SHARD_BYTES,
    REDIS_PATIENCE_SECONDS,
    STALE_AFTER_SECONDS,
    WARN_IDLE_SECONDS,
)
from chunkq.jobs.contract.errors import ChunkqError, StoreWriteError
from chunkq.jobs.contract.manifest import RunManifest, load_manifest
from chunkq.jobs.contract.outage import OutageLog
from chunkq.jobs.contract.run import Run
from chunkq.jobs.contract.run_files import RunLayout, read_json
from chunkq.jobs.contract.specs import chunk_job_id
from chunkq.jobs.queue import jobmeta, run_queues
from chunkq.jobs.queue.abandon import mark_abandoned
from chunkq.jobs.queue.enqueue import (
    chunk_queue,
    enqueue_chunks,
    forget_finished,
    restore_from_manifest,
    retry_quarantined,
    window_size,
)
from chunkq.jobs.queue.queueing import give_back
from chunkq.supervisor.result.assemble import Failure, assemble
from chunkq.supervisor.result.building import Build
from chunkq.supervisor.result.mapped_building import start_build
from chunkq.supervisor.store.attempts import AttemptRecorder, FailedAttempt
from chunkq.supervisor.store.phases import WATCH, Phases
from chunkq.supervisor.store.run_lock import RunLock
from chunkq.supervisor.store.store_lock import StoreLock
from chunkq.supervisor.watch import demand
from chunkq.supervisor.watch.display import ProgressDisplay
from chunkq.supervisor.watch.idle import warn_idle
from chunkq.supervisor.watch.progress import Tracker
from chunkq.supervisor.watch.retry import RetryPolicy, settle_failure
from chunkq.supervisor.watch.snapshot import Snapshot
from chunkq.supervisor.watch.wakeup import Wakeup

if TYPE_CHECKING:
    from chunkq.jobs.queue.rq_api import Job
    from chunkq.supervisor.watch.metrics import RunMetrics

log = logging.getLogger(__name__)

TOP_UP_FRACTION = 10  # the supervisor tops the window up once this fraction of it is free


class RedisGoneError(ChunkqError):
    """Redis stayed unreachable for longer than the supervisor's patience."""


@dataclass(frozen=True)
class WatchSettings:
    poll_seconds: float = DEFAULT_POLL_SECONDS
    policy: RetryPolicy = field(default_factory=RetryPolicy)
    allow_partial: bool = False
    redis_patience: float = REDIS_PATIENCE_SECONDS
    metrics_port: int | None = None  # Prometheus metrics on 127.0.0.1:<port> (0: any free port)
    wait_for_owner: bool = False  # another process owns the run: wait for it instead of refusing
    warn_idle: float = WARN_IDLE_SECONDS  # say so when chunks wait and no worker took one for this long
    stale_after: float = STALE_AFTER_SECONDS  # a running chunk's heartbeat silent this long: stuck
    window: int | None = None  # jobs of the run in Redis at once; None: enqueue.window_size decides
    shard_bytes: int = DEFAULT_SHARD_BYTES  # a larger result is published as shards of this size
    keep_outputs: bool = False  # keep the chunk arrays once the result is published (assemble.free_outputs)
    # When chunkq started the pool itself (chunkq run, the API): time.monotonic() then. Its idle
    # warnings then speak of that pool, never ask the user to start another.
    own_pool_started: float | None = None


@dataclass
class Outcome:
    snapshot: Snapshot
    result: dict[str, Any] | None  # the published result manifest (whole, or partial if allowed)

    @property
    def quarantined(self) -> list[Failure]:
        return self.snapshot.quarantined

    @property
    def partial(self) -> bool:
        return self.result is not None and not self.result.get("complete", True)


def _failure_line(f: Failure) -> str:
    return (
        f"  {(f.label or f'chunk {f.chunk}').removesuffix(')')}, job {f.job_id}, {f.error_class}, "
        f"attempt {f.attempt}{', ' + f.reason if f.reason else ''}): {errors.first_line(f.error)}"
    )


def failure_report(failures: list[Failure], run_id: str | None = None) -> str:
    lines = [f"{len(failures)} chunk(s) quarantined:", *map(_failure_line, failures)]
    fixable = [f.chunk for f in failures if f.error_class != errors.BAD_INPUT]
    if fixable:
        again = f"`chunkq supervise {run_id}`" if run_id else "`chunkq supervise RUN`"
        lines.append(
            f"Fix the cause above (a pool's --allow-model, a GPU, the store...), then {again} or the "
            "same `chunkq run` command: a new supervisor tries chunks quarantined so again"
        )
    if len(fixable) < len(failures):
        lines.append("Bad input stays quarantined: fix the corpus rows named above and submit it again")
    return "\n".join(lines)


def unsettled_report(failures: list[Failure], run_id: str) -> str:
    """Failed attempts a supervisor has not settled yet (none runs, or it is between two looks):
    not quarantined, not yet in the store's record (the hostile pass: `status` called such a first
    attempt "quarantined" and counted 0 failed attempts)."""
    lines = [f"{len(failures)} chunk(s) failed, waiting for a supervisor to retry them:"]
    lines += map(_failure_line, failures)
    lines.append(f"`chunkq supervise {run_id}` or the same `chunkq run` command retries and records them")
    return "\n".join(lines)


def submitted_window(layout: RunLayout) -> int | None:
    """The ``--queue-window`` the run was submitted with, if any (a damaged record: none)."""
    try:
        value = read_json(layout.queue_window).get("queue_window") if layout.queue_window.is_file() else None
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


@dataclass
class Supervisor:
    """One run under watch: what a look reads (the tracker) and what it acts with."""

    connection: redis.Redis
    layout: RunLayout
    manifest: RunManifest
    settings: WatchSettings
    lock: RunLock
    owner: StoreLock
    metrics: RunMetrics | None = None
    rng: random.Random = field(default_factory=random.Random)  # back-off jitter, not security
    tracker: Tracker = field(init=False)
    recorder: AttemptRecorder = field(init=False)

    idle_since: float | None = None
    idle_warned: float = 0.0
    submitted_window: int | None = None  # --queue-window given to submit (this look's is the watch's)

    def __post_init__(self) -> None:
        self.tracker = Tracker(
            self.connection, self.layout, self.manifest, stale_after=self.settings.stale_after
        )
        self.recorder = AttemptRecorder(self.layout)
        self.submitted_window = submitted_window(self.layout)

    def _watch_idle(self, snap: Snapshot) -> None:
        """Chunks wait and none runs: after ``warn_idle`` seconds say so, with the queue to serve."""
        now = time.monotonic()
        if not snap.chunks_queued or snap.chunks_running:
            self.idle_since = None
            return
        self.idle_since = self.idle_since or now
        idle = now - self.idle_since
        if idle < self.settings.warn_idle:
            # Normal while workers start and load the model: no alarm before warn_idle.
            snap.starting = snap.chunks_done == 0
            return
        snap.idle_seconds = idle
        own = self.settings.own_pool_started
        if own is not None:
            snap.own_pool_seconds = now - own
        if now - self.idle_warned < self.settings.warn_idle:
            return
        self.idle_warned = now
        warn_idle(self.connection, self.manifest, snap, idle)

    def look(self) -> Snapshot:
        self.owner.check()  # stop at once if another process took the run over while we were paused
        self.lock.renew()
        snap = self._poll()
        self._top_up(snap)
        self._act(snap)
        acted = snap.failures or snap.stale or snap.gone or snap.stranded or snap.unlisted
        snap = self._poll() if acted else snap
        self._watch_idle(snap)
        busy = 0 if snap.settled else snap.chunks_queued + snap.chunks_running + snap.chunks_retrying
        pools, own = self.manifest.pool_queue, self.manifest.queue
        demand.publish(self.connection, pools, self.manifest.run_id, busy)
        # Each look, not once: a Redis restarted without its data has the run's turn back at once.
        if snap.settled:
            run_queues.unregister(self.connection, pools, own)
            run_queues.retire(self.connection, pools, own)
        else:
            run_queues.register(self.connection, pools, own, self.manifest.priority)
        if self.metrics is not None:
            self.metrics.observe(snap)
        return snap

    def _poll(self) -> Snapshot:
        """A look at the run; the finished jobs it counted are deleted from Redis (the store keeps them)."""
        snap = self.tracker.poll()
        forget_finished(self.connection, self.manifest.queue, self.tracker.take_finished())
        if self.tracker.ledger is not None:
            self.tracker.ledger.flush(force=snap.settled)  # the owner records finished chunks in batches
        if snap.settled:
            chunk_progress.forget(self.connection, self.manifest.run_id)  # reports of chunks now counted
        return snap

    def _top_up(self, snap: Snapshot) -> None:
        """Queue the next waiting chunks, in chunk order, while the window has room."""
        if snap.lost:
            log.warning(
                "run %s: %d chunk(s) had a job in Redis and now have neither a job nor an output "
                "(a flushed or evicted Redis); they are queued again",
                self.manifest.run_id,
                len(snap.lost),
            )
        if not snap.chunks_waiting:
            return
        window = window_size(
            self.connection, self.manifest.pool_queue, self.settings.window or self.submitted_window
        )
        room = window - (snap.chunks_queued + snap.chunks_running + snap.chunks_retrying)
        if room < max(1, window // TOP_UP_FRACTION) and snap.chunks_queued:
            return  # a tenth of the window at a time: one enqueue per many chunks, not one per chunk
        taken = self.tracker.take_waiting(room)
        if taken:
            recorded = self.recorder.record_job  # a waiting chunk's failed job, if it has one
            enqueue_chunks(self.connection, self.layout, self.manifest, taken, before_requeue=recorded)
            snap.chunks_queued += len(taken)
            snap.chunks_waiting -= len(taken)
            log.debug(
                "run %s: queued chunks %d-%d (window %d)", self.manifest.run_id, taken[0], taken[-1], window
            )

    def _act(self, snap: Snapshot) -> None:
        run_id = self.manifest.run_id
        if snap.stranded:
            self._requeue(snap.stranded, "were taken by a worker that died before starting them")
        if snap.unlisted:
            self._requeue(snap.unlisted, "were queued in no queue list (a deleted or evicted list)")
        for index in snap.stale:
            mark_abandoned(
                self.connection,
                chunk_job_id(run_id, index),
                f"no heartbeat for over {self.settings.stale_after:g} s",
            )
        for index, why in snap.gone.items():
            mark_abandoned(self.connection, chunk_job_id(run_id, index), why)
        for index, job in self.tracker.failed_jobs.items():
            self._settle(index, job)

    def _requeue(self, chunks: list[int], why: str) -> None:
        """Put queued jobs no worker would take back at the front of their queue's list."""
        queue = chunk_queue(self.connection, self.manifest.queue)
        give_back(
            self.connection, queue, [chunk_job_id(self.manifest.run_id, i) for i in chunks], at_front=True
        )
        log.warning("run %s: chunk(s) %s %s; queued again", self.manifest.run_id, chunks, why)

    def _settle(self, index: int, job: Job) -> None:
        if jobmeta.error_class(job.meta) == errors.STORAGE:
            # Every other chunk would fail the same way: stop with the path, count no attempt, and
            # leave the job failed, so the same command requeues it once the store is fixed.
            raise StoreWriteError(
                f"run {self.manifest.run_id}: chunk {index} could not be written to the store: "
                f"{errors.first_line(str(job.meta.get(jobmeta.ERROR, '')))}; fix the store (free space, "
                "permissions, a read-only mount) and run the same command again"
            )
        restore_from_manifest(job, self.layout, self.manifest, index)
        already = jobmeta.quarantined(job.meta)
        # What this attempt said, read before the next one is numbered (which clears it).
        failed = FailedAttempt.from_job(job, index, jobmeta.attempt(job.meta), None)
        error_class = jobmeta.error_class(job.meta)
        outcome = settle_failure(self.connection, job, self.settings.policy, self.rng)
        if outcome == "quarantined":
            reason = str(job.meta.get(jobmeta.QUARANTINE_REASON, ""))
            failed = dataclasses.replace(failed, quarantined=True, reason=reason)
        self.recorder.record(failed)
        if self.metrics is not None:
            new = "quarantined_now" if outcome == "quarantined" and not already else outcome
            self.metrics.settled(new, error_class)


T = TypeVar("T")


def redis_never_gone() -> str | None:
    return None


def _patiently(
    step: Callable[[], T], settings: WatchSettings, gone: Callable[[], str | None] = redis_never_gone
) -> T:
    """Run ``step``, riding out a Redis outage (a restart with append-only persistence) up to the
    patience, or until ``gone`` says why the server will not come back."""
    outage = OutageLog(log, "Redis", "the run goes on when it is back")
    while True:
        began = time.monotonic()
        try:
            done = step()
        except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError) as exc:
            why = gone()
            if why:
                raise RedisGoneError(why) from exc
            if outage.seconds > settings.redis_patience:
                raise RedisGoneError(f"Redis unreachable for {outage.seconds:.0f} s: {exc}") from exc
            outage.failed(exc, began)
            time.sleep(settings.poll_seconds)
            continue
        outage.recovered()
        return done


def supervise(
    connection: redis.Redis,
    layout: RunLayout,
    display: ProgressDisplay,
    settings: WatchSettings | None = None,
    keep_going: Callable[[], bool] = lambda: True,
    redis_gone: Callable[[], str | None] = redis_never_gone,
    owner: StoreLock | None = None,
    manifest: RunManifest | None = None,
    phases: Phases | None = None,
) -> Outcome:
    """Watch until every chunk is done or quarantined, then assemble (partially only if allowed).

    ``keep_going`` lets a caller stop the watch early (``chunkq run`` when its pool has died);
    ``redis_gone`` says why Redis will not come back (``chunkq run``'s embedded server), so an
    outage ends the watch at once rather than after the patience. ``owner``: the run's store lock,
    when the caller took it already; otherwise it is taken here (and released at the end).
    ``phases``: where the watch's and assembly's seconds are kept (supervisor/store/phases.py).
    """
    settings = settings or WatchSettings()
    with contextlib.ExitStack() as stack:
        if owner is None:
            owner = stack.enter_context(StoreLock(layout.owner, f"run {layout.run_id}"))
            owner.acquire(settings.wait_for_owner)
        if manifest is None:  # read once the lock is held: a resume rewrites it (--priority) under the lock
            manifest = load_manifest(layout)
        return _supervise(
            connection, layout, manifest, display, settings, keep_going, redis_gone, owner, phases or Phases()
        )


def _supervise(
    connection: redis.Redis,
    layout: RunLayout,
    manifest: RunManifest,
    display: ProgressDisplay,
    settings: WatchSettings,
    keep_going: Callable[[], bool],
    redis_gone: Callable[[], str | None],
    owner: StoreLock,
    phases: Phases,
) -> Outcome:
    lock = RunLock(connection, manifest.run_id)
    metrics = None
    if settings.metrics_port is not None:
        # Here, not at the top: prometheus_client is for runs that asked for --metrics-port.
        from chunkq.queue_worker.processes.metrics import serve as serve_metrics
        from chunkq.supervisor.watch.metrics import RunMetrics

        metrics = RunMetrics(manifest.run_id)
        serve_metrics(metrics.registry, settings.metrics_port)
    watch = Supervisor(connection, layout, manifest, settings, lock, owner, metrics)
    if owner.took_over:  # its supervisor is gone: its lock in Redis is too
        _patiently(lambda: lock.take_over(owner.took_over), settings, redis_gone)
    _patiently(lock.acquire, settings, redis_gone)
    room = window_size(connection, manifest.pool_queue, settings.window or submitted_window(layout))
    retried = _patiently(lambda: retry_quarantined(connection, layout, manifest, room), settings, redis_gone)
    if retried:
        log.warning(
            "run %s: chunk(s) %s were quarantined by an earlier supervisor for a reason that may have "
            "been fixed since (not their input); they get new attempts",
            manifest.run_id,
            retried,
        )
    wakeup = Wakeup(connection, manifest.queue)
    build = start_build(layout, manifest, settings.shard_bytes)  # the result, written as chunks land
    try:
        return _watch_and_assemble(watch, wakeup, display, keep_going, build, phases, redis_gone)
    except BaseException:
        if build is not None:  # a full disk, a lost lock, ^C: no half-built result left beside it
            build.abandon()
        raise


def _encode_again(watch: Supervisor, damaged: list[int]) -> None:
    """Chunks counted done whose outputs the build found damaged and set aside: queued again by
    this watch (a resumed run said "to be encoded again", then failed its assembly on them)."""
    if damaged:
        watch.tracker.reopen(damaged)


def _watch_and_assemble(
    watch: Supervisor,
    wakeup: Wakeup,
    display: ProgressDisplay,
    keep_going: Callable[[], bool],
    build: Build | None,
    phases: Phases,
    redis_gone: Callable[[], str | None],
) -> Outcome:
    settings, layout, manifest = watch.settings, watch.layout, watch.manifest
    with phases.phase(WATCH):
        try:
            while True:
                snap = _patiently(watch.look, settings, redis_gone)
                display.update(snap)
                if snap.settled or not keep_going():
                    break
                if build is not None:
                    build.advance(watch.tracker.pending, phases=phases)
                    _encode_again(watch, build.take_set_aside())
                wakeup.wait(settings.poll_seconds)
        finally:
            wakeup.close()
            watch.lock.release()
    if not snap.settled or (snap.quarantined and not settings.allow_partial):
        if build is not None:
            build.abandon()
        return Outcome(snap, None)
    missing = snap.quarantined if settings.allow_partial else None
    if build is not None:
        build.advance(watch.tracker.pending, seconds=math.inf, phases=phases)  # the last chunks
    fence, shards, keep = watch.owner.check, settings.shard_bytes, settings.keep_outputs
    return Outcome(snap, assemble(Run(layout, manifest), missing, fence, shards, phases, build, keep))
