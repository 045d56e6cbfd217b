"""A run's plan read back: the row map ``submit/plan.py`` wrote (each corpus row's chunk row, and
its id), for assembly (the result in corpus order, rows a left-out chunk takes), for counting a
run's rows the same everywhere (status, runs, metrics, a finished run's summary), and for what the
plan saved.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path
from typing import Any, overload

import numpy as np

from chunkq.jobs.contract.errors import BadInputError
from chunkq.jobs.contract.manifest import RunManifest
from chunkq.jobs.contract.run_files import (
    RunLayout,
    file_sha256,
    load_npy,
    new_memmap,
    read_chunk_input,
)
from chunkq.supervisor.result.chunk_reads import ChunkReads

log = logging.getLogger(__name__)

ROWS_AT_A_TIME = 1 << 16  # corpus rows of the row map put in the result at a time, at most
# and of their float32 vectors: 65,536 rows of 256 dims took 64 MB and copies; 8 MiB still held ~50 MB
# for a moment (the block, its copies, and the distinct vectors' pages a gather of its rows touches)
BLOCK_BYTES = 2 << 20


def rows_at_a_time(dim: int) -> int:
    """Corpus rows put in the result at a time for vectors of ``dim``."""
    return max(1, min(ROWS_AT_A_TIME, BLOCK_BYTES // (4 * max(1, dim))))


def chunk_of_row(rows: np.ndarray[Any, Any], chunk_size: int, encode_rows: int) -> np.ndarray[Any, Any]:
    """The chunk that holds each chunk row: those to encode first, those from the cache after them."""
    after = -(-encode_rows // chunk_size) + (rows - encode_rows) // chunk_size
    return np.where(rows < encode_rows, rows // chunk_size, after)


def corpus_rows_per_chunk(layout: RunLayout, manifest: RunManifest) -> np.ndarray[Any, Any] | None:
    """Each chunk's corpus rows where they are not its own rows (duplicates, windows), else None."""
    if (manifest.plan or {}).get("identity", True):
        return None
    try:
        counts = np.asarray(load_npy(layout.plan_chunk_rows), dtype=np.int64)
    except (OSError, ValueError):  # a run planned before the count was kept: count it from the map
        counts = np.zeros(manifest.chunks, dtype=np.int64)
        for rows, _ in row_map_parts(layout, manifest):
            counts += np.bincount(chunk_of(manifest, rows), minlength=manifest.chunks)
    return counts if counts.shape == (manifest.chunks,) else None


def corpus_rows_of(layout: RunLayout, manifest: RunManifest, chunks: Collection[int]) -> int:
    """The result rows ``chunks`` give: a run's rows (its corpus's, or its windows), counted the
    same by status, runs, the metrics and the summary of a finished run."""
    counts = corpus_rows_per_chunk(layout, manifest)
    if counts is None:
        return manifest.rows_of(chunks)
    return int(counts[sorted(chunks)].sum()) if chunks else 0


def savings(plan: dict[str, Any] | None) -> dict[str, Any] | None:
    """What the plan saved, for status, report, runs and metrics: the corpus's rows, those encoded
    (distinct texts the cache lacked, and cached ones set aside as damaged), those read from the
    cache, and the duplicates encoded once; None for a run without the cache."""
    if plan is None:
        return None
    damaged = int(plan.get("cache_damaged_rows") or 0)
    return {
        "rows": int(plan["corpus_rows"]),
        "distinct": int(plan["encode_rows"]) + int(plan["cached_rows"]),
        "encoded": int(plan["encode_rows"]) + damaged,
        "from_cache": int(plan["cached_rows"]) - damaged,
        "deduplicated": int(plan["duplicate_rows"]),
        "cache_seconds_saved": float(plan.get("cache_seconds_saved") or 0.0),
    }


def describe_savings(saved: dict[str, Any], planned: bool = False) -> str:
    """One line: ``700 rows: 120 encoded, 500 from the vector cache, 80 repeating a text of the run``
    (each distinct text is encoded or read from the cache once, whatever its copies). ``planned``:
    a run not yet published, whose plan says what is to be done (its status said "15,000 encoded"
    with 3,000 rows done)."""
    encoded = "to encode" if planned else "encoded"
    return (
        f"{saved['rows']:,} rows{' planned' if planned else ''}: {saved['encoded']:,} {encoded}, "
        f"{saved['from_cache']:,} from the vector cache, {saved['deduplicated']:,} repeating another "
        "row's text (each text encoded or read once)"
    )


