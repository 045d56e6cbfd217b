"""Tie a child process's life to its parent's, so no worker or server outlives the process that owns it."""

from __future__ import annotations

import ctypes
import signal
import sys

_PR_SET_PDEATHSIG = 1
# Loaded here, once: a preexec_fn runs in the child between fork and exec, where loading a library
# could deadlock on the loader's lock if another thread (the metrics server) held it at the fork.
_LIBC = ctypes.CDLL("libc.so.6", use_errno=True) if sys.platform.startswith("linux") else None
# The pid a worker's parent had when it was started; a worker whose parent differs was orphaned
# before it began, and exits.
PARENT_PID_ENV = "CHUNKQ_PARENT_PID"


def die_with_parent() -> None:
    """In the child: SIGTERM it when its parent dies, even by SIGKILL (Linux; elsewhere a no-op)."""
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
