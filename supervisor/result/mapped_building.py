"""The result written while the chunks land, for a run whose corpus rows are not its chunk rows
in order (``building.py`` for the rest): texts repeated in the corpus are encoded once, and texts the
vector cache held were written at submit into chunks after the others, so the row map
(``planned_rows``) says which chunk row each corpus row takes its vector from.

Each finished chunk, in whatever order, is read once and checked (``ChunkReads``) into a scratch
file of the distinct texts' vectors, beside the result being made; the result then advances through
the corpus rows in order, a block at a time, as far as every row of the block has its vector. For
the vector cache, each distinct text's hash is kept, so the result's parts can be its shards too
(a corpus row's hash beside its row, a text repeated in the corpus repeated there). A hostile
pass's worth of ways to stand aside are the same as ``Build``'s.
"""

from __future__ import annotations

import logging
import mmap
import time
from collections.abc import Collection, Iterator
from typing import Any

import numpy as np

from chunkq.jobs import kinds
from chunkq.jobs.compute.quantize import convert, derived_floats
from chunkq.jobs.compute.vector_cache import HASH_BYTES, text_hashes
from chunkq.jobs.contract.manifest import RunManifest
from chunkq.jobs.contract.run_files import RunLayout, new_memmap, read_chunk_input
from chunkq.jobs.contract.storage import is_local
from chunkq.supervisor.result.building import Build
from chunkq.supervisor.result.chunk_reads import ChunkReads, Unfit
from chunkq.supervisor.result.planned_rows import PartIds, row_map_parts, rows_at_a_time
from chunkq.supervisor.store.phases import BUILD, Phases

log = logging.getLogger(__name__)


