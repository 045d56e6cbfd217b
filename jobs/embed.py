"""The embed job: read a chunk from the store, encode it, publish the output atomically."""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime
from typing import Any

import numpy as np

from jobs import models, runtime
from jobs.errors import BadInputError
from jobs.specs import ChunkSpec, EncodeOptions
from jobs.store import RunLayout, read_chunk_input, verify_output, write_output

log = logging.getLogger(__name__)


def encode_texts(
    loaded: models.LoadedModel, texts: list[str], options: EncodeOptions
) -> np.ndarray[Any, Any]:
    """The maths alone: texts in, float32 rows out, in input order."""
    model = loaded.model
    # The cached model is shared by every run this process serves, so set the length on each call.
    model.max_seq_length = options.max_seq_length or loaded.default_max_seq_length
    embeddings = model.encode(
        texts,
        batch_size=options.batch_size,
        normalize_embeddings=options.normalize_embeddings,
        convert_to_numpy=True,
        show_progress_bar=False,
    )
    return np.asarray(embeddings, dtype=np.float32)


def embed_chunk(spec: dict[str, Any]) -> dict[str, Any]:
    """RQ job function: encode one chunk and return its output metadata (JSON)."""
    chunk = ChunkSpec.from_dict(spec)
    layout = RunLayout(chunk.store, chunk.run_id)
    existing, _ = verify_output(layout, chunk.index, chunk.rows)
    if existing is not None:
        log.info("chunk %s already has a valid output; not encoding it again", chunk.job_id)
        return {**existing, "skipped": True}

    _, texts = read_chunk_input(layout, chunk.index)
    if len(texts) != chunk.rows:
        raise BadInputError(
            f"chunk {chunk.job_id}: input holds {len(texts)} rows, the spec says {chunk.rows}"
        )
    ctx = runtime.current()
    loaded = models.get_model(chunk.model, ctx.device, chunk.options.precision)
    started_at = datetime.now(UTC)
    t0 = time.perf_counter()
    embeddings = encode_texts(loaded, texts, chunk.options)
    seconds = time.perf_counter() - t0
    meta = {
        "run_id": chunk.run_id,
        "chunk": chunk.index,
        "first_row": chunk.first_row,
        "model": chunk.model,
        "worker": ctx.name,
        "pid": ctx.pid,
        "host": ctx.host,
        "device": ctx.device,
        "gpu": ctx.gpu,
        "precision": chunk.options.precision,
        "batch_size": chunk.options.batch_size,
        "seconds": round(seconds, 4),
        "started_at": started_at.isoformat(),
        "finished_at": datetime.now(UTC).isoformat(),
    }
    published = write_output(layout, chunk.index, embeddings, meta)
    log.info("chunk %s: %d rows in %.2f s", chunk.job_id, len(texts), seconds)
    return {**published, "skipped": False}
