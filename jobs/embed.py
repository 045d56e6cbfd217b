"""The embed job: read a chunk from the store, encode it, publish the output atomically.

Out of memory: free what can be freed, halve the batch and try again, down to 1; the size that
fitted is recorded for the run's later chunks on the same kind of device. A broken CUDA context:
fail with CudaFatalError and tell the worker to exit, since no in-process reset exists.
"""

from __future__ import annotations

import logging
import time
import traceback
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

import numpy as np
from rq import get_current_job

from chunkq.jobs import cuda, errors, faults, jobmeta, models, quantize, runtime, token_batches
from chunkq.jobs.errors import BadInputError, ChunkOutOfMemoryError, CudaFatalError, TamperedJobError
from chunkq.jobs.manifest import RunManifest, load_manifest
from chunkq.jobs.run_files import (
    RunLayout,
    atomic_write_json,
    read_chunk_input,
    read_json,
    verify_output,
    write_output,
)
from chunkq.jobs.scope import check_spec
from chunkq.jobs.specs import BATCH_TOKENS_AUTO, ChunkSpec, EncodeOptions

log = logging.getLogger(__name__)

MIN_BATCH = 1


def encode_texts(
    loaded: models.LoadedModel, texts: list[str], options: EncodeOptions
) -> np.ndarray[Any, Any]:
    """The maths alone: texts in, float32 rows out, in input order (prompt, truncation and
    normalisation applied as sentence-transformers applies them; not yet converted for storage)."""
    model = loaded.model
    # The cached model is shared by every run this process serves, so set the length on each call.
    model.max_seq_length = options.max_seq_length or loaded.default_max_seq_length
    kwargs: dict[str, Any] = {
        "normalize_embeddings": options.normalize_embeddings,
        "prompt": options.prompt,
        "prompt_name": options.prompt_name,
        "truncate_dim": options.truncate_dim,
    }
    if isinstance(options.batch_tokens, int):
        return token_batches.encode(model, texts, options.batch_tokens, kwargs)
    return token_batches.encode(model, texts, options.batch_size, kwargs, by_tokens=False)


WARM_UP_TOKENS_GPU = (16, 64, 256, 512)  # lengths a warm-up encode covers, capped at the model's maximum
WARM_UP_TOKENS_CPU = (16, 64)  # on the CPU the predecessor is still computing on the same cores
WARM_UP_TEXTS = 8


def warm_up(loaded: models.LoadedModel, device: str) -> tuple[list[int], float]:
    """Encode a few texts of representative lengths once, so a new process's first chunk does not
    pay for kernel selection, allocator growth and lazy initialisation; (lengths, seconds)."""
    limit = loaded.default_max_seq_length or 512
    on_gpu = device.startswith("cuda")
    lengths = sorted({min(n, limit) for n in (WARM_UP_TOKENS_GPU if on_gpu else WARM_UP_TOKENS_CPU)})
    texts = [
        " ".join(["warm"] * max(1, n - 2)) for n in lengths for _ in range(WARM_UP_TEXTS if on_gpu else 2)
    ]
    started = time.perf_counter()
    loaded.model.max_seq_length = limit
    loaded.model.encode(texts, batch_size=len(texts), convert_to_numpy=True, show_progress_bar=False)
    if on_gpu:
        import torch

        torch.cuda.synchronize()
    return lengths, time.perf_counter() - started


def _learned(layout: RunLayout, device_kind: str) -> dict[str, Any]:
    """What the run learned on this kind of device: the batch size or token budget that fitted."""
    try:
        data = read_json(layout.learned_batch(device_kind))
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _remember(layout: RunLayout, device_kind: str, updates: dict[str, Any]) -> None:
    atomic_write_json(
        layout.learned_batch(device_kind), {**_learned(layout, device_kind), **updates, "device": device_kind}
    )


def _start_limit(options: EncodeOptions, learned: dict[str, Any]) -> int:
    """The batch size, or token budget, this chunk starts from."""
    if options.batch_tokens == BATCH_TOKENS_AUTO:
        return int(learned.get("batch_tokens") or token_batches.AUTO_START_TOKENS)
    if isinstance(options.batch_tokens, int):
        return min(options.batch_tokens, int(learned.get("batch_tokens") or options.batch_tokens))
    return min(options.batch_size, int(learned.get("batch_size") or options.batch_size))


