"""The embed job: read a chunk from the store, encode it, publish the output atomically.

Out of memory: free what can be freed, halve the batch and try again, down to 1; the size that
fitted is recorded for the run's later chunks on the same kind of device (``learned``). The caching
allocator's NVML assert is an out-of-memory too, halved in the same process (its context survives
it); the process leaves only if a CUDA call after it fails. A broken CUDA context: fail with
CudaFatalError and tell the worker to exit, since no in-process reset exists. A GPU that cannot run
the model at all: DeviceUnsupportedError, and the worker leaves that GPU. NaN or Inf rows are never
published: encoded again in float32 when the run's precision is lower, else the chunk fails.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

import numpy as np
import redis

from chunkq.jobs import kinds
from chunkq.jobs.compute import (
    agreement,
    chunk_progress,
    cuda,
    device_busy,
    learned,
    models,
    quantize,
    runtime,
    token_batches,
)
from chunkq.jobs.compute.model_identity import check_loaded
from chunkq.jobs.compute.scope import check_spec
from chunkq.jobs.compute.vector_cache import library_versions
from chunkq.jobs.contract import errors
from chunkq.jobs.contract.chunk_output import verify_output
from chunkq.jobs.contract.defaults import DEFAULT_KIND, DEFAULT_PRECISION
from chunkq.jobs.contract.errors import (
    BadInputError,
    BadRowsError,
    ChunkOutOfMemoryError,
    CudaFatalError,
    DeviceUnsupportedError,
    NonFiniteError,
    TamperedJobError,
)
from chunkq.jobs.contract.manifest import RunManifest, load_manifest
from chunkq.jobs.contract.ragged import Ragged, write_ragged_output
from chunkq.jobs.contract.run_files import (
    RunLayout,
    non_finite_rows,
    read_chunk_input,
    write_output,
)
from chunkq.jobs.contract.specs import ChunkSpec, EncodeOptions
from chunkq.jobs.drills import faults
from chunkq.jobs.kinds.contract import WithBadRows
from chunkq.jobs.queue import jobmeta
from chunkq.jobs.queue.rq_api import get_current_job

log = logging.getLogger(__name__)

MIN_BATCH = 1


def encode_texts(
    loaded: models.LoadedModel,
    texts: list[str],
    options: EncodeOptions,
    on_rows: Callable[[int], None] | None = None,
) -> np.ndarray[Any, Any]:
    """The maths alone: a chunk's row texts in, float32 rows out, in input order, as the run's kind
    (jobs.kinds) computes them; not yet converted for storage. ``on_rows``: told the rows encoded
    so far after each batch."""
    loaded.set_length(options.max_seq_length)  # on each call: the model serves every run of the process
    encoded: np.ndarray[Any, Any] = kinds.get(options.kind).encode(loaded.model, texts, options, on_rows)
    return encoded


WARM_UP_TOKENS_GPU = (16, 64, 256, 512)  # lengths a warm-up encode covers, capped at the model's maximum
WARM_UP_TOKENS_CPU = (16, 64)  # on the CPU the predecessor is still computing on the same cores
WARM_UP_TEXTS = 8


def warm_up(loaded: models.LoadedModel, device: str, kind: str = DEFAULT_KIND) -> tuple[list[int], float]:
    """Encode a few texts of representative lengths once, so a new process's first chunk does not
    pay for kernel selection, allocator growth and lazy initialisation; (lengths, seconds)."""
    limit = loaded.default_max_seq_length or 512
    on_gpu = device.startswith("cuda")
    lengths = sorted({min(n, limit) for n in (WARM_UP_TOKENS_GPU if on_gpu else WARM_UP_TOKENS_CPU)})
    started = time.perf_counter()
    loaded.set_length(limit)
    kinds.get(kind).warm_up(loaded.model, [n for n in lengths for _ in range(WARM_UP_TEXTS if on_gpu else 2)])
    if on_gpu:
        import torch

        torch.cuda.synchronize()
    return lengths, time.perf_counter() - started


@dataclass
class Encoded:
    """What an encode with back-off produced: the rows, the batch size that fitted, each halving."""

    embeddings: np.ndarray[Any, Any]
    limit: int  # the batch size, or token budget, that fitted
    backoffs: list[dict[str, Any]] = field(default_factory=list)
    bad_rows: dict[int, str] = field(default_factory=dict)  # rows without a vector (--allow-missing)


@dataclass(frozen=True)
class Attempt:
    """One attempt at a chunk, as its encode sees it: the model loaded for it, the chunk, which
    attempt, the worker's context and who hears of rows as they are encoded."""

    loaded: models.LoadedModel
    chunk: ChunkSpec
    number: int
    ctx: runtime.WorkerContext
    on_rows: Callable[[int], None] | None = None


