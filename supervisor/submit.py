"""``chunkq submit``: split a corpus into chunks in the store, write the run manifest, enqueue jobs.

Submitting is idempotent: the same corpus and options map to the same run, chunks already done or
in flight are left alone, and a different corpus or different options under a taken run id are
refused. Chunk inputs are written before the manifest, so a run with a manifest has whole inputs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import redis

from chunkq.jobs import late
from chunkq.jobs.calibrate import CALIBRATION_ROWS, ranges_for
from chunkq.jobs.errors import ConfigError, CorpusError, ModelChangedError, RunConflictError, StoreError
from chunkq.jobs.manifest import RunManifest, load_manifest, producer_record
from chunkq.jobs.model_identity import model_identity, short
from chunkq.jobs.model_info import describe
from chunkq.jobs.run_files import (
    RunLayout,
    atomic_write_json,
    file_sha256,
    read_chunk_input,
    write_chunk_input,
)
from chunkq.jobs.specs import FORMAT_VERSION, EncodeOptions, fingerprint, validate_run_id
from chunkq.jobs.storage import is_local, local_scratch, open_store, remove_tree
from chunkq.jobs.vector_cache import VectorCache, cache_enabled, producer, producer_key
from chunkq.queue_worker.settings import DEFAULT_QUEUE
from chunkq.supervisor.assemble import set_aside
from chunkq.supervisor.corpus import CorpusOptions, Record, check_readable, read_corpus
from chunkq.supervisor.dupes import IdRegistry
from chunkq.supervisor.enqueue import EnqueueCounts, enqueue_chunks, window_size
from chunkq.supervisor.plan import write_planned_inputs
from chunkq.supervisor.result import published_result
from chunkq.supervisor.windows import (
    LATE_WINDOWS_PER_SEGMENT,
    LONG_TEXTS,
    POOLS,
    WindowCounts,
    default_size,
    late_rows,
    load_tokenizer,
    window_rows,
)

log = logging.getLogger(__name__)

DEFAULT_CHUNK_SIZE = 1000


@dataclass(frozen=True)
class SubmitRequest:
    """What the user asked for; the identity fields decide the run id."""

    corpus: Path | tuple[Path, ...]  # one file, or several read in this order as one corpus
    store: Path
    model: str
    corpus_options: CorpusOptions
    chunk_size: int = DEFAULT_CHUNK_SIZE
    encode: EncodeOptions = field(default_factory=EncodeOptions)
    run_id: str | None = None
    queue: str = DEFAULT_QUEUE
    job_timeout: int | None = None  # seconds per chunk; default scales with the chunk size
    queue_window: int | None = None  # jobs in Redis at once (enqueue.window_size); the rest wait in the store
    cache: bool | None = None  # the vector cache and in-run deduplication; None: on for float outputs
    long_texts: str = LONG_TEXTS[0]  # "window"/"late": long texts cut into windows, a result row each
    window_tokens: int | None = None  # None: the model's maximum length less special tokens and prompt
    window_stride: int | None = None  # None: a quarter of a window
    pool: str = POOLS[0]  # with windows: a vector per text as well (mean, or weighted by tokens)

    def __post_init__(self) -> None:
        # A late run's rows are late rows (jobs.late): its workers must encode them so.
        if self.encode.late_chunking != (self.long_texts == "late"):
            object.__setattr__(self, "encode", replace(self.encode, late_chunking=self.long_texts == "late"))

    @property
    def cached(self) -> bool:
        return cache_enabled(self.cache, self.encode)

    @property
    def windowed(self) -> bool:
        return self.long_texts in ("window", "late")

    @property
    def planned(self) -> bool:
        """The run's chunks are planned (supervisor.plan): with the cache, or with windows."""
        return self.cached or self.windowed

    def timeout(self) -> int:
        return self.job_timeout or max(600, 2 * self.chunk_size)

    @property
    def corpora(self) -> tuple[Path, ...]:
        return self.corpus if isinstance(self.corpus, tuple) else (self.corpus,)


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