def chunk_of(manifest: RunManifest, rows: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """The chunk that holds each chunk row."""
    encode_rows = int((manifest.plan or {}).get("encode_rows", manifest.rows))
    return chunk_of_row(rows, manifest.chunk_size, encode_rows)


class PartIds(Sequence[Any]):
    """A part's ids, each decoded when it is taken. A part is up to PART_ROWS rows: as a list of
    str, 10^6 ids held ~64 MB in the supervisor for the whole build (issue 64.6, the one cost a row
    its watch kept); as the file's bytes and where each line ends, the file's size and 4 bytes a row."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        ends = np.flatnonzero(np.frombuffer(data, dtype=np.uint8) == ord("\n"))
        if data and not data.endswith(b"\n"):
            ends = np.append(ends, len(data))
        self.ends = ends.astype(np.uint32) if len(data) < 1 << 32 else ends

    def _lines(self, at: slice) -> Iterator[bytes]:
        first, stop, step = at.indices(len(self.ends))
        if step != 1:
            raise ValueError("a part's ids are taken a run of rows at a time")
        start = int(self.ends[first - 1]) + 1 if first else 0
        for end in self.ends[first:stop].tolist():
            yield self.data[start:end]
            start = end + 1

    def __len__(self) -> int:
        return len(self.ends)

    @overload
    def __getitem__(self, at: int) -> Any: ...
    @overload
    def __getitem__(self, at: slice) -> list[Any]: ...
    def __getitem__(self, at: int | slice) -> Any:
        if isinstance(at, slice):
            return [self._id(line) for line in self._lines(at)]
        row = range(len(self.ends))[at]
        return self._id(next(self._lines(slice(row, row + 1))))

    def __iter__(self) -> Iterator[Any]:
        for start in range(0, len(self), ROWS_AT_A_TIME):
            yield from self[start : start + ROWS_AT_A_TIME]

    @staticmethod
    def _id(line: bytes) -> Any:
        value = json.loads(line)
        return value if isinstance(value, dict) else str(value)


def row_map_parts(layout: RunLayout, manifest: RunManifest) -> Iterator[tuple[np.ndarray[Any, Any], PartIds]]:
    """Each part of the row map (chunk rows) and its ids, checked against the manifest's checksums."""
    plan = manifest.plan or {}
    for part, described in enumerate(plan.get("parts") or []):
        map_path, ids_path = layout.plan_map(part), layout.plan_ids(part)
        data = ids_path.read_bytes()
        if hashlib.sha256(data).hexdigest() != described.get("ids_sha256"):
            raise BadInputError(f"{ids_path}: does not match the checksum in the run's manifest")
        if file_sha256(map_path) != described.get("map_sha256"):
            raise BadInputError(f"{map_path}: does not match the checksum in the run's manifest")
        rows = np.asarray(load_npy(map_path), dtype=np.int64)
        ids = PartIds(data)
        if len(ids) != len(rows) or len(rows) != described.get("rows"):
            raise BadInputError(
                f"{map_path}: {len(rows)} rows, {len(ids)} ids, the manifest says {described.get('rows')}"
            )
        if len(rows) and (rows.min() < 0 or rows.max() >= manifest.rows):
            raise BadInputError(f"{map_path}: a row outside the run's {manifest.rows} chunk rows")
        yield rows, ids


def lost_rows(layout: RunLayout, manifest: RunManifest, skip: set[int]) -> dict[int, int]:
    """Corpus rows each left-out chunk takes from a partial result (every row whose text it holds)."""
    if not skip:
        return {}
    counts = corpus_rows_per_chunk(layout, manifest)
    if counts is None:
        return {index: manifest.chunk_rows(index) for index in skip}
    return {index: int(counts[index]) for index in skip}


def rows_without_vector(layout: RunLayout, manifest: RunManifest, bad: np.ndarray[Any, Any]) -> int:
    """Corpus rows whose chunk row is one of ``bad`` (rows left out under --allow-missing, numbered
    as the chunks number them): every row whose text it holds."""
    if not len(bad):
        return 0
    if (manifest.plan or {}).get("identity", True):
        return len(bad)
    return sum(int(np.isin(rows, bad).sum()) for rows, _ in row_map_parts(layout, manifest))


def result_rows(
    reads: ChunkReads,
    skip: set[int],
    dim: int,
    scratch: Path,
    bad: np.ndarray[Any, Any] | None = None,
) -> Iterator[tuple[list[Any], np.ndarray[Any, Any]]]:
    """(ids, float32 rows) of the result in corpus order, from the chunk outputs (each read once,
    ``reads``), rows of ``skip``'s chunks, and chunk rows in ``bad`` (no vector: --allow-missing),
    left out."""
    layout, manifest = reads.layout, reads.manifest
    bad = np.zeros(0, dtype=np.int64) if bad is None else bad
    if (manifest.plan or {}).get("identity", True):
        for index in range(manifest.chunks):
            if index not in skip:
                ids, texts = read_chunk_input(layout, index)
                block = np.asarray(reads.rows(index, texts))
                first = manifest.first_row(index)
                keep = ~np.isin(np.arange(first, first + len(ids)), bad)
                if not keep.all():
                    ids, block = [i for i, k in zip(ids, keep, strict=True) if k], block[keep]
                yield ids, block
        return
    # The distinct texts' vectors, gathered into one local file the row map picks from.
    vectors = new_memmap(scratch / "distinct.f32", np.float32, (max(1, manifest.rows), dim))
    have = np.zeros(manifest.rows, dtype=bool)
    for index in range(manifest.chunks):
        if index in skip:
            continue
        first, count = manifest.first_row(index), manifest.chunk_rows(index)
        vectors[first : first + count] = reads.rows(index)
        have[first : first + count] = True
    have[bad] = False
    for part_rows, part_ids in row_map_parts(layout, manifest):
        step = rows_at_a_time(dim)
        for start in range(0, len(part_rows), step):
            rows, ids = part_rows[start : start + step], part_ids[start : start + step]
            keep = have[rows]
            if not keep.all():
                ids = [i for i, k in zip(ids, keep, strict=True) if k]
                rows = rows[keep]
            yield ids, np.asarray(vectors[rows])
    del vectors
    (scratch / "distinct.f32").unlink(missing_ok=True)