def encode_with_backoff(at: Attempt, texts: list[str], start_batch: int) -> Encoded:
    """Encode, halving the batch (or the token budget) after each out-of-memory error.

    The floor is one text per batch: MIN_BATCH texts, or a budget of one text at the maximum length.
    """
    loaded, chunk, attempt, ctx = at.loaded, at.chunk, at.number, at.ctx
    device = ctx.device
    by_tokens = chunk.options.batch_tokens is not None
    unit = learned.unit(chunk.options)
    floor = (chunk.options.max_seq_length or loaded.default_max_seq_length or 512) if by_tokens else MIN_BATCH
    what = "token budget" if by_tokens else "batch size"
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
            rows = encode_texts(loaded, texts, options, at.on_rows)
            faults.poison(chunk.run_id, chunk.index, attempt, chunk.options.precision, rows)
            return Encoded(rows, batch, backoffs)
        except Exception as exc:
            kind = errors.classify(exc)
            if kind == errors.CUDA_FATAL:
                raise CudaFatalError(f"chunk {chunk.job_id}: {exc}") from exc
            if kind == errors.UNSUPPORTED and not (errors.launch_too_large(exc) and batch > floor):
                raise DeviceUnsupportedError(
                    f"{_where(ctx)} cannot run model {chunk.model} ({chunk.options.precision}): "
                    f"{errors.first_line(str(exc))}; this GPU takes no more chunks"
                ) from exc
            if kind not in (errors.OOM, errors.UNSUPPORTED):
                raise
            detail = str(exc)
            # torch's out-of-memory report asserted (NVML cannot work in this process): an OOM all
            # the same, and the context survives it (seen on an H100: the same process allocated and
            # computed after it, and the next oversized allocation asserted again). The probe below
            # decides, as after any OOM, whether this process may go on.
            report_failed = errors.allocator_assert(exc)
            # The failed forward pass's frames hold its activations; whoever still holds the
            # exception (a log handler, a debugger) would keep that memory from the next attempt.
            traceback.clear_frames(exc.__traceback__)
        # Out of the except block, so nothing refers to the failed attempt any more: only now can
        # empty_cache() hand its memory back for the smaller batch.
        cuda.free_cached_memory(device)
        if not cuda.context_usable(device) or faults.probe_fails(chunk.run_id, chunk.index, attempt):
            raise CudaFatalError(f"chunk {chunk.job_id}: CUDA context unusable after: {detail}")
        if batch <= floor:
            raise ChunkOutOfMemoryError(
                f"chunk {chunk.job_id}: out of memory even at {what} {batch}: {detail}"
            )
        backoffs.append(
            {
                unit: batch,
                "error": errors.first_sentence_of(detail),
                **({"report_failed": True} if report_failed else {}),
            }
        )
        batch = max(floor, batch // 2)
        log.warning("chunk %s: %s; retrying with %s %d", chunk.job_id, backoffs[-1]["error"], what, batch)


def _width(encoded: Any) -> int:
    """The dimensions a chunk's rows have: a matrix's columns, a ragged output's space."""
    return encoded.dim if isinstance(encoded, Ragged) else int(encoded.shape[1])


def _where(ctx: runtime.WorkerContext) -> str:
    return f"GPU {ctx.gpu} ({ctx.device_kind})" if ctx.gpu is not None else ctx.device


def _non_finite_error(chunk: ChunkSpec, bad: np.ndarray[Any, Any], how: str) -> NonFiniteError:
    shown = ", ".join(str(chunk.first_row + int(r)) for r in bad[:5]) + (" ..." if len(bad) > 5 else "")
    return NonFiniteError(
        f"chunk {chunk.job_id}: {len(bad)} row(s) with NaN or infinite values {how} (corpus rows "
        f"{shown}); not published"
    )


def encode_finite(at: Attempt, texts: list[str], start_batch: int) -> tuple[Encoded, dict[str, Any] | None]:
    """Encode with back-off; rows that came out NaN or infinite (a float16 or bfloat16 overflow)
    are encoded again in float32 once, or fail the chunk. Returns what fitted and, after a float32
    encode, what it was for (for the output's metadata)."""
    chunk, ctx = at.chunk, at.ctx
    encoded = encode_with_backoff(at, texts, start_batch)
    if isinstance(encoded.embeddings, WithBadRows):
        encoded.bad_rows, encoded.embeddings = encoded.embeddings.bad, encoded.embeddings.matrix
    if isinstance(encoded.embeddings, Ragged):
        # Every float entry array: a sparse run's values, a multivector run's token vectors.
        for values in encoded.embeddings.arrays.values():
            if values.dtype.kind == "f" and not bool(np.isfinite(values).all()):
                bad_entries = np.unique(np.nonzero(~np.isfinite(values))[0])
                rows = np.unique(np.searchsorted(encoded.embeddings.offsets, bad_entries, side="right") - 1)
                raise _non_finite_error(chunk, rows, f"in {chunk.options.precision}")
        return encoded, None
    bad = non_finite_rows(encoded.embeddings)
    if not len(bad):
        return encoded, None
    precision = chunk.options.precision
    if precision == DEFAULT_PRECISION:
        raise _non_finite_error(chunk, bad, f"in {precision}")
    log.warning(
        "chunk %s: %d row(s) NaN or infinite in %s; encoding them again in %s",
        chunk.job_id,
        len(bad),
        precision,
        DEFAULT_PRECISION,
    )
    wide = replace(chunk, options=replace(chunk.options, precision=DEFAULT_PRECISION))
    full = models.get_model(chunk.model, ctx.device, DEFAULT_PRECISION, chunk.options)
    try:
        check_loaded(chunk, at.loaded.identity_value, full, at.loaded.code and at.loaded.code.to_json())
        again = encode_with_backoff(
            replace(at, loaded=full, chunk=wide, on_rows=None), [texts[int(i)] for i in bad], encoded.limit
        )
    finally:
        models.forget(chunk.model, ctx.device, DEFAULT_PRECISION, chunk.options)  # its memory is the run's
    still = non_finite_rows(again.embeddings)
    if len(still):
        raise _non_finite_error(chunk, bad[still], f"in {precision} and again in {DEFAULT_PRECISION}")
    encoded.embeddings[bad] = again.embeddings
    return encoded, {"rows": [int(i) for i in bad], "from": precision, "to": DEFAULT_PRECISION}


def _job_meta(updates: dict[str, Any], starting: bool = False) -> int:
    """Record who runs the chunk in the RQ job's meta (for the dashboard); return the attempt number.
    ``starting``: this attempt begins, and nothing an earlier one said of how it ended stays."""
    job = get_current_job()
    if job is None:
        return 1
    for key in jobmeta.ATTEMPT_STATE if starting else ():
        job.meta.pop(key, None)
    job.meta.update(updates)
    job.meta.setdefault(jobmeta.ATTEMPT, 1)
    job.save_meta()  # type: ignore[no-untyped-call]
    return jobmeta.attempt(job.meta)


_ENDS_THE_PROCESS = {
    errors.CUDA_FATAL: runtime.BROKEN_CONTEXT,
    errors.UNSUPPORTED: runtime.DEVICE_UNSUPPORTED,
}


def _record_failure(exc: BaseException) -> None:
    kind = errors.classify(exc)
    if kind in _ENDS_THE_PROCESS:
        runtime.end_after_job(_ENDS_THE_PROCESS[kind], str(exc))
    job = get_current_job()
    if job is not None:
        jobmeta.failed(job.meta, kind, str(exc))
        try:
            job.save_meta()  # type: ignore[no-untyped-call]
        except redis.exceptions.RedisError as lost:
            # Redis gone (its disk full, its host down): the job's own error is what fails the
            # chunk; the worker finds Redis gone on its next call and exits as it does then.
            failed = f"{type(exc).__name__}: {exc}"
            log.warning("the chunk failed (%s) and Redis cannot record it: %s", failed, lost)


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
    written by submit to the store before any job existed, is the authority (while ``chunkq run``
    still splits a new run's corpus, the manifest so far, ``splitting.json``, names its chunks).
    """
    manifest = load_manifest(layout, splitting=True)  # `chunkq run` queues chunks while it splits
    why = manifest.spec_mismatch(chunk)
    if job_id is not None and job_id != chunk.job_id:
        why = "; ".join(filter(None, [why, f"job id {job_id!r} is not the chunk's {chunk.job_id!r}"]))
    if why:
        raise TamperedJobError(f"chunk {chunk.job_id}: the job does not match the run's manifest ({why})")
    return manifest


def _shown(rid: Any) -> str:
    """A row's id in a message: a text's id quoted, a window as its text's id and window number."""
    if isinstance(rid, dict):
        return f"{rid.get('id')!r} window {rid.get('window')}"
    return repr(rid)


def _embed(chunk: ChunkSpec) -> dict[str, Any]:
    ctx = runtime.current()
    # Who runs this attempt, before anything refuses it (a model this pool may not run): never '?'
    who = {jobmeta.WORKER: ctx.name, jobmeta.HOST: ctx.host, jobmeta.DEVICE: ctx.device, jobmeta.GPU: ctx.gpu}
    attempt = _job_meta(who, starting=True)
    check_spec(chunk, ctx)
    layout = RunLayout(chunk.store, chunk.run_id)
    job = get_current_job()
    manifest = check_against_manifest(layout, chunk, job.id if job is not None else None)
    existing, _ = verify_output(layout, chunk.index, chunk.rows, manifest.producer())
    if existing is not None:
        log.info("chunk %s already has a valid output; not encoding it again", chunk.job_id)
        return {**existing, "skipped": True}

    ids, texts = read_chunk_input(layout, chunk.index)
    if len(texts) != chunk.rows:
        raise BadInputError(
            f"chunk {chunk.job_id}: input holds {len(texts)} rows, the spec says {chunk.rows}"
        )
    loaded = models.get_model(chunk.model, ctx.device, chunk.options.precision, chunk.options)
    recorded = check_loaded(
        chunk,
        manifest.model_identity,
        loaded,
        manifest.data.get("model_code"),
        manifest.data.get("model_canary"),
    )
    # A static embedding has no padding to save: its batches are counted in texts.
    tokens_apply = kinds.get(chunk.options.kind).by_tokens and loaded.default_max_seq_length is not None
    work = replace(chunk, options=token_batches.for_device(chunk.options, ctx.device, tokens_apply))
    start = learned.start_limit(work.options, learned.read(layout, ctx.device_kind))
    started_at = datetime.now(UTC)
    cuda.reset_peak_memory(ctx.device)
    t0 = time.perf_counter()
    progress = chunk_progress.RowsReporter(
        job.connection if job is not None else None, chunk.run_id, chunk.index, len(texts)
    )
    progress(0)
    try:
        with device_busy.measured(loaded.model, ctx.device, ctx.utilisation) as busy:
            encoded, widened = encode_finite(Attempt(loaded, work, attempt, ctx, progress), texts, start)
    except BadRowsError as exc:
        named = "; ".join(f"id {_shown(ids[i])}: {why}" for i, why in list(exc.rows.items())[:5])
        raise BadInputError(
            f"chunk {chunk.job_id}: {len(exc.rows)} row(s) have no vector ({named}); fix or drop "
            "them, or give --allow-missing to leave them out of the result"
        ) from exc
    seconds = time.perf_counter() - t0
    agreed = agreement.for_chunk(
        chunk.model, chunk.index, chunk.options, texts, encoded.embeddings, encode_texts
    )
    late = models.late_code_reads(loaded, layout.store)  # none: every file it ran is in the identity
    if late:
        log.warning(
            "chunk %s: the model's code read %s as it encoded, not as it loaded: the run's "
            "vectors stay out of the vector cache",
            chunk.job_id,
            ", ".join(late[:3]),
        )
    speed = sum(map(len, texts)) / max(seconds, 1e-9)
    fitted, backed_off = encoded.limit, bool(encoded.backoffs)
    learned.update(
        layout,
        ctx.device_kind,
        lambda record: learned.after_chunk(record, work.options, fitted, backed_off, speed),
    )
    by_tokens = work.options.batch_tokens is not None
    meta = {
        "run_id": chunk.run_id,
        "chunk": chunk.index,
        "first_row": chunk.first_row,
        **manifest.producer(),
        "model_identity": recorded,  # what encoded it: the run's, or (none recorded) its own
        "libraries": library_versions(),  # the vector cache takes the rows only if its key's are these
        "code_read_late": late,  # files the model's code read in this encode that its load did not
        "worker": ctx.name,
        "pid": ctx.pid,
        "host": ctx.host,
        "device": ctx.device,
        "device_kind": ctx.device_kind,
        "gpu": ctx.gpu,
        "precision": chunk.options.precision,
        "embedding_dim": _width(encoded.embeddings),  # before packing bits
        "batch_size": chunk.options.batch_size if by_tokens else encoded.limit,
        "batch_size_requested": chunk.options.batch_size,
        "batch_tokens": encoded.limit if by_tokens else None,
        "batch_tokens_requested": chunk.options.batch_tokens,
        "oom_backoffs": encoded.backoffs,  # each halving this attempt made: from which size, and why
        "batch_start": start,  # below the request: what the run learned from earlier out-of-memory errors
        "non_finite_recoded": widened,  # rows that came out NaN/Inf and were encoded again in fp32
        "attempt": attempt,
        "seconds": round(seconds, 4),
        "model_load_seconds": round(loaded.load_seconds, 3),
        "model_loaded_at": loaded.loaded_at,
        "startup": ctx.startup(),  # the worker's start-up and its pool's, for the report
        **cuda.peak_memory(ctx.device),
        "started_at": started_at.isoformat(),
        "finished_at": datetime.now(UTC).isoformat(),
        "rows_at": progress.samples,  # [seconds since started_at, rows encoded by then], for the report
        "busy": busy.to_dict(),  # how busy the device was over the chunk, and who said (compute/device_busy)
        **agreed,  # a rounding precision's, with fp32, on a sample of the chunk (compute/agreement)
        **(
            {
                "bad_rows": [
                    {"row": chunk.first_row + i, "id": ids[i], "reason": why}
                    for i, why in sorted(encoded.bad_rows.items())
                ]
            }
            if encoded.bad_rows
            else {}
        ),
    }
    if meta.get("bad_rows"):
        shown = [f"{r['id']}: {r['reason']}" for r in meta["bad_rows"][: jobmeta.BAD_ROWS_SHOWN]]
        more = len(meta["bad_rows"]) - len(shown)
        _job_meta({jobmeta.BAD_ROWS: shown + ([f"and {more} more"] if more else [])})
    if isinstance(encoded.embeddings, Ragged):
        published = write_ragged_output(layout, chunk.index, encoded.embeddings, meta, chunk.options.kind)
    else:
        stored = quantize.convert(encoded.embeddings, manifest.chunk_dtype, manifest.ranges)
        if stored.dtype.kind == "f" and len(overflow := non_finite_rows(stored)):
            raise _non_finite_error(chunk, overflow, f"once stored as {manifest.chunk_dtype}")
        published = write_output(layout, chunk.index, stored, meta, manifest.chunk_dtype)
    how = "token budget" if by_tokens else "batch size"
    log.info("chunk %s: %d rows in %.2f s (%s %d)", chunk.job_id, len(texts), seconds, how, encoded.limit)
    return {**published, "skipped": False}
