"""A ragged run's result (jobs.contract.ragged: sparse vectors as CSR, token vectors per text), assembled
from the chunk outputs in corpus order (a ragged run has no plan: no vector cache, no windows); a
partial result leaves the missing chunks' rows out and says so, as a matrix result does.

Up to ``--shard-size`` bytes, one **block**: ``offsets.npy`` (rows + 1, int64, from 0), one file
per entry array (``indices.npy`` and ``values.npy``, or ``vectors.npy``) and ``ids.jsonl``, each
checksummed in the result manifest's ``ragged``. Larger, ordered **shards** in
``shards-<stamp>/``, each a block of its own (``000003.offsets.npy`` from 0, ``000003.values.npy``,
``000003.ids.jsonl``...), listed in order under ``ragged.shards``. A shard holds whole chunks (rows
of varying length are cut where a chunk ends), so one chunk larger than the size is a shard alone.
On an object store each shard is uploaded as soon as it is whole and its local files removed.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from chunkq.jobs.contract.errors import BadInputError
from chunkq.jobs.contract.ragged import OFFSETS, SCHEMAS, WIDE, entry_shape
from chunkq.jobs.contract.run_files import (
    RunLayout,
    file_sha256,
    load_npy,
    new_npy_memmap,
    read_chunk_input,
    read_json,
)
from chunkq.jobs.contract.storage import private_dirs, private_open, publish_file, remove_tree
from chunkq.supervisor.result.chunk_reads import ChunkReads
from chunkq.supervisor.result.result_names import SHARD_DIR, SINGLE, new_shard_dir


def files(kind: str) -> tuple[str, ...]:
    return (f"{OFFSETS}.npy", *(f"{name}.npy" for name in SCHEMAS[kind]))


@dataclass(frozen=True)
class Block:
    """One whole CSR block of rows: the result's files, or one shard's."""

    folder: Path
    prefix: str  # "" for the single block, "000003." for shard 3
    rows: int
    entries: int
    sha256: dict[str, str]  # by file name without the prefix (offsets.npy, values.npy...)
    ids_sha256: str

    def path(self, name: str) -> Path:
        return self.folder / f"{self.prefix}{name}"

    @property
    def ids_path(self) -> Path:
        return self.folder / (f"{self.prefix}ids.jsonl" if self.prefix else SINGLE[1])

    def described(self) -> dict[str, Any]:
        return {
            "rows": self.rows,
            "entries": self.entries,
            "sha256": self.sha256,
            "ids_sha256": self.ids_sha256,
        }


def write(
    reads: ChunkReads,
    skip: set[int],
    built: Path,
    rows: int,
    shard_bytes: int,
    upload_to: Path | None = None,
) -> dict[str, Any]:
    """Write the result's files into ``built`` (shards uploaded to ``upload_to``, an object
    store's result folder, as each is whole), each chunk output read once (``reads``); what the
    result manifest says of them."""
    layout, manifest = reads.layout, reads.manifest
    kind = manifest.options["kind"]
    chunks = [i for i in range(manifest.chunks) if i not in skip]
    metas = {i: read_json(layout.output_meta(i)) for i in chunks}
    dim = int(next(iter(metas.values()))["dim"]) if metas else 0
    per_entry = sum(np.dtype(d).itemsize * (dim if n in WIDE else 1) for n, d in SCHEMAS[kind].items())
    sizes = [(int(metas[i]["rows"]) + 1) * 8 + int(metas[i]["entries"]) * per_entry for i in chunks]
    if sum(sizes) <= shard_bytes:
        block = _write_block(reads, kind, chunks, metas, dim, built, "")
        _check_rows(block.rows, rows)
        ragged = {"kind": kind, "entries": block.entries, "sha256": block.sha256}
        return {"ragged": ragged, "ids_sha256": block.ids_sha256}
    shard_dir = new_shard_dir()
    shards: list[Block] = []
    try:
        for group in _groups(chunks, sizes, shard_bytes):
            shard = _write_block(reads, kind, group, metas, dim, built / shard_dir, f"{len(shards):06d}.")
            if upload_to is not None:
                for local in [shard.path(name) for name in files(kind)] + [shard.ids_path]:
                    publish_file(local, upload_to / shard_dir / local.name)  # and removes it here
            shards.append(shard)
        _check_rows(sum(s.rows for s in shards), rows)
    except BaseException:
        if upload_to is not None:
            remove_tree(upload_to / shard_dir)
        raise
    entries = sum(s.entries for s in shards)
    described = [s.described() for s in shards]
    return {"ragged": {"kind": kind, "entries": entries, "shard_dir": shard_dir, "shards": described}}


def _groups(chunks: list[int], sizes: list[int], limit: int) -> Iterator[list[int]]:
    """Consecutive chunks, as many as fit in ``limit`` bytes, at least one."""
    group: list[int] = []
    held = 0
    for index, size in zip(chunks, sizes, strict=True):
        if group and held + size > limit:
            yield group
            group, held = [], 0
        group.append(index)
        held += size
    if group:
        yield group


def _check_rows(assembled: int, expected: int) -> None:
    if assembled != expected:
        raise BadInputError(f"assembled {assembled} rows, the manifest expects {expected}")


def _write_block(
    reads: ChunkReads,
    kind: str,
    chunks: list[int],
    metas: dict[int, Any],
    dim: int,
    folder: Path,
    prefix: str,
) -> Block:
    schema = SCHEMAS[kind]
    private_dirs(folder)
    rows = sum(int(metas[i]["rows"]) for i in chunks)
    entries = sum(int(metas[i]["entries"]) for i in chunks)
    offsets = new_npy_memmap(folder / f"{prefix}{OFFSETS}.npy", np.int64, (rows + 1,))
    arrays = {
        name: new_npy_memmap(folder / f"{prefix}{name}.npy", np.dtype(dtype), entry_shape(name, entries, dim))
        for name, dtype in schema.items()
    }
    offsets[0] = 0
    row = entry = 0
    block = Block(folder, prefix, rows, entries, {}, "")
    with private_open(block.ids_path, "w", encoding="utf-8") as ids_file:
        for index in chunks:
            ids, _ = read_chunk_input(reads.layout, index)
            got = reads.arrays(index)
            mine = got[OFFSETS]
            if len(ids) != len(mine) - 1:
                raise BadInputError(f"chunk {index}: input holds {len(ids)} rows, its output {len(mine) - 1}")
            count = int(mine[-1])
            offsets[row + 1 : row + len(ids) + 1] = entry + mine[1:]
            for name in schema:
                arrays[name][entry : entry + count] = got[name]
            ids_file.writelines(json.dumps(rid, ensure_ascii=False) + "\n" for rid in ids)
            row, entry = row + len(ids), entry + count
    for array in (offsets, *arrays.values()):
        array.flush()
    del offsets, arrays
    digests = {name: file_sha256(block.path(name)) for name in files(kind)}
    return Block(folder, prefix, rows, entries, digests, file_sha256(block.ids_path))


def blocks(folder: Path, result: dict[str, Any]) -> list[Block]:
    """The blocks a result manifest names, in row order; ValueError when it names them wrongly (a
    shard folder outside the result is refused, never followed)."""
    ragged = result["ragged"]
    shards = ragged.get("shards")
    if shards is None:
        return [
            Block(
                folder,
                "",
                int(result["rows"]),
                int(ragged["entries"]),
                ragged["sha256"],
                result["ids_sha256"],
            )
        ]
    shard_dir = ragged.get("shard_dir")
    if not isinstance(shard_dir, str) or not SHARD_DIR.fullmatch(shard_dir):
        raise ValueError(f"shard_dir {shard_dir!r} is not a shard folder's name")
    if not isinstance(shards, list) or not shards:
        raise ValueError("its shard list is empty or not a list")
    return [
        Block(
            folder / shard_dir,
            f"{n:06d}.",
            int(s["rows"]),
            int(s["entries"]),
            dict(s["sha256"]),
            str(s["ids_sha256"]),
        )
        for n, s in enumerate(shards)
    ]


def problems(layout: RunLayout, result: dict[str, Any], rows: int, checksums: bool) -> list[str]:
    """What is wrong with a ragged result's files: their shapes against ``rows`` (cheap), and with
    ``checksums`` their bytes against the manifest."""
    ragged = result.get("ragged")
    if not isinstance(ragged, dict) or ragged.get("kind") not in SCHEMAS:
        return ["result/manifest.json does not describe its ragged files"]
    try:
        parts = blocks(layout.result, result)
    except (KeyError, TypeError, ValueError) as exc:
        return [f"result/manifest.json lists its ragged files wrongly: {exc}"]
    found: list[str] = []
    if sum(b.rows for b in parts) != rows or sum(b.entries for b in parts) != ragged.get("entries"):
        found.append("result/manifest.json's shards do not add up to its rows and entries")
    dim = int(result.get("dim") or 0)
    for block in parts:
        found += _block_problems(block, ragged["kind"], dim, checksums)
    return found


def _block_problems(block: Block, kind: str, dim: int, checksums: bool) -> list[str]:
    expected: dict[str, tuple[tuple[int, ...], np.dtype[Any]]] = {
        f"{OFFSETS}.npy": ((block.rows + 1,), np.dtype(np.int64))
    }
    for array_name, array_dtype in SCHEMAS[kind].items():
        expected[f"{array_name}.npy"] = (entry_shape(array_name, block.entries, dim), np.dtype(array_dtype))
    found: list[str] = []
    for name, (shape, dtype) in expected.items():
        path = block.path(name)
        if not path.is_file():
            found.append(f"{path.name} is missing")
            continue
        try:
            array = load_npy(path)
        except (OSError, ValueError) as exc:
            found.append(f"{path.name} unreadable: {exc}")
            continue
        if array.shape != shape or array.dtype != dtype:
            found.append(f"{path.name} holds {array.shape} {array.dtype}, expected {shape} {dtype}")
        elif checksums and file_sha256(path) != block.sha256.get(name):
            found.append(f"{path.name} does not match the checksum in result/manifest.json")
    if not block.ids_path.is_file():
        found.append(f"{block.ids_path.name} is missing")
    elif checksums and file_sha256(block.ids_path) != block.ids_sha256:
        found.append(f"{block.ids_path.name} does not match the checksum in result/manifest.json")
    return found


def block_arrays(block: Block, kind: str) -> dict[str, np.ndarray[Any, Any]]:
    """A block's arrays by name (memory-mapped where local): offsets and the entry arrays."""
    return {name.removesuffix(".npy"): load_npy(block.path(name)) for name in files(kind)}


def load(result_folder: Path) -> dict[str, np.ndarray[Any, Any]]:
    """A ragged result's arrays by name: one block memory-mapped where local; shards read into
    memory and joined (``blocks`` and ``block_arrays`` read them one at a time)."""
    manifest = read_json(result_folder / "manifest.json")
    kind = manifest["ragged"]["kind"]
    parts = [block_arrays(block, kind) for block in blocks(result_folder, manifest)]
    if len(parts) == 1:
        return parts[0]
    starts = np.cumsum([0] + [int(p[OFFSETS][-1]) for p in parts[:-1]])
    shifted = [p[OFFSETS][1:] + start for p, start in zip(parts, starts, strict=True)]
    joined = {OFFSETS: np.concatenate([np.zeros(1, np.int64), *shifted]).astype(np.int64)}
    joined.update({name: np.concatenate([p[name] for p in parts]) for name in SCHEMAS[kind]})
    return joined
