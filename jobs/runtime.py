"""The per-process worker context (arq's ``ctx``): who runs the job, on which device."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

# How the pool tells a worker its device: set in its environment before torch is imported.
DEVICE_ENV = "CHUNKQ_DEVICE"  # "cpu" or "cuda"
GPU_ENV = "CHUNKQ_GPU"  # the physical GPU index, for the record


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


_context: WorkerContext | None = None
_broken: str | None = None


def set_context(context: WorkerContext) -> None:
    global _context
    _context = context


def mark_context_broken(reason: str) -> None:
    """Record that this process's CUDA context is unusable; the worker exits after the job."""
    global _broken
    _broken = reason


def context_broken() -> str | None:
    return _broken


def current() -> WorkerContext:
    """The context the worker set at start-up, or a CPU default for plain in-process calls."""
    if _context is not None:
        return _context
    return WorkerContext(
        name=f"local-{os.getpid()}", host=socket.gethostname(), pid=os.getpid(), device="cpu"
    )
