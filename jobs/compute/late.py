"""Late chunking (``--long-texts late``): a window's vector pooled from the token embeddings of one
forward pass over the segment around it, so each window's vector has seen its neighbours' words
(Günther et al., "Late Chunking: Contextual Chunk Embeddings Using Long-Context Embedding Models",
2024; asked of the serving systems in huggingface/text-embeddings-inference#434 and
michaelfeil/infinity#550).

Submit cuts a text into segments of up to the model's context and each segment into windows
(supervisor.submit.windows.late_rows); every window is a row of the run, as with ``--long-texts window``,
but the row's text is the window's place in its segment and the segment itself (``row_text``). So
the run's deduplication and the vector cache key a window by its segment and span, and a worker
sees a late row as an ordinary row until it encodes it (``encode``): the chunk's distinct segments
are encoded once each for their token embeddings, and each window's vector is the mean of the
embeddings of its own tokens, normalised where the model or the run normalises.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from chunkq.jobs.contract.errors import BadInputError, ConfigError

LATE_POOLING = "mean"  # the pooling late chunking is defined with; a model that pools otherwise is refused


def row_text(segment: str, start: int, end: int) -> str:
    """A late row's text: the window's character span within its segment, then the segment."""
    return f"{start}:{end}:{segment}"


def parse_row(text: str) -> tuple[str, int, int]:
    """(segment, start, end) of a late row's text; BadInputError for anything else."""
    start, sep1, rest = text.partition(":")
    end, sep2, segment = rest.partition(":")
    if not (sep1 and sep2 and start.isdigit() and end.isdigit()):
        raise BadInputError(f"not a late-chunking row (expected 'start:end:segment'): {text[:60]!r}")
    a, b = int(start), int(end)
    if not 0 <= a < b <= len(segment):
        raise BadInputError(
            f"late-chunking row: span {a}:{b} is outside its segment of {len(segment)} characters"
        )
    return segment, a, b


def check_pooling(pooling: str | None, model: str) -> None:
    """Late chunking pools a window's tokens by their mean: a model that pools otherwise (its first
    token, the last, the max) gives vectors late chunking does not define."""
    if pooling != LATE_POOLING:
        raise ConfigError(
            f"model {model} pools its tokens by {pooling or 'an unknown method'}, late chunking needs mean "
            "pooling; use --long-texts window"
        )


def _model_pooling(model: Any) -> str | None:
    for module in model:
        mode = getattr(module, "pooling_mode", None)
        if mode is not None:
            return mode if isinstance(mode, str) else "+".join(mode)
    return None


def _normalizes(model: Any) -> bool:
    return any(type(module).__name__ == "Normalize" for module in model)


EMPTY_WINDOW = "its window holds no token (its characters tokenize to nothing): no vector can be pooled"


def encode(
    model: Any,
    texts: list[str],
    plan_batches: Callable[[list[int]], list[list[int]]],
    encode_kwargs: dict[str, Any],
    on_rows: Callable[[int], None] | None = None,
) -> tuple[np.ndarray[Any, Any], dict[int, str]]:
    """Late rows in, a float32 vector per row out (input order), and the rows that have none (a
    window whose characters tokenize to nothing), each with why: their vectors are zeros, never
    published (the chunk fails naming them, or under --allow-missing they are left out).
    ``plan_batches``: the segments' token lengths to batches of segment indices (a token budget or a
    batch size, as the chunk's back-off has it). ``encode_kwargs`` as for a plain encode: the prompt
    is read before each segment (its tokens are in the pass, not in any window); normalisation is
    applied to the pooled vectors, since sentence-transformers normalises sentence embeddings only."""
    check_pooling(_model_pooling(model), "this")
    rows = [parse_row(text) for text in texts]
    segments = list(dict.fromkeys(segment for segment, _, _ in rows))
    where = {segment: i for i, segment in enumerate(segments)}
    prompt = encode_kwargs.get("prompt") or ""
    if not prompt and encode_kwargs.get("prompt_name"):
        prompt = model.prompts.get(encode_kwargs["prompt_name"], "")
    limit = int(model.max_seq_length)
    tokenized = model.tokenizer([prompt + s for s in segments], return_offsets_mapping=True, truncation=False)
    lengths = [len(ids) for ids in tokenized["input_ids"]]
    too_long = [i for i, n in enumerate(lengths) if n > limit]
    if too_long:
        raise BadInputError(
            f"a late-chunking segment of {lengths[too_long[0]]} tokens exceeds the model's {limit} "
            "(the run was planned for a longer maximum length)"
        )
    options = {k: v for k, v in encode_kwargs.items() if k in ("prompt", "prompt_name")}
    tokens: list[Any] = [None] * len(segments)
    for batch in plan_batches(lengths):
        found = model.encode(
            [segments[i] for i in batch],
            batch_size=len(batch),
            output_value="token_embeddings",
            convert_to_numpy=False,
            show_progress_bar=False,
            **options,
        )
        for i, embeddings in zip(batch, found, strict=True):
            tokens[i] = embeddings.float().cpu().numpy()
    out = np.zeros((len(rows), tokens[0].shape[1] if tokens else 0), dtype=np.float32)
    empty: dict[int, str] = {}
    for r, (segment, start, end) in enumerate(rows):
        s = where[segment]
        offsets = tokenized["offset_mapping"][s]
        first, last = len(prompt) + start, len(prompt) + end
        mine = [t for t, (a, b) in enumerate(offsets) if b > a and first <= a < last]
        if not mine:
            empty[r] = EMPTY_WINDOW
            continue
        out[r] = tokens[s][mine].mean(axis=0)
    # In sentence-transformers' order: the model's Normalize module acts on the pooled vector, then
    # encode truncates (truncate_dim), then normalises if asked (normalize_embeddings).
    if _normalizes(model):
        out = _unit(out)
    if encode_kwargs.get("truncate_dim"):
        out = np.ascontiguousarray(out[:, : encode_kwargs["truncate_dim"]])
    if encode_kwargs.get("normalize_embeddings"):
        out = _unit(out)
    if on_rows is not None:
        on_rows(len(rows))
    out[list(empty)] = 0.0  # normalising a zero row keeps it zero; it is never published
    return out, empty


def _unit(rows: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    norms = np.linalg.norm(rows, axis=1, keepdims=True)
    return rows / np.where(norms > 0, norms, 1)
