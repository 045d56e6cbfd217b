"""Assembly: verify every chunk output and publish the ordered embedding matrix, whole or not at all.

The matrix is appended to one chunk at a time, so memory stays flat in the corpus size, and
written as one file or as ordered shards (``writer.py``). It is built under a temporary name; on
a filesystem store it is renamed into place only when whole, on an object store its files are
uploaded and its manifest, the commit marker that readers look for, is uploaded last.
"""

from __future__ import annotations

import logging
import shutil
import time
from array import array
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from chunkq.jobs import kinds
from chunkq.jobs.compute import agreement
from chunkq.jobs.compute.model_identity import short
from chunkq.jobs.compute.quantize import convert, derived_floats, stored_columns
from chunkq.jobs.contract.chunk_output import output_meta
from chunkq.jobs.contract.defaults import DEFAULT_SHARD_BYTES
from chunkq.jobs.contract.errors import AssemblyError, BadInputError
from chunkq.jobs.contract.manifest import RunManifest
from chunkq.jobs.contract.run import Run
from chunkq.jobs.contract.run_files import (
    MANIFEST_NAME,
    RunLayout,
    atomic_write_json,
    read_chunk_input,
)
from chunkq.jobs.contract.specs import PACKED_DTYPES, storage_dtype
from chunkq.jobs.contract.storage import is_local, list_with_mtime
from chunkq.supervisor.result import planned_rows
from chunkq.supervisor.result import ragged as ragged_result
from chunkq.supervisor.result.building import Build
from chunkq.supervisor.result.chunk_reads import CacheFeed, ChunkReads, Unfit, set_aside_because
from chunkq.supervisor.result.published import TEXTS, shard_names
from chunkq.supervisor.result.reader import published_result
from chunkq.supervisor.result.result_names import SINGLE
from chunkq.supervisor.result.text_pooling import TextPooler
from chunkq.supervisor.result.writer import PartWriter, ResultWriter, local_build_dir, publish
from chunkq.supervisor.store.phases import CACHE, PUBLISH, VERIFY, WRITE, Phases, timed

log = logging.getLogger(__name__)


@dataclass
class Verified:
    """What the result needs of the verified chunk outputs, in a few bytes a chunk: each one's
    stored columns (an array: a run of 10^5 chunks must not hold 10^5 records), and the rest as
    totals (who did the work, on which devices, for how long)."""

    dims: array[int] = field(default_factory=lambda: array("i"))  # per chunk; 0: none verified
    workers: set[str] = field(default_factory=set)
    processes: set[tuple[str, int]] = field(default_factory=set)  # (host, pid) of each that encoded a chunk
    devices: set[str] = field(default_factory=set)
    seconds: float = 0.0
    embedding_dim: int = 0  # the dimensions encoded (packed bits store 8 a column)
    bad_rows: dict[int, list[dict[str, Any]]] = field(default_factory=dict)  # chunk: rows left out
    models: dict[str, int] = field(default_factory=dict)  # each model identity outputs name: a chunk of it
    agreements: list[dict[str, Any]] = field(default_factory=list)  # a rounding precision's, per chunk

    def add(self, index: int, meta: dict[str, Any]) -> None:
        self.dims[index] = dim = int(meta["dim"])
        if meta.get("model_identity"):
            self.models.setdefault(str(meta["model_identity"]), index)
        if meta.get("bad_rows"):
            self.bad_rows[index] = list(meta["bad_rows"])
        self.embedding_dim = self.embedding_dim or int(meta.get("embedding_dim") or dim)
        self.workers.add(str(meta.get("worker")))
        if meta.get("source") != "cache" and isinstance(meta.get("pid"), int):
            self.processes.add((str(meta.get("host")), int(meta["pid"])))
        self.devices.add(str(meta.get("device")))
        if isinstance(meta.get("agreement"), dict):
            self.agreements.append(meta["agreement"])
        try:
            self.seconds += float(meta.get("seconds") or 0.0)
        except (TypeError, ValueError):
            pass


@dataclass
class Failure:
    """A chunk whose last attempt failed: waiting for its next attempt, or quarantined (what a result
    left out, in a partial one; the watch reads it from the chunk's job)."""

    chunk: int
    first_row: int
    rows: int
    job_id: str
    error_class: str
    attempt: int
    error: str
    traceback: str
    quarantined: bool
    reason: str = ""
    label: str = ""  # how messages name the chunk (RunManifest.chunk_label)


