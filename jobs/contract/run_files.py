"""The store layout and its atomic writes.

    <store>/runs/<run>/manifest.json           run manifest (written last by submit)
    <store>/runs/<run>/splitting.json          the manifest so far, while `chunkq run` still splits
                                               the corpus and workers take its first chunks
    <store>/runs/<run>/inputs/<chunk>.jsonl.gz {"id": ..., "text": ...} per row (plain .jsonl in older stores)
    <store>/runs/<run>/outputs/<chunk>.npy     float32 rows x dim
    <store>/runs/<run>/outputs/<chunk>.json    output metadata; its presence commits the .npy
    <store>/runs/<run>/failures/<chunk>-a<N>.json  each failed attempt, recorded by the supervisor
    <store>/runs/<run>/owner.json              the process that supervises the run (supervisor.owner)
    <store>/runs/<run>/result/                 embeddings.npy, ids.jsonl, manifest.json (published by rename),
                                               or shards-<tag>/ (supervisor.result.published)

Every file is published whole (see jobs.contract.storage): a reader sees either the whole file or none of it,
and a chunk output counts only once its metadata, written after the .npy, exists.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from chunkq.jobs.contract.defaults import DEFAULT_OUTPUT_DTYPE
from chunkq.jobs.contract.errors import BadInputError, StoreError
from chunkq.jobs.contract.specs import chunk_name, storage_dtype, validate_run_id
from chunkq.jobs.contract.storage import (
    atomic_path,
    is_local,
    list_names,
    list_with_mtime,
    no_links_below,
    open_store,
)

MANIFEST_NAME = "manifest.json"  # a run's manifest in its folder; a result's in result/ (or a build)


class RunLayout:
    """Paths of one run under a store root. The run id is validated and every path is checked to be
    reached through no symbolic link below the store root, so none leads out of the store."""

    def __init__(self, store: str | os.PathLike[str], run_id: str) -> None:
        self.store = open_store(store)
        self.run_id = validate_run_id(run_id)
        self._root = self.store / "runs" / self.run_id

    def _path(self, *parts: str) -> Path:
        """``<root>/<parts>``, refused if a link below the store root leads there."""
        return no_links_below(self.store, self._root.joinpath(*parts))

    @property
    def root(self) -> Path:
        return self._path()

    @property
    def manifest(self) -> Path:
        return self._path(MANIFEST_NAME)

    @property
    def splitting(self) -> Path:
        """The manifest so far of a run whose corpus is still being split (supervisor.submit.streaming):
        its chunks written until now, which workers may take; gone once ``manifest`` is written."""
        return self._path("splitting.json")

    @property
    def inputs(self) -> Path:
        return self._path("inputs")

    @property
    def outputs(self) -> Path:
        return self._path("outputs")

    @property
    def damaged_outputs(self) -> Path:
        """Chunk outputs that failed verification, kept for a look; never read again."""
        return self._path("outputs", "damaged")

    @property
    def result(self) -> Path:
        return self._path("result")

    @property
    def result_manifest(self) -> Path:
        """The published result's manifest: written last, so its presence commits the result."""
        return self._path("result", MANIFEST_NAME)

    def input_path(self, index: int) -> Path:
        return self._path("inputs", f"{chunk_name(index)}.jsonl.gz")

    def plain_input_path(self, index: int) -> Path:
        """A chunk input as a store written before inputs were compressed holds it."""
        return self._path("inputs", f"{chunk_name(index)}.jsonl")

    def output_npy(self, index: int) -> Path:
        return self._path("outputs", f"{chunk_name(index)}.npy")

    def output_array(self, index: int, name: str) -> Path:
        """One of a ragged output's entry arrays (``ragged.py``), beside its offsets (``output_npy``)."""
        return self._path("outputs", f"{chunk_name(index)}.{name}.npy")

    def output_meta(self, index: int) -> Path:
        return self._path("outputs", f"{chunk_name(index)}.json")

    @property
    def owner(self) -> Path:
        return self._path("owner.json")

    @property
    def ledger(self) -> Path:
        """Batches of one short record per finished chunk (supervisor.store.ledger)."""
        return self._path("ledger")

    @property
    def summary(self) -> Path:
        return self._path("summary.json")

    @property
    def failures(self) -> Path:
        return self._path("failures")

    def failure_path(self, index: int, attempt: int) -> Path:
        return self._path("failures", f"{chunk_name(index)}-a{attempt}.json")

    @property
    def plan(self) -> Path:
        """The row map of a run with the vector cache on: each corpus row's id and chunk row."""
        return self._path("plan")

    def plan_map(self, part: int) -> Path:
        return self._path("plan", f"rows-{chunk_name(part)}.npy")

    def plan_ids(self, part: int) -> Path:
        return self._path("plan", f"ids-{chunk_name(part)}.jsonl")

    @property
    def plan_chunk_rows(self) -> Path:
        """The corpus rows each chunk gives the result (int64 a chunk): a run's rows, counted as done."""
        return self._path("plan", "corpus-rows-per-chunk.npy")

    @property
    def queue_window(self) -> Path:
        """The ``--queue-window`` the run was submitted with, for the supervisor that watches it."""
        return self._path("queue_window.json")

    @property
    def start_marks(self) -> Path:
        """When the ``chunkq run`` that created the run reached each step before its first chunk."""
        return self._path("start.json")

    @property
    def phases(self) -> Path:
        """Each phase of the commands that ran the run: wall and CPU seconds (supervisor/store/phases.py)."""
        return self._path("phases.json")

    def learned_batch(self, device_kind: str) -> Path:
        """Where the batch size that fitted on this kind of device is kept for the run's later chunks."""
        safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in device_kind)[:80] or "device"
        return self._path("learned", f"{safe}.json")

    def committed_outputs(self) -> Iterator[tuple[int, float]]:
        """(index, commit time) of each chunk whose output metadata (the commit marker) exists."""
        for name, mtime in list_with_mtime(self.outputs):
            stem, dot, ext = name.partition(".")
            if ext == "json" and dot and stem.isdigit():
                yield int(stem), mtime

    def done_indices(self, chunks: int | None = None) -> Iterator[int]:
        """Indices whose output metadata (the commit marker) exists, as the listing yields them:
        names only, no stat of each (200,000 of them at 10^5 chunks). Only a chunk's own name counts,
        and given the run's ``chunks``, only its chunks: a stray file is no chunk done."""
        for name in list_names(self.outputs):
            stem, dot, ext = name.partition(".")
            if ext == "json" and dot and stem.isdigit():
                index = int(stem)
                if stem == chunk_name(index) and (chunks is None or index < chunks):
                    yield index

    def done_chunks(self, chunks: int | None = None) -> set[int]:
        return set(self.done_indices(chunks))


