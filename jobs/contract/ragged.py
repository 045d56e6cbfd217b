"""Outputs that are not a matrix of one width: a sparse vector per text (CSR), and later a matrix
of token vectors per text. A chunk's ragged output is its row offsets (int64, rows + 1, from 0 to
the entries) at the chunk's usual ``.npy`` path, and entry arrays as long as the last offset at
``NNNNNN.<name>.npy`` (``RunLayout.output_array``), each checksummed in the chunk's metadata,
which is written last and commits them, as a matrix output's is. ``chunk_output`` reads either.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from chunkq.jobs.contract.run_files import (
    RunLayout,
    atomic_write_json,
    save_npy_atomic,
)

# A ragged kind's entry arrays and their dtypes: what a chunk output and the result hold.
SCHEMAS: dict[str, dict[str, str]] = {
    "sparse": {"indices": "<i4", "values": "<f4"},
    "multivector": {"vectors": "<f4"},
}
WIDE = frozenset({"vectors"})  # entry arrays of one row of the output's width per entry; the rest are flat
OFFSETS = "offsets"


def entry_shape(name: str, entries: int, dim: int) -> tuple[int, ...]:
    return (entries, dim) if name in WIDE else (entries,)


@dataclass
class Ragged:
    """Rows of varying length: row i's entries are ``arrays[name][offsets[i]:offsets[i + 1]]``."""

    offsets: np.ndarray[Any, Any]  # int64, rows + 1
    arrays: dict[str, np.ndarray[Any, Any]]
    dim: int  # the width of the space the entries index (a sparse vector's vocabulary)

    @property
    def rows(self) -> int:
        return len(self.offsets) - 1

    @classmethod
    def of_rows(cls, rows: list[dict[str, np.ndarray[Any, Any]]], schema: dict[str, str], dim: int) -> Ragged:
        lengths = [len(next(iter(row.values()))) if row else 0 for row in rows]
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        arrays = {
            name: np.concatenate([row[name] for row in rows]).astype(dtype, copy=False)
            if rows
            else np.empty(entry_shape(name, 0, dim), dtype=dtype)
            for name, dtype in schema.items()
        }
        return cls(offsets, arrays, dim)


def write_ragged_output(
    layout: RunLayout, index: int, ragged: Ragged, meta: dict[str, Any], kind: str
) -> dict[str, Any]:
    """Publish a ragged chunk output: the entry arrays, then the offsets, then the metadata."""
    digests = {
        name: save_npy_atomic(layout.output_array(index, name), np.ascontiguousarray(array))
        for name, array in ragged.arrays.items()
    }
    full = {
        **meta,
        "rows": ragged.rows,
        "dim": ragged.dim,
        "dtype": kind,
        "entries": int(ragged.offsets[-1]),
        "sha256": save_npy_atomic(layout.output_npy(index), ragged.offsets),
        "arrays": digests,
    }
    atomic_write_json(layout.output_meta(index), full)
    return full