def _check_metas(layout: RunLayout, manifest: RunManifest, skip: set[int]) -> tuple[Verified, dict[int, str]]:
    """Each chunk output's metadata (no array is read yet): the run's, and all of one dimension. A
    bad output is set aside, so the next run encodes it again; its problem is listed either way."""
    verified = Verified(array("i", [0]) * manifest.chunks)
    failed: dict[int, str] = {}
    producer = manifest.producer()
    for index in range(manifest.chunks):
        if index in skip:
            continue
        meta, why = output_meta(layout, index, producer)
        if meta is None:
            failed[index] = set_aside_because(layout, manifest, index, why)
        else:
            verified.add(index, meta)
    # The dimension the model gives is the one most chunks have: a lone output of another dimension
    # is the odd one out, not the healthy chunks around it.
    dims = Counter(d for d in verified.dims if d)
    if len(dims) > 1:
        dim, _ = dims.most_common(1)[0]
        for index in [i for i, d in enumerate(verified.dims) if d and d != dim]:
            why = f"dimension {verified.dims[index]}, while {dims[dim]} other chunk(s) have {dim}"
            verified.dims[index] = 0
            failed[index] = set_aside_because(layout, manifest, index, why)
    return verified, failed


def _models_problem(verified: Verified) -> list[str]:
    if len(verified.models) <= 1:
        return []
    named = ", ".join(f"{short(m)} (chunk {i})" for m, i in verified.models.items())
    return [
        f"its chunks were encoded by {len(verified.models)} different models ({named}): the model's "
        "files differ between hosts or changed during the run; give every host the same files and "
        "start the run again"
    ]


def _write_result(
    reads: ChunkReads,
    writer: ResultWriter,
    skip: set[int],
    dim: int,
    scratch: Path,
    bad_rows: dict[int, list[dict[str, Any]]],
    bad: np.ndarray[Any, Any],
) -> None:
    layout, manifest = reads.layout, reads.manifest
    if manifest.plan is not None:
        pooler = _pooler(manifest, writer, skip)
        for ids, block in planned_rows.result_rows(reads, skip, dim, scratch, bad):
            floats = derived_floats(block, manifest.options)
            writer.write(ids, convert(floats, manifest.output_dtype, manifest.ranges))
            if pooler is not None:
                pooler.add(ids, floats)
        if pooler is not None:
            pooler.finish()
        return
    for index in range(manifest.chunks):
        if index in skip:
            continue
        rows = manifest.chunk_rows(index)
        ids, texts = read_chunk_input(layout, index)
        if len(ids) != rows:
            raise BadInputError(f"chunk {index}: input holds {len(ids)} rows, the manifest says {rows}")
        block = reads.rows(index, texts)
        if block.shape != (rows, writer.dim):
            raise BadInputError(
                f"chunk {index}: output has shape {block.shape}, expected ({rows}, {writer.dim})"
            )
        if index in bad_rows:  # rows whose input could not be read (--allow-missing): no vector
            first = manifest.first_row(index)
            keep = sorted(set(range(rows)) - {int(r["row"]) - first for r in bad_rows[index]})
            ids, block = [ids[i] for i in keep], np.asarray(block)[keep]
        writer.write(ids, block)


def _pooler(manifest: RunManifest, writer: ResultWriter, skip: set[int]) -> TextPooler | None:
    """--pool: a vector per text, written beside the windows' rows as texts.npy (a whole result's
    only: a partial one lacks some texts' windows)."""
    windows = (manifest.plan or {}).get("windows") or {}
    if windows.get("pool", "none") == "none" or skip:
        return None
    texts = PartWriter(
        writer.built / TEXTS[0], writer.built / TEXTS[1], int(windows["texts"]), writer.dim, writer.dtype
    )
    writer.extra = texts

    def write(ids: list[Any], vectors: Any) -> None:
        texts.write(ids, convert(vectors, manifest.output_dtype, manifest.ranges))

    return TextPooler(str(windows["pool"]), bool(windows.get("normalize")), write)


