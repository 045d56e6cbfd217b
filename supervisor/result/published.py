"""The published result's two forms, and how each is read and checked (``writer.py`` writes them).

    result/manifest.json                 the commit marker: rows, dim, checksums, the form
    result/embeddings.npy, ids.jsonl     one file each, when the embeddings fit in one shard
    result/shards-<tag>/000000.npy       ordered shards of at most ``shard_bytes`` of embeddings,
    result/shards-<tag>/000000.ids.jsonl each with its ids; the manifest lists them in order with
                                         their rows and checksums ("shards", "shard_dir")

A result larger than one shard is sharded so that no process needs local scratch beyond one shard:
on an object store each shard is uploaded (one multipart upload) as soon as it is whole, while
assembly goes on. The shard folder's name is new at every assembly and only the manifest, written
last, names it: readers never see a half-made set, an older result stays readable until the new
manifest replaces its own, and shards that no manifest names (an assembly that died, or lost its
lock) are removed by the next one.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from chunkq.jobs import kinds
from chunkq.jobs.contract.errors import AssemblyError, ConfigError, StoreError
from chunkq.jobs.contract.manifest import RunManifest, load_manifest
from chunkq.jobs.contract.ragged import OFFSETS, SCHEMAS
from chunkq.jobs.contract.run_files import (
    RunLayout,
    file_sha256,
    load_npy,
    non_finite_rows,
    read_json,
    read_npy_header,
)
from chunkq.jobs.contract.specs import storage_dtype
from chunkq.jobs.contract.storage import (
    is_local,
)

log = logging.getLogger(__name__)

DEFAULT_SHARD_BYTES = 1 << 30  # 1 GiB of embeddings a shard; a result up to this size is one .npy
SINGLE = ("embeddings.npy", "ids.jsonl")
# A ragged result's arrays (``ragged.py``), uploaded before the manifest as SINGLE's are.
RAGGED_FILES = tuple(f"{name}.npy" for name in (OFFSETS, *sorted({n for s in SCHEMAS.values() for n in s})))
TEXTS = ("texts.npy", "texts.ids.jsonl")  # --long-texts window --pool: a vector per text, beside the windows
SHARD_DIR = re.compile(r"shards-[0-9A-Za-z]{1,64}")  # what a result manifest may name as its shard folder


_UNITS = {
    "": 1,
    "k": 10**3,
    "m": 10**6,
    "g": 10**9,
    "t": 10**12,
    "ki": 2**10,
    "mi": 2**20,
    "gi": 2**30,
    "ti": 2**40,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*", re.IGNORECASE)


def shard_bytes(value: int | str) -> int:
    """A shard size in bytes from ``1073741824``, ``1GiB``, ``512MB``, ``64k``...; ConfigError
    for anything else or under a kilobyte (a shard per few rows is a mistake, not a choice)."""
    match = _SIZE.fullmatch(str(value))
    if match is None:
        raise ConfigError(f"shard size {value!r}: give bytes, or a number with kB, MB, GB, KiB, MiB or GiB")
    size = int(float(match.group(1)) * _UNITS[(match.group(2) or "").lower()])
    if size < 1024:
        raise ConfigError(f"shard size {value!r}: at least 1 KiB")
    return size


def new_shard_dir() -> str:
    """A shard folder's name no earlier result of the run has used (older ones are removed once
    the new manifest is in place)."""
    return f"shards-{datetime.now(UTC).strftime('%Y%m%dT%H%M%S%f')}{os.getpid()}"


def shard_names(index: int) -> tuple[str, str]:
    """The embeddings and ids file names of shard ``index``."""
    return f"{index:06d}.npy", f"{index:06d}.ids.jsonl"


@dataclass(frozen=True)
class ResultPart:
    """One embeddings file and its ids, a run of rows in the result's order."""

    embeddings: Path
    ids: Path
    rows: int
    embeddings_sha256: str
    ids_sha256: str


def describe_left_out(rows: list[dict[str, Any]], shown: int = 5) -> str:
    """Rows left out of a result under --allow-missing, in one line: how many, and the first few by
    id with why."""
    named = "; ".join(f"{r.get('id')!r}: {r.get('reason')}" for r in rows[:shown])
    more = f"; and {len(rows) - shown} more (result/manifest.json lists all)" if len(rows) > shown else ""
    return f"{len(rows)} row(s) left out: {named}{more}"


