"""The result written while the run's chunks land, so that after the last chunk only its own rows
and a check are left (issue 64.3: assembly read and wrote every row after the last chunk, 20 s at
10^6 rows).

The supervisor owns a ``Build`` from the start of its watch. After each look it takes the finished
chunks in chunk order, as far as they go without a gap: each output read once and checked against
its checksum (``ChunkReads``, as assembly reads it), its rows appended to the result being made
(``ResultWriter``), its texts hashed for the vector cache. When every chunk is done, ``assemble``
finishes the build instead of writing the result again. A build is for the common case, and says
so when it does not apply (``start`` returns None): a dense run on a filesystem store whose result
rows are its chunk rows in order (no plan, or a plan that maps every corpus row to its own chunk
row: no duplicate, no hit from the cache). What stops it on the way (an output found damaged, rows
left out under --allow-missing, another dimension) makes it stand aside, and assembly does the whole
work as before, naming every problem. A killed supervisor leaves a folder beside the result that
the next assembly removes; the next build starts again from the first chunk.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any

from chunkq.jobs.compute.quantize import convert, derived_floats, stored_columns
from chunkq.jobs.compute.vector_cache import BLOCK_ROWS
from chunkq.jobs.contract.chunk_output import output_meta
from chunkq.jobs.contract.manifest import RunManifest
from chunkq.jobs.contract.run_files import RunLayout, read_chunk_input
from chunkq.jobs.contract.specs import storage_dtype
from chunkq.jobs.contract.storage import remove_leftovers_beside, temp_beside
from chunkq.supervisor.result.chunk_reads import CacheFeed, ChunkReads, Unfit
from chunkq.supervisor.result.writer import ResultWriter, local_build_dir
from chunkq.supervisor.store.phases import BUILD, Phases

log = logging.getLogger(__name__)

LOOK_SECONDS = 0.25  # what one look of the watch spends on the build at most: it still acts on failures


class Build:
    """A whole result being written in chunk order (see the module's docstring)."""

    def __init__(self, layout: RunLayout, manifest: RunManifest, shard_bytes: int) -> None:
        self.layout, self.manifest, self.shard_bytes = layout, manifest, shard_bytes
        self.next = 0  # the first chunk not yet in the result
        self.writer: ResultWriter | None = None
        self.built: Path | None = None
        self.feed = CacheFeed.of(layout, manifest, partial=False)  # the cache's share of the work
        self.reads = ChunkReads(layout, manifest, set(), {}, self.feed)
        self.stood_aside = ""  # why it stopped, once it did

    def ready_for_assembly(self) -> None:
        """Before assembly finishes the build: what it needs handed over (nothing, here)."""

    @property
    def complete(self) -> bool:
        return not self.stood_aside and self.next == self.manifest.chunks and self.writer is not None

    def advance(
        self, pending: Collection[int], seconds: float = LOOK_SECONDS, phases: Phases | None = None
    ) -> None:
        """Take the done chunks (not in ``pending``) from the next one on, for ``seconds`` at most."""
        if self.stood_aside or self.next >= self.manifest.chunks or self.next in pending:
            return
        with (phases or Phases()).phase(BUILD):
            deadline = time.monotonic() + seconds
            while self.next < self.manifest.chunks and self.next not in pending:
                if not self._take(self.next):
                    return
                self.next += 1
                if time.monotonic() > deadline:
                    return

    def _meta_to_take(self, index: int) -> dict[str, Any] | None:
        """A finished chunk's record, checked as the build needs it (the result opened on the first),
        or None once the build stood aside for it."""
        meta, why = output_meta(self.layout, index, self.manifest.producer())
        if meta is None:
            self._stand_aside(f"chunk {index}: {why}")
            return None
        if meta.get("bad_rows"):
            self._stand_aside(f"chunk {index} left rows out (--allow-missing)")
            return None
        if self.writer is None:
            self._open(int(meta["dim"]))
        if int(meta["dim"]) != self.dim:
            self._stand_aside(f"chunk {index} has dimension {meta['dim']}, the first {self.dim}")
            return None
        return meta

    def _take(self, index: int) -> bool:
        meta = self._meta_to_take(index)
        if meta is None:
            return False
        ids, texts = read_chunk_input(self.layout, index)
        try:
            block = self.reads.rows(index, texts)
        except Unfit:
            return self._stand_aside(self.reads.listed()[0] if self.reads.listed() else f"chunk {index}")
        if self.manifest.plan is not None:  # full float32 vectors: the result's are derived from them
            block = convert(
                derived_floats(block, self.manifest.options), self.manifest.output_dtype, self.manifest.ranges
            )
        if len(ids) != len(block) or self.writer is None:
            return self._stand_aside(f"chunk {index}: {len(ids)} ids and {len(block)} rows")
        self.writer.write(ids, block)
        return True

    def _open(self, dim: int) -> None:
        manifest = self.manifest
        self.dim = dim
        columns = dim
        if manifest.plan is not None:
            columns = stored_columns(int(manifest.options.get("truncate_dim") or dim), manifest.output_dtype)
        dtype = storage_dtype(manifest.output_dtype)
        self.built = local_build_dir(self.layout)
        # The cache may take the result's parts as shards of its own when they are its float32 rows.
        linkable = self.feed is not None and dtype.str == "<f4" and columns == dim
        rows = manifest.corpus_rows  # the result's: a corpus row each
        block_rows = BLOCK_ROWS if linkable else 0
        self.writer = ResultWriter(self.built, rows, columns, dtype, self.shard_bytes, block_rows=block_rows)
        if self.feed is not None and linkable:
            # beside the result, not in it (renamed into place); a killed supervisor's goes here
            spool = self.layout.result.with_name("cache-hashes")
            remove_leftovers_beside(spool)
            self.feed.link_later(temp_beside(spool))

    def take_set_aside(self) -> list[int]:
        """The chunks whose outputs the build found damaged and set aside since the last call."""
        taken = sorted(self.reads.problems)
        self.reads.problems.clear()
        return taken

    def _stand_aside(self, why: str) -> bool:
        self.stood_aside = why
        log.info("run %s: the result is made after the last chunk instead (%s)", self.manifest.run_id, why)
        self.abandon()
        return False

    def abandon(self) -> None:
        import shutil

        if self.writer is not None:
            self.writer.abort()
        if self.feed is not None and self.feed.spool is not None:
            self.feed.spool.unlink(missing_ok=True)
        if self.built is not None:
            shutil.rmtree(self.built, ignore_errors=True)
        self.writer = self.built = None
