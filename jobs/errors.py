"""The chunkq exception tree: which failures are whose fault, and what should happen next."""

from __future__ import annotations


class ChunkqError(Exception):
    """Base of every error chunkq raises on purpose."""


class ConfigError(ChunkqError):
    """The settings cannot work (unknown GPU, bad option); fix the command, not the data."""


class BadInputError(ChunkqError):
    """The input cannot be encoded as given; retrying will not help."""


class CorpusError(BadInputError):
    """A corpus file is malformed; the message names the file and line or row."""


class RunConflictError(ChunkqError):
    """A run id is already taken by a different corpus or different options."""


class StoreError(ChunkqError):
    """The store holds something missing or inconsistent for a run."""


class AssemblyError(StoreError):
    """Assembly found missing or corrupt chunk outputs; ``problems`` lists every one."""

    def __init__(self, run_id: str, problems: list[str]) -> None:
        self.run_id = run_id
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"run {run_id}: cannot assemble, {len(problems)} problem(s):\n{lines}")


class JobNotAllowedError(ChunkqError):
    """A job named a function, callback or webhook outside the allow-list."""


class ChunkOutOfMemoryError(ChunkqError):
    """Out of memory even at the smallest batch size; another worker or GPU may still manage."""


class CudaFatalError(ChunkqError):
    """The CUDA context is broken (sticky error); only a fresh process can use the GPU again."""


class ChunkAbandonedError(ChunkqError):
    """The worker running the chunk died or hung; the chunk itself may be fine."""


# Error classes as recorded in a job's meta and used by the supervisor's retry policy.
OOM = "oom"
CUDA_FATAL = "cuda_fatal"
BAD_INPUT = "bad_input"
CONFIG = "config"
ABANDONED = "abandoned"
OTHER = "other"
NEVER_RETRIED = frozenset({BAD_INPUT, CONFIG})
NOT_THE_CHUNKS_FAULT = frozenset({ABANDONED, CUDA_FATAL})  # retried at once, on a fresh process

_OOM_MARKERS = ("out of memory", "cublas_status_alloc_failed", "cudnn_status_alloc_failed",
                "cudnn_status_not_enough_workspace")  # fmt: skip
_CUDA_FATAL_MARKERS = (
    "illegal memory access",
    "unspecified launch failure",
    "device-side assert",
    "nvml_success == driverapi::get()->nvmlinit_v2_()",
    "cudacachingallocator",
    "expandable_segments",
    "cuda error",
    "cuda driver error",
    "cublas_status_execution_failed",
    "cudnn_status_execution_failed",
    "misaligned address",
    "an illegal instruction",
)


def classify(exc: BaseException) -> str:
    """Which error class ``exc`` belongs to; decides retry, back-off or quarantine."""
    if isinstance(exc, ChunkOutOfMemoryError):
        return OOM
    if isinstance(exc, CudaFatalError):
        return CUDA_FATAL
    if isinstance(exc, BadInputError):
        return BAD_INPUT
    if isinstance(exc, ConfigError):
        return CONFIG
    if isinstance(exc, ChunkAbandonedError):
        return ABANDONED
    message = str(exc).lower()
    if type(exc).__name__ == "OutOfMemoryError" or (
        isinstance(exc, RuntimeError) and any(marker in message for marker in _OOM_MARKERS)
    ):
        # A failed expandable-segments mapping reports "out of memory" too, but it breaks the context.
        return CUDA_FATAL if "expandable_segments" in message else OOM
    if isinstance(exc, RuntimeError) and any(marker in message for marker in _CUDA_FATAL_MARKERS):
        return CUDA_FATAL
    return OTHER
