"""A stand-in ``libnvidia-ml.so.1`` whose every call fails as NVML does on the seeds' host: a driver
updated under a running system, where ``nvmlInit`` returns NVML_ERROR_LIB_RM_VERSION_MISMATCH (18)
and ``nvmlErrorString`` says "RM has detected an NVML/RM version mismatch." (what nvidia-ml-py
raises there: rapidsai/dask-cuda#949, XuehaiPan/nvitop#41; nvidia-smi says "Failed to initialize
NVML: Driver/library version mismatch").

Built at test time with the host's C compiler. It exports every entry point PyTorch looks up
(``c10/cuda/driver_api.h``, C10_NVML_DRIVER_API: nvmlInit_v2, nvmlDeviceGetHandleByPciBusId_v2,
nvmlDeviceGetNvLinkRemoteDeviceType, nvmlDeviceGetNvLinkRemotePciInfo_v2,
nvmlDeviceGetComputeRunningProcesses, nvmlSystemGetCudaDriverVersion_v2, and the optional
nvmlDeviceGetGpuFabricInfoV) and those nvidia-ml-py and chunkq call. Each returns 18 whatever its
arguments (the C calling convention lets a function ignore them).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

LIB_RM_VERSION_MISMATCH = 18
MESSAGE = "RM has detected an NVML/RM version mismatch."
ENTRY_POINTS = (
    # PyTorch's (C10_NVML_DRIVER_API and its optional one)
    "nvmlInit_v2",
    "nvmlDeviceGetHandleByPciBusId_v2",
    "nvmlDeviceGetNvLinkRemoteDeviceType",
    "nvmlDeviceGetNvLinkRemotePciInfo_v2",
    "nvmlDeviceGetComputeRunningProcesses",
    "nvmlSystemGetCudaDriverVersion_v2",
    "nvmlDeviceGetGpuFabricInfoV",
    # nvidia-ml-py's, for what chunkq and its doctor ask
    "nvmlInit",
    "nvmlInitWithFlags",
    "nvmlShutdown",
    "nvmlSystemGetDriverVersion",
    "nvmlSystemGetCudaDriverVersion",
    "nvmlDeviceGetCount",
    "nvmlDeviceGetCount_v2",
    "nvmlDeviceGetHandleByIndex",
    "nvmlDeviceGetHandleByIndex_v2",
    "nvmlDeviceGetHandleByUUID",
    "nvmlDeviceGetName",
    "nvmlDeviceGetUUID",
    "nvmlDeviceGetMemoryInfo",
    "nvmlDeviceGetMemoryInfo_v2",
    "nvmlDeviceGetComputeMode",
    "nvmlDeviceGetMigMode",
    "nvmlDeviceGetMaxMigDeviceCount",
    "nvmlDeviceGetMigDeviceHandleByIndex",
    "nvmlDeviceGetComputeRunningProcesses_v2",
    "nvmlDeviceGetComputeRunningProcesses_v3",
    "nvmlDeviceGetUtilizationRates",
    "nvmlDeviceGetPciInfo",
    "nvmlDeviceGetPciInfo_v3",
)


def compiler() -> str | None:
    return shutil.which("cc") or shutil.which("gcc")


def build(folder: Path) -> Path:
    """Compile the stand-in into ``folder`` (put it first on LD_LIBRARY_PATH); the folder."""
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler here")
    folder.mkdir(parents=True, exist_ok=True)
    source = folder / "nvml_standin.c"
    fails = LIB_RM_VERSION_MISMATCH
    functions = "\n".join(f"int {name}(void) {{ return {fails}; }}" for name in ENTRY_POINTS)
    source.write_text(
        f"{functions}\n"
        "const char *nvmlErrorString(int result) {\n"
        f'    return result == {LIB_RM_VERSION_MISMATCH} ? "{MESSAGE}" : "Unknown Error";\n'
        "}\n"
    )
    library = folder / "libnvidia-ml.so.1"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(library), str(source)], check=True, capture_output=True)
    return folder
