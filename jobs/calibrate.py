"""int8/uint8 ranges for a whole run, from a sample of its texts, in a process of its own.

Quantized to int8, a value's code depends on the per-dimension minimum and maximum it is measured
against; ranges taken per chunk would give the same value different codes in different chunks. So
submit computes one set before any chunk runs and keeps it in the run's manifest, where every worker
and every rerun reads it. The encode runs here, in a child process (``python -m
chunkq.jobs.calibrate``, JSON in and out), so a supervisor never imports torch or holds a model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from typing import Any

from chunkq.jobs.contract.errors import ConfigError
from chunkq.jobs.contract.specs import EncodeOptions

CALIBRATION_ROWS = 1000  # texts encoded for the ranges (sentence-transformers suggests 100s or more)
CALIBRATION_TIMEOUT = 1800.0
CUDA_VISIBLE = "CUDA_VISIBLE_DEVICES"


def ranges_for(
    model: str, options: EncodeOptions, texts: list[str], visible: str | None = None
) -> dict[str, Any]:
    """{"rows": n, "ranges": [[minimums], [maximums]], "device": ..., "visible": ...} of ``texts``
    encoded as the run encodes them. ``visible``: the process's ``CUDA_VISIBLE_DEVICES`` ("" for the
    CPU, a GPU's UUID), so that a run given ``--gpus none`` or some GPUs does not calibrate on
    another (busy, or in exclusive mode another process's); None: as this process sees them."""
    request = json.dumps({"model": model, "options": options.to_dict(), "texts": texts})
    env = None if visible is None else {**os.environ, CUDA_VISIBLE: visible}
    done = subprocess.run(
        [sys.executable, "-m", "chunkq.jobs.calibrate"],
        input=request.encode(),
        capture_output=True,
        timeout=CALIBRATION_TIMEOUT,
        check=False,
        env=env,
    )
    if done.returncode != 0:
        last = (done.stderr.decode(errors="replace").strip().splitlines() or ["no message"])[-1]
        raise ConfigError(f"calibrating {options.output_dtype} ranges with model {model} failed: {last}")
    return dict(json.loads(done.stdout))


def ranges_here(model: str, options: EncodeOptions, texts: list[str], device: str) -> list[list[float]]:
    """The ranges of ``texts`` encoded in this process in fp32, as a run's calibration encodes them."""
    from chunkq.jobs.compute import models, quantize
    from chunkq.jobs.embed import encode_texts

    wide = replace(options, batch_tokens=None)
    loaded = models.get_model(model, device, "fp32", wide)
    return quantize.ranges_of(encode_texts(loaded, texts, wide))


def _main() -> None:
    from chunkq.jobs.compute import model_refs

    request = json.loads(sys.stdin.buffer.read())
    options = EncodeOptions.from_dict(request["options"])
    model_refs.assume_offline()
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    texts = list(request["texts"])
    print(
        json.dumps(
            {
                "rows": len(texts),
                "ranges": ranges_here(request["model"], options, texts, device),
                "device": device,
                "visible": os.environ.get(CUDA_VISIBLE),
            }
        )
    )


if __name__ == "__main__":
    _main()
