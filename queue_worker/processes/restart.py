"""The pool's restart policy: what an ended worker means for its job, its device and its slot.

A pure decision from the exit code (``exit_codes.CODES``), whether the pool is stopping, and the
slot's and device's recent history, so the pool's loop only carries it out and a test can ask it
directly: the job to fail now, the crash window that retires a device, the back-off while Redis
is away, the fork server given up after a forked worker could not create a CUDA context.
"""

from __future__ import annotations

import logging
import signal
from dataclasses import dataclass

from chunkq.queue_worker import exit_codes

REDIS_BACKOFF_CAP = 60.0  # seconds between workers of a slot while Redis stays away


@dataclass(frozen=True)
class Verdict:
    code: int  # the exit code as the pool reads it (a SIGTERM while stopping is a stop)
    abandon_job: bool  # fail the job it was running now, not after RQ's timeout + 60 s
    counts_as_crash: bool  # toward --crash-limit for its device
    may_restart: bool  # False: starting the same worker again cannot help; retire the slot
    retire_device: bool  # --crash-limit deaths within --crash-window: take the device out of the pool
    stop_forking: bool  # a forked worker cannot create a CUDA context: start fresh interpreters
    delay: float  # seconds before its replacement starts
    redis_losses: int  # the slot's workers in a row that ended because Redis was away
    crashes: tuple[float, ...]  # the device's deaths within the crash window, this one included
    level: int  # how loudly the pool logs it


@dataclass(frozen=True)
class RestartPolicy:
    restart_delay: float  # after an unexpected exit, so a crashing worker cannot spin
    crash_limit: int
    crash_window: float

    def judge(
        self,
        code: int,
        redis_losses: int = 0,
        crashes: tuple[float, ...] = (),
        now: float = 0.0,
        stopping: bool = False,
    ) -> Verdict:
        """``code``: the worker's return code (negative: the signal that killed it); ``redis_losses``
        and ``crashes``: the slot's and its device's history, as the last verdict left them.

        While Redis stays away, each worker that ends for it waits twice as long as the last, up to
        REDIS_BACKOFF_CAP: not a respawn every second for as long as the outage lasts."""
        if stopping and code == -signal.SIGTERM:
            code = exit_codes.EXIT_STOPPED  # told to stop before its handlers were even installed
        meaning = exit_codes.of(code)
        losses = redis_losses + 1 if code == exit_codes.EXIT_REDIS else 0  # any other end: Redis was there
        delay = 0.0 if meaning.clean else self.restart_delay
        if losses:
            delay = min(REDIS_BACKOFF_CAP, max(delay, 1.0) * 2**losses)
        recent = tuple(t for t in crashes if now - t <= self.crash_window)
        if meaning.gpus_fault:
            recent += (now,)
        return Verdict(
            code=code,
            abandon_job=not meaning.clean,
            counts_as_crash=meaning.gpus_fault,
            may_restart=meaning.restart,
            retire_device=meaning.retires_device or (meaning.gpus_fault and len(recent) >= self.crash_limit),
            stop_forking=code == exit_codes.EXIT_FORKED_NO_CUDA,
            delay=float(delay),
            redis_losses=losses,
            crashes=recent,
            level=logging.INFO if meaning.clean else logging.WARNING,
        )
