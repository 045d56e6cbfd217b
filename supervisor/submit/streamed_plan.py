"""The run's plan made in one pass over the corpus, each chunk of texts to encode written (and handed
to ``written``, which queues it) as soon as it is full, so workers start on the first chunk while
the rest of the corpus is still read (issue 64.2: at 200,000 rows the split took 13 s before any
worker had a chunk).

It makes the plan ``plan.py`` makes (the texts the cache lacks first, in order of first occurrence,
then those it holds; a row map where a row is not its own chunk row; tests/supervisor/test_streamed_submit.py
holds the two to the same bytes), with the run's distinct texts and the cache's hashes held in
memory (``hash_index.py``: about 48 bytes a text), which the two-pass plan partitions on disk
instead. The cache's are held where they are at most ``STREAM_MAX_CACHE_ROWS``; past that the
run takes the two-pass plan.
"""

from __future__ import annotations

import json
import logging
import tempfile
from collections.abc import Callable, Iterable, Iterator
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np

from chunkq.jobs.compute.vector_cache import CacheDamage, Shard, VectorCache, text_hashes
from chunkq.jobs.contract.run_files import RunLayout, json_string
from chunkq.jobs.contract.storage import local_scratch, remove_tree
from chunkq.supervisor.submit.hash_index import MISSING, HashIndex
from chunkq.supervisor.submit.hash_join import ROW_BLOCK, PlanRow
from chunkq.supervisor.submit.plan import (
    PART_ROWS,
    Chunker,
    pairs_file,
    write_cached_chunks,
    write_corpus_rows_per_chunk,
    write_row_map,
)

log = logging.getLogger(__name__)

STREAM_MAX_CACHE_ROWS = 1 << 22  # the cache's texts under the run's producer, held in memory
# corpus rows read at a time at most: a row read is ~340 bytes of Python objects, and 2^16 of them were
# a sixth of the supervisor at the end of a 10^6-row split
READ_BLOCK_ROWS = 1 << 15


POSITION_BITS = 40  # a cached text's number: its shard << 40 | its row in the shard


def cache_index(cache: VectorCache | None, scratch: Path) -> tuple[HashIndex, list[Shard]] | None:
    """Each cached text's hash to its shard and row, and the shards; None where they are too many to
    hold (the two-pass plan then). A damaged shard is set aside and its texts are encoded.
    ``scratch``: a local folder for the index's records."""
    if cache is None:
        return HashIndex(folder=scratch), []
    shards = cache.shards()
    if sum(s.rows for s in shards) > STREAM_MAX_CACHE_ROWS:
        return None
    index, kept = HashIndex(folder=scratch), list[Shard]()
    for shard in shards:
        try:
            hashes = cache.hashes(shard)
        except CacheDamage:
            continue
        keys, first = np.unique(hashes, return_index=True)  # a text a shard holds twice: its first row
        fresh = index.get(keys) == MISSING  # one an earlier shard holds: that shard's
        index.put(keys[fresh], (len(kept) << POSITION_BITS) | first[fresh].astype(np.int64))
        kept.append(shard)
    return index, kept


def write_streamed_inputs(
    records: Iterable[PlanRow],
    layout: RunLayout,
    chunk_size: int,
    cache: VectorCache | None,
    found: tuple[HashIndex, list[Shard]],
    output_producer: dict[str, Any],
    written: Callable[[int, int], None],
) -> dict[str, Any]:
    """The plan in one pass (see the module's docstring); the manifest's ``plan``."""
    index, shards = found
    with local_scratch(layout.root) as where:
        folder = Path(tempfile.mkdtemp(prefix=".plan-", dir=where))
        try:
            return _write(records, layout, chunk_size, cache, index, shards, output_producer, written, folder)
        finally:
            remove_tree(folder)


def _blocks(records: Iterable[PlanRow], first: int) -> Iterator[list[PlanRow]]:
    """``first`` rows (a chunk: the first worker's work comes before the rest is read), then blocks
    growing to READ_BLOCK_ROWS (each costs a round of hashing)."""
    it, size = iter(records), first
    while True:
        block = list(islice(it, size))
        if not block:
            return
        yield block
        del block  # the next block is read without this one: two alive at once held ~50 MB at 10^6
        size = min(READ_BLOCK_ROWS, 2 * size)