def describe_inputs(paths: tuple[Path, ...]) -> list[dict[str, Any]]:
    """Each corpus file with its checksum and size, for the manifest and the run's identity."""
    described = []
    for path in paths:
        before = _stamp(path)
        sha256 = file_sha256(path)
        _unchanged(path, before)
        where = str(path.resolve()) if is_local(path) else str(path)
        described.append({"path": where, "sha256": sha256, "size": before[0], "version": before[1]})
    return described


def _stamp(path: Path) -> tuple[int, str]:
    """(size, version): the modification time in ns here; an object's ETag (or time) as its store gives it."""
    if is_local(path):
        st = path.stat()
        return st.st_size, str(st.st_mtime_ns)
    remote: Any = path
    remote.fs.invalidate_cache(remote.path)
    info = remote.fs.info(remote.path)
    version = info.get("ETag") or info.get("etag") or info.get("LastModified") or info.get("mtime") or ""
    return int(info.get("size") or 0), str(version)


def _unchanged(path: Path, before: tuple[int, str]) -> None:
    """Refuse a corpus file written to while chunkq read it: its checksum would not cover its rows."""
    if _stamp(path) != before:
        raise CorpusError(
            f"{path}: the file changed while chunkq read it (size or modification time); "
            "submit it again once whatever writes it has finished"
        )


def _identity(req: SubmitRequest, inputs: list[dict[str, Any]]) -> dict[str, Any]:
    """What makes two submissions the same run: the files' contents and order, not their names."""
    checksums = [i["sha256"] for i in inputs]
    return {
        "corpus_sha256": checksums[0] if len(checksums) == 1 else checksums,
        "format": req.corpus_options.format,
        "text_field": req.corpus_options.text_field,
        "id_field": req.corpus_options.id_field,
        **({"pair_field": req.corpus_options.pair_field} if req.corpus_options.pair_field else {}),
        "chunk_size": req.chunk_size,
        "model": req.model,
        "options": req.encode.to_dict(),
        # Only where they are on, so runs without them keep the fingerprint they had before.
        **({"vector_cache": True} if req.cached else {}),
        **(
            {
                "long_texts": {
                    "mode": req.long_texts,
                    "tokens": req.window_tokens,
                    "overlap": req.window_stride,
                    "pool": req.pool,
                }
            }
            if req.windowed
            else {}
        ),
    }


def default_run_id(corpus: Path, run_fingerprint: str) -> str:
    """The corpus file's name and a short fingerprint: ``notes-3fa2c1d0e9b4``; runs of different
    files are told apart at a glance, runs of one file with other options by the fingerprint."""
    stem = re.sub(r"[^A-Za-z0-9-]+", "-", corpus.stem).strip("-")[:40] or "run"
    return f"{stem}-{run_fingerprint[:12]}"


def _labels(paths: tuple[Path, ...]) -> list[str]:
    """Names that tell several corpus files apart: their paths below the deepest common folder."""
    if len(paths) == 1:
        return [""]
    names = [str(p.resolve()) if is_local(p) else str(p).partition("://")[2] for p in paths]
    common = os.path.commonpath([os.path.dirname(n) for n in names])
    return [os.path.relpath(n, common) for n in names]


def read_inputs(req: SubmitRequest) -> Iterator[Record]:
    """The records of every corpus file in order. Row-number ids of several files are prefixed
    with the file's name (``a.jsonl:3``) so that they stay unique across files."""
    for path, label in zip(req.corpora, _labels(req.corpora), strict=True):
        yield from read_corpus(path, req.corpus_options, number_prefix=f"{label}:" if label else "")


def run_corpus_fields(manifest: RunManifest, names: tuple[str, ...]) -> Iterator[Record]:
    """The run's corpus read again, in its order, with ``names`` in each record's ``extra`` (export
    --columns); StoreError if a file is not as the run read it (its size or version changed)."""
    corpus = manifest.data["corpus"]
    options = CorpusOptions(
        format=corpus["format"],
        text_field=corpus["text_field"],
        id_field=corpus["id_field"],
        pair_field=corpus.get("pair_field"),
        extra_fields=names,
    )
    inputs = manifest.data.get("inputs") or [corpus]
    paths = tuple(open_store(str(i["path"])) for i in inputs)
    for path, described in zip(paths, inputs, strict=True):
        if _stamp(path) != (described["size"], described["version"]):
            raise StoreError(
                f"{path} has changed since run {manifest.run_id} read it; --columns needs it as it was"
            )
    for path, label in zip(paths, _labels(paths), strict=True):
        yield from read_corpus(path, options, number_prefix=f"{label}:" if label else "")


