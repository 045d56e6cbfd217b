"""Which GPUs this process may use, read from NVML without creating a CUDA context.

Real hosts differ from a workstation in three ways, each handled here with one line saying which
GPU and why:
- **Inherited visibility.** Slurm (``--gres=gpu:2``) and the Kubernetes device plugin give a
  process some GPUs through ``CUDA_VISIBLE_DEVICES`` (indices or UUIDs), while NVML lists every
  GPU of the host. ``visible`` keeps those this process may use, read as CUDA reads the variable.
- **MIG and restricted GPUs.** A GPU in MIG mode is used through its instances: each has a
  ``MIG-...`` UUID that CUDA accepts (its parent's ``GPU-...`` is refused). A GPU that NVML cannot
  read (``NO_PERMISSION`` where a cgroup hides it, ``GPU_IS_LOST``) is skipped, not fatal.
- **Compute mode.** ``PROHIBITED`` takes no context: skipped. ``EXCLUSIVE_PROCESS`` takes one
  process's: the pool runs one worker there and no standby (``GpuInfo.exclusive``).

- **NVML that cannot initialise.** Where ``nvmlInit`` fails (a driver updated under a running host:
  NVML_ERROR_LIB_RM_VERSION_MISMATCH; WSL2; some containers) CUDA may still work: the devices are
  then asked of CUDA in a child process (``cuda_devices``), and what only NVML tells (free memory,
  processes, compute mode, MIG) is unknown, with NVML's error as the reason (``Survey``). Never "no
  GPU" because a reporting library failed.

``CHUNKQ_SIMULATED_GPUS`` names a JSON file that stands in for NVML (``simulated_nvml``), for tests
and drills on hosts without GPUs, like ``CHUNKQ_FAULTS``; ``CHUNKQ_SIMULATED_CUDA`` stands in for
the CUDA driver's answer.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass
from typing import Any

from chunkq.jobs.contract import environment

log = logging.getLogger(__name__)

SIMULATED_ENV = environment.SIMULATED_GPUS
VISIBLE_ENV = "CUDA_VISIBLE_DEVICES"
# NVML's compute modes (nvml.h): 1 is the deprecated EXCLUSIVE_THREAD, which acts as EXCLUSIVE_PROCESS.
COMPUTE_MODES = {0: "default", 1: "exclusive_process", 2: "prohibited", 3: "exclusive_process"}


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    name: str
    used_memory: int | None


FROM_NVML = "nvml"
FROM_CUDA = "cuda"  # NVML could not say: found through CUDA, free memory and processes unknown


@dataclass(frozen=True)
class GpuInfo:
    index: int  # NVML's index of the physical GPU (PCI bus order), as nvidia-smi shows it
    name: str
    uuid: str  # what CUDA_VISIBLE_DEVICES pins: GPU-... or, for a MIG instance, MIG-...
    memory_total: int
    memory_free: int | None  # None: unknown (NVML could not say; each worker reads its own)
    processes: tuple[GpuProcess, ...] = ()  # those NVML listed; () where it could not say
    mig: int | None = None  # the MIG instance's index on its GPU; None for a whole GPU
    compute_mode: str = "default"  # "unknown" where NVML could not say
    source: str = FROM_NVML  # who listed it: NVML, or CUDA where NVML failed
    utilisation: int | None = None  # percent busy in NVML's last sample period; None: unknown

    @property
    def key(self) -> str:
        """A name unique among a host's devices: ``0``, or ``0-mig1`` for a MIG instance."""
        return str(self.index) if self.mig is None else f"{self.index}-mig{self.mig}"

    @property
    def label(self) -> str:
        return f"GPU {self.index}" if self.mig is None else f"GPU {self.index} MIG {self.mig}"

    @property
    def exclusive(self) -> bool:
        """EXCLUSIVE_PROCESS: one CUDA context at a time, so one worker and no standby."""
        return self.compute_mode == "exclusive_process"


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _process_name(pid: int) -> str:
    try:
        import psutil

        return str(psutil.Process(pid).name())
    except Exception:  # another container's pid, or gone
        return "?"


def _processes(nvml: Any, handle: Any) -> tuple[GpuProcess, ...]:
    try:
        running = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
    except nvml.NVMLError:  # NOT_SUPPORTED on some MIG setups, NO_PERMISSION in containers
        return ()
    return tuple(
        GpuProcess(int(p.pid), _process_name(int(p.pid)), getattr(p, "usedGpuMemory", None)) for p in running
    )


def _compute_mode(nvml: Any, handle: Any) -> str:
    try:
        return COMPUTE_MODES.get(int(nvml.nvmlDeviceGetComputeMode(handle)), "default")
    except nvml.NVMLError:  # not supported: no restriction is known
        return "default"