def _number_cached(chunk_row: np.ndarray[Any, Any], misses: int) -> bool:
    """Give the cache's texts their chunk rows (they follow the others), a block at a time; whether
    every row is its own chunk row."""
    identity = True
    for start in range(0, len(chunk_row), ROW_BLOCK):
        block = chunk_row[start : start + ROW_BLOCK]
        from_cache = block < 0
        block[from_cache] = misses + (-block[from_cache] - 1)
        identity = identity and bool(np.array_equal(block, np.arange(start, start + len(block))))
    return identity


def _write(
    records: Iterable[PlanRow],
    layout: RunLayout,
    chunk_size: int,
    cache: VectorCache | None,
    cached: HashIndex,
    shards: list[Shard],
    output_producer: dict[str, Any],
    written: Callable[[int, int], None],
    folder: Path,
) -> dict[str, Any]:
    encode = Chunker(layout, chunk_size, 0, [], written)
    seen = HashIndex(folder=folder)  # a distinct text's chunk row; a cached one's as -(its hit number + 1)
    rows = misses = hits = 0
    paths = {name: folder / name for name in ("ids.jsonl", "chunk_row.bin", "hits.jsonl", "hits.refs")}
    with (
        open(paths["ids.jsonl"], "wb") as ids,
        open(paths["chunk_row.bin"], "wb") as chunk_rows,
        open(paths["hits.jsonl"], "wb") as hit_rows,
        open(paths["hits.refs"], "wb") as refs,
    ):
        for block in _blocks(records, chunk_size):
            keys, first, inverse = np.unique(
                text_hashes(r.text for r in block), return_index=True, return_inverse=True
            )
            numbers = seen.get(keys)
            new = np.flatnonzero(numbers == MISSING)
            new = new[np.argsort(first[new], kind="stable")]  # in order of first occurrence
            where = cached.get(keys[new])
            hit, miss = new[where != MISSING], new[where == MISSING]
            numbers[miss] = misses + np.arange(len(miss))
            numbers[hit] = -(hits + 1 + np.arange(len(hit)))
            seen.put(keys[new], numbers[new])
            for row in first[miss]:
                encode.add(block[row].id, block[row].text)
            if len(hit):
                found = where[where != MISSING]
                pairs = np.stack([found >> POSITION_BITS, found & ((1 << POSITION_BITS) - 1)], axis=1)
                refs.write(pairs.astype(np.int64).tobytes())
                hit_rows.write(
                    b"".join(
                        json.dumps({"id": block[row].id, "text": block[row].text}).encode() + b"\n"
                        for row in first[hit]
                    )
                )
            misses, hits = misses + len(miss), hits + len(hit)
            ids.write("".join(json_string(r.id) + "\n" for r in block).encode())
            chunk_rows.write(numbers[inverse.reshape(-1)].astype(np.int64).tobytes())
            rows += len(block)
            del block  # before the next one is read (see _blocks)
        encode.flush()
    seen.close()  # the split's largest part (~25 MB at 10^6 distinct texts): not kept for what follows
    del seen
    if not rows:
        return {"corpus_rows": 0}
    chunk_row = np.memmap(paths["chunk_row.bin"], dtype=np.int64, mode="r+", shape=(rows,))
    identity = _number_cached(chunk_row, misses)
    parts = [] if identity else write_row_map(layout, chunk_row, paths["ids.jsonl"], rows)
    if not identity:
        write_corpus_rows_per_chunk(layout, chunk_row, chunk_size, misses, hits)
    del chunk_row
    read = write_cached_chunks(
        layout,
        chunk_size,
        encode.index,
        misses,
        paths["hits.jsonl"],
        pairs_file(paths["hits.refs"]),
        shards,
        cache,
        output_producer,
    )
    return {
        "corpus_rows": rows,
        "distinct_rows": misses + hits,
        "encode_rows": misses,
        "cached_rows": hits,
        "duplicate_rows": rows - misses - hits,
        "cache_damaged_rows": read["damaged"],
        "cache_shards_read": read["shards"],
        "cache_seconds_saved": round(read["seconds"], 3),
        "identity": identity,
        "part_rows": PART_ROWS,
        "parts": parts,
        "streamed": True,
    }
