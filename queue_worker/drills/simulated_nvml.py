"""A stand-in for NVML on hosts without GPUs: the calls chunkq makes, answered from a JSON file,
failing with pynvml's own exception classes (``pynvml.NVMLError(code)``) where the file says.

Used when ``CHUNKQ_SIMULATED_GPUS`` names such a file (tests, drills); every process that reads
it (doctor, the pool, its metrics) then sees the same host. A worker pinned to a simulated GPU
still runs real torch, which finds no CUDA device and refuses to fall back to the CPU.

    {"gpus": [
        {"name": "NVIDIA H100 80GB HBM3", "memory_total": 85899345920, "memory_free": 80000000000,
         "processes": [{"pid": 4242, "used_memory": 1073741824}],
         "compute_mode": 3,                 # nvml.h: 0 default, 2 prohibited, 3 exclusive process
         "error": "NO_PERMISSION",           # every call on this GPU fails so (GPU_IS_LOST, ...)
         "utilization": 85,                  # percent in every utilisation sample (a sample per 1/6 s)
         "mig": [{"memory_total": 21474836480, "memory_free": 20000000000}]}
     ],
     "init_error": "DRIVER_NOT_LOADED"}      # nvmlInit fails so
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pynvml

from chunkq.jobs.contract.errors import ConfigError

SAMPLE_US = 166_667  # a utilisation sample per 1/6 s, as recent GPUs take them


def _error(name: str) -> pynvml.NVMLError:
    code = getattr(pynvml, f"NVML_ERROR_{name}", None)
    if not isinstance(code, int):
        raise ConfigError(f"simulated NVML: unknown error {name!r} (use nvml.h's names, e.g. NO_PERMISSION)")
    return pynvml.NVMLError(code)


@dataclass(frozen=True)
class _Handle:
    spec: dict[str, Any]
    uuid: str


class SimulatedNvml:
    """The part of pynvml's interface that chunkq uses."""

    NVMLError = pynvml.NVMLError
    NVML_DEVICE_MIG_ENABLE = pynvml.NVML_DEVICE_MIG_ENABLE

    def __init__(self, data: dict[str, Any]) -> None:
        self.gpus: list[dict[str, Any]] = list(data.get("gpus", []))
        self.init_error: str | None = data.get("init_error")

    def nvmlInit(self) -> None:
        if self.init_error:
            raise _error(self.init_error)

    def nvmlShutdown(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:
        spec = self.gpus[index]
        if spec.get("error"):
            raise _error(spec["error"])
        return _Handle(spec, spec.get("uuid", f"GPU-{index:08x}-sim0-0000-0000-000000000000"))

    @staticmethod
    def _checked(handle: _Handle) -> dict[str, Any]:
        if handle.spec.get("error"):
            raise _error(handle.spec["error"])
        return handle.spec

    def nvmlDeviceGetName(self, handle: _Handle) -> str:
        return str(self._checked(handle).get("name", "NVIDIA H100 80GB HBM3"))

    def nvmlDeviceGetUUID(self, handle: _Handle) -> str:
        return handle.uuid

    def nvmlDeviceGetMemoryInfo(self, handle: _Handle) -> Any:
        spec = self._checked(handle)
        total = int(spec.get("memory_total", 80 << 30))
        return SimpleNamespace(total=total, free=int(spec.get("memory_free", total)))

    def nvmlDeviceGetComputeRunningProcesses(self, handle: _Handle) -> list[Any]:
        spec = self._checked(handle)
        if spec.get("processes_error"):
            raise _error(spec["processes_error"])
        running = spec.get("processes", [])
        return [SimpleNamespace(pid=int(p["pid"]), usedGpuMemory=p.get("used_memory")) for p in running]

    def nvmlDeviceGetUtilizationRates(self, handle: _Handle) -> Any:
        spec = self._checked(handle)
        if "utilization" not in spec:
            raise _error("NOT_SUPPORTED")
        return SimpleNamespace(gpu=int(spec["utilization"]), memory=0)

    def nvmlDeviceGetSamples(self, handle: _Handle, kind: int, since_us: int) -> tuple[int, list[Any]]:
        """The driver's utilisation samples since ``since_us``: one per 1/6 s up to now, each at the
        file's ``utilization`` percent; NOT_FOUND when there are none, as NVML says it."""
        spec = self._checked(handle)
        if "utilization" not in spec:
            raise _error("NOT_SUPPORTED")
        now = int(time.time() * 1e6)
        times = range(since_us + SAMPLE_US, now + 1, SAMPLE_US)
        if not times:
            raise _error("NOT_FOUND")
        value = SimpleNamespace(uiVal=int(spec["utilization"]))
        return pynvml.NVML_VALUE_TYPE_UNSIGNED_INT, [
            SimpleNamespace(timeStamp=t, sampleValue=value) for t in times
        ]

    def nvmlDeviceGetComputeMode(self, handle: _Handle) -> int:
        return int(self._checked(handle).get("compute_mode", 0))

    def nvmlDeviceGetMigMode(self, handle: _Handle) -> tuple[int, int]:
        spec = self._checked(handle)
        if "mig" not in spec:
            raise _error("NOT_SUPPORTED")
        return (pynvml.NVML_DEVICE_MIG_ENABLE,) * 2

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: _Handle) -> int:
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: _Handle, index: int) -> _Handle:
        instances = self._checked(handle).get("mig", [])
        if index >= len(instances):
            raise _error("NOT_FOUND")
        parent = handle.uuid.removeprefix("GPU-")
        return _Handle(instances[index], instances[index].get("uuid", f"MIG-{parent[:8]}-mig{index}"))


def load(path: str) -> SimulatedNvml:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"CHUNKQ_SIMULATED_GPUS={path}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"CHUNKQ_SIMULATED_GPUS={path}: expected a JSON object with a 'gpus' list")
    return SimulatedNvml(data)
