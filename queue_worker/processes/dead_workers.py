"""The jobs of a pool's dead and hung workers: failed at once, not after RQ's timeout + 60 s.

RQ notices a dead worker's job only when the job's timeout and a minute more have passed, and
cannot stop a hung CUDA call (SIGALRM does not interrupt one). The pool knows sooner: it reaped the
process, or saw its job run past its timeout. Each such worker's job is failed here as abandoned
(the supervisor retries it), and its name freed; while Redis is away, the worker is kept and tried
again on the pool's next turn.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Iterable
from typing import Any

import psutil
import redis

from chunkq.jobs.queue.abandon import forget_worker, mark_abandoned, running_job_ids
from chunkq.jobs.queue.queueing import fetch_job, workers_named

log = logging.getLogger("chunkq.queue_worker.processes.pool")  # the pool's own lines, under its one name

WATCHDOG_SECONDS = 2.0  # how often running jobs are checked against their timeouts
RELEASE_RETRY_SECONDS = 10.0  # after Redis refused a release, before the next try


class DeadWorkers:
    """One pool's record of the workers whose jobs must be released."""

    def __init__(self, connection: redis.Redis, pool_name: str, queue: str, hung_grace: float) -> None:
        self.connection = connection
        self.pool_name = pool_name
        self.queue = queue
        self.hung_grace = hung_grace
        self.pending: list[tuple[str, str]] = []  # (worker name, reason) not yet released
        self.hung: dict[str, str] = {}  # worker name -> why the watchdog killed it
        self._next_watchdog = 0.0
        self._retry_at = float("-inf")

    def add(self, worker_name: str, reason: str) -> None:
        self.pending.append((worker_name, reason))

    def release(self, now: float | None = None) -> None:
        """Fail the jobs of the workers added so far. Once Redis refuses one, the rest wait with it
        for a later turn, RELEASE_RETRY_SECONDS on: against a Redis that answers nothing each try
        costs a whole reply limit, and one after another they held the pool's loop (a signal, a
        reaped worker) 5 s for every worker that had died meanwhile, 50 s after a few minutes."""
        now = time.monotonic() if now is None else now
        if now < self._retry_at:
            return
        pending, self.pending = self.pending, []
        for number, (worker_name, reason) in enumerate(pending):
            try:
                for job_id in running_job_ids(self.connection, worker_name):
                    mark_abandoned(self.connection, job_id, f"worker {worker_name} {reason}")
                forget_worker(self.connection, worker_name)
            except redis.RedisError as exc:
                waiting = len(pending) - number
                log.warning("cannot release the jobs of %d dead worker(s) yet (%s); will retry", waiting, exc)
                self.pending.extend(pending[number:])
                self._retry_at = now + RELEASE_RETRY_SECONDS
                return

    def release_predecessors(self) -> None:
        """Workers of an earlier run of this pool under the same name (a requeued Slurm job, a
        restarted service) that died with it on this host: their jobs fail now, not once their
        heartbeat is stale, and their names are freed (RQ refuses to register a name twice)."""
        host = socket.gethostname()
        try:
            for worker in workers_named(self.connection, self.queue, f"{self.pool_name}-"):
                if worker.hostname != host or worker.pid is None:
                    continue  # on another host: its heartbeat tells the supervisor
                if not _alive(worker.pid, worker.name):
                    self.add(
                        worker.name, f"(pid {worker.pid}) died with an earlier run of pool {self.pool_name}"
                    )
        except redis.RedisError as exc:
            log.warning("cannot look for workers of an earlier run of this pool (%s)", exc)
        self.release()

    def watchdog(self, now: float, running: Iterable[tuple[str, Any]]) -> None:
        """Kill each running worker (name, process) whose job runs past its timeout and the grace."""
        if now < self._next_watchdog:
            return
        self._next_watchdog = now + WATCHDOG_SECONDS
        for worker_name, proc in running:
            try:
                for job_id in running_job_ids(self.connection, worker_name):
                    job = fetch_job(self.connection, job_id)
                    if job is None:
                        continue
                    started = job.started_at.timestamp() if job.started_at else time.time()
                    limit = (job.timeout or 0) + self.hung_grace
                    if job.timeout and time.time() - started > limit:
                        self.hung[worker_name] = f"hung on {job_id} for over {limit:.0f} s; killed"
                        log.error("worker %s %s", worker_name, self.hung[worker_name])
                        proc.kill()
            except Exception as exc:  # a job gone between the two reads, or Redis away
                log.debug("watchdog skipped %s: %s", worker_name, exc)


def _alive(pid: int, worker_name: str) -> bool:
    """Whether ``pid`` is still that worker (its title names it), not a reused pid."""
    try:
        return worker_name in " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return False
