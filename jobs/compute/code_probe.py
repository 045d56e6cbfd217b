"""Submit's probe: a ``--trust-remote-code`` model loaded once on the CPU in a fresh interpreter, its
code listed and its canary encoded (jobs/compute/model_code.py) before the run's identity is fixed.
Every submit probes: a listing kept from an earlier probe cannot see an import that now succeeds,
or a link that now points elsewhere (a hostile pass served a wrong result from both).

    python -m chunkq.jobs.compute.code_probe REQUEST_JSON OUT_JSON   # what ``probe`` starts
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from chunkq.jobs.compute.model_code import ACCEPT_FLAG, Listing, from_json
from chunkq.jobs.contract.errors import ConfigError

log = logging.getLogger(__name__)
PROBE_SECONDS = 1800  # a model of tens of GB loads on the CPU in minutes; the probe is bounded all the same


def probe(ref: str, options: dict[str, Any]) -> Listing:
    """The listing of ``ref``'s load with ``options`` (``EncodeOptions.to_dict``), and its canary,
    made by a fresh interpreter on the CPU in one thread (its canary the same on every run here)."""
    with tempfile.TemporaryDirectory(prefix="chunkq-code-") as tmp:
        out = Path(tmp) / "listing.json"
        request = json.dumps({"model": ref, "options": options})
        cmd = [sys.executable, "-m", "chunkq.jobs.compute.code_probe", request, str(out)]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=PROBE_SECONDS, check=False)
        except subprocess.TimeoutExpired:
            raise ConfigError(_cannot(ref, f"its load ran past {PROBE_SECONDS} s")) from None
        if done.returncode != 0 or not out.is_file():
            why = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1][:300]
            raise ConfigError(_cannot(ref, f"its load failed: {why}"))
        return from_json(json.loads(out.read_text()))


def _cannot(ref: str, why: str) -> str:
    return (
        f"model {ref}: chunkq loads a model that brings its own code once on the CPU at submit, to "
        f"identify the code it runs, and {why}; give {ACCEPT_FLAG} to run it without that (its files "
        "alone are compared, and no vector cache is used)"
    )


def _probe_main(request: str, out: str) -> None:
    """In the probe's own interpreter: load as a worker loads, warm up, write the listing."""
    import torch

    from chunkq.jobs.compute import model_reads, models
    from chunkq.jobs.contract.specs import EncodeOptions

    torch.set_num_threads(1)  # one thread: the canary's sums in one order, as on every probe here
    model_reads.no_working_directory_imports()
    asked = json.loads(request)
    options = EncodeOptions.from_dict(asked["options"])
    loaded = models.get_model(asked["model"], "cpu", "fp32", options)
    listing = loaded.code if loaded.code is not None else Listing()
    Path(out).write_text(json.dumps(listing.to_record()))


if __name__ == "__main__":
    _probe_main(sys.argv[1], sys.argv[2])
