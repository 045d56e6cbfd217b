"""The published result, opened and read: the one way a result leaves the store (export's files, the
sinks, the Python API, ``assemble --verify``, and the check that an assembly need not run again).

Opening reads the result manifest and checks it against the run's manifest and each file's header
and size (``published.result_disagreement``): no row is read. Reading streams the files once, a
batch at a time: every byte is hashed on its way to the reader and every float row checked finite,
so damage is found by the pass that reads the rows, at the latest when it reaches a file's end
(AssemblyError). A reader that writes a file whole and puts it in place at the end (an export file,
a FAISS index) is thus never handed a damaged result as whole; one that cannot take rows back (a
table written a batch at a time) calls ``verify()`` first, the one second pass.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any

import numpy as np

from chunkq.jobs import kinds
from chunkq.jobs.contract.chunk_output import npy_from_bytes
from chunkq.jobs.contract.errors import AssemblyError, ConfigError, StoreError
from chunkq.jobs.contract.manifest import RunManifest
from chunkq.jobs.contract.run import ResultManifest, Run
from chunkq.jobs.contract.run_files import RunLayout, read_npy_header
from chunkq.jobs.contract.specs import storage_dtype
from chunkq.supervisor.result import ragged as ragged_result
from chunkq.supervisor.result.published import (
    TEXTS,
    ResultPart,
    rebuild_advice,
    result_disagreement,
    result_name,
    result_parts,
)

log = logging.getLogger(__name__)

BATCH_ROWS = 8192  # rows a dense read hands over at once: memory stays flat in the row count
READ_BYTES = 1 << 20  # a file is read and hashed this much at a time when its rows are not wanted
LEVELS = ("window", "document")  # a windowed run: a row per window, or its texts' pooled vectors


class _Damage(Exception):
    """What one file of the result says against its manifest (a line of ``problems``)."""


def texts_of(run: RunManifest, result: ResultManifest) -> dict[str, Any]:
    """A windowed run's vectors per text as its result manifest records them (``--level document``)."""
    texts = result.fields.get("texts")
    if not isinstance(texts, dict):
        raise ConfigError(
            f"--level document: run {run.run_id} has no vector per text (a windowed run with --pool "
            "mean or weighted has one); export its rows"
        )
    return texts


