"""The GPUs CUDA itself sees, asked where NVML cannot say (the seeds' host: a driver updated under a
running system answers every NVML call with NVML_ERROR_LIB_RM_VERSION_MISMATCH, while CUDA works).

NVML is a reporting library; CUDA is the truth about which GPUs a process can use. The pool and the
supervisor must never hold a CUDA context (a forked worker could not use CUDA, and a context costs a
GPU's memory), so the question is asked in a short-lived child process (this file run as a script
by ``python -I -S``: it needs only the standard library, and so skips chunkq's and site-packages'
imports, 0.04 s against 0.47 s as a module of the package; every chunkq run asks twice) through the
CUDA driver API: ``cuInit`` and the ``cuDevice*``
queries create no context. It answers each device's index in PCI bus order (what
``CUDA_DEVICE_ORDER=PCI_BUS_ID``, which the pool sets for its workers, gives), UUID, name, total
memory and PCI bus id, as JSON. Free memory needs a context: a worker reads its own.

``CHUNKQ_SIMULATED_CUDA`` names a JSON file that stands in for the driver's answer (tests and drills
on hosts without GPUs), as ``CHUNKQ_SIMULATED_GPUS`` stands in for NVML.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

# Spelt here, as jobs/contract/environment.py declares it: this file runs as a script with the
# standard library alone (above), so it imports nothing of chunkq.
SIMULATED_ENV = "CHUNKQ_SIMULATED_CUDA"
ASK_SECONDS = 60  # cuInit on a host with many GPUs takes seconds; a hung driver must not hang the pool
LIBCUDA = "libcuda.so.1"


@dataclass(frozen=True)
class CudaDevices:
    """What CUDA answered: its devices, or why it has none."""

    devices: list[dict[str, Any]]
    error: str | None = None  # why CUDA has no answer: no driver, cuInit's error, a child that failed


def _check(cuda: Any, result: int, call: str) -> None:
    if result != 0:
        text = ctypes.c_char_p()
        cuda.cuGetErrorString(result, ctypes.byref(text))
        said = text.value.decode() if text.value else f"error {result}"
        raise OSError(f"{call}: {said} (CUresult {result})")


def _uuid(raw: bytes) -> str:
    """CUDA's 16 bytes as NVML and CUDA_VISIBLE_DEVICES spell a GPU: GPU-8-4-4-4-12 hex digits."""
    h = raw.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def _query() -> list[dict[str, Any]]:
    """In this process: every device the driver lists (raises OSError with the driver's words)."""
    cuda = ctypes.CDLL(LIBCUDA)
    _check(cuda, cuda.cuInit(0), "cuInit")
    count = ctypes.c_int()
    _check(cuda, cuda.cuDeviceGetCount(ctypes.byref(count)), "cuDeviceGetCount")
    found = []
    for ordinal in range(count.value):
        device = ctypes.c_int()
        _check(cuda, cuda.cuDeviceGet(ctypes.byref(device), ordinal), "cuDeviceGet")
        name = ctypes.create_string_buffer(256)
        _check(cuda, cuda.cuDeviceGetName(name, 256, device), "cuDeviceGetName")
        total = ctypes.c_size_t()
        _check(cuda, cuda.cuDeviceTotalMem_v2(ctypes.byref(total), device), "cuDeviceTotalMem")
        uuid = ctypes.create_string_buffer(16)
        get_uuid = getattr(cuda, "cuDeviceGetUuid_v2", None) or cuda.cuDeviceGetUuid
        _check(cuda, get_uuid(uuid, device), "cuDeviceGetUuid")
        bus = ctypes.create_string_buffer(32)
        _check(cuda, cuda.cuDeviceGetPCIBusId(bus, 32, device), "cuDeviceGetPCIBusId")
        found.append(
            {
                "index": ordinal,
                "uuid": _uuid(uuid.raw),
                "name": name.value.decode(),
                "memory_total": int(total.value),
                "pci_bus_id": bus.value.decode(),
            }
        )
    return found


def ask() -> CudaDevices:
    """Ask a short-lived child process what CUDA sees (this process stays without a context)."""
    simulated = os.environ.get(SIMULATED_ENV)
    if simulated:
        with open(simulated, encoding="utf-8") as fh:
            data = json.load(fh)
        return CudaDevices(list(data.get("devices", [])), data.get("error"))
    env = dict(os.environ, CUDA_DEVICE_ORDER="PCI_BUS_ID")
    env.pop("CUDA_VISIBLE_DEVICES", None)  # every device of the host, as NVML would list them
    try:
        done = subprocess.run(
            [sys.executable, "-I", "-S", os.path.abspath(__file__)],
            env=env,
            capture_output=True,
            text=True,
            timeout=ASK_SECONDS,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return CudaDevices([], f"asking CUDA failed: {exc}")
    try:
        answer = json.loads(done.stdout)
    except ValueError:
        last = (done.stderr.strip().splitlines() or ["no answer"])[-1]
        return CudaDevices([], f"asking CUDA failed (exit {done.returncode}): {last}")
    return CudaDevices(list(answer.get("devices", [])), answer.get("error"))


def main() -> int:
    """The child: one JSON object on stdout, {"devices": [...]} or {"devices": [], "error": "..."}."""
    try:
        answer: dict[str, Any] = {"devices": _query()}
    except OSError as exc:  # no libcuda (no driver), or the driver's own error
        answer = {"devices": [], "error": str(exc)}
    print(json.dumps(answer))
    return 0


if __name__ == "__main__":
    sys.exit(main())
