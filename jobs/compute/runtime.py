"""The per-process worker context (arq's ``ctx``): who runs the job, on which device."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from chunkq.jobs.compute.device_busy import UtilisationSince
from chunkq.jobs.contract import environment

# How the pool tells a worker its device: set in its environment before torch is imported.
DEVICE_ENV = environment.DEVICE  # "cpu" or "cuda"
GPU_ENV = environment.GPU  # the physical GPU index, for the record
# When the pool that started this worker started, and the run it was started for (``chunkq run``
# starts a pool per run): how long the run waited before its first chunk, for the report.
POOL_STARTED_ENV = environment.POOL_STARTED_AT
POOL_FOR_RUN_ENV = environment.POOL_FOR_RUN


@dataclass(frozen=True)
class WorkerContext:
    """Identity of the process running jobs; recorded in every chunk's output metadata."""

    name: str
    host: str
    pid: int
    device: str  # "cpu" or "cuda" (the one GPU that CUDA_VISIBLE_DEVICES leaves visible)
    gpu: str | None = None  # the physical GPU index the pool pinned, for the record
    device_kind: str = "cpu"  # the GPU's model name: what a learned batch size is valid for
    # What jobs may name, since anyone who can write to Redis can write a job: the one store this
    # worker serves and the models it may load. None only for plain in-process calls (tests, notebooks).
    store: str | None = None
    models: frozenset[str] | None = None
    remote_code: bool = False  # whether a model's own code may run here (pool --trust-remote-code)
    # Start-up, as wall-clock seconds (epoch): the pool's start, this process's, and when it was
    # ready to take a job (model loaded, warmed up). None where unknown (in-process calls).
    pool_started_at: float | None = None
    pool_for_run: str | None = None
    process_started_at: float | None = None
    ready_at: float | None = None
    warm_up_seconds: float | None = None  # the warm-up encode before ready_at (None: none ran)
    # The GPU's utilisation samples since a time (jobs.compute.device_busy), from the worker's NVML; None
    # on the CPU or where NVML cannot say (a busy share then comes from CUDA events).
    utilisation: UtilisationSince | None = field(default=None, compare=False, repr=False)

    def startup(self) -> dict[str, Any] | None:
        """What a chunk's output records of its worker's start-up (ISO times), or None."""
        if self.process_started_at is None:
            return None

        def iso(t: float | None) -> str | None:
            return None if t is None else datetime.fromtimestamp(t, UTC).isoformat()

        return {
            "pool_started_at": iso(self.pool_started_at),
            "pool_for_run": self.pool_for_run,
            "process_started_at": iso(self.process_started_at),
            "ready_at": iso(self.ready_at),
            "warm_up_seconds": None if self.warm_up_seconds is None else round(self.warm_up_seconds, 3),
        }


# Why a worker must end after the job in hand (jobs/ cannot name the worker's exit codes; the
# worker maps each to one): the first reason given holds.
BROKEN_CONTEXT = "broken_context"  # a sticky CUDA error: no in-process reset exists
DEVICE_UNSUPPORTED = "device_unsupported"  # this GPU cannot run this model at all

_context: WorkerContext | None = None
_ending: tuple[str, str] | None = None  # (one of the reasons above, the error)


def set_context(context: WorkerContext) -> None:
    global _context
    _context = context


def end_after_job(why: str, detail: str) -> None:
    """Record that this process must not take another job; the worker exits after this one."""
    global _ending
    if _ending is None:
        _ending = (why, detail)


def ending() -> tuple[str, str] | None:
    """Why this process must end after its job, and the error that decided it; None to go on."""
    return _ending


def reset_ending() -> None:
    """For tests that run jobs in-process: forget an earlier job's verdict."""
    global _ending
    _ending = None


def context_broken() -> str | None:
    """The error that broke this process's CUDA context, or None."""
    return _ending[1] if _ending is not None and _ending[0] == BROKEN_CONTEXT else None


def current() -> WorkerContext:
    """The context the worker set at start-up, or a CPU default for plain in-process calls."""
    if _context is not None:
        return _context
    return WorkerContext(
        name=f"local-{os.getpid()}", host=socket.gethostname(), pid=os.getpid(), device="cpu"
    )
