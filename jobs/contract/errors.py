"""The chunkq exception tree: which failures are whose fault, and what should happen next."""

from __future__ import annotations

import errno
import os
import re


class ChunkqError(Exception):
    """Base of every error chunkq raises on purpose."""


class ConfigError(ChunkqError):
    """The settings cannot work (unknown GPU, bad option); fix the command, not the data."""


class BadInputError(ChunkqError):
    """The input cannot be encoded as given; retrying will not help."""


class BadRowsError(BadInputError):
    """Rows of a chunk cannot be read (an image missing or not an image): ``rows`` maps each row's
    place in the chunk to the reason. Without --allow-missing the chunk fails, naming them."""

    def __init__(self, message: str, rows: dict[int, str]) -> None:
        super().__init__(message)
        self.rows = rows


class CorpusError(BadInputError):
    """A corpus file is malformed; the message names the file and line or row."""


class RunConflictError(ChunkqError):
    """A run id is already taken by a different corpus or different options."""


class ModelChangedError(RunConflictError):
    """A run's model is not the bytes it was submitted with (its files replaced since)."""


class StoreError(ChunkqError):
    """The store holds something missing or inconsistent for a run."""


class RunNotFoundError(StoreError):
    """The store holds no run of that id."""


class DamagedRunError(StoreError):
    """A run's own record (its manifest) cannot be read: the run cannot be resumed, only removed."""


class AssemblyError(StoreError):
    """Assembly found missing or corrupt chunk outputs; ``problems`` lists every one."""

    def __init__(self, run_id: str, problems: list[str], doing: str = "assemble") -> None:
        """``doing``: what cannot be done (a reader's "read its result": an export is no assembly)."""
        self.run_id = run_id
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"run {run_id}: cannot {doing}, {len(problems)} problem(s):\n{lines}")


class ChunksFailedError(ChunkqError):
    """Chunks were quarantined after their attempts (or the run stopped before it settled)."""


class TamperedJobError(ConfigError):
    """A job's spec differs from its run's manifest (written into Redis by someone else); refused."""


class JobNotAllowedError(ChunkqError):
    """A job named a function, callback or webhook outside the allow-list."""


class StoreWriteError(ChunkqError):
    """The store cannot be written (full, read-only, not ours): no chunk can finish until it is fixed."""


class ChunkOutOfMemoryError(ChunkqError):
    """Out of memory even at the smallest batch size; another worker or GPU may still manage."""


class CudaFatalError(ChunkqError):
    """The CUDA context is broken (sticky error); only a fresh process can use the GPU again."""


class DeviceUnsupportedError(ConfigError):
    """This GPU cannot run this model (no kernels for its architecture, an unsupported cuBLAS call):
    the device takes no more chunks; another device may run them."""


class NonFiniteError(ChunkqError):
    """The encode produced NaN or infinite values; the chunk is never published with them."""


class ChunkAbandonedError(ChunkqError):
    """The worker running the chunk died or hung; the chunk itself may be fine."""


# Error classes as recorded in a job's meta and used by the supervisor's retry policy.
OOM = "oom"
CUDA_FATAL = "cuda_fatal"
BAD_INPUT = "bad_input"
CONFIG = "config"
TAMPERED = (
    "tampered"  # the job's spec was not the manifest's: the supervisor queues it again from the manifest
)
ABANDONED = "abandoned"
STORAGE = "storage"  # the store refused a write: the run stops with the path instead of retrying every chunk
STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM})
# A full or read-only disk as other runtimes word it: LanceDB's Rust ("No space left on device (os
# error 28), /path/to/lance-io/src/..."), FAISS's C++ ("write error in F: ... (No space left on device)").
_REFUSED_WRITE = re.compile(
    r"No space left on device|Disk quota exceeded|Read-only file system|os error (?:28|30|122)\b"
)


