"""GPU discovery through NVML (never a CUDA context in the pool) and per-worker pinning."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from chunkq.jobs.errors import ConfigError
from chunkq.jobs.runtime import DEVICE_ENV, GPU_ENV

log = logging.getLogger(__name__)

DEFAULT_ALLOC_CONF = "expandable_segments:True"


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    name: str
    used_memory: int | None


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    uuid: str
    memory_total: int
    memory_free: int
    processes: tuple[GpuProcess, ...] = ()


def _process_name(pid: int) -> str:
    try:
        import psutil

        return str(psutil.Process(pid).name())
    except Exception:  # another container's pid, or gone
        return "?"


def _processes(pynvml: Any, handle: Any) -> tuple[GpuProcess, ...]:
    try:
        running = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
    except pynvml.NVMLError:
        return ()
    return tuple(
        GpuProcess(int(p.pid), _process_name(int(p.pid)), getattr(p, "usedGpuMemory", None)) for p in running
    )


def discover() -> list[GpuInfo]:
    """The GPUs NVML sees, in PCI bus order; an empty list where there is no driver or no GPU."""
    try:
        import pynvml
    except ImportError:  # pragma: no cover - nvidia-ml-py is a dependency
        return []
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        log.debug("NVML unavailable (%s): no GPUs", exc)
        return []
    try:
        gpus = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            name = pynvml.nvmlDeviceGetName(handle)
            uuid = pynvml.nvmlDeviceGetUUID(handle)
            gpus.append(
                GpuInfo(
                    index=index,
                    name=name.decode() if isinstance(name, bytes) else str(name),
                    uuid=uuid.decode() if isinstance(uuid, bytes) else str(uuid),
                    memory_total=int(memory.total),
                    memory_free=int(memory.free),
                    processes=_processes(pynvml, handle),
                )
            )
        return gpus
    finally:
        pynvml.nvmlShutdown()


def select(spec: str, available: list[GpuInfo]) -> list[GpuInfo]:
    """Resolve ``--gpus`` (``all``, ``none`` or ``0,2``) against the GPUs present.

    ``all`` on a machine without GPUs means CPU workers; naming an index that does not exist is the
    "invalid device ordinal" case and is refused with the list of GPUs that do.
    """
    spec = spec.strip().lower()
    if spec in ("none", "cpu", ""):
        return []
    if spec == "all":
        return list(available)
    by_index = {gpu.index: gpu for gpu in available}
    chosen = []
    for part in spec.split(","):
        try:
            index = int(part)
        except ValueError:
            raise ConfigError(
                f"--gpus: {part!r} is not a GPU index (use all, none or a list like 0,2)"
            ) from None
        if index not in by_index:
            present = ", ".join(f"{g.index} ({g.name})" for g in available) or "none"
            raise ConfigError(f"--gpus: GPU {index} does not exist; GPUs present: {present}")
        chosen.append(by_index[index])
    return chosen


def usable(gpus: list[GpuInfo], min_free_memory: int, skip_busy: bool) -> list[GpuInfo]:
    """Report GPUs short of free memory or busy with other processes; skip them as configured."""
    kept = []
    for gpu in gpus:
        if gpu.memory_free < min_free_memory:
            log.warning(
                "GPU %d (%s): %.1f GiB free, below --min-free-memory %.1f GiB; skipped",
                gpu.index,
                gpu.name,
                gpu.memory_free / 2**30,
                min_free_memory / 2**30,
            )
            continue
        if gpu.processes:
            names = ", ".join(f"{p.name} (pid {p.pid})" for p in gpu.processes)
            log.warning(
                "GPU %d (%s) is busy with: %s%s", gpu.index, gpu.name, names, "; skipped" if skip_busy else ""
            )
            if skip_busy:
                continue
        kept.append(gpu)
    return kept


def parse_size(text: str) -> int:
    """'8GiB', '512M', '0' -> bytes."""
    units = {
        "": 1,
        "k": 2**10,
        "kb": 2**10,
        "kib": 2**10,
        "m": 2**20,
        "mb": 2**20,
        "mib": 2**20,
        "g": 2**30,
        "gb": 2**30,
        "gib": 2**30,
        "t": 2**40,
        "tb": 2**40,
        "tib": 2**40,
    }
    raw = text.strip().lower()
    number = raw.rstrip("kmgtib")
    try:
        return int(float(number) * units[raw[len(number) :]])
    except (ValueError, KeyError):
        raise ConfigError(f"cannot read the size {text!r} (use e.g. 8GiB, 512MiB)") from None


def worker_environment(
    base: dict[str, str], gpu: GpuInfo | None, cpu_threads: int, no_nvml: bool = False
) -> dict[str, str]:
    """The environment of one worker: pinned to one GPU (or none) before it imports torch."""
    env = dict(base)
    # NVML numbers GPUs in PCI bus order; make CUDA agree so index N is the same card in both.
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    if gpu is None:
        env["CUDA_VISIBLE_DEVICES"] = ""
        env[DEVICE_ENV] = "cpu"
        env.pop(GPU_ENV, None)
    else:
        env["CUDA_VISIBLE_DEVICES"] = gpu.uuid or str(gpu.index)
        env[DEVICE_ENV] = "cuda"
        env[GPU_ENV] = str(gpu.index)
        env.setdefault("PYTORCH_CUDA_ALLOC_CONF", DEFAULT_ALLOC_CONF)
        if no_nvml:  # sidesteps the NVML INTERNAL ASSERT in the caching allocator on some drivers
            env["PYTORCH_NO_NVML"] = "1"
    threads = str(max(1, cpu_threads))
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env.setdefault(var, threads)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Per-worker download/loading bars would interleave in the pool's log.
    env.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    return env


def cpu_threads_per_worker(workers: int) -> int:
    return max(1, (os.cpu_count() or 1) // max(1, workers))


WORKERS_AUTO = "auto"  # --workers-per-gpu auto: as many as pay off on each GPU


def workers_per_gpu_value(value: str) -> str:
    """--workers-per-gpu as given: a number of workers (1 or more) or 'auto'."""
    if value == WORKERS_AUTO or (value.isdigit() and int(value) >= 1):
        return value
    raise ConfigError(f"{value!r}: give a number of workers (1 or more) or 'auto'")


AUTO_MAX_WORKERS = 4  # more than this per GPU measured no further gain for small models (issue 15)
CORES_PER_WORKER = 2  # tokenising and Python for one worker, the other half of a core pair for the rest
CONTEXT_BYTES = 1 << 29  # a CUDA context and cuBLAS workspaces, per process
ACTIVATION_BYTES = 2 << 30  # headroom for a batch's activations
UNKNOWN_MODEL_BYTES = 1_400_000_000  # a model we cannot measure: taken for a bge-large in fp32
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def model_bytes(path: str | None, precision: str) -> int | None:
    """The model's weights in ``precision``, from the sizes of its weight files; None if not local."""
    if not path or not os.path.isdir(path):
        return None
    stored = 0
    for root, _dirs, files in os.walk(path):
        stored += sum(os.path.getsize(os.path.join(root, f)) for f in files if f.endswith(WEIGHT_SUFFIXES))
    return stored // 2 if precision in ("fp16", "bf16") and stored else stored


