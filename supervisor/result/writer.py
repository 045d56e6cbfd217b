"""Writing a result (the forms ``result/published.py`` reads): each part streamed to a local or
temporary file and checked as it lands, shards uploaded as soon as they are whole, the manifest
written last, then published, and what no manifest names removed.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import numpy as np

from chunkq.jobs.contract.run_files import (
    MANIFEST_NAME,
    RunLayout,
)
from chunkq.jobs.contract.storage import (
    exchange_dirs,
    is_local,
    list_dirs,
    private_dirs,
    private_open,
    publish_file,
    remove_leftovers_beside,
    remove_tree,
    temp_beside,
)
from chunkq.supervisor.result.published import RAGGED_FILES, TEXTS, shard_names
from chunkq.supervisor.result.result_names import SINGLE, new_shard_dir

log = logging.getLogger(__name__)


@contextlib.contextmanager
def _named(path: Path) -> Iterator[None]:
    """A write to an open file fails with no file name ("No space left on device"): the user is
    told which store filled up, as for any other write of the run."""
    try:
        yield
    except OSError as exc:
        if exc.filename is None:
            raise OSError(exc.errno, exc.strerror, str(path)) from exc
        raise


class PartWriter:
    """One embeddings file and its ids being written: the header first (the rows are known), rows
    appended with plain writes (dirty pages of a memory map would count as resident memory), both
    hashed as they are written, so nothing is read back."""

    def __init__(
        self, embeddings: Path, ids: Path, rows: int, dim: int, dtype: np.dtype[Any], block_rows: int = 0
    ) -> None:
        """``block_rows``: also the sha256 of each block of that many rows (the vector cache's
        checksums, for a result part the cache takes as a shard of its own)."""
        private_dirs(embeddings.parent)
        self.paths, self.rows, self.written = (embeddings, ids), rows, 0
        self._emb, self._ids = private_open(embeddings, "wb"), private_open(ids, "wb")
        self.dtype = dtype
        self._emb_hash, self._ids_hash = hashlib.sha256(), hashlib.sha256()
        self.block_rows = block_rows
        self.blocks: list[str] = []
        self._block, self._block_filled = hashlib.sha256(), 0
        header = io.BytesIO()
        np.lib.format.write_array_header_1_0(
            header,
            {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": (rows, dim)},
        )
        self._write(self._emb, self._emb_hash, header.getvalue())

    def _write(self, fh: IO[bytes], digest: Any, data: bytes | memoryview) -> None:
        with _named(self.paths[fh is self._ids]):
            fh.write(data)
        digest.update(data)

    def write(self, ids: list[Any], block: np.ndarray[Any, Any]) -> None:
        rows = np.ascontiguousarray(block, dtype=self.dtype)
        self._write(self._emb, self._emb_hash, rows.data)
        if self.block_rows:
            self._hash_blocks(rows)
        lines = "".join(json.dumps(rid, ensure_ascii=False) + "\n" for rid in ids).encode()
        self._write(self._ids, self._ids_hash, lines)
        self.written += len(ids)

    def _hash_blocks(self, rows: np.ndarray[Any, Any]) -> None:
        start = 0
        while start < len(rows):
            take = min(len(rows) - start, self.block_rows - self._block_filled)
            self._block.update(rows[start : start + take].data)
            self._block_filled += take
            start += take
            if self._block_filled == self.block_rows:
                self._end_block()

    def _end_block(self) -> None:
        self.blocks.append(self._block.hexdigest())
        self._block, self._block_filled = hashlib.sha256(), 0

    def close(self) -> dict[str, Any]:
        for fh, path in zip((self._emb, self._ids), self.paths, strict=True):
            with _named(path):
                fh.flush()
                os.fsync(fh.fileno())
            fh.close()
        if self.written != self.rows:
            raise ValueError(f"{self.paths[0].name}: wrote {self.written} rows, expected {self.rows}")
        if self.block_rows and self._block_filled:
            self._end_block()
        return {
            "rows": self.rows,
            "embeddings_sha256": self._emb_hash.hexdigest(),
            "ids_sha256": self._ids_hash.hexdigest(),
        }

    def abort(self) -> None:
        """Close the files being thrown away; their unwritten buffers may meet the full disk that
        stopped the run, and that error is the one to tell, not this one."""
        for fh in (self._emb, self._ids):
            with contextlib.suppress(OSError):
                fh.close()


class ResultWriter:
    """Rows in the result's order, written as one file or as shards of ``shard_bytes``.

    ``built`` is the local folder the result is made in. With ``upload_to`` (an object store's
    result folder) each finished shard is uploaded there at once and its local files removed, so
    local scratch never exceeds one shard.
    """

    def __init__(
        self,
        built: Path,
        rows: int,
        dim: int,
        dtype: np.dtype[Any],
        shard_bytes: int,
        upload_to: Path | None = None,
        block_rows: int = 0,
    ) -> None:
        """``block_rows``: each part's block checksums too (``PartWriter``), in ``part_blocks``."""
        self.built, self.rows, self.dim, self.dtype, self.upload_to = built, rows, dim, dtype, upload_to
        self.block_rows = block_rows
        self.part_blocks: list[list[str]] = []  # each finished part's block checksums, in order
        self.shard_rows = max(1, shard_bytes // (dim * dtype.itemsize))
        self.sharded = rows > self.shard_rows
        self.shard_dir = new_shard_dir() if self.sharded else None
        self.done: list[dict[str, Any]] = []
        self.total = 0
        self._part: PartWriter | None = None
        self.extra: PartWriter | None = None  # texts.npy beside the rows (--pool), closed by assembly

    def _open_part(self) -> PartWriter:
        if self.shard_dir is None:
            embeddings, ids = (self.built / name for name in SINGLE)
            return PartWriter(embeddings, ids, self.rows, self.dim, self.dtype, self.block_rows)
        rows = min(self.shard_rows, self.rows - self.total)
        embeddings, ids = (self.built / self.shard_dir / name for name in shard_names(len(self.done)))
        return PartWriter(embeddings, ids, rows, self.dim, self.dtype, self.block_rows)

    def write(self, ids: list[Any], block: np.ndarray[Any, Any]) -> None:
        """Append rows; a block that crosses a shard's end is split there."""
        if self.total + len(ids) > self.rows:
            raise ValueError(f"{self.total + len(ids)} rows for a result of {self.rows}")
        start = 0
        while start < len(ids):
            if self._part is None:
                self._part = self._open_part()
            take = min(len(ids) - start, self._part.rows - self._part.written)
            self._part.write(ids[start : start + take], block[start : start + take])
            start += take
            self.total += take
            if self._part.written == self._part.rows:
                self._finish_part()

    def _finish_part(self) -> None:
        part, self._part = self._part, None
        if part is None:
            return
        self.done.append(part.close())
        self.part_blocks.append(part.blocks)
        if self.upload_to is not None and self.shard_dir is not None:
            for local in part.paths:
                publish_file(local, self.upload_to / self.shard_dir / local.name)

    def finish(self) -> dict[str, Any]:
        """What the result manifest says of the files: their checksums, or the shard list."""
        if self.total != self.rows or self._part is not None:
            raise ValueError(f"assembled {self.total} rows, the manifest expects {self.rows}")
        if self.shard_dir is None:
            (single,) = self.done
            return {"embeddings_sha256": single["embeddings_sha256"], "ids_sha256": single["ids_sha256"]}
        return {"shard_dir": self.shard_dir, "shard_rows": self.shard_rows, "shards": self.done}

    def abort(self) -> None:
        if self._part is not None:
            self._part.abort()
            self._part = None
        if self.extra is not None:
            self.extra.abort()
            self.extra = None
        if self.upload_to is not None and self.shard_dir is not None:
            remove_tree(self.upload_to / self.shard_dir)


def publish(built: Path, result: Path, uploaded: str | None) -> None:
    """Put a whole result in place; readers trust it only once its manifest.json exists.

    A filesystem store renames the folder ``built`` into place. On an object store the files in
    ``built`` are uploaded (``uploaded``: a shard folder already there) and manifest.json last;
    then whatever the new manifest does not name is removed.
    """
    if is_local(result):
        if not result.exists():
            os.rename(built, result)
        elif exchange_dirs(built, result):  # in one step: readers see the old result or the new one
            shutil.rmtree(built)
        else:  # no exchange here: the shortest window, the old result renamed aside first
            old = result.with_name(f".result.old-{os.getpid()}")
            os.rename(result, old)
            os.rename(built, result)
            shutil.rmtree(old)
        return
    if uploaded is None:
        (result / MANIFEST_NAME).unlink(missing_ok=True)  # uncommit a stale result before its files change
    for name in (*SINGLE, *TEXTS, *RAGGED_FILES):
        if (built / name).exists():
            publish_file(built / name, result / name)
    publish_file(built / MANIFEST_NAME, result / MANIFEST_NAME)
    _remove_unnamed(result, uploaded)


def _remove_unnamed(result: Path, keep: str | None) -> None:
    """Files of older results in ``result`` that its manifest no longer names."""
    for folder in list_dirs(result):
        if folder.startswith("shards-") and folder != keep:
            remove_tree(result / folder)
    if keep is not None:
        for name in (*SINGLE, *RAGGED_FILES):
            (result / name).unlink(missing_ok=True)


def local_build_dir(layout: RunLayout) -> Path:
    """Where a result is made: beside ``result/`` on a filesystem store (renamed into place), a
    private temporary folder otherwise."""
    if is_local(layout.root):
        removed = remove_leftovers_beside(layout.result)  # a killed assembly's, hundreds of MB
        if removed:
            log.info("run %s: removed %d result(s) a killed assembly left unfinished", layout.run_id, removed)
        built = temp_beside(layout.result)
        shutil.rmtree(built, ignore_errors=True)
        private_dirs(built)
        return built
    return Path(tempfile.mkdtemp(prefix=f"chunkq-result-{layout.run_id}-"))