def refused_write(exc: BaseException) -> str | None:
    """Why a write was refused for want of room or of the right to write (in words), or None: an
    OSError of STORAGE_ERRNOS, or a client's error whose text says so."""
    if isinstance(exc, OSError) and exc.errno in STORAGE_ERRNOS:
        return exc.strerror or os.strerror(exc.errno)
    found = _REFUSED_WRITE.search(str(exc))
    if found is None:
        return None
    code = {"28": errno.ENOSPC, "30": errno.EROFS, "122": errno.EDQUOT}
    return (
        os.strerror(code[found.group(0).split()[-1]])
        if found.group(0).startswith("os error")
        else found.group(0)
    )


UNSUPPORTED = "unsupported"  # this GPU cannot run this model: retried at once, on another device
NON_FINITE = "non_finite"  # NaN or Inf rows: retried (once in float32 within the attempt, when lower)
OTHER = "other"
NEVER_RETRIED = frozenset({BAD_INPUT, CONFIG})
NOT_THE_CHUNKS_FAULT = frozenset({ABANDONED, CUDA_FATAL, UNSUPPORTED})  # retried at once, elsewhere

# Classification reads the exception's type and its first sentence only. A real torch OOM message
# ends in advice that names ``expandable_segments`` (torch >= 2.3, CUDACachingAllocator.cpp), so
# any marker searched for in the whole text would misread an OOM as a broken context (seen on an
# H100). Each pattern below is matched against the start of the first sentence.
_OOM_HEADS = (
    "cuda out of memory",  # CUDACachingAllocator: torch.OutOfMemoryError (a RuntimeError before 1.13)
    "hip out of memory",  # the same allocator on ROCm
    "cuda error: out of memory",  # cudaErrorMemoryAllocation outside the caching allocator
    "cuda error: cublas_status_alloc_failed",  # cuBLAS could not allocate its workspace
    "cudnn error: cudnn_status_alloc_failed",
)
# Host RAM on a CPU worker, where a smaller batch helps too. torch 2.13 words it "[enforce fail at
# alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: ...": the second sentence.
_CPU_OOM = "defaultcpuallocator: can't allocate memory"
# A sticky error: the context, or the caching allocator's view of it, stays broken for the life of
# the process (PyTorch has no in-process reset).
_CUDA_FATAL_HEADS = (
    "cuda driver error:",  # C10_CUDA_DRIVER_CHECK: an expandable-segments map/set-access failure
    "cuda error:",  # any other CUDA runtime error: illegal address, device-side assert, launch failure
    "cudnn error: cudnn_status_execution_failed",
)
# A failed assert in torch's CUDA code, e.g. the allocator's own `!handles_.at(i) INTERNAL ASSERT
# FAILED at "c10/cuda/CUDACachingAllocator.cpp":487` after a partial expandable-segment mapping, or
# NVML's `... INTERNAL ASSERT FAILED at PeerToPeerAccess.cpp:83`.
_INTERNAL_ASSERT = "internal assert failed"
_CUDA_WORDS = ("cuda", "nvml")
# An out-of-memory in disguise. When an allocation fails, the caching allocator's OOM branch calls
# ``reportProcessMemoryInfo`` (c10/cuda/CUDACachingAllocator.cpp) to describe the device's memory
# before it raises OutOfMemoryError; that function asserts ``NVML_SUCCESS ==
# DriverAPI::get()->nvmlInit_v2_()``, ``... nvmlDeviceGetHandleByPciBusId_v2_( pci_id,
# &nvml_device)`` and ``NVML_SUCCESS == r`` (nvmlDeviceGetComputeRunningProcesses). Where NVML
# cannot work in the process (containers, MIG slices, some drivers) the assert is raised instead of
# the OOM (pytorch/pytorch#112377, #112950, #130486, #157535; fal-ai/fal#478). The context is fine;
# the batch is too big.
_ALLOCATOR_FILE = "cudacachingallocator.cpp"
_NVML_WORD = "nvml_success"
# Errors that say this GPU cannot run this model, and that leave the context usable: no kernels
# built for its architecture (cudaErrorNoKernelImageForDevice), a cuBLAS call it does not support
# (bf16 or fp16 GEMMs on older GPUs), a launch shape it cannot take. Retrying on it cannot help.
_UNSUPPORTED_HEADS = (
    "cuda error: no kernel image is available for execution on the device",
    "cuda error: cublas_status_not_supported",
    "cuda error: invalid configuration argument",
)
_SENTENCE_END = re.compile(r"\.(\s|$)")


