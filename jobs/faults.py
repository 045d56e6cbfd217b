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
- ``broken_context``: the after-error probe finds the context unusable.
- ``hang`` (ignores SIGALRM, as a hung CUDA call would, and sleeps), ``sigkill`` (kills its own
  process), ``slow`` (takes ``seconds`` longer).
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from dataclasses import dataclass
from typing import Any

from chunkq.jobs.errors import ConfigError

ENV = "CHUNKQ_FAULTS"
KINDS = ("oom", "device_assert", "cuda_fatal", "broken_context", "hang", "sigkill", "slow")

# c10's CUDA error check appends these lines to every CUDA runtime error (torch 2.x).
_CUDA_ADVICE = (
    "\nCUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace "
    "below might be incorrect.\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1\n"
    "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.\n"
)
# CUDACachingAllocator's OOM message (torch >= 2.3), as seen on an H100 (issue 14).
_OOM_TEXT = (
    "CUDA out of memory. Tried to allocate {wanted:.2f} GiB. GPU 0 has a total capacity of 79.18 GiB of "
    "which 3.41 GiB is free. Including non-PyTorch memory, this process has 75.76 GiB memory in use. Of "
    "the allocated memory 75.06 GiB is allocated by PyTorch, and 181.50 MiB is reserved by PyTorch but "
    "unallocated. If reserved but unallocated memory is large try setting "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for "
    "Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
)


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
    }
    if unknown:
        raise ConfigError(f"{ENV}: unknown field(s) {sorted(unknown)} in {rule!r}")
    chunks, attempts = rule.get("chunks"), rule.get("attempts")
    return Fault(
        kind=rule["kind"],
        chunks=frozenset(int(c) for c in chunks) if chunks is not None else None,
        attempts=frozenset(int(a) for a in attempts) if attempts is not None else None,
        probability=float(rule.get("probability", 1.0)),
        seed=int(rule.get("seed", 0)),
        above_batch=int(rule.get("above_batch", 0)),
        seconds=float(rule.get("seconds", 0.0)),
        run_id=rule.get("run_id"),
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
        if fault.kind == "broken_context" or not fault.matches(run_id, chunk, attempt):
            continue
        if fault.kind == "oom" and batch_size > fault.above_batch:
            _out_of_memory(device, batch_size)
        if fault.kind == "device_assert":
            _device_assert(device)
        if fault.kind == "cuda_fatal":
            raise _accelerator_error("CUDA error: an illegal memory access was encountered" + _CUDA_ADVICE)
        if fault.kind == "slow":
            time.sleep(fault.seconds)  # a long chunk: something to kill a worker in the middle of
        if fault.kind == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if fault.kind == "hang":
            # Like a hung CUDA call: RQ's SIGALRM job timeout cannot get it out.
            signal.signal(signal.SIGALRM, signal.SIG_IGN)
            while True:
                time.sleep(3600)


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


def probe_fails(run_id: str, chunk: int, attempt: int) -> bool:
    return any(f.kind == "broken_context" and f.matches(run_id, chunk, attempt) for f in _FAULTS)
