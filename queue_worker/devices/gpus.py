"""Which GPUs a pool uses (``--gpus``, memory and busy filters, ``--workers-per-gpu auto``) and each
worker's pinning. What the host has, and what this process may use, is ``discovery``'s."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from chunkq.jobs.compute.runtime import DEVICE_ENV, GPU_ENV
from chunkq.jobs.contract.errors import ConfigError
from chunkq.jobs.contract.settings import WORKERS_AUTO
from chunkq.jobs.contract.units import parse_size
from chunkq.queue_worker.devices.discovery import VISIBLE_ENV, GpuInfo, allowed, survey
from chunkq.queue_worker.devices.memory_room import memory_room
from chunkq.queue_worker.devices.torch_build import check_gpus_usable

log = logging.getLogger(__name__)

DEFAULT_ALLOC_CONF = "expandable_segments:True"


def select(spec: str, available: list[GpuInfo], allowed: list[GpuInfo] | None = None) -> list[GpuInfo]:
    """Resolve ``--gpus`` (``all``, ``none`` or ``0,2``: NVML's indices, as nvidia-smi and ``chunkq
    doctor`` show them) against the host's GPUs and those this process may use (``allowed``, from
    its inherited ``CUDA_VISIBLE_DEVICES``; all of them when None).

    ``all`` means the GPUs this process may use (CPU workers where there is none); naming a GPU
    that does not exist is the "invalid device ordinal" case, and naming one this process may not
    use would take another job's GPU: both are refused, naming those it may use.
    """
    allowed = list(available) if allowed is None else allowed
    spec = spec.strip().lower()
    if spec in ("none", "cpu", ""):
        return []
    if spec == "all":
        return list(allowed)
    chosen: list[GpuInfo] = []
    for part in spec.split(","):
        try:
            index = int(part)
        except ValueError:
            raise ConfigError(
                f"--gpus: {part!r} is not a GPU index (use all, none or a list like 0,2)"
            ) from None
        devices = [gpu for gpu in available if gpu.index == index]
        if not devices:
            present = ", ".join(f"{g.index} ({g.name})" for g in _physical(available)) or "none"
            raise ConfigError(f"--gpus: GPU {index} does not exist; GPUs present: {present}")
        mine = [gpu for gpu in devices if gpu in allowed]
        if not mine:
            usable_here = ", ".join(f"{g.label} ({g.name})" for g in allowed) or "none"
            raise ConfigError(
                f"--gpus: GPU {index} is not one this process may use ({VISIBLE_ENV}="
                f"{os.environ.get(VISIBLE_ENV, '')!r} gives it: {usable_here})"
            )
        chosen += mine
    return chosen


def _physical(gpus: list[GpuInfo]) -> list[GpuInfo]:
    """One entry per physical GPU (a MIG GPU lists each instance)."""
    seen: dict[int, GpuInfo] = {}
    for gpu in gpus:
        seen.setdefault(gpu.index, gpu)
    return list(seen.values())


def usable(
    gpus: list[GpuInfo],
    min_free_memory: int,
    skip_busy: bool,
    skipped: list[str] | None = None,
) -> list[GpuInfo]:
    """Report GPUs short of free memory or busy with other processes; skip them as configured (and
    say why in ``skipped``, where given)."""
    kept = []
    skipped = [] if skipped is None else skipped
    say = log.warning
    for gpu in gpus:
        if gpu.memory_free is None:
            if min_free_memory:
                say(
                    "%s (%s): free memory unknown (NVML could not say); --min-free-memory not checked",
                    gpu.label,
                    gpu.name,
                )
        elif gpu.memory_free < min_free_memory:
            why = (
                f"{gpu.label} ({gpu.name}): {gpu.memory_free / 2**30:.1f} GiB free, below --min-free-memory "
                f"{min_free_memory / 2**30:.1f} GiB"
            )
            say("%s; skipped", why)
            skipped.append(why)
            continue
        if gpu.processes:
            names = ", ".join(f"{p.name} (pid {p.pid})" for p in gpu.processes)
            say("%s (%s) is busy with: %s%s", gpu.label, gpu.name, names, "; skipped" if skip_busy else "")
            if skip_busy:
                skipped.append(f"{gpu.label} ({gpu.name}) is busy with {names} (--busy-gpus skip)")
                continue
        kept.append(gpu)
    return kept


def worker_environment(base: dict[str, str], gpu: GpuInfo | None, cpu_threads: int) -> dict[str, str]:
    """The environment of one worker: pinned to one GPU (or none) before it imports torch."""
    env = dict(base)
    # NVML numbers GPUs in PCI bus order; make CUDA agree so index N is the same card in both.
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    if gpu is None:
        env["CUDA_VISIBLE_DEVICES"] = ""
        env[DEVICE_ENV] = "cpu"
        env.pop(GPU_ENV, None)
    else:
        # By UUID: a MIG instance's MIG-... is the only name CUDA takes for it.
        env["CUDA_VISIBLE_DEVICES"] = gpu.uuid or str(gpu.index)
        env[DEVICE_ENV] = "cuda"
        env[GPU_ENV] = gpu.key
        env.setdefault("PYTORCH_CUDA_ALLOC_CONF", DEFAULT_ALLOC_CONF)
    threads = str(max(1, cpu_threads))
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env.setdefault(var, threads)
    # A chunk is tokenised in one call (jobs/compute/tokenized.py); the Rust tokenizers split it over the
    # worker's share of the cores (2 cores: 4,864 -> 6,826 docstrings/s, BENCHMARKS.md).
    # Nothing tokenises before a fork (the fork server only loads), so no child inherits a used pool.
    env.setdefault("TOKENIZERS_PARALLELISM", "true")
    env.setdefault("RAYON_NUM_THREADS", threads)
    # Per-worker download/loading bars would interleave in the pool's log.
    env.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    return env


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity (what Slurm's task plugin, taskset or a
    cpuset gives it), not the host's count, which a pool on 2 CPUs of a 64-core node would take for
    64 workers; no more than a cgroup's CPU quota (a container's CPU limit) lets it use, nor than
    the Slurm job's --cpus-per-task where its cluster does not pin tasks (TaskPlugin=task/none)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    slurm = os.environ.get("SLURM_CPUS_PER_TASK", "")
    if slurm.isdigit() and int(slurm) > 0:
        cores = min(cores, int(slurm))
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, int(int(quota) / int(period) + 0.5)))
    except (OSError, ValueError):
        pass  # cgroup v1 or none: the affinity alone
    return max(1, cores)


def cpu_threads_per_worker(workers: int) -> int:
    return max(1, usable_cores() // max(1, workers))


AUTO_MAX_WORKERS = 4  # more than this per GPU measured no further gain for small models
CORES_PER_WORKER = 2  # tokenising and Python for one worker, the other half of a core pair for the rest
CONTEXT_BYTES = 1 << 29  # a CUDA context and cuBLAS workspaces, per process
ACTIVATION_BYTES = 2 << 30  # headroom for a batch's activations
UNKNOWN_MODEL_BYTES = 1_400_000_000  # a model we cannot measure: taken for a bge-large in fp32
SKIPPED_WEIGHT_FOLDERS = ("onnx", "openvino")  # exported copies sentence-transformers loads only if asked


def _loaded_weights(files: list[str]) -> list[str]:
    """The weight files transformers loads from one folder: its safetensors when there are any
    (sharded ones included), else its ``pytorch_model*.bin``; never an OpenVINO ``.bin`` beside them."""
    safetensors = [f for f in files if f.endswith(".safetensors")]
    if safetensors:
        return safetensors
    return [f for f in files if f.startswith("pytorch_model") and f.endswith(".bin")]


def model_bytes(path: str | None, precision: str) -> int | None:
    """The model's weights in ``precision``, from the sizes of the weight files that load (each
    module's folder); None if the model is not a local folder."""
    if not path or not os.path.isdir(path):
        return None
    stored = 0
    for root, dirs, files in os.walk(path):
        dirs[:] = [d for d in dirs if d not in SKIPPED_WEIGHT_FOLDERS and not d.startswith(".")]
        stored += sum(os.path.getsize(os.path.join(root, f)) for f in _loaded_weights(files))
    return stored // 2 if precision in ("fp16", "bf16") and stored else stored


