"""Which text each exported row stands for, as a hash: the ``text_sha256`` column every table chunkq
writes holds, so that a later export into the table can check that it brings the same corpus rows
(same ids, same texts) before it adds a column beside them.

A row's text is its own: a corpus text, or a window's span of one (a late-chunking window's span of
its segment, not the segment). They are read from the run's chunk inputs in the store, in the order
the row map (``result/planned_rows``) lays corpus rows on them, so an export needs no corpus file;
a windowed run's texts exported whole (``--level document``) are read from its corpus, which holds
them whole. Each is the sha256 of the text's UTF-8 bytes, in hex.
"""

from __future__ import annotations

import hashlib
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from chunkq.jobs.compute.late import parse_row
from chunkq.jobs.contract.errors import StoreError
from chunkq.jobs.contract.manifest import RunManifest
from chunkq.jobs.contract.run_files import RunLayout, new_memmap, read_chunk_input

HASH_COLUMN = "text_sha256"


def text_sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def _key(rid: Any) -> Any:
    """A row's id as the stream and the result both give it: a text id, or a window's (id, number)."""
    return (str(rid["id"]), int(rid["window"])) if isinstance(rid, dict) else str(rid)


class RowHashes:
    """Each result row's text hash, read in step with the result (both are in corpus order; a row
    the result lacks, under --allow-missing, is passed over)."""

    def __init__(self, layout: RunLayout, manifest: RunManifest, level: str) -> None:
        self.stream = self._documents(manifest) if level == "document" else self._rows(layout, manifest)
        self.current: tuple[Any, str] | None = None

    def of(self, ids: list[Any]) -> list[str]:
        found = []
        for rid in ids:
            key = _key(rid)
            while self.current is None or self.current[0] != key:
                self.current = next(self.stream, None)
                if self.current is None:
                    raise StoreError(f"row {key!r} of the result is not among the run's rows")
            found.append(self.current[1])
        return found

    def _documents(self, manifest: RunManifest) -> Iterator[tuple[Any, str]]:
        from chunkq.supervisor.corpus.files import run_corpus_fields

        try:
            for record in run_corpus_fields(manifest, ()):
                yield str(record.id), text_sha256(record.text)
        except (OSError, StoreError) as exc:
            raise StoreError(
                f"--level document: each text's hash comes from run {manifest.run_id}'s corpus, which "
                f"cannot be read as the run read it ({exc}); export --level window, or put it back"
            ) from None

    def _rows(self, layout: RunLayout, manifest: RunManifest) -> Iterator[tuple[Any, str]]:
        from chunkq.supervisor.result.planned_rows import row_map_parts

        late = bool(((manifest.plan or {}).get("windows") or {}).get("late"))
        if (manifest.plan or {}).get("identity", True):
            for index in range(manifest.chunks):
                ids, texts = read_chunk_input(layout, index)
                for rid, text in zip(ids, texts, strict=True):
                    yield _key(rid), _own_hash(text, late).hex()
            return
        with tempfile.TemporaryDirectory(prefix="chunkq-row-texts-") as scratch:
            digests = self._chunk_row_digests(layout, manifest, Path(scratch), late)
            for rows, part_ids in row_map_parts(layout, manifest):
                for rid, digest in zip(part_ids, digests[rows], strict=True):
                    yield _key(rid), digest.tobytes().hex()
            del digests

    @staticmethod
    def _chunk_row_digests(
        layout: RunLayout, manifest: RunManifest, scratch: Path, late: bool
    ) -> np.ndarray[Any, Any]:
        """Every chunk row's text digest, in a local file: a row map may point anywhere in it."""
        shape = (max(1, manifest.rows), 32)
        digests = new_memmap(scratch / "digests", np.uint8, shape)
        for index in range(manifest.chunks):
            _, texts = read_chunk_input(layout, index)
            first = manifest.first_row(index)
            block = b"".join(_own_hash(t, late) for t in texts)
            digests[first : first + len(texts)] = np.frombuffer(block, np.uint8).reshape(-1, 32)
        return digests


def _own_hash(text: str, late: bool) -> bytes:
    if late:
        segment, start, end = parse_row(text)
        text = segment[start:end]
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()