def first_sentence(exc: BaseException) -> str:
    """The exception's first line, up to its first full stop: the error without torch's advice."""
    return first_sentence_of(str(exc))


def first_line(text: str) -> str:
    text = text.strip()
    return text.splitlines()[0] if text else ""


def first_sentence_of(text: str) -> str:
    return _SENTENCE_END.split(first_line(text), maxsplit=1)[0].strip()


def allocator_assert(exc: BaseException) -> bool:
    """Whether ``exc`` is the caching allocator's NVML assert: an out-of-memory whose report failed."""
    head = first_sentence(exc).lower()
    return (
        isinstance(exc, RuntimeError)
        and _INTERNAL_ASSERT in head
        and _NVML_WORD in head
        and _ALLOCATOR_FILE in head
    )


_BUSY_HEAD = "cuda error: cuda-capable device(s) is/are busy or unavailable"


def context_unavailable_now(exc: BaseException) -> bool:
    """Creating a CUDA context failed for want of memory, or because the GPU is busy (another process
    holds it in EXCLUSIVE_PROCESS mode): this process cannot use it, another one later may."""
    return classify(exc) == OOM or first_sentence(exc).lower().startswith(_BUSY_HEAD)


def launch_too_large(exc: BaseException) -> bool:
    """A kernel launch whose grid this GPU cannot take: often a batch too large for it (pytorch/ort#116:
    a (128, 3, 224, 224) input failed where (16, ...) ran), so a smaller batch is tried first."""
    return first_sentence(exc).lower().startswith(_UNSUPPORTED_HEADS[2])


def _torch_error(exc: BaseException) -> str | None:
    """OOM, UNSUPPORTED or CUDA_FATAL for an error raised by torch or a CUDA library, None for
    anything else."""
    names = {cls.__name__ for cls in type(exc).__mro__}
    head = first_sentence(exc).lower()
    if "OutOfMemoryError" in names:  # torch.OutOfMemoryError (torch.cuda.OutOfMemoryError is an alias)
        return OOM
    if not isinstance(exc, RuntimeError):
        return None
    if head.startswith(_OOM_HEADS) or _CPU_OOM in first_line(str(exc)).lower() or allocator_assert(exc):
        return OOM
    if head.startswith(_UNSUPPORTED_HEADS):
        return UNSUPPORTED
    if head.startswith(_CUDA_FATAL_HEADS) or (
        _INTERNAL_ASSERT in head and any(word in head for word in _CUDA_WORDS)
    ):
        return CUDA_FATAL
    if "AcceleratorError" in names:  # torch >= 2.8 raises CUDA runtime errors as this RuntimeError subclass
        return CUDA_FATAL
    return None


def classify(exc: BaseException) -> str:
    """Which error class ``exc`` belongs to; decides retry, back-off or quarantine."""
    if isinstance(exc, ChunkOutOfMemoryError):
        return OOM
    if isinstance(exc, CudaFatalError):
        return CUDA_FATAL
    if isinstance(exc, DeviceUnsupportedError):
        return UNSUPPORTED
    if isinstance(exc, NonFiniteError):
        return NON_FINITE
    if isinstance(exc, TamperedJobError):
        return TAMPERED
    if isinstance(exc, BadInputError):
        return BAD_INPUT
    if isinstance(exc, ConfigError):
        return CONFIG
    if isinstance(exc, ChunkAbandonedError):
        return ABANDONED
    if isinstance(exc, StoreWriteError) or (isinstance(exc, OSError) and exc.errno in STORAGE_ERRNOS):
        return STORAGE
    return _torch_error(exc) or OTHER