def _conflict(manifest: RunManifest, identity: dict[str, Any]) -> RunConflictError:
    theirs = manifest.data.get("identity", {})
    diffs = [
        f"{key}: stored {theirs.get(key)!r}, given {value!r}"
        for key, value in identity.items()
        if theirs.get(key) != value
    ]
    return RunConflictError(
        f"run {manifest.run_id} already exists with a different corpus or options ("
        + "; ".join(diffs)
        + "); choose another --run-id or omit it to get one derived from the corpus and options"
    )


def _same_model(manifest: RunManifest, now: str | None) -> None:
    """Refuse to go on with (or answer for) a run whose model's files are not the bytes it was
    submitted with: its chunks so far and its result are the old model's."""
    then = manifest.model_identity
    if then is None or now is None or then == now:
        return
    raise ModelChangedError(
        f"run {manifest.run_id}: model {manifest.model} has changed since the run was submitted (its "
        f"files were {short(then)}, they are now {short(now)}); what the run holds is the old model's. "
        f"To encode with the model as it is now: `chunkq clean {manifest.run_id}` and the same command "
        "again, or keep that run and give this one --run-id NAME; or put the old files back to go on"
    )


def _write_inputs(req: SubmitRequest, layout: RunLayout) -> int:
    """Stream the corpus into chunk files; return the row count. Only one chunk is ever in memory."""
    rows, index, buffer = 0, 0, list[Record]()
    with local_scratch(layout.root) as scratch, IdRegistry(scratch / ".ids.sqlite") as seen:

        def flush() -> None:
            seen.add(buffer)
            write_chunk_input(layout, index, [(r.id, r.text) for r in buffer])

        for record in read_inputs(req):
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


def _nothing(rows: list[Any]) -> None:
    del rows


def chunk_options(req: SubmitRequest) -> dict[str, Any]:
    """What a run's chunks are encoded and stored with: with the plan, float32 vectors at the model's
    full dimension, as the cache keeps them (the result is derived from them at assembly)."""
    if not req.cached:
        return req.encode.to_dict()
    return replace(req.encode, truncate_dim=None, output_dtype="float32").to_dict()


def _vector_cache(
    req: SubmitRequest, identity: str | None
) -> tuple[VectorCache | None, dict[str, Any] | None]:
    """The store's cache for this run's model and options, and what they are; (None, None) when the
    model's files are not on this host, so its identity cannot be known (duplicates are still
    encoded once)."""
    if identity is None:
        log.warning("model %s: its files are not on this host; the vector cache is not used", req.model)
        return None, None
    described = producer(req.model, identity, req.encode)
    return VectorCache(req.store, producer_key(described)), described


def _window_plan(req: SubmitRequest) -> tuple[Any, int, int | None, bool, int | None]:
    """(tokenizer, window tokens, overlap, whether pooled vectors are normalised, late chunking's
    context or None). --long-texts window: by default the model's maximum length less its special
    tokens and prompt; a larger window would be truncated, so it is refused. late: segments of that
    many tokens, windows of a quarter of it by default; a model that does not mean-pool is refused."""
    info = describe(req.model, req.encode.revision)
    if info.folder is None:
        raise ConfigError(
            f"model {req.model}: its files are not on this host; texts cannot be cut into windows"
        )
    tokenizer = load_tokenizer(info.folder)
    longest = req.encode.max_seq_length or info.max_seq_length
    if longest is None:
        raise ConfigError(f"model {req.model}: no maximum sequence length found; give --max-seq-length")
    name = req.encode.prompt_name or info.default_prompt_name
    prompt = req.encode.prompt or (info.prompts.get(name) if name else None)
    room = default_size(tokenizer, longest, prompt)
    if req.long_texts == "late":
        late.check_pooling(info.pooling, req.model)
        size = req.window_tokens or room // LATE_WINDOWS_PER_SEGMENT
        return tokenizer, size, req.window_stride, req.encode.normalize_embeddings or info.normalizes, room
    size = req.window_tokens or room
    if size > room:
        raise ConfigError(
            f"--window-tokens {size}: the model reads {room} tokens of text at most (its maximum length "
            f"{longest} less its special tokens and prompt); a larger window would be truncated"
        )
    return tokenizer, size, req.window_stride, req.encode.normalize_embeddings or info.normalizes, None


