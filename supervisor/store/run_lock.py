"""One supervisor per run: a Redis lock with expiry, renewed on every look.

A supervisor that is killed leaves its lock to expire, so its successor waits at most the TTL;
one that took the run's store lock over from it (it is known gone) drops the lock at once.
"""

from __future__ import annotations

import logging

import redis
from redis.exceptions import LockError

from chunkq.jobs.contract.errors import ChunkqError

log = logging.getLogger(__name__)

LOCK_TTL_SECONDS = 15.0
LOCK_WAIT_SECONDS = 30.0  # longer than the TTL: a restarted supervisor outwaits its dead predecessor


class RunLockedError(ChunkqError):
    """Another supervisor is watching this run."""


class RunLock:
    def __init__(self, connection: redis.Redis, run_id: str, wait: float = LOCK_WAIT_SECONDS) -> None:
        self.run_id, self.wait = run_id, wait
        self.lock = connection.lock(
            f"chunkq:supervisor:{run_id}", timeout=LOCK_TTL_SECONDS, thread_local=False
        )

    def acquire(self) -> None:
        if not self.lock.acquire(blocking=True, blocking_timeout=self.wait):
            raise RunLockedError(
                f"another supervisor is watching run {self.run_id} (lock held for over {self.wait:.0f} s); "
                "stop it, or let it finish"
            )

    def take_over(self, whose: str) -> None:
        """Drop the lock of a supervisor known to be gone: ``whose`` is the run's store lock that
        was taken over from it (every supervisor holds that lock before this one). Otherwise its
        successor waited out the TTL before its first look: a rerun after a kill -9 sat silent
        for up to 15 s with every chunk done."""
        if self.lock.redis.delete(self.lock.name):
            log.warning("run %s: taking over the supervisor lock of %s", self.run_id, whose)
        else:  # its TTL ran out before this process got here
            log.info("run %s: the supervisor lock of %s had expired", self.run_id, whose)

    def renew(self) -> None:
        """Keep the lock; if it expired (Redis was away), take it again or give up the run."""
        try:
            self.lock.reacquire()
        except LockError:
            log.warning("supervisor lock of run %s expired; taking it again", self.run_id)
            self.acquire()

    def release(self) -> None:
        try:
            self.lock.release()
        except (LockError, redis.RedisError):
            pass  # expired or unreachable: it will expire on its own
