"""Every chunkq process's exit code, in one table: the commands' (what a shell sees) and the
workers' (what a pool reads, so it knows why a worker ended without parsing its log).

A number means one thing wherever both kinds use it: 0 done or stopped, 6 configuration, 7 Redis.
``chunkq pool`` is a command and exits with the commands' codes; 1, 10, 11, 14 and 15 from a worker
are the workers' own (1 is Python's own code for an uncaught exception), read only by its pool.
RQ itself exits 0 after max-jobs, burst, idle timeout and warm shutdown alike.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass

# Shared by commands and workers.
EXIT_OK = 0
EXIT_CONFIG = 6  # settings that cannot work: restarting will not help
EXIT_REDIS = 7  # Redis unreachable, or lost

# Commands (chunkq ...).
EXIT_CHUNKS_FAILED = 1  # chunks were quarantined; the report names each with its rows and last error
EXIT_USAGE = 2  # click's own code for a bad command line
EXIT_BAD_INPUT = 3  # the corpus is malformed
EXIT_CONFLICT = 4  # the run id is taken by another corpus or other options
EXIT_ASSEMBLY = 5  # chunk outputs missing or corrupt
EXIT_POOL_DIED = 8  # chunkq run: the worker pool ended before the run did
EXIT_PARTIAL = 9  # --allow-partial: a result without the quarantined chunks was published
EXIT_LOCKED = 10  # another supervisor is watching the run
EXIT_STORAGE = 11  # a disk or store is full, read-only or not ours to write
EXIT_NOT_FOUND = 13  # no run of that id in the store
EXIT_INTERNAL = 70  # a bug in chunkq (sysexits' EX_SOFTWARE); the traceback is written to a file
EXIT_INTERRUPTED = 130  # Ctrl+C; the run resumes from the store
EXIT_BROKEN_PIPE = 141  # whoever read the output stopped reading (`| head`): 128 + SIGPIPE, as a shell says

# Workers (python -m chunkq.queue_worker.worker), read by their pool.
EXIT_STOPPED = EXIT_OK
EXIT_ERROR = 1
EXIT_MAX_JOBS = 10
EXIT_CUDA_FATAL = 11
EXIT_ORPHANED = 14
EXIT_FORKED_NO_CUDA = 15
EXIT_NO_CONTEXT = 16
EXIT_DEVICE_UNSUPPORTED = 17


@dataclass(frozen=True)
class ExitCode:
    reason: str  # for people: "worker X <reason>"
    label: str  # for metrics: a short, bounded label
    clean: bool = False  # an ending, not a failure: its job (if any) settled, no crash counted
    restart: bool = True  # starting the same worker again can help
    gpus_fault: bool = True  # counts toward --crash-limit for its device
    retires_device: bool = False  # no worker on this device can help: take it out of the pool at once


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
    # Out of memory or busy while creating its context: this worker, not the fork server, failed.
    EXIT_NO_CONTEXT: ExitCode("could not create its CUDA context (out of memory or busy)", "no_context"),
    # No kernels for this GPU's architecture, an unsupported cuBLAS call: its job goes elsewhere.
    EXIT_DEVICE_UNSUPPORTED: ExitCode(
        "found that its GPU cannot run the model",
        "unsupported",
        restart=False,
        gpus_fault=False,
        retires_device=True,
    ),
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