def result_parts(layout: RunLayout, result: dict[str, Any]) -> list[ResultPart]:
    """The files a result manifest names, in row order; ValueError when it names them wrongly (a
    manifest edited to point outside its result folder is refused, never followed)."""
    folder = layout.result
    shards = result.get("shards")
    if shards is None:
        embeddings, ids = SINGLE
        return [
            ResultPart(
                folder / embeddings,
                folder / ids,
                int(result["rows"]),
                str(result.get("embeddings_sha256")),
                str(result.get("ids_sha256")),
            )
        ]
    shard_dir = result.get("shard_dir")
    if not isinstance(shard_dir, str) or not SHARD_DIR.fullmatch(shard_dir):
        raise ValueError(f"shard_dir {shard_dir!r} is not a shard folder's name")
    if not isinstance(shards, list) or not shards:
        raise ValueError("its shard list is empty or not a list")
    parts = []
    for index, shard in enumerate(shards):
        rows = shard.get("rows") if isinstance(shard, dict) else None
        if not isinstance(rows, int) or rows < 1:
            raise ValueError(f"shard {index} has no row count")
        embeddings, ids = shard_names(index)
        parts.append(
            ResultPart(
                folder / shard_dir / embeddings,
                folder / shard_dir / ids,
                rows,
                str(shard.get("embeddings_sha256")),
                str(shard.get("ids_sha256")),
            )
        )
    return parts


def read_result_manifest(layout: RunLayout) -> Any:
    """The published result's manifest.json, parsed; None when there is none, {} when unreadable."""
    path = layout.result_manifest
    try:
        return read_json(path) if path.is_file() else None
    except (OSError, ValueError):
        return {}


def _declared_shape(part: ResultPart) -> tuple[tuple[int, ...], str, int]:
    """The shape and dtype a shard's header declares, and the bytes the file must then hold."""
    with part.embeddings.open("rb") as fh:
        shape, fortran, dtype = read_npy_header(fh)
        data_offset = fh.tell()
    rows_bytes = dtype.itemsize
    for n in shape:
        rows_bytes *= n
    return shape, dtype.str + (" Fortran-ordered" if fortran else ""), data_offset + rows_bytes


def result_disagreement(layout: RunLayout, result: Any, manifest: RunManifest) -> list[str]:
    """How the result manifest disagrees with the run's manifest or its own files' headers (cheap:
    no hashing). An edited result manifest keeps checksums that still match its files, so only the
    run manifest can tell that its rows, model or options are not the run's."""
    if not isinstance(result, dict):
        return ["result/manifest.json is not a JSON object"]
    problems = [
        f"result/manifest.json says {key} {result.get(key)!r}, the run's manifest {value!r}"
        for key, value in (
            ("fingerprint", manifest.fingerprint),
            ("model", manifest.model),
            ("options", manifest.options),
            ("corpus_rows", manifest.corpus_rows),
            ("dtype", manifest.output_dtype),
        )
        if result.get(key) != value
    ]
    missing = result.get("missing") or []
    try:
        expected_rows = manifest.corpus_rows - sum(int(m["rows"]) for m in missing)
        expected_rows -= len(result.get("bad_rows") or [])  # left out under --allow-missing
    except (TypeError, KeyError, ValueError):
        return [*problems, "result/manifest.json lists missing chunks it cannot describe"]
    if result.get("rows") != expected_rows or bool(result.get("complete")) == bool(missing):
        problems.append(
            f"result/manifest.json says {result.get('rows')!r} rows (complete: {result.get('complete')!r}), "
            f"the run's manifest and its missing chunks make {expected_rows}"
        )
    if kinds.get(manifest.kind).ragged:
        from chunkq.supervisor.result import ragged as ragged_result  # it writes with this module's names

        return [*problems, *ragged_result.problems(layout, result, expected_rows, checksums=False)]
    # The dtype the run's manifest asks for: the result manifest's own word could be edited.
    expected_dtype = storage_dtype(manifest.output_dtype).str
    try:
        parts = result_parts(layout, result)
    except (KeyError, TypeError, ValueError) as exc:
        return [*problems, f"result/manifest.json lists its files wrongly: {exc}"]
    if sum(part.rows for part in parts) != expected_rows:
        problems.append(f"its shards hold {sum(p.rows for p in parts)} rows, expected {expected_rows}")
    for part in parts:
        name = _name(layout, part.embeddings)
        try:
            shape, dtype, size = _declared_shape(part)
            actual = part.embeddings.stat().st_size
        except (OSError, ValueError) as exc:
            problems.append(f"{name} unreadable: {exc}")
            continue
        if shape != (part.rows, result.get("dim")) or dtype != expected_dtype:
            expected = f"({part.rows}, {result.get('dim')!r}) {expected_dtype}"
            problems.append(f"{name} holds {shape} {dtype}, expected {expected}")
        elif actual != size:  # a truncated or grown file: seen without reading it
            problems.append(f"{name} is {actual} bytes, its header makes {size}")
    return problems


