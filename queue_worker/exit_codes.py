"""Named worker exit codes, so the pool knows why a worker ended without parsing its log.

RQ itself exits 0 after max-jobs, burst, idle timeout and warm shutdown alike.
"""

from __future__ import annotations

import signal

EXIT_STOPPED = 0  # asked to stop (signal) and did so cleanly
EXIT_ERROR = 1  # an unexpected exception in the worker itself
# Ran its N jobs or worked its --recycle-after seconds: recycled, so the CUDA context is destroyed
# rather than flushed.
EXIT_MAX_JOBS = 10
EXIT_CUDA_FATAL = 11  # the CUDA context is broken; only a fresh process can use the GPU again
EXIT_CONFIG = 12  # the settings cannot work (no CUDA on a GPU worker, bad model); restarting will not help
EXIT_REDIS = 13  # lost the connection to Redis
EXIT_ORPHANED = 14  # its pool is gone
EXIT_FORKED_NO_CUDA = 15  # forked by the fork server, it cannot create a CUDA context: use fresh interpreters

REASONS = {
    EXIT_STOPPED: "stopped on request",
    EXIT_ERROR: "crashed with an unexpected error",
    EXIT_MAX_JOBS: "recycled: ran its max jobs or worked its --recycle-after seconds",
    EXIT_CUDA_FATAL: "hit a fatal CUDA error",
    EXIT_CONFIG: "refused its configuration",
    EXIT_REDIS: "lost Redis",
    EXIT_ORPHANED: "found its pool gone",
    EXIT_FORKED_NO_CUDA: "could not create a CUDA context in a forked process",
}


def describe(returncode: int) -> str:
    """A human reason for a worker's return code (negative means killed by a signal)."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"killed by {name}"
    return REASONS.get(returncode, f"exited with unknown code {returncode}")
