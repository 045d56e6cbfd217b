"""Assembly's one read of each chunk output: the arrays are read and checked from the same bytes
(``jobs.contract.chunk_output``) as the result is written from them, and the vectors the run's
workers encoded go to the vector cache on the way, not in a pass of their own.

A damaged output is set aside (the next run encodes it again) and listed; it ends the writing, and
the outputs not read yet are still checked, so one assembly names every problem. The result being
built is then abandoned; vectors already given to the cache were checked and stay (derived data).
"""

from __future__ import annotations

import logging
import tempfile
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from chunkq.jobs.compute.vector_cache import HASH_BYTES, VectorCache, block_digests, producer, text_hashes
from chunkq.jobs.contract.chunk_output import ROWS, output_arrays, output_meta
from chunkq.jobs.contract.manifest import RunManifest
from chunkq.jobs.contract.ragged import SCHEMAS
from chunkq.jobs.contract.run_files import RunLayout, read_chunk_input
from chunkq.jobs.contract.specs import EncodeOptions
from chunkq.jobs.contract.storage import is_local, publish_file

log = logging.getLogger(__name__)

CACHE_WRITE_ROWS = 1 << 18  # encoded rows gathered before they are written to the cache as a shard


class Unfit(Exception):
    """A chunk output failed its check: the result being written is abandoned."""


