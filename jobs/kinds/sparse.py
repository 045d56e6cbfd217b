"""sparse: a sparse vector per text over the model's vocabulary (SPLADE and the like), as
``SparseEncoder.encode_document`` / ``encode_query`` / ``encode`` give it, stored as CSR
(jobs.contract.ragged): each row's active indices in rising order and their values.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from chunkq.jobs.compute import token_batches
from chunkq.jobs.compute.tokenized import length_limit
from chunkq.jobs.contract.ragged import SCHEMAS, Ragged
from chunkq.jobs.contract.specs import BACKENDS, EncodeOptions
from chunkq.jobs.kinds.contract import Kind, OnRows, ragged_rows, warm_up_texts


def encode_call(model: Any, role: str | None) -> Any:
    """The model's call for ``role``: ``encode_query``/``encode_document`` (its own routing and
    prompts), or plain ``encode``."""
    return getattr(model, f"encode_{role}") if role else model.encode


def encode(model: Any, texts: list[str], options: EncodeOptions, on_rows: OnRows) -> Ragged:
    call = encode_call(model, options.role)
    lengths = token_batches.token_lengths(model, texts, length_limit(model))

    def encoded(batch: list[int]) -> tuple[list[dict[str, Any]], int]:
        found = call(
            [texts[i] for i in batch],
            batch_size=len(batch),
            prompt=options.prompt,
            prompt_name=options.prompt_name,
            convert_to_tensor=True,
            convert_to_sparse_tensor=True,
            max_active_dims=options.max_active_dims,
            show_progress_bar=False,
        )
        found = found.coalesce().cpu()
        where, values = found.indices().numpy(), found.values().float().numpy()
        rows = []
        for position in range(len(batch)):
            mine = where[0] == position
            order = np.argsort(where[1][mine], kind="stable")
            rows.append({"indices": where[1][mine][order], "values": values[mine][order]})
        return rows, int(found.shape[1])

    return ragged_rows(
        len(texts), token_batches.each_batch(lengths, options, on_rows), encoded, SCHEMAS["sparse"]
    )


def refuse(options: EncodeOptions) -> str | None:
    if options.truncate_dim or options.normalize_embeddings or options.late_chunking:
        return "a sparse vector is not truncated, normalised or late-chunked"
    if options.output_dtype != "float32":
        return "sparse values are stored as float32"
    return None


KIND = Kind(
    name="sparse",
    model_class="SparseEncoder",
    reference="SparseEncoder.encode(texts) (encode_query / encode_document with --role)",
    row="a sparse vector per text (CSR: indices, values)",
    rows_are="sparse vectors",
    encode=encode,
    warm_up=warm_up_texts,
    refuse=refuse,
    ragged=True,
    cached=False,
    dim_note=" (the vocabulary: a sparse vector's space)",
    dim_source="vocabulary",
    sink_rows="sparse",
    backends=BACKENDS,
)
