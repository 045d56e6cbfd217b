"""What a sink is given: what the rows are (``Rows``), then the rows themselves a batch at a time, read
from the published result: a dense matrix's rows, a sparse run's CSR rows (``SparseRows``), or a
windowed run's vectors per text (``--level document``, its ``texts.npy``)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from chunkq.jobs import kinds
from chunkq.jobs.contract.errors import ConfigError
from chunkq.jobs.contract.manifest import RunManifest
from chunkq.supervisor.result import ragged as ragged_result
from chunkq.supervisor.result.published import WINDOW_COLUMNS
from chunkq.supervisor.result.reader import PublishedResult

DENSE, SPARSE = "dense", "sparse"  # the row kinds a sink writes (a cross run's scores are dense rows)
WINDOW_FIELDS = WINDOW_COLUMNS  # a window's columns beside text_id, as every export writes them


@dataclass(frozen=True)
class Rows:
    """What a sink is told of the result before its rows: their count, width and stored dtype, the
    run's metric (cosine where its vectors are unit length), and the run it is."""

    run_id: str
    rows: int
    dim: int  # a dense row's width; a sparse row's space (the model's vocabulary)
    dtype: str  # the result's output dtype: float32, float16, int8, uint8, binary, ubinary
    normalized: bool
    windowed: bool  # each row a window: its id is "<text id>#<window>", with the window's columns
    columns: tuple[str, ...] = ()  # --columns: corpus fields copied beside each row, as text
    kind: str = DENSE  # dense rows (a matrix), or sparse ones (SparseRows)
    column: str | None = None  # --column: the vector column's name (None: the sink's default)
    max_active: int | None = None  # a sparse run's most non-zeros in one row (pgvector holds 16,000)


@dataclass(frozen=True)
class SparseRows:
    """A batch of sparse vectors as CSR: row i's dimensions are ``indices[offsets[i]:offsets[i+1]]``
    (rising), with ``values`` beside them."""

    offsets: np.ndarray[Any, Any]  # int64, rows + 1, from 0
    indices: np.ndarray[Any, Any]  # int32
    values: np.ndarray[Any, Any]  # float32

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def row(self, i: int) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.indices[a:b], self.values[a:b]


def row_kind(run: RunManifest) -> str:
    """How a run's rows go into a store: dense or sparse; ConfigError for rows no store here takes."""
    kind = kinds.get(run.kind)
    if not kind.sink_rows:
        raise ConfigError(
            f"run {run.run_id} is {run.kind}: {kind.row}, which LanceDB, pgvector and FAISS do not hold "
            "as one row; export it as Parquet"
        )
    return kind.sink_rows


def row_keys(ids: list[Any], windowed: bool) -> tuple[list[str], dict[str, list[Any]]]:
    """Each row's key in the sink and the window columns: a window's id is its text's and number."""
    if not windowed:
        return [str(rid) for rid in ids], {}
    columns: dict[str, list[Any]] = {"text_id": [str(rid["id"]) for rid in ids]}
    for name in WINDOW_FIELDS:
        columns[name] = [int(rid[name]) for rid in ids]
    return [f"{rid['id']}#{rid['window']}" for rid in ids], columns


def sparse_batches(result: PublishedResult, batch_rows: int) -> Iterator[tuple[list[Any], SparseRows]]:
    """A sparse result's rows ``batch_rows`` at a time, a block (the result, or a shard) read at once."""
    for ids, arrays in result.ragged_blocks():
        offsets, indices, values = arrays["offsets"], arrays["indices"], arrays["values"]
        for start in range(0, len(ids), batch_rows):
            end = min(start + batch_rows, len(ids))
            a, b = int(offsets[start]), int(offsets[end])
            part = SparseRows(
                np.asarray(offsets[start : end + 1], dtype=np.int64) - a,
                np.asarray(indices[a:b], dtype=np.int32),
                np.asarray(values[a:b], dtype=np.float32),
            )
            yield ids[start:end], part


def most_active(result: PublishedResult) -> int:
    """A sparse result's most non-zero entries in one row (its offsets alone are read)."""
    most = 0
    for block in ragged_result.blocks(result.layout.result, result.manifest.fields):
        offsets = ragged_result.block_arrays(block, SPARSE)["offsets"]
        if len(offsets) > 1:
            most = max(most, int(np.diff(np.asarray(offsets, dtype=np.int64)).max()))
    return most
