"""A ragged run's result (jobs.ragged: sparse vectors as CSR): ``offsets.npy`` (rows + 1, int64),
one file per entry array (``indices.npy``, ``values.npy``), ``ids.jsonl``, each checksummed in the
result manifest's ``ragged``. Assembled from the chunk outputs in corpus order (a ragged run has
no plan: no vector cache, no windows); a partial result leaves the missing chunks' rows out and
says so, as a matrix result does. One file per array: no shards.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from chunkq.jobs.errors import BadInputError
from chunkq.jobs.manifest import RunManifest
from chunkq.jobs.ragged import OFFSETS, SCHEMAS, entry_shape
from chunkq.jobs.run_files import RunLayout, file_sha256, load_npy, read_chunk_input, read_json
from chunkq.jobs.storage import private_open
from chunkq.supervisor.result import SINGLE


def files(kind: str) -> tuple[str, ...]:
    return (f"{OFFSETS}.npy", *(f"{name}.npy" for name in SCHEMAS[kind]))


def write(layout: RunLayout, manifest: RunManifest, skip: set[int], built: Path, rows: int) -> dict[str, Any]:
    """Write the result's files into ``built``; what the result manifest says of them."""
    kind = manifest.options["kind"]
    schema = SCHEMAS[kind]
    chunks = [i for i in range(manifest.chunks) if i not in skip]
    metas = {i: read_json(layout.output_meta(i)) for i in chunks}
    entries = sum(int(metas[i]["entries"]) for i in chunks)
    offsets = np.lib.format.open_memmap(built / f"{OFFSETS}.npy", "w+", np.int64, (rows + 1,))
    dim = int(next(iter(metas.values()))["dim"]) if metas else 0
    arrays = {
        name: np.lib.format.open_memmap(
            built / f"{name}.npy", "w+", np.dtype(dtype), entry_shape(name, entries, dim)
        )
        for name, dtype in schema.items()
    }
    offsets[0] = 0
    row = entry = 0
    with private_open(built / SINGLE[1], "w", encoding="utf-8") as ids_file:
        for index in chunks:
            ids, _ = read_chunk_input(layout, index)
            mine = load_npy(layout.output_npy(index))
            if len(ids) != len(mine) - 1:
                raise BadInputError(f"chunk {index}: input holds {len(ids)} rows, its output {len(mine) - 1}")
            count = int(mine[-1])
            offsets[row + 1 : row + len(ids) + 1] = entry + mine[1:]
            for name in schema:
                arrays[name][entry : entry + count] = load_npy(layout.output_array(index, name))
            ids_file.writelines(json.dumps(rid, ensure_ascii=False) + "\n" for rid in ids)
            row, entry = row + len(ids), entry + count
    if row != rows:
        raise BadInputError(f"assembled {row} rows, the manifest expects {rows}")
    for array in (offsets, *arrays.values()):
        array.flush()
    del offsets, arrays
    return {
        "ragged": {
            "kind": kind,
            "entries": entry,
            "sha256": {name: file_sha256(built / name) for name in files(kind)},
        },
        "ids_sha256": file_sha256(built / SINGLE[1]),
    }


def problems(layout: RunLayout, result: dict[str, Any], rows: int, checksums: bool) -> list[str]:
    """What is wrong with a ragged result's files: their shapes against ``rows`` (cheap), and with
    ``checksums`` their bytes against the manifest."""
    ragged = result.get("ragged")
    if not isinstance(ragged, dict) or ragged.get("kind") not in SCHEMAS:
        return ["result/manifest.json does not describe its ragged files"]
    found: list[str] = []
    entries = ragged.get("entries")
    expected: dict[str, tuple[tuple[Any, ...], np.dtype[Any]]] = {
        f"{OFFSETS}.npy": ((rows + 1,), np.dtype(np.int64))
    }
    dim = int(result.get("dim") or 0)
    expected.update(
        {
            f"{n}.npy": (entry_shape(n, int(entries or 0), dim), np.dtype(d))
            for n, d in SCHEMAS[ragged["kind"]].items()
        }
    )
    for name, (shape, dtype) in expected.items():
        path = layout.result / name
        if not path.is_file():
            found.append(f"{name} is missing")
            continue
        try:
            array = load_npy(path)
        except (OSError, ValueError) as exc:
            found.append(f"{name} unreadable: {exc}")
            continue
        if array.shape != shape or array.dtype != dtype:
            found.append(f"{name} holds {array.shape} {array.dtype}, expected {shape} {dtype}")
        elif checksums and file_sha256(path) != ragged.get("sha256", {}).get(name):
            found.append(f"{name} does not match the checksum in result/manifest.json")
    ids = layout.result / SINGLE[1]
    if not ids.is_file():
        found.append(f"{SINGLE[1]} is missing")
    elif checksums and file_sha256(ids) != result.get("ids_sha256"):
        found.append(f"{SINGLE[1]} does not match the checksum in result/manifest.json")
    return found


def load(result_folder: Path) -> dict[str, np.ndarray[Any, Any]]:
    """A ragged result's arrays by name (memory-mapped where local): offsets and the entry arrays."""
    manifest = read_json(result_folder / "manifest.json")
    names = files(manifest["ragged"]["kind"])
    return {name.removesuffix(".npy"): load_npy(result_folder / name) for name in names}