class MappedBuild(Build):
    def __init__(self, layout: RunLayout, manifest: RunManifest, shard_bytes: int) -> None:
        super().__init__(layout, manifest, shard_bytes)
        # Chunks are read without the cache: it takes the result's parts at the end, with their hashes.
        self.reads = ChunkReads(layout, manifest, set(), {}, None)
        self.untaken = set(range(manifest.chunks))
        self.have = np.zeros(manifest.rows, dtype=bool)
        self.distinct: np.ndarray[Any, Any] | None = None
        self.hashes: np.ndarray[Any, Any] | None = None  # each distinct text's, beside its vector
        self.parts: Iterator[tuple[np.ndarray[Any, Any], PartIds]] = row_map_parts(layout, manifest)
        self.part: tuple[np.ndarray[Any, Any], PartIds] | None = None
        self.offset = 0  # the next corpus row of the current part
        self.corpus_done = 0
        self.libraries = (manifest.plan or {}).get("libraries")

    @property
    def complete(self) -> bool:
        return (
            not self.stood_aside and self.corpus_done == self.manifest.corpus_rows and self.writer is not None
        )

    def advance(self, pending: Collection[int], seconds: float = 0.25, phases: Phases | None = None) -> None:
        if self.stood_aside:
            return
        with (phases or Phases()).phase(BUILD):
            deadline = time.monotonic() + seconds
            try:
                for index in [i for i in sorted(self.untaken) if i not in pending]:
                    if not self._take_distinct(index):
                        return
                    self.untaken.discard(index)
                    if time.monotonic() > deadline:
                        return
                self._write_ready(deadline)
            finally:
                self._unmap_pages()

    def _unmap_pages(self) -> None:
        """Let go of the scratch's pages this look touched: they stay in the page cache (written
        back, the kernel's to evict), not in this process's memory. Mapped, every vector of the run
        counted in its resident set: 1.6 GiB at 10^6 rows of 256 dims against 0.7 at 10^5."""
        for scratch in (self.distinct, self.hashes):
            mapped = getattr(scratch, "_mmap", None)  # numpy's memmap keeps its mmap.mmap there
            if mapped is not None and hasattr(mmap, "MADV_DONTNEED"):
                mapped.madvise(mmap.MADV_DONTNEED)

    def _open(self, dim: int) -> None:
        super()._open(dim)
        rows = max(1, self.manifest.rows)
        self.distinct = new_memmap(self._scratch(), np.float32, (rows, self.dim))
        self.hashes = new_memmap(self._scratch(".hashes"), f"S{HASH_BYTES}", (rows,))

    def _take_distinct(self, index: int) -> bool:
        meta = self._meta_to_take(index)
        if meta is None:
            return False
        if self.distinct is None or self.hashes is None:
            return self._stand_aside(f"chunk {index} has dimension {meta['dim']}, the first {self.dim}")
        _, texts = read_chunk_input(self.layout, index)
        try:
            block = self.reads.rows(index, texts)
        except Unfit:
            return self._stand_aside(self.reads.listed()[0] if self.reads.listed() else f"chunk {index}")
        first = self.manifest.first_row(index)
        if len(block) != len(texts) or first + len(texts) > self.manifest.rows:
            return self._stand_aside(f"chunk {index}: {len(texts)} texts and {len(block)} rows")
        self.distinct[first : first + len(texts)] = block
        self.have[first : first + len(texts)] = True
        self.hashes[first : first + len(texts)] = text_hashes(texts)
        self._unmap_pages()  # a look may take many chunks: their pages go one chunk at a time
        if self.libraries and meta.get("libraries") != self.libraries and meta.get("source") != "cache":
            self.feed = None  # rows of other releases: the cache's key would not be theirs
        return True

    def _scratch(self, name: str = ".distinct.f32") -> Any:
        """Inside the result being made (a killed supervisor's goes with its leftovers), deleted
        before the result is published."""
        return (self.built or self.layout.result) / name

    def _write_ready(self, deadline: float) -> None:
        """The result's next corpus rows, a block at a time, while their vectors are all there."""
        while self.writer is not None and self.distinct is not None:
            if self.part is None or self.offset >= len(self.part[0]):
                self.part, self.offset = next(self.parts, None), 0
                if self.part is None:
                    return
            rows, ids = self.part
            block = rows[self.offset : self.offset + rows_at_a_time(self.dim)]
            if not self.have[block].all():
                return
            floats = derived_floats(np.asarray(self.distinct[block]), self.manifest.options)
            stored = convert(floats, self.manifest.output_dtype, self.manifest.ranges)
            self.writer.write(ids[self.offset : self.offset + len(block)], stored)
            self._unmap_pages()
            self.offset += len(block)
            self.corpus_done += len(block)
            if time.monotonic() > deadline:
                return

    def ready_for_assembly(self) -> None:
        """The scratch of distinct vectors goes; the cache is handed the result's hashes."""
        if self.feed is not None and self.feed.linking and self.corpus_done and self.hashes is not None:
            # each corpus row's, in the result's order (the row map read again: kept whole while the
            # chunks landed, they cost 16 bytes a row the whole run)
            for rows, _ in row_map_parts(self.layout, self.manifest):
                self.feed.spool_hashes(self.hashes[rows])
                self._unmap_pages()
            self.reads.cache = self.feed
        self._drop_scratch()

    def _drop_scratch(self) -> None:
        if self.distinct is not None:
            del self.distinct
            self.distinct = None
            self._scratch().unlink(missing_ok=True)
        if self.hashes is not None:
            del self.hashes
            self.hashes = None
            self._scratch(".hashes").unlink(missing_ok=True)

    def abandon(self) -> None:
        self._drop_scratch()
        super().abandon()


def start_build(layout: RunLayout, manifest: RunManifest, shard_bytes: int) -> Build | None:
    """A build for this run: in chunk order (``building.py``), or by the row map where its corpus
    rows are not its chunk rows in order; None where neither applies. Here, beside both."""
    plan = manifest.plan
    if kinds.get(manifest.kind).ragged or not is_local(layout.root) or manifest.chunks == 0:
        return None
    if plan is not None and plan.get("windows"):
        return None  # a row per window, and a vector per text beside them: assembly's
    if plan is not None and not plan.get("identity", True):
        return MappedBuild(layout, manifest, shard_bytes)
    if manifest.corpus_rows != manifest.rows:
        return None
    return Build(layout, manifest, shard_bytes)
