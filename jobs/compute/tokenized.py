"""A chunk tokenised once: the model's own preprocessing over the whole chunk, cut into batches.

Planning batches needs every text's token length, and ``model.encode`` tokenises each batch again:
on an H100 tokenising alone took 5.2 s of a 20,000-text MiniLM encode (DESIGN.md §6), on the
worker's only thread while the GPU waited. Here the chunk goes through ``model.preprocess``
(``tokenize`` before sentence-transformers 5) once; the lengths come from its attention mask and
each batch is its rows, trimmed to the batch's longest, run through the model as ``encode`` runs
it (forward, truncate, normalise). The features of a batch cut so equal those of the batch
tokenised alone: padding to the longest text is all that differs, and it is trimmed (from the left
for a left-padding tokenizer).

Where the features cannot be cut so (flattened inputs for variable-length attention kernels, a
modality other than text, a tokenizer output without an attention mask), ``features`` says None
and the caller encodes batch by batch as before.
"""

from __future__ import annotations

from typing import Any

import numpy as np


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

    preprocess = getattr(model, "preprocess", None)
    if preprocess is not None:
        out = preprocess(texts, prompt=prompt) if prompt else preprocess(texts)
    else:  # sentence-transformers < 5: the prompt is part of the text, as its encode does it
        out = model.tokenize([prompt + t for t in texts] if prompt else texts)
    mask = out.get("attention_mask")
    if not isinstance(mask, torch.Tensor) or mask.ndim != 2 or mask.shape[0] != len(texts):
        return None
    for value in out.values():
        if isinstance(value, torch.Tensor) and value.ndim >= 1 and value.shape[0] == len(texts):
            if value.ndim != 2 or value.shape != mask.shape:
                return None  # per-text tensors of another shape: not text tokens to trim
    return dict(out)


def lengths(chunk_features: dict[str, Any]) -> list[int]:
    return [int(n) for n in chunk_features["attention_mask"].sum(dim=1).tolist()]


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
    """The embeddings of the chunk's ``rows``, as ``model.encode`` of those texts gives them."""
    import torch

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
