"""What a run measures on a sample of its own texts, taken evenly across its chunks, in a child
process (``jobs/calibrate.py``): the one set of int8/uint8 ranges its chunks quantize against, kept
in the run's manifest. (How a precision that rounds agrees with fp32 the workers measure as they
encode: ``jobs/compute/agreement.py``.)
"""

from __future__ import annotations

import logging
from typing import Any

from chunkq.jobs.calibrate import CALIBRATION_ROWS, ranges_for
from chunkq.jobs.contract.run_files import RunLayout, read_chunk_input
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
    return ranges_for(req.model, req.encode, texts, req.calibrate_on)
