"""The host a CPU figure was measured on. OpenVINO's speed against PyTorch's follows the CPU's
generation: the same 2-core run, the same packages, OpenVINO f32 ran at 0.95x torch 2.13 on one
AMD EPYC host with AVX-512 BF16 and 2.14x on another (family 26) a day later (BENCHMARKS.md)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

# The instruction sets a CPU runtime picks its kernels by.
FLAGS_OF_NOTE = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_bf16", "amx_int8")


def cpu_described(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict[str, Any]:
    """The CPU's model name, family, model and instruction sets of note, and a one-line summary."""
    fields: dict[str, str] = {}
    try:
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    flags = set(fields.get("flags", "").split())
    found = {
        "model_name": fields.get("model name", "unknown"),
        "family": fields.get("cpu family", "?"),
        "model": fields.get("model", "?"),
        "cores": os.cpu_count(),
        "flags": [flag for flag in FLAGS_OF_NOTE if flag in flags],
    }
    found["said"] = (
        f"{found['model_name']} (family {found['family']}, model {found['model']}), {found['cores']} cores; "
        f"{' '.join(found['flags']) or 'no AVX-512/AMX'}"
    )
    return found
