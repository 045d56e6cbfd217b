"""The pool's restart policy: what an ended worker means for its job, its device and its slot.

A pure decision from the exit code (``exit_codes.CODES``) and the slot's recent history, so the
pool's loop only carries it out, and a test can ask it directly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from chunkq.queue_worker import exit_codes

REDIS_BACKOFF_CAP = 60.0  # seconds between workers of a slot while Redis stays away


@dataclass(frozen=True)
class Verdict:
    abandon_job: bool  # fail the job it was running now, not after RQ's timeout + 60 s
    counts_as_crash: bool  # toward --crash-limit for its device
    may_restart: bool  # False: starting the same worker again cannot help; retire the slot
    delay: float  # seconds before its replacement starts
    redis_losses: int  # the slot's workers in a row that ended because Redis was away
    level: int  # how loudly the pool logs it


@dataclass(frozen=True)
class RestartPolicy:
    restart_delay: float = 1.0  # after an unexpected exit, so a crashing worker cannot spin

    def judge(self, code: int, redis_losses: int) -> Verdict:
        """While Redis stays away, each worker that ends for it waits twice as long as the last, up to
        REDIS_BACKOFF_CAP: not a respawn every second for as long as the outage lasts."""
        meaning = exit_codes.of(code)
        losses = redis_losses + 1 if code == exit_codes.EXIT_REDIS else 0  # any other end: Redis was there
        delay = 0.0 if meaning.clean else self.restart_delay
        if losses:
            delay = min(REDIS_BACKOFF_CAP, max(delay, 1.0) * 2**losses)
        return Verdict(
            abandon_job=not meaning.clean,
            counts_as_crash=meaning.gpus_fault,
            may_restart=meaning.restart,
            delay=float(delay),
            redis_losses=losses,
            level=logging.INFO if meaning.clean else logging.WARNING,
        )
