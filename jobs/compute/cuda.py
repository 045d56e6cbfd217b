"""What can be done about CUDA from inside a job: free cached memory, and probe the context."""

from __future__ import annotations

import gc
import logging
import sys

from chunkq.jobs.contract import errors
from chunkq.jobs.drills import faults

log = logging.getLogger(__name__)


def free_cached_memory(device: str) -> None:
    """Release what the failed attempt held, so a smaller batch has room."""
    gc.collect()
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()


def apply_allocator_settings(conf: str) -> None:
    """Hand PYTORCH_CUDA_ALLOC_CONF to the allocator directly, in a worker forked from the fork
    server: whether torch read the variable lazily or while the server imported it, the worker's
    own setting is the one in force."""
    import torch

    # torch >= 2.9 names it torch._C._accelerator_setAllocatorSettings; the old name still works there
    # but warns in every worker's log.
    setter = (
        getattr(torch._C, "_accelerator_setAllocatorSettings", None)
        or torch.cuda.memory._set_allocator_settings
    )
    try:
        setter(conf)
    except (AttributeError, RuntimeError) as exc:  # a CPU build of torch, or an older one
        print(f"chunkq: could not apply PYTORCH_CUDA_ALLOC_CONF={conf!r}: {exc}", file=sys.stderr)


def open_context(device: str) -> Exception | None:
    """Create this process's CUDA context with a first allocation: the error if it cannot, else None
    (always None on the CPU)."""
    if not device.startswith("cuda"):
        return None
    try:
        faults.inject_context()
        import torch

        torch.ones(1, device=device).item()
    except Exception as exc:  # any failure: the caller decides what it means
        return exc
    return None


def limit_memory(device: str, limit_bytes: int) -> float | None:
    """Cap what PyTorch's caching allocator may hold on ``device`` at ``limit_bytes``: the share of
    the GPU it set, or None where there is nothing to cap (the CPU, no limit, a limit at or above
    the GPU's memory). Past the cap the allocator fails a block as a full GPU does (the
    ``set_fraction`` check in c10/cuda/CUDACachingAllocator.cpp's ``alloc_block``): it frees its
    cache, tries again, then raises its own ``torch.OutOfMemoryError`` ("CUDA out of memory. Tried
    to allocate ... GiB allowed; ..."), which a job halves its batch for as for any OOM."""
    if not device.startswith("cuda") or limit_bytes <= 0:
        return None
    import torch

    total = torch.cuda.get_device_properties(device).total_memory
    if limit_bytes >= total:
        return None
    share = limit_bytes / total
    torch.cuda.set_per_process_memory_fraction(share, device)
    return share


def context_usable(device: str) -> bool:
    """A tiny allocation and a synchronise: a broken (sticky-error) context fails this for good.

    PyTorch has no in-process reset for such a context, so a False here means: exit the process.
    A probe that itself runs out of memory (workers and a standby share the GPU) proves the context
    works: an out-of-memory is an out-of-memory wherever it happens.
    """
    if not device.startswith("cuda"):
        return True
    import torch

    try:
        faults.inject_probe()
        probe = torch.ones(1, device=device)
        torch.cuda.synchronize()
        return bool(probe.item() == 1.0)
    except Exception as exc:
        if errors.classify(exc) == errors.OOM:
            log.warning("context probe out of memory (%s): the context works", errors.first_sentence(exc))
            return True
        log.error("CUDA context probe failed: %s", exc)
        return False


def reset_peak_memory(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.reset_peak_memory_stats()


def peak_memory(device: str) -> dict[str, int]:
    """Peak GPU memory allocated and reserved since the reset (on the CPU: the process's RSS)."""
    if device.startswith("cuda"):
        import torch

        return {
            "peak_allocated_bytes": int(torch.cuda.max_memory_allocated()),
            "peak_reserved_bytes": int(torch.cuda.max_memory_reserved()),
        }
    import resource

    import psutil

    rss = int(psutil.Process().memory_info().rss)
    # The kernel updates its high-water mark lazily, so it can trail the RSS just read.
    high_water = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # KiB on Linux
    return {"rss_bytes": rss, "peak_rss_bytes": max(rss, high_water)}