def _write_planned(
    req: SubmitRequest, layout: RunLayout, run_fingerprint: str, identity: str | None
) -> dict[str, Any]:
    """The chunk inputs by plan (supervisor.plan), and the manifest's fields that describe it."""
    cache, described = _vector_cache(req, identity) if req.cached else (None, None)
    options = chunk_options(req)
    output_producer = producer_record(run_fingerprint, req.model, options, identity)
    counts = WindowCounts()
    with local_scratch(layout.root) as scratch, IdRegistry(scratch / ".ids.sqlite") as seen:
        rows: Any = read_inputs(req)
        check: Any = seen.add
        if req.windowed:
            tokenizer, size, overlap, normalize, context = _window_plan(req)
            if context is None:
                rows = window_rows(rows, tokenizer, size, overlap, seen.add, counts)
            else:
                rows = late_rows(rows, tokenizer, context, size, overlap, seen.add, counts)
            check = _nothing
        plan = write_planned_inputs(
            rows,
            layout,
            req.chunk_size,
            cache,
            output_producer,
            check,
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
    plan["producer"] = cache.key if cache is not None else None
    plan["model_identity"] = described["model_identity"] if described is not None else None
    plan["libraries"] = described["libraries"] if described is not None else None
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


def _create_run(req: SubmitRequest, layout: RunLayout, identified: Identified) -> RunManifest:
    identity, inputs = identified.identity, identified.inputs
    run_fingerprint = fingerprint(identity)
    try:
        if req.planned:
            chunking = _write_planned(req, layout, run_fingerprint, identified.model_identity)
        else:
            rows = _write_inputs(req, layout)
            chunking = {"rows": rows, "chunks": -(-rows // req.chunk_size)}
        # The checksums were taken in an earlier pass: the rows just copied must be of those bytes.
        for path, described in zip(req.corpora, inputs, strict=True):
            _unchanged(path, (described["size"], described["version"]))
        calibration = _calibration(req, layout, chunking["chunks"]) if req.encode.calibrated else None
    except BaseException:
        # No manifest was written, so nothing refers to these inputs: leave the store as it was.
        remove_tree(layout.root)
        raise
    data = {
        "format_version": FORMAT_VERSION,
        "run_id": layout.run_id,
        "created_at": datetime.now(UTC).isoformat(),
        "fingerprint": run_fingerprint,
        "identity": identity,
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
        "options": req.encode.to_dict(),
        "chunk_size": req.chunk_size,
        **chunking,
        "queue": req.queue,
        "job_timeout": req.timeout(),
    }
    if calibration is not None:
        data["calibration"] = calibration
    atomic_write_json(layout.manifest, data)
    manifest = RunManifest(data)
    _record_cache_use(layout, manifest)
    return manifest


def _record_cache_use(layout: RunLayout, manifest: RunManifest) -> None:
    """What the run took from the cache, for ``chunkq cache`` (once the run exists: a failed submit
    leaves no trace in the store)."""
    plan = manifest.plan or {}
    if not plan.get("producer"):
        return
    try:
        VectorCache(layout.store, str(plan["producer"])).record_use(
            manifest.run_id,
            rows=int(plan["corpus_rows"]),
            distinct=int(plan["distinct_rows"]),
            hits=int(plan["cached_rows"]),
            damaged=int(plan["cache_damaged_rows"]),
        )
    except OSError as exc:  # derived data: a cache that cannot be written costs time, not the run
        log.warning("the vector cache cannot be written (%s); the run goes on without adding to it", exc)


def _calibration(req: SubmitRequest, layout: RunLayout, chunks: int) -> dict[str, Any]:
    """The run's one set of int8/uint8 ranges (jobs.calibrate), from up to CALIBRATION_ROWS texts
    taken evenly across its chunks, before any chunk runs."""
    picked = sorted({round(i * (chunks - 1) / max(1, CALIBRATION_ROWS - 1)) for i in range(CALIBRATION_ROWS)})
    per_chunk = -(-CALIBRATION_ROWS // len(picked))
    texts: list[str] = []
    for index in picked:
        texts += read_chunk_input(layout, index)[1][:per_chunk]
    log.info("run %s: computing %s ranges from %d texts", layout.run_id, req.encode.output_dtype, len(texts))
    return ranges_for(req.model, req.encode, texts[:CALIBRATION_ROWS])


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
class Identified:
    """A request's corpus read once for its checksums: which run it is, and why."""

    run_id: str
    inputs: list[dict[str, Any]]
    identity: dict[str, Any]
    fingerprint: str
    model_identity: str | None  # the model's bytes (jobs.model_identity); None: not on this host


def identify(req: SubmitRequest) -> Identified:
    """Check the corpus files and hash them: the run id, before anything is written or locked."""
    if req.chunk_size < 1:
        raise ConfigError(f"--chunk-size must be at least 1, got {req.chunk_size}")
    for path in req.corpora:
        check_readable(path)
    inputs = describe_inputs(req.corpora)
    identity = _identity(req, inputs)
    run_fingerprint = fingerprint(identity)
    run_id = validate_run_id(req.run_id) if req.run_id else default_run_id(req.corpora[0], run_fingerprint)
    model = model_identity(req.model, req.encode.revision)
    return _begun_without_cache(req, inputs, identity, model) or Identified(
        run_id, inputs, identity, run_fingerprint, model
    )


def _begun_without_cache(
    req: SubmitRequest, inputs: list[dict[str, Any]], identity: dict[str, Any], model: str | None
) -> Identified | None:
    """The same corpus and options submitted before the vector cache existed: that run, so the same
    command resumes it (without the cache) rather than start again. Only where the cache was not
    asked for by name: ``--cache`` means a run that uses it."""
    if req.cache is not None or "vector_cache" not in identity or req.windowed:
        return None
    before = {k: v for k, v in identity.items() if k != "vector_cache"}
    before_fingerprint = fingerprint(before)
    run_id = validate_run_id(req.run_id) if req.run_id else default_run_id(req.corpora[0], before_fingerprint)
    layout = RunLayout(req.store, run_id)
    if not layout.manifest.is_file() or load_manifest(layout).fingerprint != before_fingerprint:
        return None
    log.info("run %s was submitted before the vector cache; it goes on without it", run_id)
    return Identified(run_id, inputs, before, before_fingerprint, model)


@dataclass(frozen=True)
class Prepared:
    """A run in the store, made from its corpus or found there, before anything is queued."""

    manifest: RunManifest
    created: bool
    published: bool  # a whole, intact result exists: nothing to encode


def prepare(req: SubmitRequest, identified: Identified | None = None) -> Prepared:
    """Create the run for ``req`` in the store (the whole corpus read and split into chunk inputs),
    or find it there; no Redis. ``chunkq run`` does this before it starts any server or process, so
    a bad line on row 9,000 leaves nothing behind. ``identified``: ``identify(req)``, when the caller
    needed the run id first (to lock the run)."""
    identified = identified or identify(req)
    layout = RunLayout(req.store, identified.run_id)
    if not layout.manifest.is_file():
        with removed_on_failure(req.store, req.store / "runs"):
            manifest = _create_run(req, layout, identified)
        log.info(
            "run %s: %d rows in %d chunks written to %s",
            layout.run_id,
            manifest.corpus_rows,
            manifest.chunks,
            layout.root,
        )
        return Prepared(manifest, created=True, published=False)
    manifest = load_manifest(layout)
    if manifest.fingerprint != identified.fingerprint:
        raise _conflict(manifest, identified.identity)
    _same_model(manifest, identified.model_identity)
    # Whole and intact: nothing to encode, even where `chunkq clean --outputs-only` freed the chunk
    # outputs it was assembled from.
    return Prepared(manifest, created=False, published=published_result(layout, manifest) is not None)


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
    counts = enqueue_chunks(
        connection,
        layout,
        manifest,
        (i for i in range(manifest.chunks) if i not in done),
        limit=window_size(connection, req.queue, req.queue_window),
    )
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
