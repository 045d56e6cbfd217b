"""Warm standby: a replacement worker loads its model while the old one runs its last chunk.

The old worker says "starting my last job" through a pipe the pool gave it; the pool starts the
replacement at once; the replacement imports torch and loads the model, then waits for the old
process to exit before it takes a job, so two copies never compute at once on one GPU and the
GPU never sits idle through a model load.
"""

from __future__ import annotations

import logging
import os
import select
import time

from chunkq.jobs.contract import environment

log = logging.getLogger(__name__)

NOTIFY_FD_ENV = environment.NOTIFY_FD  # the worker writes one line here when it starts its last job
WAIT_FOR_PID_ENV = environment.WAIT_FOR_PID  # a standby waits for this process to exit first
LAST_JOB = b"last\n"
MODEL_LOADED = b"loaded"  # followed by the seconds the load took, for the pool's metrics


def _tell_pool(line: bytes) -> None:
    fd = os.environ.get(NOTIFY_FD_ENV)
    if not fd:
        return
    try:
        os.write(int(fd), line)
    except OSError as exc:  # the pool is gone; its parent-death signal will follow
        log.debug("could not tell the pool %r: %s", line, exc)


def announce_last_job() -> None:
    """Tell the pool this worker has started its last job (no-op outside a pool)."""
    _tell_pool(LAST_JOB)


def announce_model_loaded(seconds: float) -> None:
    _tell_pool(MODEL_LOADED + f" {seconds:.3f}\n".encode())


def parse_announcements(data: bytes) -> tuple[bool, list[float]]:
    """(whether the worker started its last job, the model load times it reported) from pipe bytes."""
    last, loads = False, []
    for line in data.splitlines():
        if line == LAST_JOB.strip():
            last = True
        elif line.startswith(MODEL_LOADED + b" "):
            try:
                loads.append(float(line.split()[1]))
            except ValueError:
                pass
    return last, loads


def wait_for_predecessor(should_stop: object = None) -> None:
    """Block until the worker this one replaces has exited (its CUDA context destroyed)."""
    raw = os.environ.get(WAIT_FOR_PID_ENV)
    if not raw:
        return
    pid = int(raw)
    started = time.monotonic()
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except OSError:  # no pidfd (old kernel): fall back to polling
        while _alive(pid) and not (callable(should_stop) and should_stop()):
            time.sleep(0.05)
        return
    try:
        while not (callable(should_stop) and should_stop()):
            ready, _, _ = select.select([fd], [], [], 0.5)
            if ready:
                break
    finally:
        os.close(fd)
    log.info("predecessor %d exited; waited %.2f s after loading", pid, time.monotonic() - started)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