@dataclass
class CacheFeed:
    """The vectors the run's workers encoded (not those read from the cache at submit), added to the
    store's cache a shard of CACHE_WRITE_ROWS at a time; a failure is said and costs a later run's
    time only."""

    manifest: RunManifest
    cache: VectorCache
    hashes: list[np.ndarray[Any, Any]] = field(default_factory=list)
    vectors: list[np.ndarray[Any, Any]] = field(default_factory=list)
    seconds: float = 0.0
    written: int = 0
    broken: bool = False
    spent: tuple[float, float] = (0.0, 0.0)  # wall and CPU seconds spent here (supervisor/store/phases.py)
    # The result's own parts become the cache's shards (``link_result``): only their hashes are kept,
    # in a file beside the result being made (16 bytes a row held for the whole watch, in memory).
    spool: Path | None = None
    spooled: int = 0  # rows whose hashes the spool holds

    @property
    def linking(self) -> bool:
        return self.spool is not None

    @classmethod
    def of(cls, layout: RunLayout, manifest: RunManifest, partial: bool) -> CacheFeed | None:
        """The run's feed, or None: no cache asked for, or a partial result (its chunks are re-run)."""
        plan = manifest.plan or {}
        if not plan.get("producer") or partial:
            return None
        cache = VectorCache(layout.store, str(plan["producer"]))
        try:
            if plan.get("model_identity"):
                options = EncodeOptions.from_dict(manifest.options)
                cache.describe(producer(manifest.model, str(plan["model_identity"]), options))
        except (OSError, ValueError) as exc:
            log.warning("run %s: the vector cache was not updated: %s", manifest.run_id, exc)
            return None
        return cls(manifest, cache)

    def add(
        self,
        index: int,
        meta: dict[str, Any],
        vectors: np.ndarray[Any, Any],
        texts: list[str],
        source: Path | None = None,
    ) -> None:
        """Chunk ``index``'s vectors, if a worker encoded them with the libraries of the cache's key
        (``source``: the checked file they were read from). The hashes are of the texts the worker
        was given, never a record that could disagree."""
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            self._add(index, meta, vectors, texts, source)
        finally:
            self._spent(wall, cpu)

    def _break(self) -> None:
        """Nothing of the run joins the cache: what its finished chunks served goes too."""
        self.broken = True
        if self.linking:
            try:
                self.cache.forget_early(self.manifest.run_id)
            except OSError as exc:
                log.warning(
                    "run %s: the vector cache keeps its finished chunks: %s", self.manifest.run_id, exc
                )

    def _serve_now(self, hashes: np.ndarray[Any, Any], vectors: np.ndarray[Any, Any], source: Path) -> None:
        """A finished, checked chunk serves the cache at once (issue 65.4: a run submitted beside a
        long one that held its texts got none of them until it published): its output file, linked
        as a shard until the run's result takes its place (``link_result``)."""
        try:
            dim, blocks = int(vectors.shape[1]), block_digests(vectors)
            self.cache.link_shard(
                hashes, source, dim, blocks, self.manifest.run_id, 0.0, until_published=True
            )
        except (OSError, ValueError) as exc:
            log.info("run %s: a finished chunk does not serve the cache yet: %s", self.manifest.run_id, exc)

    def _spent(self, wall: float, cpu: float) -> None:
        self.spent = (self.spent[0] + time.perf_counter() - wall, self.spent[1] + time.process_time() - cpu)

    def link_later(self, spool: Path) -> None:
        """Keep the hashes only, in ``spool``: the result's float32 parts are linked in as shards
        once published."""
        spool.write_bytes(b"")
        self.spool, self.spooled = spool, 0

    def spool_hashes(self, hashes: np.ndarray[Any, Any]) -> None:
        """The next rows' hashes, in the result's order."""
        if self.spool is None or self.broken:
            return
        try:
            with open(self.spool, "ab") as out:
                out.write(np.ascontiguousarray(hashes, dtype=f"S{HASH_BYTES}").tobytes())
        except OSError as exc:  # a full disk: the run's own writes say so, naming their files
            log.warning(
                "run %s: the vector cache was not updated: %s (%s)", self.manifest.run_id, exc, self.spool
            )
            self._break()
            return
        self.spooled += len(hashes)

    def _add(
        self,
        index: int,
        meta: dict[str, Any],
        vectors: np.ndarray[Any, Any],
        texts: list[str],
        source: Path | None,
    ) -> None:
        libraries = (self.manifest.plan or {}).get("libraries")
        as_written = vectors.dtype == np.dtype("<f4") and vectors.ndim == 2  # the file is the shard's
        if self.broken:
            return
        if meta.get("code_read_late"):  # the identity the cache keys does not cover that code
            log.warning(
                "run %s: chunk %d's encode read %s, which the model's load did not: nothing of the run "
                "is added to the vector cache (docs/cache.md)",
                self.manifest.run_id,
                index,
                ", ".join(map(str, meta["code_read_late"][:3])),
            )
            self._break()
            return
        if self.linking and (
            meta.get("source") == "cache"
            or meta.get("bad_rows")
            or (libraries and meta.get("libraries") != libraries)
        ):
            # A part of the result is linked whole, or not at all: this run adds nothing.
            log.info(
                "run %s: chunk %d cannot join the vector cache; nothing of the run is added",
                self.manifest.run_id,
                index,
            )
            self._break()
            return
        if meta.get("source") == "cache":
            return
        if libraries and meta.get("libraries") != libraries:
            log.info(
                "run %s: chunk %d was encoded with %s, the cache's key says %s; not added to the cache",
                self.manifest.run_id,
                index,
                meta.get("libraries"),
                libraries,
            )
            return
        hashes = text_hashes(texts)
        vectors = np.asarray(vectors, dtype=np.float32)
        if meta.get("bad_rows"):  # rows without a vector (--allow-missing): zeros, never cached
            first = self.manifest.first_row(index)
            left_out = [int(r["row"]) for r in meta["bad_rows"]]
            keep = ~np.isin(np.arange(first, first + len(texts)), left_out)
            hashes, vectors = hashes[keep], vectors[keep]
        self.seconds += float(meta.get("seconds") or 0)
        if self.linking:
            self.spool_hashes(hashes)
            if source is not None and as_written and not meta.get("bad_rows"):
                self._serve_now(hashes, vectors, source)
            return
        self.hashes.append(hashes)
        self.vectors.append(vectors)
        if sum(len(h) for h in self.hashes) >= CACHE_WRITE_ROWS:
            self.flush()

    def link_result(self, parts: list[tuple[Path, int, list[str]]], dim: int) -> None:
        """Each published part of the result (its float32 ``.npy``, rows and block checksums), in
        order, added as a shard under a second name (``VectorCache.link_shard``)."""
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            if self.broken or self.spool is None or not self.spooled:
                return
            total, offset = sum(rows for _, rows, _ in parts), 0
            if total != self.spooled:
                raise ValueError(f"{self.spooled} hashes for {total} rows")
            for path, rows, blocks in parts:
                share = self.seconds * rows / max(1, total)
                # mapped a part at a time: the run's hashes are never all in memory
                hashes = np.memmap(self.spool, f"S{HASH_BYTES}", "r", offset * HASH_BYTES, (rows,))
                self.cache.link_shard(hashes, path, dim, blocks, self.manifest.run_id, share)
                del hashes
                offset += rows
            self.written = offset
            self.cache.forget_early(self.manifest.run_id)  # its finished chunks served until now
            log.info(
                "run %s: its %d vectors are the vector cache's too (one copy)", self.manifest.run_id, offset
            )
        except (OSError, ValueError) as exc:
            log.warning("run %s: the vector cache was not updated: %s", self.manifest.run_id, exc)
        finally:
            if self.spool is not None:
                self.spool.unlink(missing_ok=True)
            self.spooled, self.seconds = 0, 0.0
            self._spent(wall, cpu)

    def flush(self) -> None:
        if self.linking:
            return  # linked once the result is published (link_result)
        if self.hashes and not self.broken:
            try:
                hashes, vectors = np.concatenate(self.hashes), np.concatenate(self.vectors)
                self.cache.write(hashes, vectors, self.manifest.run_id, self.seconds)
                self.written += sum(len(h) for h in self.hashes)
            except (OSError, ValueError) as exc:
                self.broken = True
                log.warning("run %s: the vector cache was not updated: %s", self.manifest.run_id, exc)
        self.hashes, self.vectors, self.seconds = [], [], 0.0

    def close(self) -> None:
        wall, cpu = time.perf_counter(), time.process_time()
        self.flush()
        self._spent(wall, cpu)
        if self.written:
            run, written = self.manifest.run_id, self.written
            log.info("run %s: %d encoded vectors added to the vector cache", run, written)


