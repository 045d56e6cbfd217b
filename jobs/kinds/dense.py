"""dense: a vector per text, as ``SentenceTransformer.encode`` gives it (the kind chunkq began with)."""

from __future__ import annotations

from typing import Any

import numpy as np

from chunkq.jobs.compute import late, token_batches
from chunkq.jobs.compute.tokenized import length_limit
from chunkq.jobs.contract.specs import BACKENDS, EncodeOptions
from chunkq.jobs.kinds.contract import Kind, OnRows, matrix_rows, warm_up_texts, with_bad_rows


def encode(model: Any, texts: list[str], options: EncodeOptions, on_rows: OnRows) -> Any:
    """Texts in, float32 rows out, in input order (prompt, truncation and normalisation applied as
    sentence-transformers applies them); late-chunking rows pooled from their segment's pass."""
    kwargs: dict[str, Any] = {
        "normalize_embeddings": options.normalize_embeddings,
        "prompt": options.prompt,
        "prompt_name": options.prompt_name,
        "truncate_dim": options.truncate_dim,
    }
    by_tokens = isinstance(options.batch_tokens, int)
    limit = options.batch_tokens if isinstance(options.batch_tokens, int) else options.batch_size
    if options.late_chunking:
        rows, empty = late.encode(
            model, texts, lambda lengths: token_batches.batches(lengths, limit, by_tokens), kwargs, on_rows
        )
        return with_bad_rows(rows, empty, options, "late-chunking window(s) have no vector")
    if options.role:
        return _encode_with_role(model, texts, options, kwargs, on_rows)
    ahead = token_batches.tokenise_ahead(model)
    return token_batches.encode(
        model, texts, limit, kwargs, by_tokens=by_tokens, on_rows=on_rows, ahead=ahead
    )


def _encode_with_role(
    model: Any, texts: list[str], options: EncodeOptions, kwargs: dict[str, Any], on_rows: OnRows
) -> np.ndarray[Any, Any]:
    """``encode_query``/``encode_document`` a batch at a time: the model's own routing (its "query"
    or "document" prompt, its router's task), which a named prompt alone does not set."""
    call = getattr(model, f"encode_{options.role}")
    lengths = token_batches.token_lengths(model, texts, length_limit(model))
    return matrix_rows(
        len(texts),
        token_batches.each_batch(lengths, options, on_rows),
        lambda batch: call(
            [texts[i] for i in batch], batch_size=len(batch), show_progress_bar=False, **kwargs
        ),
    )


def refuse(options: EncodeOptions) -> str | None:
    return "--max-active-dims is for sparse models" if options.max_active_dims else None


KIND = Kind(
    name="dense",
    model_class="SentenceTransformer",
    reference="SentenceTransformer.encode(texts)",
    row="a vector per text",
    rows_are="embeddings",
    encode=encode,
    warm_up=warm_up_texts,
    refuse=refuse,
    canary=True,
    backends=BACKENDS,
    rounds=True,
)