def auto_workers_per_gpu(gpus: list[GpuInfo], cpu_cores: int, weights: int | None) -> tuple[int, str]:
    """How many workers each GPU gets for ``--workers-per-gpu auto``, and why.

    At batch 32 a large GPU waits on its worker's CPU work (tokenising, Python, launches): measured on
    an H100, 2 workers gave 1.85x a plain encode for a 335M model and 4 gave 2.57x for MiniLM. So as
    many as the CPU cores per GPU feed (CORES_PER_WORKER each) and the least free GPU memory holds
    (weights + context + activation headroom each), at most AUTO_MAX_WORKERS; one on the CPU.
    """
    if not gpus:
        return 1, "no GPU: one worker per CPU slot (--cpu-workers)"
    by_cpu = max(1, cpu_cores // len(gpus) // CORES_PER_WORKER)
    per_worker = (weights if weights is not None else UNKNOWN_MODEL_BYTES) + CONTEXT_BYTES + ACTIVATION_BYTES
    free = min(gpu.memory_free for gpu in gpus)
    by_memory = max(1, int(0.9 * free // per_worker))
    n = min(by_cpu, by_memory, AUTO_MAX_WORKERS)
    weights_text = f"{weights / 2**20:.0f} MiB of weights" if weights is not None else "weights unknown"
    why = (
        f"{cpu_cores} CPU cores for {len(gpus)} GPU(s) feed {by_cpu} at {CORES_PER_WORKER} cores each; "
        f"{free / 2**30:.1f} GiB free on the fullest GPU holds {by_memory} ({weights_text} + "
        f"{(CONTEXT_BYTES + ACTIVATION_BYTES) / 2**30:.1f} GiB each); at most {AUTO_MAX_WORKERS}"
    )
    return max(1, n), why


def resolve_workers_per_gpu(value: str, gpus: list[GpuInfo], preload: str | None, precision: str) -> int:
    """``--workers-per-gpu``: a number as given, or ``auto`` worked out for these GPUs and this model."""
    if value != WORKERS_AUTO:
        return int(value)
    from chunkq.jobs.models import default_model, resolve_model

    try:
        path: str | None = resolve_model(preload or default_model())
    except ConfigError:
        path = None
    workers, why = auto_workers_per_gpu(gpus, os.cpu_count() or 1, model_bytes(path, precision))
    log.info("workers per GPU: auto means %d (%s)", workers, why)
    return workers


def choose(spec: str, min_free_memory: str, busy: str) -> list[GpuInfo]:
    """The GPUs a pool uses: ``--gpus``, less those short of memory or (with ``skip``) busy."""
    return usable(select(spec, discover()), parse_size(min_free_memory), skip_busy=busy == "skip")