def auto_workers_per_gpu(
    gpus: list[GpuInfo], cpu_cores: int, weights: int | None, standby: bool = True, memory_limit: int = 0
) -> tuple[int, str]:
    """How many workers each GPU gets for ``--workers-per-gpu auto``, and why.

    At batch 32 a large GPU waits on its worker's CPU work (tokenising, Python, launches): measured on
    an H100, 2 workers gave 1.85x a plain encode for a 335M model and 4 gave 2.57x for MiniLM. So as
    many as the CPU cores per GPU feed (CORES_PER_WORKER each) and the least free GPU memory holds,
    at most AUTO_MAX_WORKERS; one on the CPU or on an EXCLUSIVE_PROCESS GPU. Each worker needs its
    weights, a context and activation headroom; with warm standby each may also have a replacement
    loading beside it (weights and a context), since recycles can coincide. ``memory_limit``
    (``--gpu-memory-limit``, bytes; 0: none) caps what each worker's PyTorch holds, weights and
    activations, though never below its weights; the context lies outside it.
    """
    if not gpus:
        return 1, "no GPU: one worker per CPU slot (--cpu-workers)"
    if any(gpu.exclusive for gpu in gpus):
        return 1, "a GPU in EXCLUSIVE_PROCESS compute mode takes one process"
    by_cpu = max(1, cpu_cores // len(gpus) // CORES_PER_WORKER)
    model = weights if weights is not None else UNKNOWN_MODEL_BYTES
    standby_bytes = model + CONTEXT_BYTES if standby else 0
    held = model + ACTIVATION_BYTES
    if memory_limit:
        held = min(held, max(memory_limit, model))
    per_worker = held + CONTEXT_BYTES + standby_bytes
    # Free memory NVML could not say: the total, less what the others use is unknown; each worker
    # then reads its own free memory for its batches (jobs.compute.token_batches).
    free = min(gpu.memory_free if gpu.memory_free is not None else gpu.memory_total for gpu in gpus)
    by_memory = max(1, int(0.9 * free // per_worker))
    n = min(by_cpu, by_memory, AUTO_MAX_WORKERS)
    weights_text = f"{weights / 2**20:.0f} MiB of weights" if weights is not None else "weights unknown"
    standby_text = f" + a standby's {standby_bytes / 2**30:.1f} GiB" if standby else ""
    if memory_limit:
        held_text = (
            f"{held / 2**30:.1f} GiB as --gpu-memory-limit holds PyTorch to, {weights_text} in it, "
            f"+ a context's {CONTEXT_BYTES / 2**30:.1f} GiB"
        )
    else:
        held_text = f"{weights_text} + {(CONTEXT_BYTES + ACTIVATION_BYTES) / 2**30:.1f} GiB"
    why = (
        f"{cpu_cores} CPU cores for {len(gpus)} GPU(s) feed {by_cpu} at {CORES_PER_WORKER} cores each; "
        f"{free / 2**30:.1f} GiB free on the fullest GPU holds {by_memory} ({held_text}{standby_text} each); "
        f"at most {AUTO_MAX_WORKERS}"
    )
    return max(1, n), why


TOO_LITTLE_MEMORY = "which that memory may not hold (a worker past a limit is killed)"
CPU_WORKER_BYTES = 512 << 20  # a CPU worker beside its weights: Python, torch, a chunk's activations


def auto_cpu_workers(cores: int, weights: int | None, available: int, where: str = "") -> tuple[int, str]:
    """``--cpu-workers`` unset: one single-threaded worker per core, as many as the memory available
    to this process holds (each its weights and CPU_WORKER_BYTES; ``where``: the cgroup whose limit
    binds, if one does: memory_room). Measured on two cores (BENCHMARKS.md,
    "The whole command"): two one-thread workers against one worker of two threads, the whole
    command 1.29x as fast for a static-embedding model at 10^5 texts and 1.24x for MiniLM at 10^4
    (57.5 s against 71.2 s, paired); a worker's second thread waits on the first for much of a chunk."""
    model = weights if weights is not None else UNKNOWN_MODEL_BYTES
    by_memory = int(0.8 * available // (model + CPU_WORKER_BYTES))
    n = max(1, min(cores, by_memory))
    weights_text = f"{model / 2**20:.0f} MiB of weights" if weights is not None else "weights unknown"
    why = (
        f"one per core ({cores}), one thread each; "
        f"{available / 2**30:.1f} GiB available{where} holds {by_memory} "
        f"({weights_text} + {CPU_WORKER_BYTES / 2**20:.0f} MiB each); --cpu-workers N for another count"
    )
    if by_memory < 1:
        why += f"; one all the same, {TOO_LITTLE_MEMORY}: give the pool more"
    return n, why


def resolve_cpu_workers(value: int | None, preload: str | None) -> int:
    """``--cpu-workers``: as given, or worked out for this host and model."""
    if value is not None:
        return value
    weights = model_bytes(_model_path(preload), "fp32")
    room = memory_room()
    where = f" ({room.source})" if room.limited else ""
    workers, why = auto_cpu_workers(usable_cores(), weights, room.available, where)
    level = logging.WARNING if TOO_LITTLE_MEMORY in why else logging.INFO
    log.log(level, "CPU workers: %d (%s)", workers, why)
    return workers


def _model_path(preload: str | None) -> str | None:
    from chunkq.jobs.compute.model_refs import default_model, resolve_model

    try:
        return resolve_model(preload or default_model())
    except ConfigError:
        return None


def resolve_workers_per_gpu(
    value: str,
    gpus: list[GpuInfo],
    preload: str | None,
    precision: str,
    standby: bool = True,
    memory_limit: int = 0,
) -> int:
    """``--workers-per-gpu``: a number as given, or ``auto`` worked out for these GPUs and this model."""
    if value != WORKERS_AUTO:
        return int(value)
    weights = model_bytes(_model_path(preload), precision)
    workers, why = auto_workers_per_gpu(gpus, usable_cores(), weights, standby, memory_limit)
    log.info("workers per GPU: auto means %d (%s)", workers, why)
    return workers


CPU_SPECS = ("none", "cpu")  # --gpus in so many words: the CPU, even where GPUs are


def choose(spec: str, min_free_memory: str, busy: str) -> list[GpuInfo]:
    """The GPUs a pool uses: ``--gpus`` among those this process may use, less those short of
    memory or (with ``skip``) busy. [] means CPU workers, and is only given where the user asked for
    the CPU (``--gpus none``), this process may use no GPU (``CUDA_VISIBLE_DEVICES=""``), or the host
    has no NVIDIA driver: a host where CUDA sees a device, or whose driver is broken, never falls
    back to the CPU silently (ConfigError, one line, saying why and what to do)."""
    host = survey()
    inherited = os.environ.get(VISIBLE_ENV)
    chosen = select(spec, host.gpus, allowed(host))
    for gpu in chosen:
        if gpu.exclusive:
            log.info("%s (%s): compute mode EXCLUSIVE_PROCESS: one worker, no standby", gpu.label, gpu.name)
    skipped: list[str] = []
    kept = usable(chosen, parse_size(min_free_memory), busy == "skip", skipped)
    check_gpus_usable([f"{g.label}: {g.name}" for g in kept])
    if kept or spec.strip().lower() in CPU_SPECS or inherited == "":
        return kept
    cpu = "give --gpus none to run on the CPU instead"
    if skipped:
        raise ConfigError(f"--gpus {spec}: no GPU left to use ({'; '.join(skipped)}); free one, or {cpu}")
    if host.gpus:
        raise ConfigError(
            f"{VISIBLE_ENV}={inherited!r} leaves this process none of the host's {len(host.gpus)} GPU(s) "
            f"({', '.join(g.uuid for g in host.gpus)}); name one of them there, or {cpu}"
        )
    if host.driver_broken:
        raise ConfigError(
            f"NVML cannot initialise ({host.nvml_error}) and CUDA lists no GPU ({host.cuda_error}): the "
            f"NVIDIA driver is broken (`chunkq doctor` says more); fix it, or {cpu}"
        )
    return kept
