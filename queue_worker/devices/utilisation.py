"""A GPU worker's reader of its GPU's utilisation samples (``jobs.compute.device_busy``'s ``nvml`` source),
from NVML as the pool sees it (the real library, or the stand-in under CHUNKQ_SIMULATED_GPUS).

None where NVML cannot say: it does not initialise (the seeds' host), the GPU is a MIG slice
(utilisation is not counted per instance), or the driver has no samples to give; the chunk's busy
share then comes from CUDA events."""

from __future__ import annotations

import logging
from typing import Any

from chunkq.jobs.compute.device_busy import UtilisationSince
from chunkq.queue_worker.devices import discovery

log = logging.getLogger(__name__)


def reader(gpu_key: str | None) -> UtilisationSince | None:
    """The reader for the GPU the pool pinned (its key: ``0``; ``0-mig1`` for a MIG slice)."""
    if gpu_key is None or not gpu_key.isdigit():
        return None
    nvml = discovery.nvml_library()
    if nvml is None:
        return None
    try:
        nvml.nvmlInit()
        handle = nvml.nvmlDeviceGetHandleByIndex(int(gpu_key))
    except Exception as exc:  # NVMLError and the stand-in's alike: no figure from NVML
        log.info(
            "GPU %s: NVML gives no utilisation (%s); a chunk's busy share comes from CUDA events",
            gpu_key,
            exc,
        )
        return None
    kind = getattr(nvml, "NVML_GPU_UTILIZATION_SAMPLES", 1)

    def since(microseconds: int) -> list[tuple[int, float]] | None:
        try:
            _, samples = nvml.nvmlDeviceGetSamples(handle, kind, microseconds)
        except nvml.NVMLError:  # NOT_FOUND: no sample since then; NOT_SUPPORTED: none ever
            return None
        return [(int(s.timeStamp), _value(s)) for s in samples if int(s.timeStamp) >= microseconds]

    return since


def _value(sample: Any) -> float:
    value = sample.sampleValue
    return float(getattr(value, "uiVal", value))
