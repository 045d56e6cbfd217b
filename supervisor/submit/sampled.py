"""What a run measures on a sample of its own texts, taken evenly across its chunks, in a child
process (``jobs/calibrate.py``): the one set of int8/uint8 ranges its chunks quantize against, and
how a precision that rounds (OpenVINO's bf16) agrees with fp32. Both go into the run's manifest.
"""

from __future__ import annotations

import logging
from typing import Any

from chunkq.jobs.calibrate import AGREEMENT_ROWS, CALIBRATION_ROWS, agreement_for, ranges_for
from chunkq.jobs.contract.run_files import RunLayout, read_chunk_input
from chunkq.jobs.contract.specs import EncodeOptions
from chunkq.supervisor.submit.identity import SubmitRequest

log = logging.getLogger(__name__)


def _sample(layout: RunLayout, chunks: int, rows: int) -> list[str]:
    """Up to ``rows`` of the run's texts, taken evenly across its chunks."""
    picked = sorted({round(i * (chunks - 1) / max(1, rows - 1)) for i in range(rows)})
    per_chunk = -(-rows // len(picked))
    texts: list[str] = []
    for index in picked:
        texts += read_chunk_input(layout, index)[1][:per_chunk]
    return texts[:rows]


def calibration(req: SubmitRequest, layout: RunLayout, chunks: int) -> dict[str, Any]:
    """The run's one set of int8/uint8 ranges (jobs.calibrate), from up to CALIBRATION_ROWS texts
    taken evenly across its chunks, before any chunk runs."""
    texts = _sample(layout, chunks, CALIBRATION_ROWS)
    log.info("run %s: computing %s ranges from %d texts", layout.run_id, req.encode.output_dtype, len(texts))
    return ranges_for(req.model, req.encode, texts)


def rounds(options: EncodeOptions) -> bool:
    """A precision asked for by name on a backend that runs it on the CPU (OpenVINO's bf16): what it
    costs in accuracy is measured on the run's own texts, and recorded."""
    return options.backend != EncodeOptions.backend and options.precision != EncodeOptions.precision


def agreement(req: SubmitRequest, layout: RunLayout, chunks: int) -> dict[str, Any]:
    texts = _sample(layout, chunks, AGREEMENT_ROWS)
    measured = agreement_for(req.model, req.encode, texts)
    log.info(
        "run %s: %s %s agrees with %s on %d of its texts: cosine min %.6f, mean %.6f",
        layout.run_id,
        req.encode.backend,
        req.encode.precision,
        measured["with"],
        measured["rows"],
        measured["min_cosine"],
        measured["mean_cosine"],
    )
    return measured
