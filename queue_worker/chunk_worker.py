"""The RQ worker that runs chunks: it keeps its model between jobs, beats while a chunk runs, gives a
taken job back when it must stop before starting it, stops between jobs on a signal (a second one
stops at once), and ends after its work time or job count with a named exit code.
``worker.py`` starts one.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

import redis
import setproctitle

from chunkq.jobs.compute import runtime
from chunkq.jobs.contract import errors
from chunkq.jobs.contract.defaults import HEARTBEAT_SECONDS, REDIS_REPLY_SECONDS
from chunkq.jobs.contract.events import announce_settled
from chunkq.jobs.contract.settings import SIGNAL_REPEAT_SECONDS
from chunkq.jobs.queue import attempt_records, jobmeta, run_queues, worker_place
from chunkq.jobs.queue.queueing import give_back
from chunkq.jobs.queue.rq_api import SimpleWorker, StopRequested, WorkerStatus, utcformat
from chunkq.queue_worker.exit_codes import (
    EXIT_CUDA_FATAL,
    EXIT_DEVICE_UNSUPPORTED,
    EXIT_ORPHANED,
    EXIT_STOPPED,
)
from chunkq.queue_worker.processes.lifeline import ORPHANED_SIGNAL, POOL_PID_ENV, pool_alive
from chunkq.queue_worker.processes.standby import announce_last_job
from chunkq.queue_worker.wait_cutter import RedisGoneWhileStopping, StopNote, StoppedWhileWaiting, WaitCutter
from chunkq.queue_worker.worker_args import worker_title

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


# The longest an idle worker waits for a job before it looks for a stop it was not woken for (a
# signal that came between its heartbeat and its wait, or a server that refuses CLIENT UNBLOCK).
STOP_POLL_SECONDS = 1


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


class ChunkWorker(SimpleWorker):
    """SimpleWorker (no fork: the model stays loaded) that counts jobs, beats while busy, exits at
    once when the CUDA context broke, and honours a second signal."""

    # RQ retries a lost Redis with a back-off that grows to a minute; a stop that comes meanwhile is
    # only seen between tries, so a short cap keeps a drain short (Kubernetes deletes Redis and the
    # pools together; Slurm's supervisor job stops its Redis before the pools' jobs end).
    max_connection_wait_time = 5.0
    stop_poll_seconds = STOP_POLL_SECONDS

    def procline(self, message: str) -> None:
        # RQ's title drops the command line; ps and the pool's tools look for the module and name.
        setproctitle.setproctitle(worker_title(f"--name {self.name}: {message}"))

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
        self.waiting = False  # inside RQ's wait for a job, where nothing is in hand yet
        self.in_job = False  # from a job's start to its end
        # Started now, not from the signal handler: starting a thread there can deadlock on a lock the
        # interrupted code holds (RQ starts its pubsub thread as a stop may come). The handler only
        # sets the cutter's event.
        self._cutter = WaitCutter(self)
        self._cutter.start()
        self._stop_note = StopNote(self)
        self.pool_queue = self.queues[0].name  # the one it was started on; the runs' come and go
        self.turn = 0  # jobs taken: where its round of the runs' queues starts (run_queues)

    @property
    def holds_nothing(self) -> bool:
        """No job in hand: waiting for one (its BLMOVE has not returned), or neither taking nor running
        one (between jobs, or on its way out after a stop)."""
        return self.waiting or not (self._taking_job or self.in_job)

    @property
    def connection_timeout(self) -> int:
        # RQ raises its connection's reply limit to its own wait for a job plus 10 s (415 s), which
        # every command then had against a Redis that stopped answering; this worker's waits are
        # STOP_POLL_SECONDS long.
        return int(self.stop_poll_seconds + REDIS_REPLY_SECONDS)

    def set_shutdown_requested_date(self) -> None:
        if self._shutdown_requested_date is not None:  # from the signal handler: no Redis here (StopNote)
            self._stop_note.ask(utcformat(self._shutdown_requested_date))

    def _shutdown(self) -> None:
        # Marked whatever follows: RQ raises StopRequested from the signal handler when the worker is
        # not busy, and a raise that lands in an ``except Exception`` of the code it interrupted is
        # lost (seen: a log handler's error path, "a worker log line was lost (StopRequested: )";
        # the worker then waited for work). The mark is not: RQ's loop and the wait for a job read it.
        self._stop_requested = True
        # Once Redis has moved a job to this worker and before it starts, RQ's raise strands the job
        # in RQ's intermediate list until a supervisor or RQ's ten-minute maintenance repairs it
        # (seen in a test: a pool stopped as its workers took their first chunks).
        if self._taking_job:
            if self.waiting:
                self._cutter.asked.set()
            return
        if not self.in_job:
            # Stopped between jobs: RQ's way out talks to Redis (the worker's death, its registries),
            # which a Redis that hangs never answers; the cutter ends the process if it does not.
            self._cutter.asked.set()
        super()._shutdown()  # type: ignore[no-untyped-call]

    def serialize(self) -> dict[str, Any]:
        # Where it runs and its pool, so a supervisor on this host can tell once both are gone that
        # its chunk is abandoned, without waiting for the heartbeat to go stale (worker_place).
        return {**super().serialize(), **worker_place.place_fields(os.environ.get(POOL_PID_ENV))}

    def heartbeat(self, timeout: int | None = None, pipeline: Any = None) -> None:
        # Each beat also looks at the pool: a worker that missed or misjudged its parent-death signal
        # (seen under load: a SIGKILLed pool's busy worker draining on as an orphan) learns it here.
        # A busy worker's beats come from its Heartbeat thread, which signals the main one to act.
        if not pool_alive():
            if threading.current_thread() is threading.main_thread():
                self._orphaned(ORPHANED_SIGNAL, None)
            else:
                os.kill(os.getpid(), ORPHANED_SIGNAL)
        try:
            if pipeline is None:  # RQ sends a heartbeat's three commands one round trip each
                with self.connection.pipeline(transaction=False) as pipe:
                    super().heartbeat(timeout, pipe)
                    pipe.execute()
            else:
                super().heartbeat(timeout, pipeline)
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
            # RQ's wait for a job retries a lost Redis forever; asked to stop, with nothing in hand,
            # there is nothing to wait for (a chunk in hand finishes without Redis: its output is in
            # the store, and the next supervisor reads it there).
            # (The state, not the current job: RQ reads that from Redis.)
            if self._stop_requested and self.get_state() != WorkerStatus.BUSY:
                raise RedisGoneWhileStopping(str(exc)) from exc
            raise
        # RQ's wait for a job starts each new wait with a heartbeat, also after a wait that a stop cut
        # short (it rounds the idle time left up to a whole second and waits again).
        if self.waiting and self._stop_requested:
            raise StoppedWhileWaiting

    def reorder_queues(self, reference_queue: Any) -> None:
        # RQ calls this as soon as its wait returned a job, before one more heartbeat: from here a
        # stop must give that job back (execute_job), not end the wait and strand it in RQ's
        # intermediate list (seen in CI: a pool's fork server killed as its workers took chunks).
        self.waiting = False
        self.turn += 1
        super().reorder_queues(reference_queue)

    def _take_turns(self) -> None:
        """Look in the runs' queues in this turn's order (jobs/queue/run_queues.py)."""
        try:
            names = run_queues.serving_order(
                run_queues.listed(self.connection, self.pool_queue), self.turn, self.pool_queue
            )
        except redis.exceptions.RedisError:
            return  # the wait that follows meets the same error, and RQ's retry handles it
        if names != self.queue_names():
            make = functools.partial(self.queue_class, connection=self.connection, serializer=self.serializer)
            self.queues = [make(name, job_class=self.job_class) for name in names]
            self._ordered_queues = self.queues[:]

    def dequeue_job_and_maintain_ttl(self, timeout: int | None, max_idle_time: int | None = None) -> Any:
        self._taking_job = True
        try:
            if timeout is None or max_idle_time is not None:  # burst: one look, no wait
                self._take_turns()
                result = super().dequeue_job_and_maintain_ttl(timeout, max_idle_time)
            else:
                # Short waits, since a signal no longer interrupts one: a stop is seen within a wait.
                result = None
                while result is None and not self._stop_requested:
                    self._take_turns()
                    self.waiting = True
                    try:
                        result = super().dequeue_job_and_maintain_ttl(
                            self.stop_poll_seconds, self.stop_poll_seconds
                        )
                    finally:
                        self.waiting = False
        except RedisGoneWhileStopping as exc:
            self.log.warning("Worker %s: stopping as asked; Redis cannot be reached (%s)", self.name, exc)
            result = None
        except StoppedWhileWaiting:
            result = None
        if result is None:
            self._taking_job = False
            if self._stop_requested:
                self.log.info("Worker %s: stopping on request", self.name)
        return result

    def execute_job(self, job: Any, queue: Any) -> None:
        if attempt_records.is_record(job):  # requeued by hand: it runs nothing (attempt_records.py)
            self._taking_job = False
            return attempt_records.put_back(self.connection, job, self.name)
        if self._stop_requested:  # the stop came while this worker took the job: it goes back, unstarted
            self._give_back(job, queue)
            self._taking_job = False
            raise StopRequested
        execution = self.prepare_execution(job)  # busy from here: RQ's own stop handling is right
        self.in_job, self._taking_job = True, False
        self.jobs_run += 1
        by_count = self.max_jobs is not None and self.jobs_run >= self.max_jobs
        by_time = self._time_is_up_after_this_job()
        if by_count or by_time:
            announce_last_job()  # the pool starts our replacement now, to load while we compute
        started = time.monotonic()
        try:
            with Heartbeat(self, job, execution):
                self.perform_job(job, queue, execution)
        finally:
            self.in_job = False
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

    def handle_job_failure(self, job: Any, queue: Any, *args: Any, **kwargs: Any) -> Any:
        """An attempt that ended without saying why (the job function never returned: a stop, its
        pool's death, a second signal) ended because its worker left: abandoned, whatever an
        earlier attempt said."""
        try:
            if jobmeta.ERROR_CLASS not in job.meta:
                said = (kwargs.get("exc_string") or (args[1] if len(args) > 1 else "") or "?").strip()
                why = f"its worker {self.name} left before the chunk finished ({said.splitlines()[-1]})"
                jobmeta.failed(job.meta, errors.ABANDONED, why)
                job.save_meta()
        except Exception as exc:  # Redis away, or meta no JSON writer takes (planted by someone else)
            self.log.debug("Worker %s: could not record why job %s ended: %s", self.name, job.id, exc)
        return super().handle_job_failure(job, queue, *args, **kwargs)

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
