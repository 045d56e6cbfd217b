"""A kind of one's own, in one module (issue 66.6): named in CHUNKQ_KINDS, it runs end to end with
nothing else changed. Its rows are a dense model's vectors scaled by SCALE, something no built-in
kind gives, so a result that holds them was made by it and by nothing else."""

from __future__ import annotations

from typing import Any

from chunkq.jobs.contract.specs import EncodeOptions
from chunkq.jobs.kinds import dense
from chunkq.jobs.kinds.contract import Kind, OnRows

SCALE = 3.0


def encode(model: Any, texts: list[str], options: EncodeOptions, on_rows: OnRows) -> Any:
    return dense.encode(model, texts, options, on_rows) * SCALE


KIND = Kind(
    name="scaled",
    model_class="SentenceTransformer",
    reference=f"SentenceTransformer.encode(texts) * {SCALE}",
    row="a vector per text, scaled",
    rows_are="scaled embeddings",
    encode=encode,
    warm_up=dense.KIND.warm_up,
    refuse=dense.KIND.refuse,
    built_on="dense",
)