@dataclass
class ChunkReads:
    """Each chunk output's arrays, read once when the result asks for them (see the module)."""

    layout: RunLayout
    manifest: RunManifest
    skip: set[int]  # left out (--allow-partial), or already found wrong by their metadata
    problems: dict[int, str]  # by chunk: what is wrong with its output (set aside)
    cache: CacheFeed | None = None
    done: set[int] = field(default_factory=set)
    others: list[str] = field(default_factory=list)  # what is wrong with the run beyond one chunk

    def listed(self) -> list[str]:
        """Every problem, the chunks' in chunk order."""
        return [self.problems[i] for i in sorted(self.problems)] + self.others

    def rows(self, index: int, texts: list[str] | None = None) -> np.ndarray[Any, Any]:
        """A dense chunk's rows; ``texts``: its input's, where the caller read them (else the cache
        reads them itself)."""
        return self.arrays(index, texts)[ROWS]

    def arrays(self, index: int, texts: list[str] | None = None) -> dict[str, np.ndarray[Any, Any]]:
        """A chunk's arrays by name (``rows``, or a ragged output's); Unfit when this one or one
        before it is wrong."""
        self.done.add(index)
        run = self.manifest
        meta, why = output_meta(self.layout, index, run.producer())
        arrays = None
        if meta is not None:
            arrays, why = output_arrays(self.layout, index, meta, run.chunk_rows(index), run.producer())
        if meta is None or arrays is None:
            self.problems[index] = set_aside_because(self.layout, run, index, why)
            raise Unfit
        if self.problems or self.others:
            raise Unfit  # checked, and nothing more is written
        if self.cache is not None and ROWS in arrays:
            if texts is None:
                texts = read_chunk_input(self.layout, index)[1]
            self.cache.add(index, meta, arrays[ROWS], texts, self.layout.output_npy(index))
        return arrays

    def check_the_rest(self) -> None:
        """Check every output the writing did not reach (after a problem), so all are listed."""
        for index in range(self.manifest.chunks):
            if index not in self.skip and index not in self.done:
                try:
                    self.arrays(index)
                except Unfit:
                    pass


def set_aside_because(layout: RunLayout, manifest: RunManifest, index: int, why: str) -> str:
    aside = set_aside(layout, index)
    again = f"; moved to {aside}, the next run encodes it again" if aside else ""
    return f"{manifest.chunk_label(index)}: {why}{again}"


def set_aside(layout: RunLayout, index: int) -> str:
    """Move a chunk's damaged output out of the way (kept for a look, never read again), so the
    next run counts the chunk as not done and encodes it again; where it went, or "" if nothing."""
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S%f")
    moved = ""
    arrays = [layout.output_array(index, name) for names in SCHEMAS.values() for name in names]
    for path in (layout.output_meta(index), layout.output_npy(index), *arrays):  # the commit marker first
        if path.exists():
            target = layout.damaged_outputs / f"{path.stem}-{stamp}{path.suffix}"
            if is_local(path):
                publish_file(path, target)
            else:
                _move_remote(path, target)
            moved = str(layout.damaged_outputs)
    if moved:
        log.warning(
            "run %s: chunk %d's output is damaged; moved to %s, to be encoded again",
            layout.run_id,
            index,
            moved,
        )
    return moved


def _move_remote(path: Path, target: Path) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        local = Path(scratch) / path.name
        local.write_bytes(path.read_bytes())
        publish_file(local, target)
    path.unlink()