def _mig_enabled(nvml: Any, handle: Any) -> bool:
    try:
        current, _pending = nvml.nvmlDeviceGetMigMode(handle)
    except nvml.NVMLError:  # NOT_SUPPORTED: a GPU without MIG
        return False
    return bool(current == nvml.NVML_DEVICE_MIG_ENABLE)


def _device(nvml: Any, handle: Any, index: int, name: str, mode: str, mig: int | None = None) -> GpuInfo:
    """What a worker pinned to ``handle`` (a whole GPU, or MIG instance ``mig`` of GPU ``index``) gets."""
    try:
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        total, free = int(memory.total), int(memory.free)
    except nvml.NVMLError as exc:  # the GPU is there; how full it is is unknown
        log.warning("GPU %d (%s): NVML cannot read its memory (%s); free memory unknown", index, name, exc)
        total, free = 0, None
    return GpuInfo(
        index=index,
        name=name,
        uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
        memory_total=total,
        memory_free=free,
        processes=_processes(nvml, handle),
        mig=mig,
        compute_mode=mode,
        utilisation=_utilisation(nvml, handle),
    )


def _utilisation(nvml: Any, handle: Any) -> int | None:
    """The percent of NVML's last sample period in which a kernel ran; None for a MIG instance or
    where NVML cannot say (NOT_SUPPORTED)."""
    try:
        return int(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
    except nvml.NVMLError:
        return None


def _mig_instances(nvml: Any, index: int, handle: Any, name: str, mode: str) -> list[GpuInfo]:
    found = []
    for slot in range(int(nvml.nvmlDeviceGetMaxMigDeviceCount(handle))):
        try:
            mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
        except nvml.NVMLError:  # NOT_FOUND: no instance in this slot
            continue
        found.append(_device(nvml, mig, index, name, mode, slot))
    if not found:
        log.warning("GPU %d (%s): MIG is on but it has no MIG instance; skipped", index, name)
    return found


def _read_gpu(nvml: Any, index: int) -> list[GpuInfo]:
    """GPU ``index`` as the devices a worker can be pinned to (itself, or its MIG instances)."""
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        name = _text(nvml.nvmlDeviceGetName(handle))
        mode = _compute_mode(nvml, handle)
        if mode == "prohibited":
            log.warning("GPU %d (%s): compute mode PROHIBITED, no process may use it; skipped", index, name)
            return []
        if _mig_enabled(nvml, handle):
            return _mig_instances(nvml, index, handle, name, mode)
        return [_device(nvml, handle, index, name, mode)]
    except nvml.NVMLError as exc:  # NO_PERMISSION (a cgroup hides it), GPU_IS_LOST, UNKNOWN
        log.warning("GPU %d: NVML cannot read it (%s); skipped", index, exc)
        return []


def nvml_library() -> Any:
    """NVML as this process sees it: the stand-in under CHUNKQ_SIMULATED_GPUS, else pynvml."""
    path = os.environ.get(SIMULATED_ENV)
    if path:
        from chunkq.queue_worker.drills import simulated_nvml

        return simulated_nvml.load(path)
    try:
        import pynvml
    except ImportError:  # pragma: no cover - nvidia-ml-py is a dependency
        return None
    return pynvml


# NVML's errors that mean there is no NVIDIA driver at all (a CPU host), not a broken one.
NO_DRIVER = ("LIBRARY_NOT_FOUND", "DRIVER_NOT_LOADED")


@dataclass(frozen=True)
class Survey:
    """What this host has: its devices, and where NVML failed, its error and CUDA's answer."""

    gpus: list[GpuInfo]
    nvml_error: str | None = None  # nvmlInit's error, in NVML's words
    nvml_error_name: str | None = None  # its nvml.h name: LIB_RM_VERSION_MISMATCH, LIBRARY_NOT_FOUND...
    cuda_error: str | None = None  # why CUDA listed none, where it was asked

    @property
    def driver_broken(self) -> bool:
        """NVML failed on a host with a driver (not a CPU host without one)."""
        return self.nvml_error is not None and self.nvml_error_name not in NO_DRIVER


def _error_name(exc: Any) -> str | None:
    """An NVML error's nvml.h name (LIB_RM_VERSION_MISMATCH), from its code."""
    import pynvml

    value = getattr(exc, "value", None)
    for name in dir(pynvml):
        if name.startswith("NVML_ERROR_") and getattr(pynvml, name) == value:
            return name[len("NVML_ERROR_") :]
    return None


def devices_json(gpus: list[GpuInfo]) -> str:
    """Devices chosen by one process, for another (``chunkq run`` to its pool): chosen once."""
    return json.dumps([asdict(gpu) for gpu in gpus])


def devices_from_json(text: str) -> list[GpuInfo]:
    return [
        GpuInfo(**{**d, "processes": tuple(GpuProcess(**p) for p in d.get("processes") or ())})
        for d in json.loads(text)
    ]


def _from_cuda(devices: list[dict[str, Any]]) -> list[GpuInfo]:
    return [
        GpuInfo(
            index=int(d["index"]),
            name=str(d["name"]),
            uuid=str(d["uuid"]),
            memory_total=int(d["memory_total"]),
            memory_free=None,
            compute_mode="unknown",
            source=FROM_CUDA,
        )
        for d in devices
    ]


def survey(nvml: Any = None) -> Survey:
    """Every device of this host a worker could be pinned to, in PCI bus order: NVML's, or where NVML
    cannot initialise, CUDA's (asked in a child process); none without a driver."""
    nvml = nvml or nvml_library()
    if nvml is None:
        return Survey([])
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:
        return _without_nvml(str(exc), _error_name(exc))
    try:
        return Survey(
            [gpu for index in range(int(nvml.nvmlDeviceGetCount())) for gpu in _read_gpu(nvml, index)]
        )
    finally:
        nvml.nvmlShutdown()


def _without_nvml(error: str, name: str | None) -> Survey:
    from chunkq.queue_worker.devices import cuda_devices

    answer = cuda_devices.ask()
    gpus = _from_cuda(answer.devices)
    found = Survey(gpus, error, name, answer.error)
    if gpus:
        log.warning(
            "NVML cannot initialise (%s): %d GPU(s) found through CUDA instead; their free memory, "
            "processes and compute mode are unknown",
            error,
            len(gpus),
        )
    elif found.driver_broken:
        log.warning("NVML cannot initialise (%s), and CUDA lists no GPU (%s)", error, answer.error)
    else:
        log.debug("NVML unavailable (%s), CUDA lists no GPU (%s): no GPUs", error, answer.error)
    return found


def read_all(nvml: Any = None) -> list[GpuInfo]:
    """Every device of this host a worker could be pinned to, in PCI bus order; [] without a driver."""
    return survey(nvml).gpus


def visible(gpus: list[GpuInfo], value: str | None) -> list[GpuInfo]:
    """The devices ``CUDA_VISIBLE_DEVICES=value`` leaves to this process, in its order, read as
    CUDA reads it: unset, all; empty, none; else a list of UUIDs (``GPU-...``, ``MIG-...``, or a
    unique prefix) or indices counted over the devices this process can open, in PCI bus order
    (what ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, which the pool sets, gives). CUDA stops at the first
    entry it cannot match, and so does this."""
    if value is None:
        return list(gpus)
    kept: list[GpuInfo] = []
    for token in (t.strip() for t in value.split(",")):
        match = _match(gpus, token)
        if not match:
            if token:
                log.warning(
                    "%s=%s: %r matches no GPU here; CUDA ignores it and all after it",
                    VISIBLE_ENV,
                    value,
                    token,
                )
            break
        kept += [gpu for gpu in match if gpu not in kept]
    return kept


def _match(gpus: list[GpuInfo], token: str) -> list[GpuInfo]:
    if token.isdigit():
        # CUDA counts the devices it can open, whole GPUs and (outside MIG) nothing else.
        physical = sorted({gpu.index for gpu in gpus})
        n = int(token)
        return [gpu for gpu in gpus if n < len(physical) and gpu.index == physical[n]]
    if token.upper().startswith(("GPU-", "MIG-")):
        # A MIG GPU's own GPU-... UUID matches nothing here: only its instances are listed.
        found = [gpu for gpu in gpus if gpu.uuid.lower().startswith(token.lower())]
        return found if len(found) == 1 else []  # an ambiguous prefix is no match, as for CUDA
    return []


def allowed(host: Survey, environ: dict[str, str] | None = None) -> list[GpuInfo]:
    """The devices of ``host`` this process may use: less those its ``CUDA_VISIBLE_DEVICES`` hides."""
    env = os.environ if environ is None else environ
    found = visible(host.gpus, env.get(VISIBLE_ENV))
    if env.get(VISIBLE_ENV) is not None:
        log.info(
            "%s=%s: this process may use %s",
            VISIBLE_ENV,
            env[VISIBLE_ENV],
            ", ".join(gpu.label for gpu in found) or "no GPU",
        )
    return found


def discover(nvml: Any = None, environ: dict[str, str] | None = None) -> list[GpuInfo]:
    """The devices this process may use: the host's (NVML's, or CUDA's where NVML fails), less those
    its ``CUDA_VISIBLE_DEVICES`` hides."""
    return allowed(survey(nvml), environ)
