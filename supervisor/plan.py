"""A run's plan with the vector cache on: each distinct text is encoded once, and the texts the
cache already holds are read from it at submit instead of being encoded.

Submit streams the corpus once into local scratch (ids, texts and each text's 16-byte hash, in
corpus order), then joins the corpus's hashes with the cache's by hash partition: both sides are
split on their hashes' leading bits into partitions of at most BUCKET_ROWS corpus rows, and each
partition is sorted and matched in memory. That gives every row its first occurrence and every
first occurrence its cache entry, if any, for bytes per text (16 read per cached text, about 40
written and read per corpus row), never a request per text. A second pass in corpus order writes:
- chunk inputs 0..E-1: the distinct texts the cache lacks, in order of first occurrence;
- the following chunks: the distinct texts it holds, their outputs written now from the cache, each
  block of vectors checked first (a damaged shard is set aside and its chunk is left to encode);
- ``plan/``: each corpus row's id and chunk row, unless every row is its own chunk row (no duplicate,
  no hit), which keeps such a run's layout exactly that of a run without the cache.

Assembly reads it back (``result_rows``): the chunk outputs, in chunk order, are the distinct texts'
vectors; each part of the row map picks the corpus's rows from them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import tempfile
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any, Protocol

import numpy as np

from chunkq.jobs.errors import BadInputError
from chunkq.jobs.manifest import RunManifest
from chunkq.jobs.run_files import (
    RunLayout,
    atomic_write_bytes,
    file_sha256,
    load_npy,
    read_chunk_input,
    read_json,
    save_npy_atomic,
    write_chunk_input,
    write_output,
)
from chunkq.jobs.storage import local_scratch, remove_tree
from chunkq.jobs.vector_cache import HASH_BYTES, CacheDamage, Shard, VectorCache, text_hashes

log = logging.getLogger(__name__)

PART_ROWS = 1 << 20  # corpus rows a file of the row map (and of its ids) holds
BUCKET_ROWS = 1 << 22  # corpus rows a partition of the join holds at most: about 100 MB sorted in memory
MAX_BUCKETS = 1 << 16  # the partition is chosen by a hash's first 16 bits
CACHE_WORKER = "cache"  # who "encoded" a chunk read from the vector cache at submit (its output's worker)
ROW_BLOCK = 1 << 16  # rows read, hashed and written at a time
_KEY = np.dtype(f"S{HASH_BYTES}")


class PlanRow(Protocol):
    """A row the plan takes: a corpus record, or a window of one (its id then a JSON object)."""

    @property
    def id(self) -> Any: ...

    @property
    def text(self) -> str: ...


@dataclass(frozen=True)
class _Spooled:
    folder: Path
    rows: int

    def path(self, name: str) -> Path:
        return self.folder / name

    def hashes(self) -> np.ndarray[Any, Any]:
        return np.memmap(self.path("hashes.bin"), dtype=_KEY, mode="r", shape=(self.rows,))

    def ends(self) -> np.ndarray[Any, Any]:
        return np.memmap(self.path("ends.bin"), dtype=np.uint64, mode="r", shape=(self.rows,))


def _spool(records: Iterable[PlanRow], folder: Path, check: Callable[[list[Any]], None]) -> _Spooled:
    """Pass one: ids, texts (UTF-8, end offsets) and hashes, in corpus order, to local scratch."""
    rows, end = 0, 0
    with (
        open(folder / "ids.jsonl", "wb") as ids,
        open(folder / "texts.bin", "wb") as texts,
        open(folder / "ends.bin", "wb") as ends,
        open(folder / "hashes.bin", "wb") as hashes,
    ):

        def flush(batch: list[PlanRow]) -> None:
            nonlocal rows, end
            check(batch)
            encoded = [r.text.encode("utf-8", "surrogatepass") for r in batch]
            ids.write("".join(json.dumps(r.id, ensure_ascii=False) + "\n" for r in batch).encode())
            texts.write(b"".join(encoded))
            offsets = end + np.cumsum([len(e) for e in encoded], dtype=np.uint64)
            ends.write(offsets.tobytes())
            hashes.write(text_hashes(r.text for r in batch).tobytes())
            rows, end = rows + len(batch), int(offsets[-1])

        batch: list[PlanRow] = []
        for record in records:
            batch.append(record)
            if len(batch) == ROW_BLOCK:
                flush(batch)
                batch = []
        if batch:
            flush(batch)
    return _Spooled(folder, rows)


class _Partitions:
    """Rows split by their hash's leading bits: in memory for one partition, else in files."""

    def __init__(self, folder: Path, name: str, buckets: int, columns: tuple[np.dtype[Any], ...]) -> None:
        self.folder, self.name, self.buckets, self.columns = folder, name, buckets, columns
        self.bits = buckets.bit_length() - 1
        self._memory: list[list[np.ndarray[Any, Any]]] = [[] for _ in range(1 + len(columns))]

    def bucket_of(self, hashes: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        lead = hashes.view(np.uint8).reshape(-1, HASH_BYTES)[:, :2].astype(np.uint32)
        return ((lead[:, 0] << 8) | lead[:, 1]) >> (16 - self.bits)

    def _file(self, bucket: int, column: int) -> Path:
        return self.folder / f"{self.name}-{bucket}-{column}.bin"

    def add(self, hashes: np.ndarray[Any, Any], *columns: np.ndarray[Any, Any]) -> None:
        arrays = (hashes, *columns)
        if self.buckets == 1:
            for kept, array in zip(self._memory, arrays, strict=True):
                kept.append(np.asarray(array))
            return
        bucket = self.bucket_of(hashes)
        order = np.argsort(bucket, kind="stable")
        bounds = np.searchsorted(bucket[order], np.arange(self.buckets + 1))
        for b in np.flatnonzero(np.diff(bounds)):
            picked = order[bounds[b] : bounds[b + 1]]
            for column, array in enumerate(arrays):
                with open(self._file(int(b), column), "ab") as fh:
                    fh.write(np.ascontiguousarray(array[picked]).tobytes())

    def get(self, bucket: int) -> list[np.ndarray[Any, Any]]:
        dtypes = (_KEY, *self.columns)
        if self.buckets == 1:
            return [
                np.concatenate(kept) if kept else np.empty(0, d)
                for kept, d in zip(self._memory, dtypes, strict=True)
            ]
        out = []
        for column, dtype in enumerate(dtypes):
            path = self._file(bucket, column)
            out.append(np.fromfile(path, dtype=dtype) if path.exists() else np.empty(0, dtype))
            path.unlink(missing_ok=True)
        return out


@dataclass
class _Joined:
    first_of: np.ndarray[Any, Any]  # each corpus row's first occurrence (a row number)
    hit_shard: np.ndarray[Any, Any]  # per first occurrence: its shard's number in ``shards``, or -1
    hit_pos: np.ndarray[Any, Any]  # and its row in that shard
    distinct: int
    misses: int
    shards: list[Shard]


def _join(spooled: _Spooled, cache: VectorCache | None, folder: Path) -> _Joined:
    """Each row's first occurrence, and each first occurrence's cache entry, by hash partition."""
    n = spooled.rows
    buckets = 1
    while buckets * BUCKET_ROWS < n and buckets < MAX_BUCKETS:
        buckets *= 2
    corpus = _Partitions(folder, "c", buckets, (np.dtype(np.int64),))
    hashes = spooled.hashes()
    for start in range(0, n, ROW_BLOCK * 16):
        block = np.array(hashes[start : start + ROW_BLOCK * 16])
        corpus.add(block, np.arange(start, start + len(block), dtype=np.int64))
    cached = _Partitions(folder, "k", buckets, (np.dtype(np.int32), np.dtype(np.int64)))
    shards: list[Shard] = []
    for shard in cache.shards() if cache is not None else []:
        try:
            known = cache.hashes(shard) if cache is not None else None
        except CacheDamage:
            continue
        if known is None or not len(known):
            continue
        cached.add(known, np.full(len(known), len(shards), np.int32), np.arange(len(known), dtype=np.int64))
        shards.append(shard)

    def row_memmap(name: str, dtype: Any, fill: int | None = None) -> np.ndarray[Any, Any]:
        array = np.memmap(folder / name, dtype=dtype, mode="w+", shape=(max(1, n),))
        if fill is not None:
            array[:] = fill
        return array

    first_of = row_memmap("first.bin", np.int64)
    hit_shard = row_memmap("hit_shard.bin", np.int32, -1)
    hit_pos = row_memmap("hit_pos.bin", np.int64)
    distinct = misses = 0
    for bucket in range(buckets):
        keys, rows = corpus.get(bucket)
        if not len(keys):
            cached.get(bucket)
            continue
        order = np.argsort(keys, kind="stable")  # rows were added in order: the first comes first
        keys, rows = keys[order], rows[order]
        starts = np.ones(len(keys), dtype=bool)
        starts[1:] = keys[1:] != keys[:-1]
        firsts = rows[starts]
        first_of[rows] = firsts[np.cumsum(starts) - 1]
        distinct += len(firsts)
        known, shard_no, pos = cached.get(bucket)
        found = np.zeros(len(firsts), dtype=bool)
        if len(known):
            order = np.argsort(known, kind="stable")
            known, shard_no, pos = known[order], shard_no[order], pos[order]
            at = np.minimum(np.searchsorted(known, keys[starts]), len(known) - 1)
            found = known[at] == keys[starts]
            hit_shard[firsts[found]] = shard_no[at[found]]
            hit_pos[firsts[found]] = pos[at[found]]
        misses += int((~found).sum())
    return _Joined(first_of, hit_shard, hit_pos, distinct, misses, shards)


def _every_row(spooled: _Spooled, folder: Path) -> _Joined:
    """No join: every row is its own first occurrence, none is cached."""
    n = spooled.rows
    first_of = np.memmap(folder / "first.bin", dtype=np.int64, mode="w+", shape=(n,))
    first_of[:] = np.arange(n)
    hit_shard = np.memmap(folder / "hit_shard.bin", dtype=np.int32, mode="w+", shape=(n,))
    hit_shard[:] = -1
    return _Joined(first_of, hit_shard, np.zeros(n, dtype=np.int64), n, n, [])


class _CorpusReader:
    """The spooled ids and texts, read back in corpus order a block at a time."""

    def __init__(self, spooled: _Spooled) -> None:
        self.ends = spooled.ends()
        self._ids: IO[bytes] = open(spooled.path("ids.jsonl"), "rb")
        self._texts: IO[bytes] = open(spooled.path("texts.bin"), "rb")

    def block(self, start: int, stop: int) -> tuple[list[bytes], list[str]]:
        """(id lines as spooled, texts) of rows start..stop-1."""
        lines = [self._ids.readline() for _ in range(start, stop)]
        base = int(self.ends[start - 1]) if start else 0
        data = self._texts.read(int(self.ends[stop - 1]) - base)
        bounds = np.concatenate([[0], np.asarray(self.ends[start:stop], dtype=np.int64) - base])
        texts = [
            data[bounds[i] : bounds[i + 1]].decode("utf-8", "surrogatepass") for i in range(stop - start)
        ]
        return lines, texts

    def close(self) -> None:
        self._ids.close()
        self._texts.close()


@dataclass
class _Chunker:
    """Rows into chunk inputs of ``size``, numbered from ``index``."""

    layout: RunLayout
    size: int
    index: int
    buffer: list[tuple[str, str]]

    def add(self, rid: str, text: str) -> None:
        self.buffer.append((rid, text))
        if len(self.buffer) == self.size:
            self.flush()

    def flush(self) -> None:
        if self.buffer:
            write_chunk_input(self.layout, self.index, self.buffer)
            self.index, self.buffer = self.index + 1, []


def write_planned_inputs(
    records: Iterable[PlanRow],
    layout: RunLayout,
    chunk_size: int,
    cache: VectorCache | None,
    output_producer: dict[str, Any],
    check: Callable[[list[Any]], None],
    dedup: bool = True,
    row_map: bool = False,
) -> dict[str, Any]:
    """Split the corpus into chunk inputs by plan (see the module's docstring); the manifest's
    ``plan``. ``cache``: None looks nothing up (duplicates are still encoded once). ``check``: told
    each block of records (the duplicate-id check). ``output_producer``: what a chunk output of the
    run records of its producer (``RunManifest.producer()``). ``dedup``: False encodes every row
    (windows with --no-cache). ``row_map``: write the row map even where it is the identity (rows
    whose ids are window objects, which chunk inputs do not carry back)."""
    with local_scratch(layout.root) as where:
        folder = Path(tempfile.mkdtemp(prefix=".plan-", dir=where))
        try:
            spooled = _spool(records, folder, check)
            if not spooled.rows:
                return {"corpus_rows": 0}
            joined = _join(spooled, cache, folder) if dedup else _every_row(spooled, folder)
            return _write(layout, chunk_size, spooled, joined, cache, output_producer, folder, row_map)
        finally:
            remove_tree(folder)


def _write(
    layout: RunLayout,
    chunk_size: int,
    spooled: _Spooled,
    joined: _Joined,
    cache: VectorCache | None,
    output_producer: dict[str, Any],
    folder: Path,
    row_map: bool,
) -> dict[str, Any]:
    """Pass two, in corpus order: the chunk inputs, the row map, then the cached chunks' outputs."""
    n, encode_rows = spooled.rows, joined.misses
    chunk_row = np.memmap(folder / "chunk_row.bin", dtype=np.int64, mode="w+", shape=(n,))
    reader = _CorpusReader(spooled)
    encode = _Chunker(layout, chunk_size, 0, [])
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
        parts = [] if identity else _write_row_map(layout, chunk_row, spooled.path("ids.jsonl"), n)
        if not identity:
            _write_corpus_rows_per_chunk(layout, chunk_row, chunk_size, encode_rows, next_hit)
        cached = _write_cached_chunks(
            layout,
            chunk_size,
            encode.index,
            encode_rows,
            hits_path,
            _pairs(refs_path),
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


def _chunk_of_row(rows: np.ndarray[Any, Any], chunk_size: int, encode_rows: int) -> np.ndarray[Any, Any]:
    """The chunk that holds each chunk row: those to encode first, those from the cache after them."""
    after = -(-encode_rows // chunk_size) + (rows - encode_rows) // chunk_size
    return np.where(rows < encode_rows, rows // chunk_size, after)


def _write_corpus_rows_per_chunk(
    layout: RunLayout, chunk_row: np.ndarray[Any, Any], chunk_size: int, encode_rows: int, cached_rows: int
) -> None:
    """How many corpus rows each chunk gives the result (a duplicate text's rows all count to the
    chunk that holds it): what progress counts as a run's rows done."""
    chunks = -(-encode_rows // chunk_size) + -(-cached_rows // chunk_size)
    counts = np.zeros(chunks, dtype=np.int64)
    for start in range(0, len(chunk_row), ROW_BLOCK):
        block = np.asarray(chunk_row[start : start + ROW_BLOCK])
        counts += np.bincount(_chunk_of_row(block, chunk_size, encode_rows), minlength=chunks)
    save_npy_atomic(layout.plan_chunk_rows, counts)


def corpus_rows_per_chunk(layout: RunLayout, manifest: RunManifest) -> np.ndarray[Any, Any] | None:
    """Each chunk's corpus rows where they are not its own rows (duplicates, windows), else None."""
    if (manifest.plan or {}).get("identity", True):
        return None
    try:
        counts = np.asarray(load_npy(layout.plan_chunk_rows), dtype=np.int64)
    except (OSError, ValueError):  # a run planned before the count was kept: count it from the map
        counts = np.zeros(manifest.chunks, dtype=np.int64)
        for rows, _ in _row_map_parts(layout, manifest):
            counts += np.bincount(chunk_of(manifest, rows), minlength=manifest.chunks)
    return counts if counts.shape == (manifest.chunks,) else None


def corpus_rows_of(layout: RunLayout, manifest: RunManifest, chunks: Collection[int]) -> int:
    """The result rows ``chunks`` give: a run's rows (its corpus's, or its windows), counted the
    same by status, runs, the metrics and the summary of a finished run."""
    counts = corpus_rows_per_chunk(layout, manifest)
    if counts is None:
        return manifest.rows_of(chunks)
    return int(counts[sorted(chunks)].sum()) if chunks else 0


def _pairs(path: Path) -> np.ndarray[Any, Any]:
    """A file of int64 pairs, memory-mapped (16 bytes a hit, never all in memory)."""
    size = path.stat().st_size // 16
    return np.memmap(path, dtype=np.int64, mode="r", shape=(size, 2)) if size else np.empty((0, 2), np.int64)


def _write_row_map(
    layout: RunLayout, chunk_row: np.ndarray[Any, Any], spooled_ids: Path, n: int
) -> list[dict[str, Any]]:
    """plan/rows-<k>.npy (each corpus row's chunk row) and plan/ids-<k>.jsonl, PART_ROWS rows a file."""
    ids = open(spooled_ids, "rb")
    dtype = np.uint32 if n <= np.iinfo(np.uint32).max else np.uint64
    parts = []
    try:
        for part, start in enumerate(range(0, n, PART_ROWS)):
            stop = min(n, start + PART_ROWS)
            map_sha = save_npy_atomic(layout.plan_map(part), np.asarray(chunk_row[start:stop], dtype=dtype))
            data = b"".join(ids.readline() for _ in range(start, stop))
            atomic_write_bytes(layout.plan_ids(part), data)
            parts.append(
                {"rows": stop - start, "map_sha256": map_sha, "ids_sha256": hashlib.sha256(data).hexdigest()}
            )
    finally:
        ids.close()
    return parts


def _write_cached_chunks(
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
    chunker = _Chunker(layout, chunk_size, first_index, [])
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


def describe_savings(saved: dict[str, Any]) -> str:
    """One line: ``700 rows: 120 encoded, 500 from the vector cache, 80 repeating a text of the run``
    (each distinct text is encoded or read from the cache once, whatever its copies)."""
    return (
        f"{saved['rows']:,} rows: {saved['encoded']:,} encoded, {saved['from_cache']:,} from the vector "
        f"cache, {saved['deduplicated']:,} repeating another row's text (each text encoded or read once)"
    )


# --- assembly ------------------------------------------------------------------------------------


def chunk_of(manifest: RunManifest, rows: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """The chunk that holds each chunk row."""
    encode_rows = int((manifest.plan or {}).get("encode_rows", manifest.rows))
    return _chunk_of_row(rows, manifest.chunk_size, encode_rows)


def _row_map_parts(
    layout: RunLayout, manifest: RunManifest
) -> Iterator[tuple[np.ndarray[Any, Any], list[Any]]]:
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
        ids = [json.loads(line) for line in data.splitlines()]
        if len(ids) != len(rows) or len(rows) != described.get("rows"):
            raise BadInputError(
                f"{map_path}: {len(rows)} rows, {len(ids)} ids, the manifest says {described.get('rows')}"
            )
        if len(rows) and (rows.min() < 0 or rows.max() >= manifest.rows):
            raise BadInputError(f"{map_path}: a row outside the run's {manifest.rows} chunk rows")
        yield rows, [i if isinstance(i, dict) else str(i) for i in ids]


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
    return sum(int(np.isin(rows, bad).sum()) for rows, _ in _row_map_parts(layout, manifest))


def result_rows(
    layout: RunLayout,
    manifest: RunManifest,
    skip: set[int],
    dim: int,
    scratch: Path,
    bad: np.ndarray[Any, Any] | None = None,
) -> Iterator[tuple[list[Any], np.ndarray[Any, Any]]]:
    """(ids, float32 rows) of the result in corpus order, from the verified chunk outputs, rows of
    ``skip``'s chunks, and chunk rows in ``bad`` (no vector: --allow-missing), left out."""
    bad = np.zeros(0, dtype=np.int64) if bad is None else bad
    if (manifest.plan or {}).get("identity", True):
        for index in range(manifest.chunks):
            if index not in skip:
                ids, _ = read_chunk_input(layout, index)
                block = np.asarray(load_npy(layout.output_npy(index)))
                first = manifest.first_row(index)
                keep = ~np.isin(np.arange(first, first + len(ids)), bad)
                if not keep.all():
                    ids, block = [i for i, k in zip(ids, keep, strict=True) if k], block[keep]
                yield ids, block
        return
    # The distinct texts' vectors, gathered into one local file the row map picks from.
    vectors = np.memmap(
        scratch / "distinct.f32", dtype=np.float32, mode="w+", shape=(max(1, manifest.rows), dim)
    )
    have = np.zeros(manifest.rows, dtype=bool)
    for index in range(manifest.chunks):
        if index in skip:
            continue
        first, count = manifest.first_row(index), manifest.chunk_rows(index)
        vectors[first : first + count] = load_npy(layout.output_npy(index))
        have[first : first + count] = True
    have[bad] = False
    for rows, ids in _row_map_parts(layout, manifest):
        keep = have[rows]
        if not keep.all():
            ids = [i for i, k in zip(ids, keep, strict=True) if k]
            rows = rows[keep]
        yield ids, np.asarray(vectors[rows])
    del vectors
    (scratch / "distinct.f32").unlink(missing_ok=True)


def encoded_chunks(
    layout: RunLayout, manifest: RunManifest
) -> Iterator[tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], float]]:
    """(text hashes, float32 vectors, encode seconds) of each chunk a worker encoded (not read from
    the cache) with the libraries of the cache's key: what assembly adds to the cache."""
    libraries = (manifest.plan or {}).get("libraries")
    for index in range(manifest.chunks):
        meta = read_json(layout.output_meta(index))
        if meta.get("source") == "cache":
            continue
        if libraries and meta.get("libraries") != libraries:
            log.info(
                "run %s: chunk %d was encoded with %s, the cache's key says %s; not added to the cache",
                layout.run_id,
                index,
                meta.get("libraries"),
                libraries,
            )
            continue
        _, texts = read_chunk_input(layout, index)
        vectors = np.asarray(load_npy(layout.output_npy(index)), dtype=np.float32)
        hashes = text_hashes(texts)
        if meta.get("bad_rows"):  # rows without a vector (--allow-missing): zeros, never cached
            first = manifest.first_row(index)
            keep = ~np.isin(np.arange(first, first + len(texts)), [int(r["row"]) for r in meta["bad_rows"]])
            hashes, vectors = hashes[keep], vectors[keep]
        yield hashes, vectors, float(meta.get("seconds") or 0)
