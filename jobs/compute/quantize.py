"""How a chunk's embeddings are stored: float32 as encoded, float16, int8/uint8 on the run's one set
of ranges, or packed bits (binary/ubinary, 8 dimensions a byte), as sentence-transformers'
``quantize_embeddings`` makes them."""

from __future__ import annotations

from typing import Any

import numpy as np

from chunkq.jobs.contract.errors import ConfigError
from chunkq.jobs.contract.specs import CALIBRATED_DTYPES, PACKED_DTYPES, storage_dtype


def stored_columns(dim: int, output_dtype: str) -> int:
    """Columns of the stored array for ``dim`` dimensions: a byte per 8 for packed bits."""
    return (dim + 7) // 8 if output_dtype in PACKED_DTYPES else dim


def ranges_of(embeddings: np.ndarray[Any, Any]) -> list[list[float]]:
    """Per-dimension [minimums, maximums] of float embeddings: int8/uint8's calibration."""
    return [embeddings.min(axis=0).tolist(), embeddings.max(axis=0).tolist()]


def convert(
    embeddings: np.ndarray[Any, Any], output_dtype: str, ranges: list[list[float]] | None = None
) -> np.ndarray[Any, Any]:
    """Float32 embeddings as stored in ``output_dtype``. int8/uint8 need the run's ``ranges``:
    ranges computed per chunk would give the same value a different code in each chunk."""
    if output_dtype == "float32":
        return np.ascontiguousarray(embeddings, dtype=np.float32)
    if output_dtype == "float16":
        return embeddings.astype(np.float16)
    if output_dtype in CALIBRATED_DTYPES and ranges is None:
        raise ConfigError(f"output dtype {output_dtype} needs the run's ranges, and its manifest has none")
    from sentence_transformers import quantize_embeddings

    bounds = None if ranges is None else np.asarray(ranges, dtype=np.float32)
    if bounds is not None and bounds.shape != (2, embeddings.shape[1]):
        raise ConfigError(
            f"the run's ranges have shape {bounds.shape}, the embeddings {embeddings.shape[1]} dims"
        )
    converted = quantize_embeddings(embeddings, precision=output_dtype, ranges=bounds)  # type: ignore[arg-type]
    return np.ascontiguousarray(converted, dtype=storage_dtype(output_dtype))


def derived_floats(vectors: np.ndarray[Any, Any], options: dict[str, Any]) -> np.ndarray[Any, Any]:
    """A result's float rows from the float32 vectors at full dimension that a planned run encodes
    (``options``: the run's own): cut to ``truncate_dim`` and, when the run normalises, scaled to
    unit length again (sentence-transformers truncates before it normalises, and a unit vector cut
    short is no longer one)."""
    truncate_dim = options.get("truncate_dim")
    if truncate_dim:
        vectors = vectors[:, :truncate_dim]
        if options.get("normalize_embeddings"):
            norms = np.linalg.norm(vectors, axis=1, keepdims=True)
            vectors = vectors / np.maximum(norms, 1e-12)  # torch's F.normalize: eps 1e-12
    return np.ascontiguousarray(vectors, dtype=np.float32)
