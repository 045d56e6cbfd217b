"""multivector: a matrix of token vectors per text (ColBERT-style late interaction), as
``MultiVectorEncoder.encode_document`` / ``encode_query`` / ``encode`` give it, stored ragged
(jobs.contract.ragged): the texts' token vectors one after another, and where each text's begin.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from chunkq.jobs.compute import token_batches
from chunkq.jobs.compute.tokenized import length_limit
from chunkq.jobs.contract.ragged import SCHEMAS, Ragged
from chunkq.jobs.contract.specs import EncodeOptions
from chunkq.jobs.kinds.contract import Kind, OnRows, ragged_rows, warm_up_texts
from chunkq.jobs.kinds.sparse import encode_call


def encode(model: Any, texts: list[str], options: EncodeOptions, on_rows: OnRows) -> Ragged:
    call = encode_call(model, options.role)
    lengths = token_batches.token_lengths(model, texts, length_limit(model))

    def encoded(batch: list[int]) -> tuple[list[dict[str, Any]], int]:
        found = call(
            [texts[i] for i in batch],
            batch_size=len(batch),
            prompt=options.prompt,
            prompt_name=options.prompt_name,
            normalize_embeddings=options.normalize_embeddings,
            convert_to_numpy=True,
            show_progress_bar=False,
        )
        rows = [{"vectors": np.asarray(vectors, dtype=np.float32)} for vectors in found]
        return rows, int(rows[-1]["vectors"].shape[1]) if rows else 0

    batches = token_batches.each_batch(lengths, options, on_rows)
    return ragged_rows(len(texts), batches, encoded, SCHEMAS["multivector"])


def refuse(options: EncodeOptions) -> str | None:
    if options.truncate_dim or options.late_chunking or options.max_active_dims:
        return "token vectors are not truncated, late-chunked or sparse"
    if options.output_dtype != "float32":
        return "token vectors are stored as float32"
    return None


KIND = Kind(
    name="multivector",
    model_class="MultiVectorEncoder",
    reference="MultiVectorEncoder.encode(texts) (encode_query / encode_document with --role)",
    row="a matrix of token vectors per text (ragged)",
    rows_are="token matrices",
    encode=encode,
    warm_up=warm_up_texts,
    refuse=refuse,
    ragged=True,
    cached=False,
    dim_note=" per token vector",
    sink_rows="",
)
