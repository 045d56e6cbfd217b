"""int8/uint8 ranges for a whole run, from a sample of its texts, in a process of its own; and how
closely a run in a rounding precision (OpenVINO's bf16) agrees with fp32 on such a sample.

Quantized to int8, a value's code depends on the per-dimension minimum and maximum it is measured
against; ranges taken per chunk would give the same value different codes in different chunks. So
submit computes one set before any chunk runs and keeps it in the run's manifest, where every worker
and every rerun reads it. The encode runs here, in a child process (``python -m
chunkq.jobs.calibrate``, JSON in and out), so a supervisor never imports torch or holds a model.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from typing import Any

from chunkq.jobs.contract.errors import ConfigError
from chunkq.jobs.contract.specs import EncodeOptions

CALIBRATION_ROWS = 1000  # texts encoded for the ranges (sentence-transformers suggests 100s or more)
AGREEMENT_ROWS = 200  # texts encoded twice for a rounding precision's agreement with fp32
CALIBRATION_TIMEOUT = 1800.0
RANGES, AGREEMENT = "ranges", "agreement"


def ranges_for(model: str, options: EncodeOptions, texts: list[str]) -> dict[str, Any]:
    """{"rows": n, "ranges": [[minimums], [maximums]]} of ``texts`` encoded as the run encodes them."""
    return _in_a_child(RANGES, model, options, texts, f"calibrating {options.output_dtype} ranges")


def agreement_for(model: str, options: EncodeOptions, texts: list[str]) -> dict[str, Any]:
    """How ``texts`` encoded as the run encodes them agree with sentence-transformers on PyTorch in
    fp32: {"rows", "with", "min_cosine", "mean_cosine"}."""
    what = f"measuring {options.backend} {options.precision} against fp32"
    return _in_a_child(AGREEMENT, model, options, texts, what)


def _in_a_child(mode: str, model: str, options: EncodeOptions, texts: list[str], what: str) -> dict[str, Any]:
    request = json.dumps({"mode": mode, "model": model, "options": options.to_dict(), "texts": texts})
    done = subprocess.run(
        [sys.executable, "-m", "chunkq.jobs.calibrate"],
        input=request.encode(),
        capture_output=True,
        timeout=CALIBRATION_TIMEOUT,
        check=False,
    )
    if done.returncode != 0:
        last = (done.stderr.decode(errors="replace").strip().splitlines() or ["no message"])[-1]
        raise ConfigError(f"{what} with model {model} failed: {last}")
    return dict(json.loads(done.stdout))


def ranges_here(model: str, options: EncodeOptions, texts: list[str], device: str) -> list[list[float]]:
    """The ranges of ``texts`` encoded in this process in fp32, as a run's calibration encodes them."""
    from chunkq.jobs.compute import models, quantize
    from chunkq.jobs.embed import encode_texts

    wide = replace(options, batch_tokens=None)
    loaded = models.get_model(model, device, "fp32", wide)
    return quantize.ranges_of(encode_texts(loaded, texts, wide))


def agreement_here(model: str, options: EncodeOptions, texts: list[str]) -> dict[str, Any]:
    """``texts`` encoded in this process as the run encodes them, and by PyTorch in fp32: the cosine
    of each pair of rows, its minimum and mean."""
    import numpy as np

    from chunkq.jobs.compute import models
    from chunkq.jobs.compute.model_code import row_cosines
    from chunkq.jobs.embed import encode_texts

    rounded = replace(options, batch_tokens=None)
    exact = replace(rounded, backend=EncodeOptions.backend, precision=EncodeOptions.precision)
    a = encode_texts(models.get_model(model, "cpu", rounded.precision, rounded), texts, rounded)
    b = encode_texts(models.get_model(model, "cpu", exact.precision, exact), texts, exact)
    cosine = row_cosines(np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64))
    return {
        "rows": len(texts),
        "with": f"{exact.backend} {exact.precision}",
        "min_cosine": round(float(cosine.min()), 6),
        "mean_cosine": round(float(cosine.mean()), 6),
    }


def _main() -> None:
    from chunkq.jobs.compute import model_refs

    request = json.loads(sys.stdin.buffer.read())
    options = EncodeOptions.from_dict(request["options"])
    model_refs.assume_offline()
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    texts = list(request["texts"])
    if request.get("mode") == AGREEMENT:
        print(json.dumps(agreement_here(request["model"], options, texts)))
        return
    print(
        json.dumps(
            {
                "rows": len(texts),
                "ranges": ranges_here(request["model"], options, texts, device),
                "device": device,
            }
        )
    )


if __name__ == "__main__":
    _main()