def atomic_write_bytes(path: Path, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def atomic_write_json(path: Path, data: Any) -> None:
    atomic_write_bytes(path, (json.dumps(data, indent=2, ensure_ascii=False) + "\n").encode())


def read_json(path: Path) -> Any:
    return json.loads(path.read_bytes())


def file_sha256(path: Path, block: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(block):
            digest.update(chunk)
    return digest.hexdigest()


class _Writes:
    """A file numpy sees as a plain writer: it then writes through ``write``, whose full disk is an
    OSError with its errno (ENOSPC), where its own ``tofile`` says "[Errno None] None".
    The bytes are hashed as they go: the file is never read back for its checksum."""

    def __init__(self, fh: Any) -> None:
        self.fh = fh
        self.digest = hashlib.sha256()

    def write(self, data: bytes) -> int:
        self.digest.update(data)
        return int(self.fh.write(data))


def save_npy_atomic(path: Path, array: np.ndarray[Any, Any]) -> str:
    """Write ``array`` as .npy atomically and return the file's sha256."""
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as fh:
            writer = _Writes(fh)
            np.save(writer, array, allow_pickle=False)
    return writer.digest.hexdigest()


def _reserve(path: Path, nbytes: int) -> None:
    """Allocate ``nbytes`` of ``path``'s file now. A memory map writes into a sparse file's holes
    when its pages are touched, and a full disk then kills the process with SIGBUS, no message:
    reserved first, a full disk is an ENOSPC here, naming the file."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if nbytes > 0:
            os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        exc.filename = str(path)
        raise
    finally:
        os.close(fd)


def new_memmap(path: Path, dtype: Any, shape: tuple[int, ...]) -> np.memmap[Any, Any]:
    """A new file of ``shape`` zeros, memory-mapped for writing, its space reserved first."""
    size = int(np.prod(shape)) * np.dtype(dtype).itemsize
    path.unlink(missing_ok=True)
    _reserve(path, size)
    return np.memmap(path, dtype=dtype, mode="r+", shape=shape)


def new_npy_memmap(path: Path, dtype: Any, shape: tuple[int, ...]) -> np.memmap[Any, Any]:
    """A new .npy file of ``shape``, memory-mapped for writing, its space reserved first."""
    array = np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=shape)
    try:
        _reserve(path, path.stat().st_size)
    except OSError:
        del array
        path.unlink(missing_ok=True)
        raise
    return array


def read_npy_header(fh: Any) -> tuple[tuple[int, ...], bool, np.dtype[Any]]:
    """(shape, Fortran order, dtype) from an open .npy file's header, the array left unread."""
    version = np.lib.format.read_magic(fh)
    read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    shape, fortran, dtype = read(fh)
    return tuple(shape), bool(fortran), dtype


def load_npy(path: Path) -> np.ndarray[Any, Any]:
    """A chunk output: memory-mapped from a local file, read whole (it is one chunk) from an object store."""
    array: np.ndarray[Any, Any]
    if is_local(path):
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    else:
        array = np.load(io.BytesIO(path.read_bytes()), allow_pickle=False)
    return array


FINITE_CHECK_ROWS = 65536  # rows checked at a time, so a memory-mapped result is never read whole


def non_finite_rows(array: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """The indices of the rows of a stored float matrix that hold NaN or an infinity (none for
    integer or bit dtypes, which cannot), read a block at a time so a memory-mapped result is
    never read whole."""
    if array.dtype.kind != "f" or array.ndim != 2:
        return np.empty(0, dtype=np.int64)
    found = [
        start + np.flatnonzero(~np.isfinite(array[start : start + FINITE_CHECK_ROWS]).all(axis=1))
        for start in range(0, array.shape[0], FINITE_CHECK_ROWS)
    ]
    return np.concatenate(found) if found else np.empty(0, dtype=np.int64)


def json_string(value: Any) -> str:
    """``json.dumps(value, ensure_ascii=False)``, byte for byte; for a str without its 2 us a call."""
    return str(_encode_string(value)) if type(value) is str else json.dumps(value, ensure_ascii=False)


_encode_string: Any = json.encoder.encode_basestring


def write_chunk_input(layout: RunLayout, index: int, rows: list[tuple[Any, str]]) -> None:
    """Write one chunk's (id, text) rows as JSON lines: ``{"id": ..., "text": ...}`` as json.dumps
    writes them (a window's id is an object)."""
    lines = [f'{{"id": {json_string(rid)}, "text": {json_string(text)}}}' for rid, text in rows]
    # Compressed: beside 256-dim vectors the texts were 15 % of a store's bytes after publish; zlib's
    # fastest level takes them to 40 % of that at 60 MB/s (3 us a row of a 10^5-row split's 11).
    data = gzip.compress(("\n".join(lines) + "\n").encode(), compresslevel=1, mtime=0)
    atomic_write_bytes(layout.input_path(index), data)


def read_chunk_input(layout: RunLayout, index: int) -> tuple[list[Any], list[str]]:
    """Return (ids, texts) of one chunk; a malformed row raises BadInputError naming it. An id is a
    string, or a window's object (its text's id, window number and span) as submit wrote it."""
    path = layout.input_path(index)
    if not path.is_file() and layout.plain_input_path(index).is_file():
        path = layout.plain_input_path(index)
    if not path.is_file():
        raise StoreError(f"chunk input {path} is missing")
    data = path.read_bytes()
    if path.name.endswith(".gz"):
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError, zlib.error) as exc:
            raise StoreError(
                f"chunk input {path} is damaged ({exc}) and cannot be read back; remove the run "
                f"(`chunkq clean {layout.run_id}`) and run the command that made it again"
            ) from None
    # Split at "\n" alone: a text may hold U+2028 or U+0085, which splitlines() would split at too.
    lines = data.decode("utf-8").split("\n")
    if lines and not lines[-1]:
        lines.pop()
    try:
        # One parse for the chunk (json escapes every newline inside a row): a call per row cost
        # 5 us a row, a tenth of tokenising it. A row it cannot take is found below.
        rows = json.loads("[" + ",".join(lines) + "]")
    except json.JSONDecodeError:
        rows = None
    if not isinstance(rows, list) or len(rows) != len(lines):
        rows = [_input_row(path, lineno, line) for lineno, line in enumerate(lines, 1)]
    ids: list[Any] = []
    texts: list[str] = []
    for lineno, row in enumerate(rows, 1):
        text = row.get("text") if isinstance(row, dict) else None
        if not isinstance(text, str):
            raise BadInputError(f"{path}:{lineno}: text is {type(text).__name__}, not a string")
        rid = row.get("id")
        ids.append(rid if isinstance(rid, dict) else str(rid))
        texts.append(text)
    return ids, texts


def _input_row(path: Path, lineno: int, line: str) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError as exc:
        raise BadInputError(f"{path}:{lineno}: invalid JSON: {exc.msg}") from exc


def write_output(
    layout: RunLayout,
    index: int,
    embeddings: np.ndarray[Any, Any],
    meta: dict[str, Any],
    output_dtype: str = DEFAULT_OUTPUT_DTYPE,
) -> dict[str, Any]:
    """Publish a chunk output: the .npy first, then its metadata, which commits it. ``embeddings``
    are already in ``output_dtype``'s stored form (jobs.compute.quantize); ``dim`` is the stored columns."""
    array = np.ascontiguousarray(embeddings, dtype=storage_dtype(output_dtype))
    digest = save_npy_atomic(layout.output_npy(index), array)
    full = {
        **meta,
        "rows": int(array.shape[0]),
        "dim": int(array.shape[1]),
        "dtype": output_dtype,
        "sha256": digest,
    }
    atomic_write_json(layout.output_meta(index), full)
    return full
