"""How a run in a precision that rounds (OpenVINO's bf16) agrees with PyTorch in fp32, measured by
the workers on the run's own texts as they encode them.

The first AGREEMENT_CHUNKS chunks each encode AGREEMENT_ROWS_PER_CHUNK of their rows (evenly spaced)
a second time with sentence-transformers on PyTorch in fp32, in the worker that encoded them, and
keep the cosines' minimum and mean in their output's metadata; assembly puts the run's in the
result's manifest. Measured at submit instead, in a process of its own, it cost 13 s and 16 CPU
seconds (imports and two model loads) and held back every chunk not yet queued: a 10^4-text bf16
run waited on it for 6 of its 34 s. Here it costs a load of the fp32 model (dropped again) and 50
rows in fp32, four times a run, while the chunks go on being encoded.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from chunkq.jobs.contract.specs import EncodeOptions

log = logging.getLogger(__name__)

AGREEMENT_CHUNKS = 4  # chunks 0-3: queued first, so the figure is known early in the run
AGREEMENT_ROWS_PER_CHUNK = 50  # 200 rows in a run of four chunks or more
EXACT = EncodeOptions()  # what a rounding precision is measured against: PyTorch, fp32
# The sample's rows are of every length: in batches of 32 the short ones padded to the longest, and 50
# docstrings took 2.4 s on one thread; in batches of at most 1,024 padded tokens, 0.83 s.
REFERENCE_BATCH_TOKENS = 1024


def measures(options: EncodeOptions, chunk: int) -> bool:
    return options.rounds and chunk < AGREEMENT_CHUNKS


def sample(rows: int) -> list[int]:
    """Which of a chunk's ``rows`` are measured: up to AGREEMENT_ROWS_PER_CHUNK, evenly spaced."""
    count = min(rows, AGREEMENT_ROWS_PER_CHUNK)
    return sorted({round(i * (rows - 1) / max(1, count - 1)) for i in range(count)}) if rows else []


def for_chunk(
    model: str,
    chunk: int,
    options: EncodeOptions,
    texts: list[str],
    encoded: Any,
    encode: Callable[[Any, list[str], EncodeOptions], Any],
) -> dict[str, Any]:
    """The agreement of a chunk's rows with fp32 where the run measures it ({} elsewhere): its key
    in the chunk output's metadata."""
    if not measures(options, chunk) or not texts:
        return {}
    found = measure(model, options, texts, encoded, encode)
    log.info("chunk %d: %s", chunk, said(options.backend, options.precision, found))
    return {"agreement": found}


def said(backend: Any, precision: Any, found: dict[str, Any]) -> str:
    """An agreement in words, as a chunk's and a run's logs say it."""
    return (
        f"{backend} {precision} agrees with {found['with']} on {found['rows']} of its texts: "
        f"cosine min {found['min_cosine']:.6f}, mean {found['mean_cosine']:.6f}"
    )


def measure(
    model: str,
    options: EncodeOptions,
    texts: list[str],
    encoded: Any,
    encode: Callable[[Any, list[str], EncodeOptions], Any],
) -> dict[str, Any]:
    """``encoded`` (the chunk's rows as the run encoded them) against the sampled texts encoded by
    ``model`` on PyTorch in fp32 on the CPU: {"rows", "with", "min_cosine", "mean_cosine",
    "cosine_sum"}. The fp32 model is dropped after, unless the worker held it already: a worker holds
    the model of its chunks, not a second one for a figure."""
    from chunkq.jobs.compute import models
    from chunkq.jobs.compute.model_code import row_cosines

    exact = replace(
        options, backend=EXACT.backend, precision=EXACT.precision, batch_tokens=REFERENCE_BATCH_TOKENS
    )
    picked = sample(len(texts))
    held = models.holds(model, "cpu", exact.precision, exact)  # this worker's other run's: kept
    try:
        reference = encode(
            models.get_model(model, "cpu", exact.precision, exact), [texts[i] for i in picked], exact
        )
    finally:
        if not held:
            models.forget(model, "cpu", exact.precision, exact)
    ours = np.asarray(encoded, dtype=np.float64)[picked]
    cosine = row_cosines(ours, np.asarray(reference, dtype=np.float64))
    return {
        "rows": len(picked),
        "with": f"{EXACT.backend} {EXACT.precision}",
        "min_cosine": round(float(cosine.min()), 6),
        "mean_cosine": round(float(cosine.mean()), 6),
        "cosine_sum": float(cosine.sum()),  # the run's mean is the sum of these over its rows
    }


def of_the_run(measured: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The run's agreement from its chunks' (None where no chunk measured one: every row of the first
    chunks came from the vector cache, measured when the run that encoded them ran)."""
    if not measured:
        return None
    rows = sum(int(m["rows"]) for m in measured)
    return {
        "rows": rows,
        "with": measured[0]["with"],
        "chunks": len(measured),
        "min_cosine": min(float(m["min_cosine"]) for m in measured),
        "mean_cosine": round(sum(float(m["cosine_sum"]) for m in measured) / max(rows, 1), 6),
    }