def _name(layout: RunLayout, path: Path) -> str:
    """A result file's name as the manifest's reader knows it: relative to result/."""
    return str(path.relative_to(layout.result)) if is_local(path) else path.name


def result_damage(layout: RunLayout, result: dict[str, Any]) -> list[str]:
    """What in the published result does not match its manifest's checksums (empty: intact)."""
    problems: list[str] = []
    for part in result_parts(layout, result):
        intact = len(problems)
        for path, digest in ((part.embeddings, part.embeddings_sha256), (part.ids, part.ids_sha256)):
            if not path.is_file():
                problems.append(f"{_name(layout, path)} is missing")
            elif file_sha256(path) != digest:
                problems.append(f"{_name(layout, path)} does not match the checksum in result/manifest.json")
        # Assembly verifies every chunk's values; a result published before it did could hold these.
        if len(problems) == intact and (bad := len(non_finite_rows(load_npy(part.embeddings)))):
            problems.append(f"{_name(layout, part.embeddings)} has {bad} row(s) of NaN or infinite values")
    return problems


def texts_damage(layout: RunLayout, result: dict[str, Any]) -> list[str]:
    """What in a result's pooled vectors per text (``texts``) does not match its checksums."""
    texts = result.get("texts")
    if not isinstance(texts, dict):
        return []
    problems = []
    for name, key in zip(TEXTS, ("embeddings_sha256", "ids_sha256"), strict=True):
        path = layout.result / name
        if not path.is_file():
            problems.append(f"{name} is missing")
        elif file_sha256(path) != texts.get(key):
            problems.append(f"{name} does not match the checksum in result/manifest.json")
    return problems


def check_published(layout: RunLayout, manifest: RunManifest, checksums: bool = True) -> list[str]:
    """Everything wrong with the published result (empty: whole, intact and this run's)."""
    return result_problems(layout, read_result_manifest(layout), manifest, checksums)


def result_problems(
    layout: RunLayout, result: Any, manifest: RunManifest, checksums: bool = True
) -> list[str]:
    """``check_published`` for a result manifest already read (``read_result_manifest``)."""
    if result is None:
        return [f"no result is published in {layout.result}"]
    problems = result_disagreement(layout, result, manifest)
    if problems or not checksums:
        return problems
    if kinds.get(manifest.kind).ragged:
        from chunkq.supervisor.result import ragged as ragged_result

        return ragged_result.problems(layout, result, int(result["rows"]), checksums=True)
    return result_damage(layout, result) + texts_damage(layout, result)


def verified_result(layout: RunLayout) -> tuple[RunManifest, dict[str, Any]]:
    """The run's manifest and its published result manifest, every file checked against its
    checksum first (what an export reads whole before it writes a byte); StoreError when nothing
    is published, AssemblyError naming the damage."""
    run = load_manifest(layout)
    if not layout.result_manifest.is_file():
        raise StoreError(f"run {layout.run_id} has no published result; run it to the end first")
    result = read_json(layout.result_manifest)
    damage = result_problems(layout, result, run, checksums=True)
    if damage:
        raise AssemblyError(layout.run_id, [f"the published result is damaged: {'; '.join(damage)}"])
    return run, result


def published_result(layout: RunLayout, manifest: RunManifest) -> dict[str, Any] | None:
    """The published result manifest if a whole, intact one exists for this very run, else None.

    Its files are checked against the run's manifest and the result manifest's checksums: a damaged
    result is never vouched for; it is assembled again from the chunk outputs.
    """
    result = read_result_manifest(layout)
    if result is None:
        return None
    if isinstance(result, dict) and result.get("fingerprint") == manifest.fingerprint:
        if not result.get("complete", True):
            return None  # partial: a rerun tries the missing chunks again
    damage = result_problems(layout, result, manifest)
    if damage:
        log.warning(
            "run %s: the published result is damaged (%s); assembling it again from the chunk outputs",
            manifest.run_id,
            "; ".join(damage),
        )
        return None
    return dict(result)


class ShardedEmbeddings:
    """A lazy, read-only view of a sharded result as one (rows, dim) matrix: ``len``,
    ``shape``, indexing by row, slice or index array, iteration by row and ``np.asarray`` (which
    reads it all). A shard is memory-mapped (local) or read (object store) when a row of it is
    wanted, one shard at a time."""

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
            part = self._parts[index]
            # Each shard is checked against its checksum as it is first read (a shard is read
            # whole anyway): shards swapped or rewritten on disk are refused, never returned.
            if file_sha256(part.embeddings) != part.embeddings_sha256:
                raise StoreError(
                    f"{part.embeddings} does not match the checksum in its result/manifest.json: the "
                    "result is damaged; `chunkq assemble RUN` publishes it again from the chunk outputs"
                )
            self._cached = (index, load_npy(part.embeddings))
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