def assemble(
    run: Run,
    missing: list[Failure] | None = None,
    fence: Callable[[], None] | None = None,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    phases: Phases | None = None,
    build: Build | None = None,
    keep_outputs: bool = False,
) -> dict[str, Any]:
    """Verify every chunk and publish ``result/``; raise AssemblyError naming every problem.

    ``missing`` (``--allow-partial``) leaves those chunks out; the result manifest then says
    ``complete: false`` and lists their row ranges and errors, so a partial result is never silent.
    ``fence`` raises if this process no longer owns the run (``StoreLock.check``): it is called
    just before the result is put in place, so a supervisor that lost its lock never publishes.
    A result of more than ``shard_bytes`` of embeddings is published as shards (``writer.py``).
    ``phases``: where its steps' seconds go.
    ``build``: the result the watch wrote as the chunks landed (``building.py``), finished here
    when it holds every chunk; otherwise it is dropped and the result written here. A whole
    result's chunk arrays are then deleted (``free_outputs``) unless ``keep_outputs``.
    """
    layout, manifest = run.layout, run.manifest
    existing = published_result(layout, manifest)
    if existing is not None:
        if build is not None:
            build.abandon()
        return existing
    skip = {f.chunk: f for f in missing or []}
    with timed(phases, VERIFY):
        verified, failed = _check_metas(layout, manifest, set(skip))
    others = _models_problem(verified)
    if build is not None and (skip or failed or others or not build.complete):
        build.abandon()
        build = None
    if build is not None:
        build.ready_for_assembly()
        reads = build.reads
    else:
        cache = CacheFeed.of(layout, manifest, partial=bool(skip))
        reads = ChunkReads(layout, manifest, set(skip) | set(failed), failed, cache, others=others)
    try:
        result = _assemble(reads, verified, skip, fence, shard_bytes, phases or Phases(), build)
    except Unfit:
        reads.check_the_rest()
        raise AssemblyError(manifest.run_id, reads.listed()) from None
    if not skip and not keep_outputs:
        free_outputs(layout)  # the result holds them now: one copy on disk (issue 64.5)
    return result


def _assemble(
    reads: ChunkReads,
    verified: Verified,
    skip: dict[int, Failure],
    fence: Callable[[], None] | None,
    shard_bytes: int,
    phases: Phases,
    build: Build | None = None,
) -> dict[str, Any]:
    """Write the result from the chunk outputs, each read once (ChunkReads), and publish it (or
    finish ``build``, which has written it already)."""
    layout, manifest = reads.layout, reads.manifest
    if reads.problems or reads.others:
        raise Unfit
    dim = next((d for d in verified.dims if d), 0)
    if not dim:
        raise AssemblyError(manifest.run_id, ["no chunk of the run has an output"])
    lost = (
        planned_rows.lost_rows(layout, manifest, set(skip))
        if manifest.plan is not None
        else {f.chunk: f.rows for f in skip.values()}
    )
    bad_rows = [row for rows in verified.bad_rows.values() for row in rows]
    bad = np.array(sorted(int(row["row"]) for row in bad_rows), dtype=np.int64)  # as chunks number rows
    left_out = (
        planned_rows.rows_without_vector(layout, manifest, bad) if manifest.plan is not None else len(bad)
    )
    total = manifest.corpus_rows - sum(lost.values()) - left_out
    built = build.built if build is not None and build.built is not None else local_build_dir(layout)
    remote = not is_local(layout.root)
    dtype = storage_dtype(manifest.output_dtype)
    embedding_dim = verified.embedding_dim
    columns = dim
    if manifest.plan is not None:  # the chunks hold full float32 vectors; the result is derived
        embedding_dim = int(manifest.options.get("truncate_dim") or dim)
        columns = stored_columns(embedding_dim, manifest.output_dtype)
    ragged = kinds.get(manifest.kind).ragged
    if build is not None and build.writer is not None:
        writer = build.writer
    else:
        writer = ResultWriter(
            built, total, columns, dtype, shard_bytes, upload_to=layout.result if remote else None
        )
    writing = (time.time(), time.perf_counter(), time.process_time())
    cache_before = reads.cache.spent if reads.cache is not None else (0.0, 0.0)
    try:
        if build is not None:
            files = writer.finish()
            uploaded = writer.shard_dir
        elif ragged:
            upload_to = layout.result if remote else None
            files = ragged_result.write(reads, set(skip), built, total, shard_bytes, upload_to)
            uploaded = files["ragged"].get("shard_dir")
        else:
            _write_result(reads, writer, set(skip), dim, built, verified.bad_rows, bad)
            files = writer.finish()
            uploaded = writer.shard_dir
        if writer.extra is not None:
            windows = (manifest.plan or {}).get("windows") or {}
            files["texts"] = {**writer.extra.close(), "pool": windows.get("pool"), "dim": columns}
        shape = {"rows": total, "dim": columns, "embedding_dim": embedding_dim}
        result = _result_manifest(manifest, verified, files, skip, lost, bad_rows, shape)
        atomic_write_json(built / MANIFEST_NAME, result)
        cache_wall, cache_cpu = reads.cache.spent if reads.cache is not None else (0.0, 0.0)
        phases.add(
            WRITE,
            writing[0],
            time.perf_counter() - writing[1] - (cache_wall - cache_before[0]),
            time.process_time() - writing[2] - (cache_cpu - cache_before[1]),
        )
        with phases.phase(PUBLISH):
            if fence is not None:
                fence()
            publish(built, layout.result, uploaded=uploaded if remote else None)
    except BaseException:
        writer.abort()
        raise
    finally:
        shutil.rmtree(built, ignore_errors=True)
    if skip:
        log.warning(
            "run %s: published a PARTIAL result: %d of %d rows; %d chunk(s) missing",
            manifest.run_id,
            total,
            manifest.corpus_rows,
            len(skip),
        )
    log.info("run %s: published %d x %d embeddings in %s", manifest.run_id, total, columns, layout.result)
    _after_publish(reads, writer, dim, phases, cache_before)
    return result


