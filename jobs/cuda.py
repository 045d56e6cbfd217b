"""What can be done about CUDA from inside a job: free cached memory, and probe the context."""

from __future__ import annotations

import gc
import logging

log = logging.getLogger(__name__)


def free_cached_memory(device: str) -> None:
    """Release what the failed attempt held, so a smaller batch has room."""
    gc.collect()
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()


def context_usable(device: str) -> bool:
    """A tiny allocation and a synchronise: a broken (sticky-error) context fails this for good.

    PyTorch has no in-process reset for such a context, so a False here means: exit the process.
    """
    if not device.startswith("cuda"):
        return True
    import torch

    try:
        probe = torch.ones(1, device=device)
        torch.cuda.synchronize()
        return bool(probe.item() == 1.0)
    except Exception as exc:
        log.error("CUDA context probe failed: %s", exc)
        return False