@dataclass
class PublishedResult:
    """A run's published result at ``level``, the one door to its rows: what it holds (rows, width,
    stored dtype, whether each row is a window or the run's rows are ragged), checked against the
    run without reading a row; ``batches``, ``ragged_blocks``, ``ids`` and ``verify`` read it."""

    layout: RunLayout
    run: RunManifest
    manifest: ResultManifest  # result/manifest.json as it was when opened
    level: str
    rows: int
    dim: int
    dtype: np.dtype[Any]
    parts: list[ResultPart]  # a dense result's files in row order (at level document: texts.npy)
    windowed: bool  # each row a window: its id an object (the text's id, window, span, tokens)

    @property
    def ragged(self) -> str | None:
        """A ragged result's kind (sparse, multivector); None for a matrix."""
        ragged = self.manifest.ragged
        return str(ragged["kind"]) if isinstance(ragged, dict) else None

    # --- dense rows ---------------------------------------------------------------------------

    def batches(self, batch_rows: int = BATCH_ROWS) -> Iterator[tuple[list[Any], np.ndarray[Any, Any]]]:
        """The rows ``batch_rows`` at a time (the last fewer) whatever the shard ends, each with its
        id; AssemblyError when a file read so far does not match its manifest."""
        held_ids: list[Any] = []
        held: list[np.ndarray[Any, Any]] = []
        for part in self.parts:
            for ids, block in self._checked(part, rows_wanted=True):
                if not held_ids and len(ids) == batch_rows:
                    yield ids, block  # a whole batch of one file: no copy
                    continue
                held_ids += ids
                held.append(block)
                if len(held_ids) >= batch_rows:
                    rows = np.concatenate(held)
                    while len(held_ids) >= batch_rows:
                        yield held_ids[:batch_rows], rows[:batch_rows]
                        held_ids, rows = held_ids[batch_rows:], rows[batch_rows:]
                    held = [rows]
        if held_ids:
            yield held_ids, np.concatenate(held)

    def _checked(self, part: ResultPart, rows_wanted: bool) -> Iterator[tuple[list[Any], np.ndarray]]:
        try:
            yield from _read_part(part, self.dim, self.dtype, rows_wanted, _names(self.layout, part))
        except FileNotFoundError:
            raise self._gone(part) from None
        except _Damage as damage:
            raise self._damaged(str(damage)) from None

    # --- ragged rows --------------------------------------------------------------------------

    def ragged_blocks(self) -> Iterator[tuple[list[Any], dict[str, np.ndarray[Any, Any]]]]:
        """A ragged result's blocks (the result, or each shard) in order: its ids and arrays by name
        (``offsets`` and the entry arrays), each file read once and checked before it is handed over
        (a block is at most one shard's size in memory)."""
        kind = self.ragged
        if kind is None:
            raise ConfigError(f"run {self.run.run_id} holds a matrix, not ragged rows")
        for block in ragged_result.blocks(self.layout.result, self.manifest.fields):
            arrays: dict[str, np.ndarray[Any, Any]] = {}
            for name in ragged_result.files(kind):
                path = block.path(name)
                arrays[name.removesuffix(".npy")] = self._verified_npy(path, block.sha256.get(name))
            raw = self._verified_bytes(block.ids_path, block.ids_sha256)
            yield [json.loads(line) for line in raw.splitlines()], arrays

    def _verified_bytes(self, path: Any, digest: str | None) -> bytes:
        try:
            raw: bytes = path.read_bytes()
        except FileNotFoundError:
            raise self._gone_file(path.name) from None
        if hashlib.sha256(raw).hexdigest() != digest:
            raise self._damaged(f"{path.name} does not match the checksum in result/manifest.json")
        return raw

    def _verified_npy(self, path: Any, digest: str | None) -> np.ndarray[Any, Any]:
        return npy_from_bytes(self._verified_bytes(path, digest))

    # --- ids alone, and the whole pass ----------------------------------------------------------

    def ids(self) -> Iterator[list[Any]]:
        """The rows' ids a file at a time, each ids file checked against its checksum, no vector read
        (what an existing table is compared with before an export writes a row)."""
        if self.ragged is not None:
            blocks = ragged_result.blocks(self.layout.result, self.manifest.fields)
            files = [(block.ids_path, block.ids_sha256) for block in blocks]
        else:
            files = [(part.ids, part.ids_sha256) for part in self.parts]
        for path, digest in files:
            yield [json.loads(line) for line in self._verified_bytes(path, digest).splitlines()]

    def verify(self) -> None:
        """Read everything once and check it; AssemblyError naming the first damage found."""
        if self.ragged is not None:
            for _ in self.ragged_blocks():
                pass
            return
        for part in self.parts:
            for _ in self._checked(part, rows_wanted=False):
                pass

    # --- what a damaged result says -----------------------------------------------------------

    def _damaged(self, why: str) -> AssemblyError:
        return damaged(self.layout, why)

    def _gone(self, part: ResultPart) -> StoreError | AssemblyError:
        return self._gone_file(part.embeddings.name)

    def _gone_file(self, name: str) -> StoreError | AssemblyError:
        """A file of the result vanished while it was read: published again meanwhile (a rerun, an
        assemble removes the old shards once its manifest is in place), or damaged."""
        if ResultManifest.read(self.layout) != self.manifest:
            return StoreError(
                f"run {self.layout.run_id}: the result was published again while this export read it "
                f"({name} was replaced); nothing was written: run the same export again"
            )
        return self._damaged(f"{name} or its ids are missing")


def damaged(layout: RunLayout, why: str) -> AssemblyError:
    """What a reader raises for a result its manifest does not vouch for, and what publishes it again."""
    problems = [f"the published result is damaged: {why}", rebuild_advice(layout)]
    return AssemblyError(layout.run_id, problems, doing="read its result")


def open_result(run: Run, level: str = "window") -> PublishedResult:
    """The run's published result at ``level`` (``document``: a windowed run's vectors per text);
    StoreError when nothing is published, AssemblyError when its manifest disagrees with the run's
    or with its files' headers. No row is read."""
    if level not in LEVELS:
        raise ConfigError(f"--level {level!r}: one of {', '.join(LEVELS)}")
    layout, manifest = run.layout, run.result
    if manifest is None:
        raise StoreError(f"run {layout.run_id} has no published result; run it to the end first")
    disagreement = result_disagreement(layout, manifest, run.manifest)
    if disagreement:
        raise damaged(layout, "; ".join(disagreement))
    windowed = bool((run.manifest.plan or {}).get("windows")) and level == "window"
    rows, dim = int(manifest.fields["rows"]), int(manifest.fields["dim"])
    parts = [] if kinds.get(run.manifest.kind).ragged else result_parts(layout, manifest.fields)
    if level == "document":
        texts = texts_of(run.manifest, manifest)
        rows, dim = int(texts["rows"]), int(texts["dim"])
        embeddings, ids = TEXTS
        sums = str(texts.get("embeddings_sha256")), str(texts.get("ids_sha256"))
        parts = [ResultPart(layout.result / embeddings, layout.result / ids, rows, *sums)]
    dtype = storage_dtype(run.manifest.output_dtype)
    return PublishedResult(layout, run.manifest, manifest, level, rows, dim, dtype, parts, windowed)


