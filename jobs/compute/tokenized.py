"""A chunk tokenised once: the model's own preprocessing over the whole chunk, cut into batches.

Planning batches needs every text's token length, and ``model.encode`` tokenises each batch again:
on an H100 tokenising alone took 5.2 s of a 20,000-text MiniLM encode (BENCHMARKS.md), on the
worker's only thread while the GPU waited. Here the chunk goes through ``model.preprocess``
(``tokenize`` before sentence-transformers 5) once; the lengths come from its attention mask and
each batch is its rows, trimmed to the batch's longest, run through the model as ``encode`` runs
it (forward, truncate, normalise). The features of a batch cut so equal those of the batch
tokenised alone: padding to the longest text is all that differs, and it is trimmed (from the left
for a left-padding tokenizer).

A static embedding (``StaticEmbedding``: a token lookup and a mean) has no padding: its features are
every text's tokens end to end (``input_ids``) and where each starts (``offsets``). A batch of them
is a run of consecutive texts, cut without a copy; its rows are the same whatever batch they are in
(each text's mean is its own), so such a chunk is encoded in input order (``in_order``).

Where the features cannot be cut so (flattened inputs for variable-length attention kernels, a
modality other than text, a tokenizer output without an attention mask), ``features`` says None
and the caller encodes batch by batch as before.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def length_limit(model: Any) -> int | None:
    """The tokens ``model`` truncates a text at; None where it truncates none (a StaticEmbedding
    says infinity, and has no setter for it)."""
    limit = getattr(model, "max_seq_length", None)
    return int(limit) if isinstance(limit, int | float) and math.isfinite(limit) else None


def prompt_of(model: Any, encode_kwargs: dict[str, Any]) -> str | None:
    """The prompt ``model.encode`` puts before each text: given, named, or the model's default."""
    prompt = encode_kwargs.get("prompt")
    if prompt is None:
        name = encode_kwargs.get("prompt_name") or getattr(model, "default_prompt_name", None)
        prompt = (getattr(model, "prompts", None) or {}).get(name) if name else None
    return str(prompt) if prompt else None


def features(model: Any, texts: list[str], prompt: str | None) -> dict[str, Any] | None:
    """The chunk's features from one pass of the model's preprocessing, or None where they cannot
    be cut into batches."""
    import torch

    out = None
    direct = _input_module_preprocess(model, texts)
    if direct is not None:
        try:
            out = direct(texts, prompt=prompt) if prompt else direct(texts)
        except TypeError:  # a module of an older signature: the model's own path adapts to it
            out = None
    preprocess = getattr(model, "preprocess", None)
    if out is not None:
        pass
    elif preprocess is not None:
        out = preprocess(texts, prompt=prompt) if prompt else preprocess(texts)
    else:  # sentence-transformers < 5: the prompt is part of the text, as its encode does it
        out = model.tokenize([prompt + t for t in texts] if prompt else texts)
    if _bags(out, len(texts)):
        return dict(out)
    mask = out.get("attention_mask")
    if not isinstance(mask, torch.Tensor) or mask.ndim != 2 or mask.shape[0] != len(texts):
        return None
    for value in out.values():
        if isinstance(value, torch.Tensor) and value.ndim >= 1 and value.shape[0] == len(texts):
            if value.ndim != 2 or value.shape != mask.shape:
                return None  # per-text tensors of another shape: not text tokens to trim
    return dict(out)


def _input_module_preprocess(model: Any, texts: list[str]) -> Any:
    """The input module's own ``preprocess``, which sentence-transformers' calls for a batch of texts
    once it has inferred the batch's modality: 52 us a text of checks for URLs and paths (a third of
    a static model's whole encode), for inputs chunkq already knows are text. None where the model is
    not a text model of sentence-transformers 6 (its own path decides then)."""
    modalities = getattr(model, "modalities", None)
    try:
        first = model[0]
    except (TypeError, IndexError, KeyError):
        return None
    method = getattr(first, "preprocess", None)
    if method is None or not isinstance(modalities, list | tuple) or "text" not in modalities:
        return None
    if "message" in modalities or not all(isinstance(t, str) for t in texts):
        return None  # a prompt becomes a system message there: its own path
    return method


def _bags(out: Any, texts: int) -> bool:
    """Whether ``out`` is a static embedding's: every text's tokens end to end, and their starts."""
    import torch

    ids, offsets = out.get("input_ids"), out.get("offsets")
    return (
        set(out) == {"input_ids", "offsets"}
        and isinstance(ids, torch.Tensor)
        and isinstance(offsets, torch.Tensor)
        and ids.ndim == offsets.ndim == 1
        and offsets.shape[0] == texts
    )


def bagged(chunk_features: dict[str, Any] | None) -> bool:
    return chunk_features is not None and "offsets" in chunk_features


def in_order(texts: int, size: int) -> list[list[int]]:
    """Batches of ``size`` consecutive texts: for features whose rows do not depend on their batch."""
    return [list(range(start, min(start + size, texts))) for start in range(0, texts, size)]


def lengths(chunk_features: dict[str, Any]) -> list[int]:
    if bagged(chunk_features):
        offsets = chunk_features["offsets"].tolist()
        ends = [*offsets[1:], int(chunk_features["input_ids"].shape[0])]
        return [end - start for start, end in zip(offsets, ends, strict=True)]
    return [int(n) for n in chunk_features["attention_mask"].sum(dim=1).tolist()]


def _bag_batch(chunk_features: dict[str, Any], rows: list[int]) -> dict[str, Any]:
    """Consecutive texts' tokens and starts, cut from the chunk's (views, no copy)."""
    ids, offsets = chunk_features["input_ids"], chunk_features["offsets"]
    first, last = rows[0], rows[-1] + 1
    start = int(offsets[first])
    end = int(offsets[last]) if last < offsets.shape[0] else int(ids.shape[0])
    return {"input_ids": ids[start:end], "offsets": offsets[first:last] - start}


def _left_padded(model: Any) -> bool:
    tokenizer = getattr(model, "tokenizer", None)
    return getattr(tokenizer, "padding_side", "right") == "left"


def encode_batch(
    model: Any,
    chunk_features: dict[str, Any],
    rows: list[int],
    token_lengths: list[int],
    encode_kwargs: dict[str, Any],
) -> np.ndarray[Any, Any]:
    """The embeddings of the chunk's ``rows``, as ``model.encode`` of those texts gives them
    (consecutive rows, for bagged features)."""
    import torch

    if bagged(chunk_features):
        batch = _bag_batch(chunk_features, rows)
    else:
        n = chunk_features["attention_mask"].shape[0]
        width = max(token_lengths[i] for i in rows)
        columns = slice(-width, None) if _left_padded(model) else slice(0, width)
        index = torch.as_tensor(rows)
        batch = {
            key: (
                value[index][:, columns]
                if isinstance(value, torch.Tensor) and value.ndim == 2 and value.shape[0] == n
                else value
            )
            for key, value in chunk_features.items()
        }
    device = model.device
    batch = {
        key: value.to(device) if isinstance(value, torch.Tensor) else value for key, value in batch.items()
    }
    with torch.inference_mode():
        embeddings = model(batch)["sentence_embedding"]
        if encode_kwargs.get("truncate_dim"):
            embeddings = embeddings[..., : encode_kwargs["truncate_dim"]]
        if encode_kwargs.get("normalize_embeddings"):
            embeddings = torch.nn.functional.normalize(embeddings, p=2, dim=1)
        return np.asarray(embeddings.float().cpu().numpy(), dtype=np.float32)
