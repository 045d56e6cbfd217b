"""Named worker exit codes, so the pool knows why a worker ended without parsing its log.

RQ itself exits 0 after max-jobs, burst, idle timeout and warm shutdown alike. One table says, for
each code, what people read, what metrics label it, and what the pool does about it.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass

EXIT_STOPPED = 0
EXIT_ERROR = 1
EXIT_MAX_JOBS = 10
EXIT_CUDA_FATAL = 11
EXIT_CONFIG = 12
EXIT_REDIS = 13
EXIT_ORPHANED = 14
EXIT_FORKED_NO_CUDA = 15


@dataclass(frozen=True)
class ExitCode:
    reason: str  # for people: "worker X <reason>"
    label: str  # for metrics: a short, bounded label
    clean: bool = False  # an ending, not a failure: its job (if any) settled, no crash counted
    restart: bool = True  # starting the same worker again can help
    gpus_fault: bool = True  # counts toward --crash-limit for its device


CODES = {
    EXIT_STOPPED: ExitCode("stopped on request", "stopped", clean=True, gpus_fault=False),
    EXIT_ERROR: ExitCode("crashed with an unexpected error", "error"),
    # Recycled, so the CUDA context is destroyed rather than flushed.
    EXIT_MAX_JOBS: ExitCode(
        "recycled: ran its max jobs or worked its --recycle-after seconds",
        "recycled",
        clean=True,
        gpus_fault=False,
    ),
    # Only a fresh process can use the GPU again.
    EXIT_CUDA_FATAL: ExitCode("hit a fatal CUDA error", "cuda_fatal"),
    # No CUDA on a GPU worker, a bad model: restarting will not help.
    EXIT_CONFIG: ExitCode("refused its configuration", "config", restart=False, gpus_fault=False),
    EXIT_REDIS: ExitCode("lost Redis", "redis", gpus_fault=False),
    EXIT_ORPHANED: ExitCode("found its pool gone", "orphaned"),
    # Forked by the fork server, it cannot create a CUDA context: the pool uses fresh interpreters.
    EXIT_FORKED_NO_CUDA: ExitCode(
        "could not create a CUDA context in a forked process", "forked_no_cuda", gpus_fault=False
    ),
}
KILLED = ExitCode("killed by a signal", "killed")
UNKNOWN = ExitCode("exited with an unknown code", "unknown")


def of(returncode: int) -> ExitCode:
    """What a worker's return code means (negative: killed by that signal)."""
    if returncode < 0:
        return KILLED
    return CODES.get(returncode, UNKNOWN)


def describe(returncode: int) -> str:
    """A human reason for a worker's return code, the signal named when it was killed."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"killed by {name}"
    if returncode not in CODES:
        return f"exited with unknown code {returncode}"
    return CODES[returncode].reason
