"""``chunkq submit``: split a corpus into chunks in the store, write the run manifest, enqueue jobs.

Submitting is idempotent: the same corpus and options map to the same run, chunks already done or
in flight are left alone, and a different corpus or different options under a taken run id are
refused. Chunk inputs are written before the manifest, so a run with a manifest has whole inputs.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import redis

from jobs.errors import ConfigError, CorpusError, RunConflictError
from jobs.specs import FORMAT_VERSION, EncodeOptions, fingerprint, validate_run_id
from jobs.storage import local_scratch, remove_tree
from jobs.store import RunLayout, atomic_write_json, file_sha256, write_chunk_input
from queue_worker.settings import DEFAULT_QUEUE
from supervisor.assemble import set_aside
from supervisor.corpus import CorpusOptions, Record, check_readable, read_corpus
from supervisor.dupes import IdRegistry
from supervisor.enqueue import EnqueueCounts, enqueue_chunks
from supervisor.manifest import RunManifest, load_manifest

log = logging.getLogger(__name__)

DEFAULT_CHUNK_SIZE = 1000


@dataclass(frozen=True)
class SubmitRequest:
    """What the user asked for; the identity fields decide the run id."""

    corpus: Path
    store: Path
    model: str
    corpus_options: CorpusOptions
    chunk_size: int = DEFAULT_CHUNK_SIZE
    encode: EncodeOptions = field(default_factory=EncodeOptions)
    run_id: str | None = None
    queue: str = DEFAULT_QUEUE
    job_timeout: int | None = None  # seconds per chunk; default scales with the chunk size

    def timeout(self) -> int:
        return self.job_timeout or max(600, 2 * self.chunk_size)


@dataclass(frozen=True)
class SubmitResult:
    run_id: str
    rows: int
    chunks: int
    done: int
    counts: EnqueueCounts
    created: bool


def corpus_checksum(path: Path) -> tuple[str, int]:
    return file_sha256(path), path.stat().st_size


def _identity(req: SubmitRequest, checksum: str) -> dict[str, Any]:
    """What makes two submissions the same run."""
    return {
        "corpus_sha256": checksum,
        "format": req.corpus_options.format,
        "text_field": req.corpus_options.text_field,
        "id_field": req.corpus_options.id_field,
        "chunk_size": req.chunk_size,
        "model": req.model,
        "options": req.encode.to_dict(),
    }


def default_run_id(corpus: Path, run_fingerprint: str) -> str:
    stem = re.sub(r"[^A-Za-z0-9-]+", "-", corpus.stem).strip("-")[:40] or "run"
    return f"{stem}-{run_fingerprint[:12]}"


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


def _write_inputs(req: SubmitRequest, layout: RunLayout) -> int:
    """Stream the corpus into chunk files; return the row count. Only one chunk is ever in memory."""
    rows, index, buffer = 0, 0, list[Record]()
    with local_scratch(layout.root) as scratch, IdRegistry(scratch / ".ids.sqlite") as seen:

        def flush() -> None:
            seen.add(buffer)
            write_chunk_input(layout, index, [(r.id, r.text) for r in buffer])

        for record in read_corpus(req.corpus, req.corpus_options):
            buffer.append(record)
            if len(buffer) == req.chunk_size:
                flush()
                rows, index, buffer = rows + len(buffer), index + 1, []
        if buffer:
            flush()
            rows += len(buffer)
    if rows == 0:
        raise CorpusError(f"{req.corpus}: the corpus holds no texts")
    return rows


def _create_run(req: SubmitRequest, layout: RunLayout, identity: dict[str, Any], size: int) -> RunManifest:
    try:
        rows = _write_inputs(req, layout)
    except BaseException:
        # No manifest was written, so nothing refers to these inputs: leave the store as it was.
        remove_tree(layout.root)
        raise
    data = {
        "format_version": FORMAT_VERSION,
        "run_id": layout.run_id,
        "created_at": datetime.now(UTC).isoformat(),
        "fingerprint": fingerprint(identity),
        "identity": identity,
        "corpus": {
            "path": str(req.corpus.resolve()),
            "sha256": identity["corpus_sha256"],
            "size": size,
            "format": req.corpus_options.format,
            "text_field": req.corpus_options.text_field,
            "id_field": req.corpus_options.id_field,
        },
        "model": req.model,
        "options": req.encode.to_dict(),
        "chunk_size": req.chunk_size,
        "rows": rows,
        "chunks": -(-rows // req.chunk_size),
        "queue": req.queue,
        "job_timeout": req.timeout(),
    }
    atomic_write_json(layout.manifest, data)
    return RunManifest(data)


def submit(req: SubmitRequest, connection: redis.Redis) -> SubmitResult:
    """Create (or find) the run for ``req`` and enqueue every chunk not yet done or in flight."""
    if req.chunk_size < 1:
        raise ConfigError(f"--chunk-size must be at least 1, got {req.chunk_size}")
    check_readable(req.corpus)
    checksum, size = corpus_checksum(req.corpus)
    identity = _identity(req, checksum)
    run_fingerprint = fingerprint(identity)
    run_id = validate_run_id(req.run_id) if req.run_id else default_run_id(req.corpus, run_fingerprint)
    layout = RunLayout(req.store, run_id)
    created = not layout.manifest.is_file()
    if created:
        manifest = _create_run(req, layout, identity, size)
        log.info(
            "run %s: %d rows in %d chunks written to %s", run_id, manifest.rows, manifest.chunks, layout.root
        )
    else:
        manifest = load_manifest(layout)
        if manifest.fingerprint != run_fingerprint:
            raise _conflict(manifest, identity)
    done = layout.done_chunks()
    for index in sorted(i for i in done if not layout.output_npy(i).exists()):
        set_aside(layout, index)  # committed, then its .npy was lost: encode it again
        done.discard(index)
    counts = enqueue_chunks(
        connection, layout, manifest, (i for i in range(manifest.chunks) if i not in done)
    )
    log.info(
        "run %s: %d chunk(s) done, %d in flight, %d enqueued, %d requeued",
        run_id,
        len(done),
        counts.in_flight,
        counts.enqueued,
        counts.requeued,
    )
    return SubmitResult(run_id, manifest.rows, manifest.chunks, len(done), counts, created)
