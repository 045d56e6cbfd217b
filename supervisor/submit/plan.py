"""A run's plan with the vector cache on: each distinct text is encoded once, and the texts the
cache already holds are read from it at submit instead of being encoded.

Submit streams the corpus once into local scratch and joins its hashes with the cache's by hash
partition (``submit/hash_join.py``): every row's first occurrence and every first occurrence's cache
entry, if any, for bytes per text (16 read per cached text, about 40 written and read per corpus
row), never a request per text. Then this module chooses, in a second pass in corpus order:
- chunk inputs 0..E-1: the distinct texts the cache lacks, in order of first occurrence;
- the following chunks: the distinct texts it holds, their outputs written now from the cache, each
  block of vectors checked first (a damaged shard is set aside and its chunk is left to encode);
- ``plan/``: each corpus row's id and chunk row, unless every row is its own chunk row (no duplicate,
  no hit), which keeps such a run's layout exactly that of a run without the cache.

Assembly reads it back (``result/planned_rows.py``): the chunk outputs, in chunk order, are the
distinct texts' vectors; each part of the row map picks the corpus's rows from them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from itertools import islice
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from chunkq.jobs.compute.vector_cache import CacheDamage, Shard, VectorCache
from chunkq.jobs.contract.run_files import (
    RunLayout,
    new_memmap,
    save_npy_atomic,
    write_chunk_input,
    write_output,
)
from chunkq.jobs.contract.storage import atomic_path, local_scratch, remove_tree
from chunkq.supervisor.result.planned_rows import chunk_of_row
from chunkq.supervisor.submit.hash_join import (
    ROW_BLOCK,
    CorpusReader,
    Joined,
    PlanRow,
    Spooled,
    every_row,
    join,
    spool,
)

log = logging.getLogger(__name__)

PART_ROWS = 1 << 18  # corpus rows a file of the row map (and of its ids) holds: what assembly holds of it
CACHE_WORKER = "cache"  # who "encoded" a chunk read from the vector cache at submit (its output's worker)


@dataclass
class Chunker:
    """Rows into chunk inputs of ``size``, numbered from ``index``; ``written`` is told each one
    (its index and rows) once it is in the store."""

    layout: RunLayout
    size: int
    index: int
    buffer: list[tuple[str, str]]
    written: Callable[[int, int], None] | None = None

    def add(self, rid: str, text: str) -> None:
        self.buffer.append((rid, text))
        if len(self.buffer) == self.size:
            self.flush()

    def flush(self) -> None:
        if self.buffer:
            write_chunk_input(self.layout, self.index, self.buffer)
            if self.written is not None:
                self.written(self.index, len(self.buffer))
            self.index, self.buffer = self.index + 1, []


def write_planned_inputs(
    records: Iterable[PlanRow],
    layout: RunLayout,
    chunk_size: int,
    cache: VectorCache | None,
    output_producer: dict[str, Any],
    dedup: bool = True,
    row_map: bool = False,
) -> dict[str, Any]:
    """Split the corpus into chunk inputs by plan (see the module's docstring); the manifest's
    ``plan``. ``cache``: None looks nothing up (duplicates are still encoded once).
    ``output_producer``: what a chunk output of the run records of its producer
    (``RunManifest.producer()``). ``dedup``: False encodes every row
    (windows with --no-cache). ``row_map``: write the row map even where it is the identity (rows
    whose ids are window objects, which chunk inputs do not carry back)."""
    with local_scratch(layout.root) as where:
        folder = Path(tempfile.mkdtemp(prefix=".plan-", dir=where))
        try:
            spooled = spool(records, folder)
            if not spooled.rows:
                return {"corpus_rows": 0}
            joined = join(spooled, cache, folder) if dedup else every_row(spooled, folder)
            return _write(layout, chunk_size, spooled, joined, cache, output_producer, folder, row_map)
        finally:
            remove_tree(folder)


def _write(
    layout: RunLayout,
    chunk_size: int,
    spooled: Spooled,
    joined: Joined,
    cache: VectorCache | None,
    output_producer: dict[str, Any],
    folder: Path,
    row_map: bool,
) -> dict[str, Any]:
    """Pass two, in corpus order: the chunk inputs, the row map, then the cached chunks' outputs."""
    n, encode_rows = spooled.rows, joined.misses
    chunk_row = new_memmap(folder / "chunk_row.bin", np.int64, (n,))
    reader = CorpusReader(spooled)
    encode = Chunker(layout, chunk_size, 0, [])
    hits_path, refs_path = folder / "hits.jsonl", folder / "hits.refs"
    next_miss = next_hit = 0
    identity = True
    try:
        with open(hits_path, "wb") as hits, open(refs_path, "wb") as refs:
            for start in range(0, n, ROW_BLOCK):
                stop = min(n, start + ROW_BLOCK)
                rows = np.arange(start, stop)
                first = np.asarray(joined.first_of[start:stop])
                shard = np.asarray(joined.hit_shard[start:stop])
                is_first = first == rows
                miss, hit = is_first & (shard < 0), is_first & (shard >= 0)
                mapped = np.empty(stop - start, dtype=np.int64)
                mapped[miss] = next_miss + np.arange(int(miss.sum()))
                mapped[hit] = encode_rows + next_hit + np.arange(int(hit.sum()))
                next_miss, next_hit = next_miss + int(miss.sum()), next_hit + int(hit.sum())
                chunk_row[start:stop][is_first] = mapped[is_first]
                mapped[~is_first] = chunk_row[first[~is_first]]  # a first occurrence comes earlier
                chunk_row[start:stop] = mapped
                identity = identity and bool(np.array_equal(mapped, rows))
                lines, texts = reader.block(start, stop)
                for i in np.flatnonzero(miss):
                    encode.add(json.loads(lines[i]), texts[i])
                for i in np.flatnonzero(hit):
                    hits.write(json.dumps({"id": json.loads(lines[i]), "text": texts[i]}).encode() + b"\n")
                refs.write(
                    np.stack([shard[hit].astype(np.int64), joined.hit_pos[start:stop][hit]], 1).tobytes()
                )
            encode.flush()
        identity = identity and not row_map
        parts = [] if identity else write_row_map(layout, chunk_row, spooled.path("ids.jsonl"), n)
        if not identity:
            write_corpus_rows_per_chunk(layout, chunk_row, chunk_size, encode_rows, next_hit)
        cached = write_cached_chunks(
            layout,
            chunk_size,
            encode.index,
            encode_rows,
            hits_path,
            pairs_file(refs_path),
            joined.shards,
            cache,
            output_producer,
        )
    finally:
        reader.close()
    return {
        "corpus_rows": n,
        "distinct_rows": joined.distinct,
        "encode_rows": encode_rows,
        "cached_rows": next_hit,
        "duplicate_rows": n - joined.distinct,
        "cache_damaged_rows": cached["damaged"],
        "cache_shards_read": cached["shards"],
        "cache_seconds_saved": round(cached["seconds"], 3),
        "identity": identity,
        "part_rows": PART_ROWS,
        "parts": parts,
    }


def write_corpus_rows_per_chunk(
    layout: RunLayout, chunk_row: np.ndarray[Any, Any], chunk_size: int, encode_rows: int, cached_rows: int
) -> None:
    """How many corpus rows each chunk gives the result (a duplicate text's rows all count to the
    chunk that holds it): what progress counts as a run's rows done."""
    chunks = -(-encode_rows // chunk_size) + -(-cached_rows // chunk_size)
    counts = np.zeros(chunks, dtype=np.int64)
    for start in range(0, len(chunk_row), ROW_BLOCK):
        block = np.asarray(chunk_row[start : start + ROW_BLOCK])
        counts += np.bincount(chunk_of_row(block, chunk_size, encode_rows), minlength=chunks)
    save_npy_atomic(layout.plan_chunk_rows, counts)


def pairs_file(path: Path) -> np.ndarray[Any, Any]:
    """A file of int64 pairs, memory-mapped (16 bytes a hit, never all in memory)."""
    size = path.stat().st_size // 16
    return np.memmap(path, dtype=np.int64, mode="r", shape=(size, 2)) if size else np.empty((0, 2), np.int64)


def write_row_map(
    layout: RunLayout, chunk_row: np.ndarray[Any, Any], spooled_ids: Path, n: int
) -> list[dict[str, Any]]:
    """plan/rows-<k>.npy (each corpus row's chunk row) and plan/ids-<k>.jsonl, PART_ROWS rows a file."""
    dtype = np.uint32 if n <= np.iinfo(np.uint32).max else np.uint64
    parts = []
    with open(spooled_ids, "rb") as ids:
        for part, start in enumerate(range(0, n, PART_ROWS)):
            stop = min(n, start + PART_ROWS)
            map_sha = save_npy_atomic(layout.plan_map(part), np.asarray(chunk_row[start:stop], dtype=dtype))
            ids_sha = _copy_lines(ids, stop - start, layout.plan_ids(part))
            parts.append({"rows": stop - start, "map_sha256": map_sha, "ids_sha256": ids_sha})
    return parts


def _copy_lines(source: BinaryIO, count: int, path: Path) -> str:
    """The next ``count`` lines of ``source`` into ``path`` (atomically), a block at a time; their
    sha256. A part's lines joined in one go held ~60 MB of bytes objects at 2^20 rows."""
    digest = hashlib.sha256()
    with atomic_path(path) as tmp, open(tmp, "wb") as out:
        while count > 0:
            data = b"".join(islice(source, min(count, ROW_BLOCK)))
            count -= min(count, ROW_BLOCK)
            digest.update(data)
            out.write(data)
    return digest.hexdigest()


def write_cached_chunks(
    layout: RunLayout,
    chunk_size: int,
    first_index: int,
    encode_rows: int,
    hits_path: Path,
    refs: np.ndarray[Any, Any],
    shards: list[Shard],
    cache: VectorCache | None,
    output_producer: dict[str, Any],
) -> dict[str, Any]:
    """The chunks of texts the cache holds: inputs (kept, should an output be damaged later) and
    outputs read from the cache. A chunk that touches a damaged shard gets no output: it is encoded."""
    damaged_shards: set[int] = set()
    damaged_rows = 0
    chunker = Chunker(layout, chunk_size, first_index, [])
    with open(hits_path, "rb") as hits:
        for offset in range(0, len(refs), chunk_size):
            chunk_refs = refs[offset : offset + chunk_size]
            for _ in range(len(chunk_refs)):
                row = json.loads(hits.readline())
                chunker.buffer.append((row["id"], row["text"]))
            index = chunker.index
            chunker.flush()
            vectors = None if cache is None else _read_hits(cache, shards, chunk_refs, damaged_shards)
            if vectors is None:
                damaged_rows += len(chunk_refs)
                continue
            now = datetime.now(UTC).isoformat()
            meta = {
                "run_id": layout.run_id,
                "chunk": index,
                "first_row": encode_rows + offset,
                **output_producer,
                "source": "cache",
                "worker": CACHE_WORKER,
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "device": "cache",
                "embedding_dim": int(vectors.shape[1]),
                "attempt": 0,
                "seconds": 0.0,
                "started_at": now,
                "finished_at": now,
                "cache_shards": sorted({shards[int(s)].name for s in chunk_refs[:, 0]}),
            }
            write_output(layout, index, vectors, meta, "float32")
    # What the cached vectors cost when they were encoded: each shard's encode seconds per row.
    rates = np.array([float(s.meta.get("encode_seconds") or 0) / max(1, s.rows) for s in shards] or [0.0])
    saved = float(rates[refs[:, 0]].sum()) if len(refs) else 0.0
    return {"damaged": damaged_rows, "shards": len({int(s) for s in refs[:, 0]}), "seconds": saved}


def _read_hits(
    cache: VectorCache, shards: list[Shard], refs: np.ndarray[Any, Any], damaged: set[int]
) -> np.ndarray[Any, Any] | None:
    """A chunk's vectors from the cache (rows ``refs``: shard number, row), or None if any shard
    they come from is damaged."""
    if any(int(s) in damaged for s in np.unique(refs[:, 0])):
        return None
    dims = {shards[int(s)].dim for s in np.unique(refs[:, 0])}
    if len(dims) != 1:
        return None
    out = np.empty((len(refs), dims.pop()), dtype=np.float32)
    for s in np.unique(refs[:, 0]):
        where = np.flatnonzero(refs[:, 0] == s)
        order = np.argsort(refs[where, 1], kind="stable")
        try:
            rows = cache.vectors(shards[int(s)], refs[where[order], 1])
        except CacheDamage:
            damaged.add(int(s))
            return None
        out[where[order]] = rows
    return out
