"""Whether the installed torch can use the host's GPUs at all, asked before any worker starts (issue
51.11): a CPU build of torch on a host whose driver lists GPUs made every worker refuse its GPU in
turn, and the terminal said only "the worker pool exited before the run finished".

Read from torch's own ``version.py`` (``cuda = '13.0'`` or ``None``, ``hip`` for ROCm), not by
importing torch: the pool and the CLI never import it (seconds of start-up, and no CUDA context in
the pool). ``CHUNKQ_SIMULATED_TORCH_CUDA`` stands in for it where GPUs are simulated
(``CHUNKQ_SIMULATED_GPUS``), so a drill on a CPU host can still reach its workers.
"""

from __future__ import annotations

import os
import re
from importlib.util import find_spec
from pathlib import Path

from chunkq.jobs.contract import environment
from chunkq.jobs.contract.errors import ConfigError

SIMULATED_ENV = environment.SIMULATED_TORCH_CUDA
_FIELD = re.compile(r"^(__version__|cuda|hip)\s*(?::[^=]*)?=\s*(.+?)\s*$", re.MULTILINE)


def build() -> dict[str, str | None] | None:
    """torch's release and the CUDA and ROCm it was built for (None: without); None where torch is
    not installed or its version.py cannot be read."""
    simulated = os.environ.get(SIMULATED_ENV)
    if simulated:
        return {"__version__": "simulated", "cuda": simulated, "hip": None}
    spec = find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        text = (Path(next(iter(spec.submodule_search_locations))) / "version.py").read_text()
    except (OSError, StopIteration):
        return None
    fields = {name: value.strip("'\"") for name, value in _FIELD.findall(text)}
    return {
        name: None if fields.get(name, "None") == "None" else fields[name]
        for name in ("__version__", "cuda", "hip")
    }


def check_gpus_usable(gpus: list[str]) -> None:
    """ConfigError when this host's driver lists ``gpus`` (their labels) and torch here is built
    without CUDA or ROCm: no worker could use them."""
    found = build()
    if not gpus or found is None or found["cuda"] or found["hip"]:
        return
    raise ConfigError(
        f"this host's driver lists {len(gpus)} GPU(s) ({', '.join(gpus)}), and the installed torch "
        f"{found['__version__']} is built without CUDA: no worker could use them. Install a CUDA build "
        "of torch (pip install torch, without +cpu), or give --gpus none to run on the CPU"
    )
