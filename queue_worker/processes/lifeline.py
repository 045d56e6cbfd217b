"""Tie a child process's life to its parent's, so no worker or server outlives the process that owns it."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

import psutil

from chunkq.jobs.contract import environment

_PR_SET_PDEATHSIG = 1
# Loaded here, once: a preexec_fn runs in the child between fork and exec, where loading a library
# could deadlock on the loader's lock if another thread (the metrics server) held it at the fork.
_LIBC = ctypes.CDLL("libc.so.6", use_errno=True) if sys.platform.startswith("linux") else None
# The pid a worker's parent had when it was started; a worker whose parent differs was orphaned
# before it began, and exits.
PARENT_PID_ENV = environment.PARENT_PID
# What a pool stops a worker with (SIGTERM drains, a second one stops now; SIGINT as SIGTERM). A pool
# may send it the moment it learns a forked worker's pid: the fork server holds these signals across
# the fork, and the worker lets them through once its handlers are in place (worker.py), so a stop
# sent in between is neither lost (the server ignores SIGTERM, or handles it as its own stop) nor fatal.
STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT})
# The pool's pid, for a worker whose parent died (ORPHANED_SIGNAL) to tell whether its pool lives on.
POOL_PID_ENV = environment.POOL_PID


# What a worker gets when the process that started it dies (its pool, or the pool's fork server).
# With its pool gone too it stops at once: nobody watches it any more, and under a batch system its
# GPU may already be another job's (a pool SIGKILLed alone left its busy workers encoding for minutes
# as orphans, heartbeating, so their chunks were never retried). With its pool alive (only the fork
# server died) it drains, as on SIGTERM, and the pool replaces it.
ORPHANED_SIGNAL = signal.SIGHUP


def pool_alive() -> bool:
    """Whether the pool named in this worker's environment still runs (True when none is named).
    A zombie is dead: the signal that asks comes as the pool dies, before anyone has reaped it
    (seen in CI: the worker of a SIGKILLed pool took it for alive and drained on)."""
    pid = os.environ.get(POOL_PID_ENV)
    if not pid:
        return True
    try:
        return bool(psutil.Process(int(pid)).status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False
    except (psutil.Error, ValueError):
        return True


def process_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not: it is dead, only not yet reaped)."""
    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


def die_with_parent(sig: signal.Signals = signal.SIGTERM) -> None:
    """In the child: send it ``sig`` when its parent dies, even by SIGKILL (Linux; elsewhere a no-op)."""
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, sig)


def killed_with_parent() -> None:
    """In a child that ignores SIGTERM (the fork server): SIGKILL when its parent dies."""
    die_with_parent(signal.SIGKILL)


def worker_dies_with_parent() -> None:
    """In a worker: ORPHANED_SIGNAL when its parent (the pool, or the pool's fork server) dies."""
    die_with_parent(ORPHANED_SIGNAL)


def fork_holding_stop_signals() -> int:
    """``os.fork()``, the child starting with STOP_SIGNALS held until its handlers exist (worker.py
    lets them through), this process's own signal mask unchanged."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    pid = -1
    try:
        pid = os.fork()
    finally:
        if pid != 0:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
    return pid
