"""Fault injection for tests and drills: makes the embed job fail the ways GPUs fail.

Off unless ``CHUNKQ_FAULTS`` holds a JSON list of rules; parsed once at import, so when it is off
the job pays one empty-tuple check. A worker with faults on says so loudly at start-up.

    CHUNKQ_FAULTS='[{"kind": "oom", "chunks": [3], "above_batch": 8},
                    {"kind": "cuda_fatal", "chunks": [5], "attempts": [1]},
                    {"kind": "sigkill", "probability": 0.1, "seed": 7}]'

Kinds:
- ``oom`` while the batch size is above ``above_batch``: on a GPU, a real allocation larger than
  the device (torch raises its real OutOfMemoryError); on the CPU, torch.OutOfMemoryError with the
  text torch 2.3+ writes (CUDACachingAllocator.cpp), its ``expandable_segments`` advice included.
- ``device_assert``: on a GPU, a real out-of-bounds index kernel, so the context really breaks; on
  the CPU, the error torch 2.11 raised for it on an H100 (``torch.AcceleratorError: CUDA error:
  device-side assert triggered`` and c10's advice lines).
- ``cuda_fatal``: the illegal-memory-access error in torch's wording (AcceleratorError where torch
  has it, a RuntimeError before 2.8), on any device; torch offers no way to cause one for real.
- ``nvml_assert`` while the batch size is above ``above_batch``: the caching allocator's assert
  that replaces an out-of-memory where NVML cannot work in the process (``variant``: ``init_2_11``,
  ``init``, ``handle`` or ``processes``, each the wording and line number of a real report; see
  ``NVML_ASSERTS``), raised as torch raises it (a RuntimeError from c10::Error). On a GPU a real
  oversized allocation fails first, so the allocator has really released its cache as it would.
- ``unsupported``: this GPU cannot run this model (``variant``: ``no_kernel_image``, ``cublas``;
  ``launch`` while the batch is above ``above_batch``, as a too-large launch grid fails); the texts
  of real reports (``UNSUPPORTED``).
- ``non_finite``: the encode's output holds NaN in ``rows`` (default [0]) of the chunk, as a float16
  overflow leaves it; with ``precision`` only when encoding in that precision.
- ``no_context``: creating the worker's CUDA context fails (``variant``: ``oom``, the runtime's
  cudaErrorMemoryAllocation, or ``busy``, a GPU another process holds in EXCLUSIVE_PROCESS mode),
  raised where the worker first touches its GPU; any chunk, any attempt.
- ``probe_oom``: the after-OOM probe's own allocation (a 2 MiB block) runs out of memory, as it
  does when workers and a standby share the GPU; the context itself is fine.
- ``broken_context``: the after-error probe finds the context unusable.
- ``hang`` (ignores SIGALRM, as a hung CUDA call would, and sleeps), ``sigkill`` (kills its own
  process), ``slow`` (takes ``seconds`` longer).
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from chunkq.jobs.contract import environment
from chunkq.jobs.contract.errors import ConfigError

ENV = environment.FAULTS
SLOW_SLICE_SECONDS = 0.1  # a batch's forward on the CPU takes about this long
KINDS = (
    "oom",
    "nvml_assert",
    "unsupported",
    "non_finite",
    "device_assert",
    "cuda_fatal",
    "no_context",
    "probe_oom",
    "broken_context",
    "hang",
    "sigkill",
    "slow",
)

# c10's CUDA error check appends these lines to every CUDA runtime error (torch 2.x).
_CUDA_ADVICE = (
    "\nCUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace "
    "below might be incorrect.\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1\n"
    "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.\n"
)
# CUDACachingAllocator's OOM message (torch >= 2.3), as seen on an H100.
_OOM_TEXT = (
    "CUDA out of memory. Tried to allocate {wanted:.2f} GiB. GPU 0 has a total capacity of 79.18 GiB of "
    "which 3.41 GiB is free. Including non-PyTorch memory, this process has 75.76 GiB memory in use. Of "
    "the allocated memory 75.06 GiB is allocated by PyTorch, and 181.50 MiB is reserved by PyTorch but "
    "unallocated. If reserved but unallocated memory is large try setting "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for "
    "Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
)

# c10/cuda/CUDACachingAllocator.cpp, reportProcessMemoryInfo, reached from the allocator's OOM branch
# (``if (!block_found)``) before it raises OutOfMemoryError. TORCH_INTERNAL_ASSERT's text ends in
# "please report a bug to PyTorch. " (trailing space included); line numbers vary by release.
NVML_ASSERTS = {
    # torch 2.11.0+cu130 on an H100 whose libnvidia-ml.so.1 failed nvmlInit_v2 with
    # NVML_ERROR_LIB_RM_VERSION_MISMATCH, raised by the allocator itself (seen on an H100, 2026-11-25).
    "init_2_11": "NVML_SUCCESS == DriverAPI::get()->nvmlInit_v2_() INTERNAL ASSERT FAILED at "
    '"/pytorch/c10/cuda/CUDACachingAllocator.cpp":1135, please report a bug to PyTorch. ',
    # pytorch/pytorch#112950 (torch 2.1): nvmlInit_v2_ failed in the process.
    "init": 'NVML_SUCCESS == DriverAPI::get()->nvmlInit_v2_() INTERNAL ASSERT FAILED at "../c10/cuda/'
    'CUDACachingAllocator.cpp":1123, please report a bug to PyTorch. ',
    # pytorch/pytorch#112950, a comment of 2024-07-10: NVML up, but no handle for the PCI bus id.
    "handle": "NVML_SUCCESS == DriverAPI::get()->nvmlDeviceGetHandleByPciBusId_v2_( pci_id, &nvml_device) "
    'INTERNAL ASSERT FAILED at "../c10/cuda/CUDACachingAllocator.cpp":815, please report a bug to '
    "PyTorch. ",
    # fal-ai/fal#478 ("CUDA OOM could sometimes look like ..."), hpcaitech/Open-Sora#716 on an A800
    # MIG slice: nvmlDeviceGetComputeRunningProcesses failed.
    "processes": 'NVML_SUCCESS == r INTERNAL ASSERT FAILED at "../c10/cuda/CUDACachingAllocator.cpp":830, '
    "please report a bug to PyTorch. ",
}
# Errors of a GPU that cannot run the model; torch >= 2.8 raises CUDA runtime errors as
# AcceleratorError, cuBLAS's through TORCH_CUDABLAS_CHECK as a RuntimeError.
UNSUPPORTED = {
    # Acly/krita-ai-diffusion#2426, Comfy-Org/ComfyUI#11780 (torch.AcceleratorError, GTX 10xx).
    "no_kernel_image": "CUDA error: no kernel image is available for execution on the device\nSearch for "
    "`cudaErrorNoKernelImageForDevice' in https://docs.nvidia.com/cuda/cuda-runtime-api/"
    "group__CUDART__TYPES.html for more information." + _CUDA_ADVICE,
    # fp16 GEMM on a GPU without it (a report quoted in several RTX 30xx setup notes).
    "cublas": "CUDA error: CUBLAS_STATUS_NOT_SUPPORTED when calling `cublasGemmEx( handle, opa, opb, m, n, "
    "k, &falpha, a, CUDA_R_16F, lda, b, CUDA_R_16F, ldb, &fbeta, c, CUDA_R_16F, ldc, CUDA_R_32F, "
    "CUBLAS_GEMM_DEFAULT_TENSOR_OP)`",
    # pytorch/pytorch#48573; pytorch/ort#116: a (128, 3, 224, 224) input failed, (16, ...) worked.
    "launch": "CUDA error: invalid configuration argument" + _CUDA_ADVICE,
}
_AS_ACCELERATOR_ERROR = ("no_kernel_image", "launch")
# Creating a context (the first allocation) fails: c10's CUDA check wording, AcceleratorError.
NO_CONTEXT = {
    "oom": "CUDA error: out of memory" + _CUDA_ADVICE,  # robbyant-research/CoDeF#72
    "busy": "CUDA error: CUDA-capable device(s) is/are busy or unavailable" + _CUDA_ADVICE,
}

_VARIANTS = {"nvml_assert": NVML_ASSERTS, "unsupported": UNSUPPORTED, "no_context": NO_CONTEXT}


@dataclass(frozen=True)
class Fault:
    kind: str
    chunks: frozenset[int] | None = None  # None: any chunk
    attempts: frozenset[int] | None = None  # None: any attempt (1-based)
    probability: float = 1.0
    seed: int = 0
    above_batch: int = 0  # oom: only while the batch size is above this
    seconds: float = 0.0  # slow: how long the chunk takes longer
    run_id: str | None = None
    variant: str = ""  # nvml_assert, unsupported: which real text
    rows: tuple[int, ...] = (0,)  # non_finite: which rows of the chunk come out NaN
    precision: str | None = None  # non_finite: only when encoding in this precision

    def matches(self, run_id: str, chunk: int, attempt: int) -> bool:
        if self.run_id is not None and run_id != self.run_id:
            return False
        if self.chunks is not None and chunk not in self.chunks:
            return False
        if self.attempts is not None and attempt not in self.attempts:
            return False
        if self.probability >= 1.0:
            return True
        draw = random.Random(f"{self.seed}:{run_id}:{chunk}:{attempt}").random()  # noqa: S311 - not security
        return draw < self.probability


def parse(raw: str | None) -> tuple[Fault, ...]:
    """Rules from the JSON text of CHUNKQ_FAULTS; a malformed rule is refused, never ignored."""
    if not raw:
        return ()
    try:
        rules = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{ENV} is not valid JSON: {exc}") from None
    if not isinstance(rules, list):
        raise ConfigError(f"{ENV} must be a JSON list of rules")
    return tuple(_rule(rule) for rule in rules)


def _rule(rule: Any) -> Fault:
    if not isinstance(rule, dict) or rule.get("kind") not in KINDS:
        raise ConfigError(f"{ENV}: each rule needs a kind out of {', '.join(KINDS)}; got {rule!r}")
    unknown = set(rule) - {
        "kind",
        "chunks",
        "attempts",
        "probability",
        "seed",
        "above_batch",
        "seconds",
        "run_id",
        "variant",
        "rows",
        "precision",
    }
    if unknown:
        raise ConfigError(f"{ENV}: unknown field(s) {sorted(unknown)} in {rule!r}")
    chunks, attempts = rule.get("chunks"), rule.get("attempts")
    texts = _VARIANTS.get(rule["kind"])
    variant = rule.get("variant", next(iter(texts)) if texts else "")
    if texts is not None and variant not in texts:
        raise ConfigError(f"{ENV}: {rule['kind']} variants are {', '.join(texts)}; got {variant!r}")
    return Fault(
        kind=rule["kind"],
        chunks=frozenset(int(c) for c in chunks) if chunks is not None else None,
        attempts=frozenset(int(a) for a in attempts) if attempts is not None else None,
        probability=float(rule.get("probability", 1.0)),
        seed=int(rule.get("seed", 0)),
        above_batch=int(rule.get("above_batch", 0)),
        seconds=float(rule.get("seconds", 0.0)),
        run_id=rule.get("run_id"),
        variant=variant,
        rows=tuple(int(r) for r in rule.get("rows", (0,))),
        precision=rule.get("precision"),
    )


_FAULTS: tuple[Fault, ...] = parse(os.environ.get(ENV))


def reload() -> None:
    """Read the rules again: a worker forked by the fork server gets its environment after import."""
    global _FAULTS
    _FAULTS = parse(os.environ.get(ENV))


def active() -> bool:
    return bool(_FAULTS)


def inject(run_id: str, chunk: int, attempt: int, batch_size: int, device: str = "cpu") -> None:
    """Called before each encode attempt; does nothing unless a rule matches."""
    if not _FAULTS:
        return
    for fault in _FAULTS:
        act = _BEFORE_ENCODE.get(fault.kind)
        if act is not None and fault.matches(run_id, chunk, attempt):
            act(fault, batch_size, device)


def _oom(fault: Fault, batch_size: int, device: str) -> None:
    if batch_size > fault.above_batch:
        _out_of_memory(device, batch_size)


def _nvml(fault: Fault, batch_size: int, device: str) -> None:
    if batch_size > fault.above_batch:
        _nvml_assert(device, fault.variant)


def _unsupported(fault: Fault, batch_size: int, device: str) -> None:
    if fault.variant != "launch" or batch_size > fault.above_batch:
        text = UNSUPPORTED[fault.variant]
        raise _accelerator_error(text) if fault.variant in _AS_ACCELERATOR_ERROR else RuntimeError(text)


def _illegal_access(fault: Fault, batch_size: int, device: str) -> None:
    raise _accelerator_error("CUDA error: an illegal memory access was encountered" + _CUDA_ADVICE)


def _slow(fault: Fault, batch_size: int, device: str) -> None:
    # Said first, so a test knows the chunk is running (the job started), not only taken.
    logging.getLogger(__name__).warning("FAULT slow: this chunk takes %.1f s longer", fault.seconds)
    # A long chunk, something to kill a worker in the middle of, made as a real one is: of short
    # calls. Python runs a signal's handler in the main thread between calls, and the kernel may
    # hand a process's signal to any of its threads; one long sleep would then hold the handler
    # until it ended (seen once, four tests at once: a worker whose pool was killed worked on in its
    # slow chunk).
    deadline = time.monotonic() + fault.seconds
    while (left := deadline - time.monotonic()) > 0:
        time.sleep(min(left, SLOW_SLICE_SECONDS))


def _sigkill(fault: Fault, batch_size: int, device: str) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _hang(fault: Fault, batch_size: int, device: str) -> None:
    # Like a hung CUDA call: RQ's SIGALRM job timeout cannot get it out.
    signal.signal(signal.SIGALRM, signal.SIG_IGN)
    while True:
        time.sleep(3600)


_BEFORE_ENCODE: dict[str, Callable[[Fault, int, str], None]] = {
    "oom": _oom,
    "nvml_assert": _nvml,
    "unsupported": _unsupported,
    "device_assert": lambda fault, batch_size, device: _device_assert(device),
    "cuda_fatal": _illegal_access,
    "slow": _slow,
    "sigkill": _sigkill,
    "hang": _hang,
}


def _accelerator_error(text: str) -> RuntimeError:
    import torch

    error_class: type[RuntimeError] = getattr(torch, "AcceleratorError", RuntimeError)
    return error_class(text)


def _out_of_memory(device: str, batch_size: int) -> None:
    import torch

    if device.startswith("cuda"):
        total = torch.cuda.get_device_properties(device).total_memory
        torch.empty(2 * total, dtype=torch.uint8, device=device)  # raises torch's own OutOfMemoryError
    raise torch.OutOfMemoryError(_OOM_TEXT.format(wanted=batch_size / 1024))


def _nvml_assert(device: str, variant: str) -> None:
    if device.startswith("cuda"):
        import torch

        try:  # a real allocation failure first: the allocator releases its cache, as before the assert
            _out_of_memory(device, 0)
        except torch.OutOfMemoryError:
            pass
    raise RuntimeError(NVML_ASSERTS[variant])


def inject_context() -> None:
    """Called where a worker first touches its GPU; raises as a failed context creation would."""
    for fault in _FAULTS:
        if fault.kind == "no_context":
            raise _accelerator_error(NO_CONTEXT[fault.variant])


def poison(run_id: str, chunk: int, attempt: int, precision: str, rows: Any) -> None:
    """After an encode: NaN in the rows a ``non_finite`` rule names (an overflow's result)."""
    for fault in _FAULTS:
        if fault.kind != "non_finite" or not fault.matches(run_id, chunk, attempt):
            continue
        if fault.precision is None or fault.precision == precision:
            for row in fault.rows:
                if row < len(rows):
                    rows[row, 0] = float("nan")


def _device_assert(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        table = torch.zeros(4, device=device)
        table[torch.tensor([1 << 20], device=device)].sum().item()  # out of bounds: the kernel asserts
        torch.cuda.synchronize(device)
    raise _accelerator_error(
        "CUDA error: device-side assert triggered"
        + _CUDA_ADVICE.replace(
            "Compile",
            "Search for `cudaErrorAssert' in https://docs.nvidia.com/cuda/cuda-runtime-api/"
            "group__CUDART__TYPES.html for more information.\nCompile",
        )
    )


def inject_probe() -> None:
    """Called before the context probe allocates; raises as that allocation would without memory."""
    if any(f.kind == "probe_oom" for f in _FAULTS):
        import torch

        # The probe's one float comes from a new 2 MiB block of the caching allocator's small pool.
        raise torch.OutOfMemoryError(_OOM_TEXT.format(wanted=2 / 1024).replace("0.00 GiB", "2.00 MiB"))


def probe_fails(run_id: str, chunk: int, attempt: int) -> bool:
    return any(f.kind == "broken_context" and f.matches(run_id, chunk, attempt) for f in _FAULTS)
