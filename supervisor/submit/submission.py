"""``chunkq submit``: split a corpus into chunks in the store, write the run manifest, enqueue jobs.

Submitting is idempotent: the same corpus and options map to the same run, chunks already done or
in flight are left alone, and a different corpus or different options under a taken run id are
refused. Chunk inputs are written before the manifest, so a run with a manifest has whole inputs.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import redis

from chunkq.jobs.compute.model_info import describe
from chunkq.jobs.contract.defaults import DEFAULT_PRIORITY
from chunkq.jobs.contract.errors import STORAGE_ERRNOS, CorpusError, RunConflictError, StoreWriteError
from chunkq.jobs.contract.manifest import RunManifest, load_manifest, producer_record
from chunkq.jobs.contract.run_files import (
    RunLayout,
    atomic_write_json,
    write_chunk_input,
)
from chunkq.jobs.contract.specs import FORMAT_VERSION, fingerprint
from chunkq.jobs.contract.storage import is_local, local_scratch, remove_tree
from chunkq.jobs.queue.enqueue import EnqueueCounts, enqueue_chunks, window_size
from chunkq.jobs.queue.run_queues import run_queue
from chunkq.supervisor.corpus.files import unchanged
from chunkq.supervisor.corpus.records import Record
from chunkq.supervisor.result.chunk_reads import set_aside
from chunkq.supervisor.result.reader import published_result
from chunkq.supervisor.store.attempts import AttemptRecorder
from chunkq.supervisor.submit.dupes import IdRegistry, unique_ids
from chunkq.supervisor.submit.heap import give_back_free_heap
from chunkq.supervisor.submit.identity import (
    Identified,
    SubmitRequest,
    conflict,
    identify,
    read_inputs,
    same_model,
)
from chunkq.supervisor.submit.plan import write_planned_inputs
from chunkq.supervisor.submit.resumed import with_batching, with_priority
from chunkq.supervisor.submit.run_cache import record_cache_use, vector_cache
from chunkq.supervisor.submit.sampled import calibration
from chunkq.supervisor.submit.streamed_plan import cache_index, write_streamed_inputs
from chunkq.supervisor.submit.streaming import SplitFeed, SplitManifest, leftovers_of_a_split
from chunkq.supervisor.submit.windows import (
    WindowCounts,
    late_rows,
    window_plan,
    window_rows,
)

log = logging.getLogger(__name__)

Written = Callable[[int, int], None]  # told each chunk input (its index, its rows) once it is written


@dataclass(frozen=True)
class SubmitResult:
    run_id: str
    rows: int
    chunks: int
    done: int
    counts: EnqueueCounts
    created: bool
    published: bool = False  # a whole, intact result is published: nothing was enqueued

    @classmethod
    def already_published(cls, manifest: RunManifest) -> SubmitResult:
        chunks = manifest.chunks
        return cls(
            manifest.run_id, manifest.corpus_rows, chunks, chunks, EnqueueCounts(), False, published=True
        )


def _write_inputs(req: SubmitRequest, layout: RunLayout, written: Written | None = None) -> int:
    """Stream the corpus into chunk files (``written`` told each); return the row count. Only one
    chunk is ever in memory."""
    rows, index, buffer = 0, 0, list[Record]()
    with local_scratch(layout.root) as scratch, IdRegistry(scratch / ".ids.sqlite") as seen:

        def flush() -> None:
            write_chunk_input(layout, index, [(r.id, r.text) for r in buffer])
            if written is not None:
                written(index, len(buffer))

        for record in unique_ids(read_inputs(req), seen):
            buffer.append(record)
            if len(buffer) == req.chunk_size:
                flush()
                rows, index, buffer = rows + len(buffer), index + 1, []
        if buffer:
            flush()
            rows += len(buffer)
    _not_empty(req, rows)
    return rows


def _not_empty(req: SubmitRequest, rows: int) -> None:
    if rows == 0:
        names = ", ".join(str(p) for p in req.corpora)
        raise CorpusError(f"{names}: the corpus holds no texts")


def chunk_options(req: SubmitRequest) -> dict[str, Any]:
    """What a run's chunks are encoded and stored with: with the plan, float32 vectors at the model's
    full dimension, as the cache keeps them (the result is derived from them at assembly)."""
    if not req.cached:
        return req.encode.to_dict()
    return replace(req.encode, truncate_dim=None, output_dtype="float32").to_dict()


def _write_planned(
    req: SubmitRequest,
    layout: RunLayout,
    run_fingerprint: str,
    identity: str | None,
    canary: list[list[float]] | None = None,
    split: SplitManifest | None = None,
) -> dict[str, Any]:
    """The chunk inputs by plan (``plan.py``, or ``streamed_plan.py`` where ``split`` is told each
    chunk as it is written), and the manifest's fields that describe it."""
    cache, described = vector_cache(req, identity, canary) if req.cached else (None, None)
    options = chunk_options(req)
    output_producer = producer_record(run_fingerprint, req.model, options, identity)
    known = {
        "producer": cache.key if cache is not None else None,
        "model_identity": described["model_identity"] if described is not None else None,
        "libraries": described["libraries"] if described is not None else None,
    }
    counts = WindowCounts()
    with local_scratch(layout.root) as scratch, IdRegistry(scratch / ".ids.sqlite") as seen:
        found = cache_index(cache, scratch) if split is not None and not req.windowed else None
        rows: Any = unique_ids(read_inputs(req), seen)
        if split is not None and found is not None:
            split.plan, split.extra = {**known, "identity": False}, {"chunk_options": options}
            plan = write_streamed_inputs(
                rows, layout, req.chunk_size, cache, found, output_producer, split.written
            )
        elif req.windowed:
            tokenizer, size, overlap, normalize, context = window_plan(req)
            if context is None:
                rows = window_rows(rows, tokenizer, size, overlap, counts)
            else:
                rows = late_rows(rows, tokenizer, context, size, overlap, counts)
        if found is None:
            plan = write_planned_inputs(
                rows,
                layout,
                req.chunk_size,
                cache,
                output_producer,
                dedup=req.cached,
                row_map=req.windowed,
            )
    _not_empty(req, plan["corpus_rows"])
    if req.windowed:
        plan["windows"] = {
            "tokens": size,
            "overlap": overlap,
            "pool": req.pool,
            **({"late": True, "context": context} if context is not None else {}),
            "normalize": normalize,  # what a pooled vector is scaled to: unit length where windows are
            **asdict(counts),
        }
    plan.update(known)
    encode_rows, cached_rows = plan["encode_rows"], plan["cached_rows"]
    size = req.chunk_size
    log.info(
        "run %s: %d rows, %d distinct texts: %d to encode, %d from the vector cache",
        layout.run_id,
        plan["corpus_rows"],
        encode_rows + cached_rows,
        encode_rows,
        cached_rows,
    )
    return {
        "rows": encode_rows + cached_rows,
        "chunks": -(-encode_rows // size) + -(-cached_rows // size),
        "plan": plan,
        "chunk_options": options,
    }


def _base_manifest(req: SubmitRequest, layout: RunLayout, identified: Identified) -> dict[str, Any]:
    """The run's manifest but for what the split finds (its rows, chunks and plan)."""
    inputs = identified.inputs
    return {
        "format_version": FORMAT_VERSION,
        "run_id": layout.run_id,
        "created_at": datetime.now(UTC).isoformat(),
        "fingerprint": fingerprint(identified.identity),
        "identity": identified.identity,
        "corpus": {
            **inputs[0],
            "format": req.corpus_options.format,
            "text_field": req.corpus_options.text_field,
            "id_field": req.corpus_options.id_field,
            **({"pair_field": req.corpus_options.pair_field} if req.corpus_options.pair_field else {}),
        },
        "inputs": inputs,  # every corpus file, in the order its rows were read
        "model": req.model,
        # What the model is as bytes, fixed now: a worker that loads other bytes refuses the chunk.
        "model_identity": identified.model_identity,
        **({"model_code": identified.model_code} if identified.model_code is not None else {}),
        **({"model_canary": identified.model_canary} if identified.model_canary is not None else {}),
        "options": req.encode.to_dict(),
        "unit_length": _unit_length(req),
        "chunk_size": req.chunk_size,
        "queue": req.queue,
        "run_queue": run_queue(req.queue, layout.run_id),
        "priority": req.priority or DEFAULT_PRIORITY,
        "job_timeout": req.timeout(),
    }


def _streams(req: SubmitRequest) -> bool:
    """Whether a new run's chunks may be queued while its corpus is split: not where the windows of a
    text need its tokenizer's plan, nor where the run's int8 ranges come from texts across every chunk."""
    return not req.windowed and not req.encode.calibrated


def _create_run(
    req: SubmitRequest, layout: RunLayout, identified: Identified, feed: SplitFeed | None = None
) -> RunManifest:
    base = _base_manifest(req, layout, identified)
    if leftovers_of_a_split(layout):
        log.warning(
            "run %s: its corpus was being split when its command stopped; splitting it again", layout.run_id
        )
    split = SplitManifest(layout, base, feed) if feed is not None and _streams(req) else None
    try:
        if req.planned:
            chunking = _write_planned(
                req, layout, base["fingerprint"], identified.model_identity, identified.model_canary, split
            )
        else:
            rows = _write_inputs(req, layout, split.written if split is not None else None)
            chunking = {"rows": rows, "chunks": -(-rows // req.chunk_size)}
        # The checksums were taken in an earlier pass: the rows just copied must be of those bytes.
        for path, described in zip(req.corpora, identified.inputs, strict=True):
            unchanged(path, (described["size"], described["version"]))
        ranges = calibration(req, layout, chunking["chunks"]) if req.encode.calibrated else None
    except BaseException as exc:
        if split is not None and split.chunks:
            split.feed.abandon()  # what took its chunks stops before they go
        # No manifest was written, so nothing refers to these inputs: leave the store as it was.
        remove_tree(layout.root)
        if isinstance(exc, OSError) and exc.errno in STORAGE_ERRNOS:
            where = f" writing {exc.filename}" if exc.filename else ""
            raise StoreWriteError(
                f"{exc.strerror}{where} while run {layout.run_id} was being created; nothing of it "
                "was kept: make room (or fix the permissions) and run the same command again"
            ) from exc
        raise
    data = {**base, **chunking}
    if ranges is not None:
        data["calibration"] = ranges
    atomic_write_json(layout.manifest, data)
    if split is not None:
        split.finished()
    manifest = RunManifest(data)
    record_cache_use(layout, manifest)
    give_back_free_heap()
    return manifest


def _unit_length(req: SubmitRequest) -> bool | None:
    """Whether each row's vector is unit length (what an export's metric follows: FAISS's inner
    product where it is), known here from the model's files; None where they are not on this host.
    --truncate-dim cuts a normalised vector after the model's Normalize module: no longer unit length
    unless --normalize scales it again."""
    if req.encode.normalize_embeddings:
        return True
    if req.encode.kind != "dense":
        return False
    info = describe(req.model, req.encode.revision)
    if info.folder is None:
        return None
    return info.normalizes and req.encode.truncate_dim is None


@contextlib.contextmanager
def removed_on_failure(*folders: Path) -> Iterator[None]:
    """Folders a first submit (or run) is about to create: if it fails (bad input on line 9,000, a
    run owned by another process), the ones it created go too, so it leaves the disk as it found it."""
    fresh = [p for p in folders if is_local(p) and not p.exists()]
    try:
        yield
    except BaseException:
        for folder in reversed(fresh):
            with contextlib.suppress(OSError):
                folder.rmdir()  # only if empty: never anything another process wrote meanwhile
        raise


@dataclass(frozen=True)
class Prepared:
    """A run in the store, made from its corpus or found there, before anything is queued."""

    manifest: RunManifest
    created: bool
    published: bool  # a whole, intact result exists: nothing to encode


def prepare(
    req: SubmitRequest, identified: Identified | None = None, feed: SplitFeed | None = None
) -> Prepared:
    """Create the run for ``req`` in the store (the whole corpus read and split into chunk inputs),
    or find it there. A bad line on row 9,000 leaves nothing behind. ``identified``:
    ``identify(req)``, when the caller needed the run id first (to lock the run). ``feed``: where a
    new run's chunks go as they are written (``streaming.py``); without it, no Redis."""
    identified = identified or identify(req)
    layout = RunLayout(req.store, identified.run_id)
    if not layout.manifest.is_file():
        with removed_on_failure(req.store, req.store / "runs"):
            manifest = _create_run(req, layout, identified, feed)
        log.info(
            "run %s: %d rows in %d chunks written to %s",
            layout.run_id,
            manifest.corpus_rows,
            manifest.chunks,
            layout.root,
        )
        return Prepared(manifest, created=True, published=False)
    # identify read it where it found the run by its identity; a run named by --run-id is read here
    manifest = identified.manifest if identified.manifest is not None else load_manifest(layout)
    if manifest.fingerprint != identified.fingerprint:
        raise conflict(manifest, identified.identity)
    same_model(manifest, identified.model_identity, identified.model_canary)
    # Whole and intact: nothing to encode, even where `chunkq clean --outputs-only` freed the chunk
    # outputs it was assembled from.
    if published_result(layout, manifest) is not None:
        return Prepared(manifest, created=False, published=True)
    manifest = with_priority(layout, with_batching(layout, manifest, req.encode), req.priority)
    return Prepared(manifest, created=False, published=False)


def submit(
    req: SubmitRequest,
    connection: redis.Redis,
    identified: Identified | None = None,
    prepared: Prepared | None = None,
) -> SubmitResult:
    """Create (or find) the run for ``req`` and enqueue every chunk not yet done or in flight
    (``prepared``: ``prepare(req, identified)``, when the caller made the run first)."""
    identified = identified or identify(req)
    run_id = identified.run_id
    layout = RunLayout(req.store, run_id)
    prepared = prepared or prepare(req, identified)
    manifest, created = prepared.manifest, prepared.created
    if prepared.published:
        log.info("run %s: result already published in %s", run_id, layout.result)
        return SubmitResult.already_published(manifest)
    done = layout.done_chunks(manifest.chunks)
    for index in sorted(i for i in done if not layout.output_npy(i).exists()):
        set_aside(layout, index)  # committed, then its .npy was lost: encode it again
        done.discard(index)
    if req.queue_window is not None:  # kept for a later `chunkq supervise` that is not told again
        atomic_write_json(layout.queue_window, {"queue_window": req.queue_window})
    try:
        counts = enqueue_chunks(
            connection,
            layout,
            manifest,
            (i for i in range(manifest.chunks) if i not in done),
            limit=window_size(connection, req.queue, req.queue_window),
            before_requeue=AttemptRecorder(layout).record_job,
        )
    except RunConflictError:
        if created:  # nothing of it was queued: the store is left as this command found it
            remove_tree(layout.root)
        raise
    log.info(
        # "in flight" read as running: after a stop these are jobs left queued (or taken by workers now
        # gone, which the supervisor gives back), not work going on.
        "run %s: %d chunk(s) done, %d already had a job in Redis, %d enqueued, %d requeued, %d waiting "
        "in the store",
        run_id,
        len(done),
        counts.in_flight,
        counts.enqueued,
        counts.requeued,
        counts.waiting,
    )
    if counts.waiting:
        log.info(
            "run %s: the supervisor (chunkq run, or chunkq supervise %s) queues the %d waiting chunk(s) "
            "in order as the queue's window frees",
            run_id,
            run_id,
            counts.waiting,
        )
    return SubmitResult(run_id, manifest.corpus_rows, manifest.chunks, len(done), counts, created)
