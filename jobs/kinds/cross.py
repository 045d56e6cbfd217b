"""cross: a score per (query, passage) pair, or a row of class scores, as ``CrossEncoder.predict``
gives it with the model's own activation (offline reranking, hard-negative mining).

A pair travels as a row's text, the canonical JSON of ``[query, passage]`` (``pair_text``), so the
run's plan, deduplication and vector cache key a pair by both its texts unchanged.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from chunkq.jobs.compute import token_batches
from chunkq.jobs.contract.errors import BadInputError
from chunkq.jobs.contract.specs import BACKENDS, EncodeOptions, canonical_json
from chunkq.jobs.kinds.contract import Kind, OnRows, matrix_rows

SCORE_DTYPES = ("float32", "float16")  # scores are not embeddings: no calibrated or packed outputs


def pair_text(query: str, passage: str) -> str:
    return canonical_json([query, passage])


def parse_pair(text: str) -> tuple[str, str]:
    try:
        pair = json.loads(text)
    except ValueError:
        pair = None
    if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(p, str) for p in pair)):
        raise BadInputError(f"not a (query, passage) pair: {text[:60]!r}")
    return pair[0], pair[1]


def _lengths(model: Any, pairs: list[tuple[str, str]]) -> list[int]:
    queries, passages = [q for q, _ in pairs], [p for _, p in pairs]
    found = model.tokenizer(queries, passages, truncation=True, max_length=int(model.max_seq_length))
    return [len(ids) for ids in found["input_ids"]]


def encode(model: Any, texts: list[str], options: EncodeOptions, on_rows: OnRows) -> np.ndarray[Any, Any]:
    pairs = [parse_pair(t) for t in texts]
    return matrix_rows(
        len(texts),
        token_batches.each_batch(_lengths(model, pairs), options, on_rows),
        lambda batch: model.predict(
            [pairs[i] for i in batch],
            batch_size=len(batch),
            prompt=options.prompt,
            prompt_name=options.prompt_name,
            convert_to_numpy=True,
            show_progress_bar=False,
        ),
    )


def warm_up(model: Any, lengths: list[int]) -> None:
    pairs = [("warm", " ".join(["warm"] * max(1, n - 4))) for n in lengths]
    model.predict(pairs, batch_size=len(pairs), show_progress_bar=False)


def refuse(options: EncodeOptions) -> str | None:
    if options.truncate_dim or options.normalize_embeddings or options.late_chunking:
        return "a cross-encoder gives scores, not vectors: no --truncate-dim, --normalize or late chunking"
    if options.role or options.max_active_dims:
        return "a pair has no query or document role, and no active dimensions"
    if options.output_dtype not in SCORE_DTYPES:
        return f"scores are stored as {' or '.join(SCORE_DTYPES)}, not {options.output_dtype}"
    return None


KIND = Kind(
    name="cross",
    model_class="CrossEncoder",
    reference="CrossEncoder.predict(pairs)",
    row="a score per (query, passage) pair, or a row of class scores",
    rows_are="scores",
    encode=encode,
    warm_up=warm_up,
    refuse=refuse,
    pairs=True,
    dim_note=" score(s) per pair",
    dim_source="labels",
    backends=BACKENDS,
)