def _names(layout: RunLayout, part: ResultPart) -> tuple[str, str]:
    """A part's embeddings and ids files as messages name them (relative to result/)."""
    return result_name(layout, part.embeddings), result_name(layout, part.ids)


def _read_part(
    part: ResultPart, dim: int, dtype: np.dtype[Any], rows_wanted: bool, names: tuple[str, str]
) -> Iterator[tuple[list[Any], np.ndarray[Any, Any]]]:
    """One embeddings file and its ids, read once: each batch hashed and (floats) checked finite
    before it is handed over, the checksums compared at the file's end; _Damage for what is wrong.
    Without ``rows_wanted`` the ids are hashed, not parsed, and nothing is handed over."""
    name, ids_name = names
    emb_hash, ids_hash = hashlib.sha256(), hashlib.sha256()
    row_bytes = dim * dtype.itemsize
    batch = BATCH_ROWS if rows_wanted else max(1, READ_BYTES // max(1, row_bytes))
    bad = 0
    with part.embeddings.open("rb") as emb, part.ids.open("rb") as ids:
        shape = _header(emb, emb_hash, name, dtype)
        if shape != (part.rows, dim):
            raise _Damage(f"{name} holds {shape}, the manifest says {(part.rows, dim)}")
        done = 0
        while done < part.rows:
            n = min(batch, part.rows - done)
            raw = emb.read(n * row_bytes)
            lines = [ids.readline() for _ in range(n)]
            if len(raw) != n * row_bytes:
                raise _Damage(f"{name} ends before its row {done + len(raw) // row_bytes + 1:,}")
            short = next((i for i, line in enumerate(lines) if not line.endswith(b"\n")), None)
            if short is not None:  # the first row whose id line is missing or cut
                raise _Damage(f"{ids_name} ends before its row {done + short + 1:,}")
            emb_hash.update(raw)
            for line in lines:
                ids_hash.update(line)
            block = np.frombuffer(raw, dtype=dtype).reshape(n, dim)
            if dtype.kind == "f":
                bad += int(n - np.isfinite(block).all(axis=1).sum())
            if rows_wanted and not bad:
                yield [json.loads(line) for line in lines], block
            done += n
        rest = emb.read(1) + ids.read(1)
    if rest:
        raise _Damage(f"{name} holds more rows than the manifest says")
    if emb_hash.hexdigest() != part.embeddings_sha256:
        raise _Damage(f"{name} does not match the checksum in result/manifest.json")
    if ids_hash.hexdigest() != part.ids_sha256:
        raise _Damage(f"{ids_name} does not match the checksum in result/manifest.json")
    if bad:  # assembly refuses these; a result published before it did could hold them
        raise _Damage(f"{name} has {bad} row(s) of NaN or infinite values")


def _header(fh: IO[bytes], digest: Any, name: str, expected: np.dtype[Any]) -> tuple[int, ...]:
    start = fh.tell()
    shape, fortran, dtype = read_npy_header(fh)
    if fortran or dtype != expected:
        order = "Fortran" if fortran else "C"
        raise _Damage(f"{name} is {dtype} {order}-ordered, expected {expected.str} C")
    end = fh.tell()
    fh.seek(start)
    digest.update(fh.read(end - start))
    return tuple(shape)


def result_problems(run: Run, checksums: bool = True) -> list[str]:
    """Everything wrong with the run's published result: its manifest against the run's and its
    files' headers, and with ``checksums`` every file read once against its checksum and (floats)
    for NaN or infinite rows. Empty: whole, intact and this run's."""
    layout, result = run.layout, run.result
    if result is None:
        return [f"no result is published in {layout.result}"]
    problems = result_disagreement(layout, result, run.manifest)
    if problems or not checksums:
        return problems
    opened = open_result(run)
    if opened.ragged is not None:
        return ragged_result.problems(layout, result.fields, int(result.fields["rows"]), checksums=True)
    views = [opened]
    if result.fields.get("texts") is not None:  # a windowed run's vectors per text, beside its windows
        try:
            views.append(open_result(run, "document"))
        except (KeyError, TypeError, ValueError) as exc:
            return [*problems, f"result/manifest.json describes its texts wrongly: {exc}"]
    for view in views:
        for part in view.parts:
            names = _names(layout, part)
            paths = (part.embeddings, part.ids)
            missing = [f"{n} is missing" for n, path in zip(names, paths, strict=True) if not path.is_file()]
            try:
                for _ in () if missing else _read_part(part, view.dim, view.dtype, False, names):
                    pass
            except _Damage as damage:
                missing.append(str(damage))
            problems += missing
    return problems


def check_published(layout: RunLayout, run: RunManifest, checksums: bool = True) -> list[str]:
    """Everything wrong with the published result as it is now (empty: whole, intact and this run's)."""
    return result_problems(Run(layout, run), checksums)


def published_result(layout: RunLayout, run: RunManifest) -> dict[str, Any] | None:
    """The published result manifest if a whole, intact one exists for this very run, else None.

    Its files are read once against the run's manifest and its checksums: a damaged result is never
    vouched for; it is assembled again from the chunk outputs."""
    opened = Run(layout, run)
    result = opened.result
    if result is None:
        return None
    if result.fingerprint == run.fingerprint and not result.complete:
        return None  # partial: a rerun tries the missing chunks again
    damage = result_problems(opened)
    if damage:
        log.warning(
            "run %s: the published result is damaged (%s); it is made again (from the chunk outputs "
            "where they were kept, else by encoding the chunks again)",
            run.run_id,
            "; ".join(damage),
        )
        return None
    return dict(result.fields)


def checked_embeddings(part: ResultPart) -> np.ndarray[Any, Any]:
    """A result file's embeddings read whole, once, and checked against its checksum on the way."""
    raw = part.embeddings.read_bytes()
    if hashlib.sha256(raw).hexdigest() != part.embeddings_sha256:  # swapped or rewritten
        raise StoreError(
            f"{part.embeddings} does not match the checksum in its result/manifest.json: the "
            "result is damaged; `chunkq status RUN` says how to publish it again"
        )
    return npy_from_bytes(raw)


class ShardedEmbeddings:
    """A lazy, read-only view of a sharded result as one (rows, dim) matrix: ``len``,
    ``shape``, indexing by row, slice or index array, iteration by row and ``np.asarray`` (which
    reads it all). A shard is read once, whole, when a row of it is wanted, and checked against
    its checksum on the way: one shard is held at a time."""

    def __init__(self, parts: list[ResultPart], dim: int, dtype: np.dtype[Any]) -> None:
        self._parts = parts
        self._starts = np.cumsum([0] + [p.rows for p in parts])
        self.shape = (int(self._starts[-1]), dim)
        self.dtype = dtype
        self.ndim = 2
        self._cached: tuple[int, np.ndarray[Any, Any]] | None = None

    def __len__(self) -> int:
        return self.shape[0]

    def shard(self, index: int) -> np.ndarray[Any, Any]:
        if self._cached is None or self._cached[0] != index:
            self._cached = (index, checked_embeddings(self._parts[index]))
        return self._cached[1]

    def _rows(self, rows: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        out = np.empty((len(rows), self.shape[1]), dtype=self.dtype)
        which = np.searchsorted(self._starts, rows, side="right") - 1
        for index in np.unique(which):
            mask = which == index
            out[mask] = self.shard(int(index))[rows[mask] - self._starts[index]]
        return out

    def __getitem__(self, key: Any) -> Any:
        """``view[rows]`` or ``view[rows, columns]``; rows: an int, a slice, an index or bool array."""
        row_key, columns = key if isinstance(key, tuple) and len(key) == 2 else (key, slice(None))
        n = self.shape[0]
        if isinstance(row_key, int | np.integer):
            if not -n <= row_key < n:
                raise IndexError(f"row {row_key} out of range for {n} rows")
            return self._rows(np.array([int(row_key) % n]))[0][columns]
        if isinstance(row_key, slice):
            rows = np.arange(*row_key.indices(n))  # only the rows picked, never an index of all rows
        else:
            picked = np.asarray(row_key)
            rows = np.flatnonzero(picked) if picked.dtype == bool else picked.astype(np.int64).ravel()
            if rows.size and (rows.min() < -n or rows.max() >= n):
                raise IndexError(f"row index out of range for {n} rows")
            rows = rows % n
        return self._rows(rows)[:, columns]

    def __iter__(self) -> Iterator[np.ndarray[Any, Any]]:
        for index in range(len(self._parts)):
            yield from self.shard(index)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray[Any, Any]:
        shards = [self.shard(i) for i in range(len(self._parts))]
        array = np.concatenate(shards) if shards else np.empty(self.shape, dtype=self.dtype)
        return array if dtype is None else array.astype(dtype)