@dataclass
class Encoded:
    """What an encode with back-off produced: the rows, the batch size that fitted, each halving."""

    embeddings: np.ndarray[Any, Any]
    limit: int  # the batch size, or token budget, that fitted
    backoffs: list[dict[str, Any]] = field(default_factory=list)


def encode_with_backoff(
    loaded: models.LoadedModel,
    texts: list[str],
    chunk: ChunkSpec,
    attempt: int,
    start_batch: int,
    device: str,
) -> Encoded:
    """Encode, halving the batch (or the token budget) after each out-of-memory error.

    The floor is one text per batch: MIN_BATCH texts, or a budget of one text at the maximum length.
    """
    by_tokens = chunk.options.batch_tokens is not None
    unit = "batch_tokens" if by_tokens else "batch_size"
    floor = (chunk.options.max_seq_length or loaded.default_max_seq_length or 512) if by_tokens else MIN_BATCH
    batch = start_batch
    backoffs: list[dict[str, Any]] = []
    while True:
        try:
            faults.inject(chunk.run_id, chunk.index, attempt, batch, device)
            options = (
                replace(chunk.options, batch_tokens=batch)
                if by_tokens
                else replace(chunk.options, batch_size=batch)
            )
            return Encoded(encode_texts(loaded, texts, options), batch, backoffs)
        except Exception as exc:
            kind = errors.classify(exc)
            if kind == errors.CUDA_FATAL:
                raise CudaFatalError(f"chunk {chunk.job_id}: {exc}") from exc
            if kind != errors.OOM:
                raise
            detail = str(exc)
            # The failed forward pass's frames hold its activations; whoever still holds the
            # exception (a log handler, a debugger) would keep that memory from the next attempt.
            traceback.clear_frames(exc.__traceback__)
        # Out of the except block, so nothing refers to the failed attempt any more: only now can
        # empty_cache() hand its memory back for the smaller batch.
        cuda.free_cached_memory(device)
        if not cuda.context_usable(device) or faults.probe_fails(chunk.run_id, chunk.index, attempt):
            raise CudaFatalError(f"chunk {chunk.job_id}: CUDA context unusable after: {detail}")
        what = "token budget" if by_tokens else "batch size"
        if batch <= floor:
            raise ChunkOutOfMemoryError(
                f"chunk {chunk.job_id}: out of memory even at {what} {batch}: {detail}"
            )
        backoffs.append({unit: batch, "error": errors.first_sentence_of(detail)})
        batch = max(floor, batch // 2)
        log.warning("chunk %s: out of memory; retrying with %s %d", chunk.job_id, what, batch)


def _learn(
    layout: RunLayout,
    kind: str,
    options: EncodeOptions,
    learned: dict[str, Any],
    encoded: Encoded,
    chars_per_second: float,
) -> None:
    """Keep what fitted for the run's later chunks on this kind of device (and tune ``auto``)."""
    if options.batch_tokens == BATCH_TOKENS_AUTO:
        _remember(
            layout,
            kind,
            token_batches.next_auto_budget(learned, encoded.limit, chars_per_second, bool(encoded.backoffs)),
        )
    elif encoded.backoffs:
        key = "batch_tokens" if options.batch_tokens is not None else "batch_size"
        known = learned.get(key)
        if known is None or encoded.limit < int(known):
            _remember(layout, kind, {key: encoded.limit})


def _job_meta(updates: dict[str, Any]) -> int:
    """Record who runs the chunk in the RQ job's meta (for the dashboard); return the attempt number."""
    job = get_current_job()
    if job is None:
        return 1
    job.meta.update(updates)
    job.meta.setdefault(jobmeta.ATTEMPT, 1)
    job.save_meta()  # type: ignore[no-untyped-call]
    return jobmeta.attempt(job.meta)


def _record_failure(exc: BaseException) -> None:
    kind = errors.classify(exc)
    if kind == errors.CUDA_FATAL:
        runtime.mark_context_broken(str(exc))
    job = get_current_job()
    if job is not None:
        jobmeta.failed(job.meta, kind, str(exc))
        job.save_meta()  # type: ignore[no-untyped-call]


def embed_chunk(spec: dict[str, Any]) -> dict[str, Any]:
    """RQ job function: encode one chunk and return its output metadata (JSON)."""
    chunk = ChunkSpec.from_dict(spec)
    try:
        return _embed(chunk)
    except Exception as exc:
        _record_failure(exc)
        raise


def check_against_manifest(layout: RunLayout, chunk: ChunkSpec, job_id: str | None) -> RunManifest:
    """The run's manifest, if ``chunk`` is what it says that chunk is; else TamperedJobError.

    Anyone who can write to Redis can enqueue ``embed_chunk`` for a real run and chunk with other
    options or another allowed model; the output would then pass every checksum. The manifest,
    written by submit to the store before any job existed, is the authority.
    """
    manifest = load_manifest(layout)
    why = manifest.spec_mismatch(chunk)
    if job_id is not None and job_id != chunk.job_id:
        why = "; ".join(filter(None, [why, f"job id {job_id!r} is not the chunk's {chunk.job_id!r}"]))
    if why:
        raise TamperedJobError(f"chunk {chunk.job_id}: the job does not match the run's manifest ({why})")
    return manifest


def _embed(chunk: ChunkSpec) -> dict[str, Any]:
    ctx = runtime.current()
    check_spec(chunk, ctx)
    layout = RunLayout(chunk.store, chunk.run_id)
    job = get_current_job()
    manifest = check_against_manifest(layout, chunk, job.id if job is not None else None)
    existing, _ = verify_output(layout, chunk.index, chunk.rows, manifest.producer())
    if existing is not None:
        log.info("chunk %s already has a valid output; not encoding it again", chunk.job_id)
        return {**existing, "skipped": True}

    attempt = _job_meta(
        {jobmeta.WORKER: ctx.name, jobmeta.HOST: ctx.host, jobmeta.DEVICE: ctx.device, jobmeta.GPU: ctx.gpu}
    )
    _, texts = read_chunk_input(layout, chunk.index)
    if len(texts) != chunk.rows:
        raise BadInputError(
            f"chunk {chunk.job_id}: input holds {len(texts)} rows, the spec says {chunk.rows}"
        )
    loaded = models.get_model(chunk.model, ctx.device, chunk.options.precision, chunk.options)
    work = replace(chunk, options=token_batches.for_device(chunk.options, ctx.device))
    learned = _learned(layout, ctx.device_kind)
    start = _start_limit(work.options, learned)
    started_at = datetime.now(UTC)
    cuda.reset_peak_memory(ctx.device)
    t0 = time.perf_counter()
    encoded = encode_with_backoff(loaded, texts, work, attempt, start, ctx.device)
    seconds = time.perf_counter() - t0
    _learn(layout, ctx.device_kind, work.options, learned, encoded, sum(map(len, texts)) / max(seconds, 1e-9))
    by_tokens = work.options.batch_tokens is not None
    meta = {
        "run_id": chunk.run_id,
        "chunk": chunk.index,
        "first_row": chunk.first_row,
        **manifest.producer(),
        "worker": ctx.name,
        "pid": ctx.pid,
        "host": ctx.host,
        "device": ctx.device,
        "device_kind": ctx.device_kind,
        "gpu": ctx.gpu,
        "precision": chunk.options.precision,
        "embedding_dim": int(encoded.embeddings.shape[1]),  # before packing bits
        "batch_size": chunk.options.batch_size if by_tokens else encoded.limit,
        "batch_size_requested": chunk.options.batch_size,
        "batch_tokens": encoded.limit if by_tokens else None,
        "batch_tokens_requested": chunk.options.batch_tokens,
        "oom_backoffs": encoded.backoffs,  # each halving this attempt made: from which size, and why
        "attempt": attempt,
        "seconds": round(seconds, 4),
        "model_load_seconds": round(loaded.load_seconds, 3),
        "model_loaded_at": loaded.loaded_at,
        **cuda.peak_memory(ctx.device),
        "started_at": started_at.isoformat(),
        "finished_at": datetime.now(UTC).isoformat(),
    }
    stored = quantize.convert(encoded.embeddings, manifest.output_dtype, manifest.ranges)
    published = write_output(layout, chunk.index, stored, meta, manifest.output_dtype)
    log.info(
        "chunk %s: %d rows in %.2f s (%s %d)",
        chunk.job_id,
        len(texts),
        seconds,
        "token budget" if by_tokens else "batch size",
        encoded.limit,
    )
    return {**published, "skipped": False}
