"""The vector cache's join, by hash partition: a corpus spooled once to local scratch (ids, texts,
each text's 16-byte hash, in corpus order), then matched with the cache's hashes partition by
partition (a hash's leading bits choose it; at most BUCKET_ROWS corpus rows each, sorted and matched
in memory). It gives every row its first occurrence and every first occurrence its cache entry,
if any. ``submit/plan.py`` chooses and writes the chunks from it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol

import numpy as np

from chunkq.jobs.compute.vector_cache import HASH_BYTES, CacheDamage, Shard, VectorCache, text_hashes
from chunkq.jobs.contract.run_files import new_memmap

BUCKET_ROWS = 1 << 22  # corpus rows a partition of the join holds at most: about 100 MB sorted in memory
MAX_BUCKETS = 1 << 16  # the partition is chosen by a hash's first 16 bits
ROW_BLOCK = 1 << 16  # rows read, hashed and written at a time
_KEY = np.dtype(f"S{HASH_BYTES}")


class PlanRow(Protocol):
    """A row the plan takes: a corpus record, or a window of one (its id then a JSON object)."""

    @property
    def id(self) -> Any: ...

    @property
    def text(self) -> str: ...


@dataclass(frozen=True)
class Spooled:
    folder: Path
    rows: int

    def path(self, name: str) -> Path:
        return self.folder / name

    def hashes(self) -> np.ndarray[Any, Any]:
        return np.memmap(self.path("hashes.bin"), dtype=_KEY, mode="r", shape=(self.rows,))

    def ends(self) -> np.ndarray[Any, Any]:
        return np.memmap(self.path("ends.bin"), dtype=np.uint64, mode="r", shape=(self.rows,))


def spool(records: Iterable[PlanRow], folder: Path) -> Spooled:
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
    return Spooled(folder, rows)


class Partitions:
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
class Joined:
    first_of: np.ndarray[Any, Any]  # each corpus row's first occurrence (a row number)
    hit_shard: np.ndarray[Any, Any]  # per first occurrence: its shard's number in ``shards``, or -1
    hit_pos: np.ndarray[Any, Any]  # and its row in that shard
    distinct: int
    misses: int
    shards: list[Shard]


def join(spooled: Spooled, cache: VectorCache | None, folder: Path) -> Joined:
    """Each row's first occurrence, and each first occurrence's cache entry, by hash partition."""
    n = spooled.rows
    buckets = 1
    while buckets * BUCKET_ROWS < n and buckets < MAX_BUCKETS:
        buckets *= 2
    corpus = Partitions(folder, "c", buckets, (np.dtype(np.int64),))
    hashes = spooled.hashes()
    for start in range(0, n, ROW_BLOCK * 16):
        block = np.array(hashes[start : start + ROW_BLOCK * 16])
        corpus.add(block, np.arange(start, start + len(block), dtype=np.int64))
    cached = Partitions(folder, "k", buckets, (np.dtype(np.int32), np.dtype(np.int64)))
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
        array = new_memmap(folder / name, dtype, (max(1, n),))
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
    return Joined(first_of, hit_shard, hit_pos, distinct, misses, shards)


def every_row(spooled: Spooled, folder: Path) -> Joined:
    """No join: every row is its own first occurrence, none is cached."""
    n = spooled.rows
    first_of = new_memmap(folder / "first.bin", np.int64, (n,))
    first_of[:] = np.arange(n)
    hit_shard = new_memmap(folder / "hit_shard.bin", np.int32, (n,))
    hit_shard[:] = -1
    return Joined(first_of, hit_shard, np.zeros(n, dtype=np.int64), n, n, [])


class CorpusReader:
    """The spooled ids and texts, read back in corpus order a block at a time."""

    def __init__(self, spooled: Spooled) -> None:
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