def _result_manifest(
    manifest: RunManifest,
    verified: Verified,
    files: dict[str, Any],
    skip: dict[int, Failure],
    lost: dict[int, int],
    bad_rows: list[dict[str, Any]],
    shape: dict[str, int],
) -> dict[str, Any]:
    missing_rows = [
        {
            "chunk": f.chunk,
            "first_row": f.first_row,
            "rows": lost[f.chunk],
            "error_class": f.error_class,
            "error": f.error,
        }
        for f in skip.values()
    ]
    return {
        **manifest.data,
        **files,
        "complete": not skip,
        "corpus_rows": manifest.corpus_rows,
        "rows": shape["rows"],
        "missing": missing_rows,
        **({"bad_rows": bad_rows} if bad_rows else {}),  # left out under --allow-missing, each with why
        "dim": shape["dim"],  # the stored array's columns
        "dtype": manifest.output_dtype,
        "embedding_dim": shape["embedding_dim"],
        "packed_bits": manifest.output_dtype in PACKED_DTYPES,  # binary/ubinary: 8 dimensions a byte
        "assembled_at": datetime.now(UTC).isoformat(),
        "workers": sorted(verified.workers),
        # worker processes that encoded a chunk of the result: what report counts too
        "worker_processes": len(verified.processes),
        "devices": sorted(verified.devices),
        "encode_seconds": round(verified.seconds, 3),
        # The model every row came from: the run's, or where submit could not tell, the chunks' one
        "model_identity": manifest.model_identity or next(iter(verified.models), None),
        **_agreed(manifest, verified),
    }


def _agreed(manifest: RunManifest, verified: Verified) -> dict[str, Any]:
    """A rounding precision's agreement with fp32, as the chunks that measured it found it."""
    found = agreement.of_the_run(verified.agreements)
    if found is None:
        return {}
    options = manifest.options
    log.info(
        "run %s: %s", manifest.run_id, agreement.said(options.get("backend"), options.get("precision"), found)
    )
    return {"agreement": found}


def _after_publish(
    reads: ChunkReads, writer: ResultWriter, dim: int, phases: Phases, before: tuple[float, float]
) -> None:
    """The run's encoded vectors to the cache: the published parts themselves, or copies."""
    if reads.cache is None:
        return
    if reads.cache.linking:
        reads.cache.link_result(_published_parts(reads.layout, writer), dim)
    else:
        reads.cache.close()
    spent = reads.cache.spent
    phases.add(CACHE, time.time(), spent[0] - before[0], spent[1] - before[1])


def free_outputs(layout: RunLayout) -> int:
    """Delete the chunk arrays (``.npy``) of a run whose whole result is published: the result holds
    their rows (on a filesystem, often the same bytes under a second name). Their records stay, so
    ``status`` and ``report`` tell the run's story and a rerun sees the result and does nothing; a
    rerun after the result was lost encodes the chunks again from their inputs. The bytes freed."""
    freed = 0
    for name, _ in list(list_with_mtime(layout.outputs)):
        if name.endswith(".npy"):
            path = layout.outputs / name
            try:
                freed += path.stat().st_size
                path.unlink()
            except FileNotFoundError:
                continue
    return freed


def _published_parts(layout: RunLayout, writer: ResultWriter) -> list[tuple[Path, int, list[str]]]:
    """Each part of the published result: its embeddings file, rows and block checksums."""
    if writer.shard_dir is None:
        return [(layout.result / SINGLE[0], writer.rows, writer.part_blocks[0])]
    return [
        (layout.result / writer.shard_dir / shard_names(i)[0], int(part["rows"]), writer.part_blocks[i])
        for i, part in enumerate(writer.done)
    ]
