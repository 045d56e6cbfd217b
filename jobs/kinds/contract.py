"""The contract every model kind keeps (see jobs/kinds/__init__.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from chunkq.jobs.contract.defaults import DEFAULT_BACKEND
from chunkq.jobs.contract.ragged import Ragged
from chunkq.jobs.contract.specs import EncodeOptions

OnRows = Callable[[int], None] | None
# A chunk's row texts to a float32 matrix, row for row, or for a ragged kind a jobs.contract.ragged.Ragged.
Encoder = Callable[[Any, list[str], EncodeOptions, OnRows], Any]


@dataclass(frozen=True)
class Kind:
    name: str
    model_class: str  # the sentence-transformers class that loads and runs it
    reference: str  # the sentence-transformers call a run of this kind equals, row for row
    row: str  # what a result row holds, in words
    rows_are: str  # what the result's rows are called: "embeddings", "scores"
    encode: Encoder
    warm_up: Callable[[Any, list[int]], None]  # run once in a fresh worker, on inputs of these token lengths
    refuse: Callable[[EncodeOptions], str | None]  # why these options mean nothing for it, or None
    ragged: bool = False  # its rows vary in length (jobs.contract.ragged)
    cached: bool = True  # the vector cache may hold its rows: of one width, keyed by what the row is
    reads_rows: bool = False  # a row names what to read (an image): it can be missing (--allow-missing)
    by_tokens: bool = True  # its inputs have tokens, so a token budget can batch them (an image has none)
    pairs: bool = False  # each row is a (query, passage) pair: the corpus names a --pair-field
    # What the model's dimension is for it, as `chunkq model` says it, and where the files say it:
    # "dimension" (its embedding width), "labels" (a classifier's), "vocabulary" (a sparse vector's).
    dim_note: str = " (--truncate-dim may keep fewer)"
    dim_source: str = "dimension"
    # How a vector store takes its rows: "dense", "sparse", or "" for rows none of them holds as one.
    sink_rows: str = "dense"
    canary: bool = False  # a model of this kind proves its code by its vectors of fixed texts
    # A kind added on top of another's models (a module named in CHUNKQ_KINDS): runs on the models
    # whose files say that kind.
    built_on: str | None = None
    # The runtimes its model class runs on (specs.BACKENDS): PyTorch, and OpenVINO where
    # sentence-transformers offers it and chunkq's tests hold it equal to PyTorch.
    backends: tuple[str, ...] = (DEFAULT_BACKEND,)
    # Runs in a precision that rounds on such a runtime (bf16, int8 on OpenVINO): its rows are vectors,
    # whose cosines with fp32's rows a run measures (compute/agreement.py); scores and sparse rows not.
    rounds: bool = False

    @property
    def matrix(self) -> bool:
        return not self.ragged


@dataclass
class WithBadRows:
    """A matrix whose rows in ``bad`` have no vector (zeros, never published): an input that could
    not be read, with the reason, left out of the result under ``--allow-missing``."""

    matrix: Any
    bad: dict[int, str]


def with_bad_rows(matrix: Any, bad: dict[int, str], options: EncodeOptions, what: str) -> Any:
    """``matrix`` as a kind returns it when rows in ``bad`` have no vector: refused (BadRowsError,
    naming them), or under --allow-missing a WithBadRows whose rows are left out of the result."""
    if not bad:
        return matrix
    if not options.allow_missing:
        from chunkq.jobs.contract.errors import BadRowsError

        shown = "; ".join(f"row {i}: {why}" for i, why in list(bad.items())[:5])
        more = f" (and {len(bad) - 5} more)" if len(bad) > 5 else ""
        raise BadRowsError(f"{len(bad)} {what}: {shown}{more}", bad)
    return WithBadRows(matrix, bad)


def matrix_rows(
    total: int, batches: Iterable[list[int]], call: Callable[[list[int]], Any], width: int = 0
) -> np.ndarray[Any, Any]:
    """The batch loop of every kind whose rows are a matrix: ``call`` encodes the rows at a batch's
    positions, which land at those positions as float32; its width is the first batch's. A row no
    batch holds is zeros (a row left out, --allow-missing); a chunk with no batch is ``width`` wide."""
    out: np.ndarray[Any, Any] | None = None
    for batch in batches:
        rows = np.asarray(call(batch), dtype=np.float32).reshape(len(batch), -1)
        if out is None:
            out = np.zeros((total, rows.shape[1]), dtype=np.float32)
        out[batch] = rows
    return out if out is not None else np.zeros((total, width), dtype=np.float32)


def ragged_rows(
    total: int,
    batches: Iterable[list[int]],
    call: Callable[[list[int]], tuple[list[dict[str, Any]], int]],
    schema: dict[str, str],
) -> Ragged:
    """The batch loop of every kind whose rows are ragged: ``call`` gives a batch's rows (each its
    entry arrays by name) and the width, placed at the batch's positions."""
    rows: list[dict[str, Any]] = [{}] * total
    dim = 0
    for batch in batches:
        found, dim = call(batch)
        for i, row in zip(batch, found, strict=True):
            rows[i] = row
    return Ragged.of_rows(rows, schema, dim)


def warm_up_texts(model: Any, lengths: list[int]) -> None:
    """A text model's warm-up: one batch of texts of these token lengths through its encode."""
    texts = [" ".join(["warm"] * max(1, n - 2)) for n in lengths]
    model.encode(texts, batch_size=len(texts), show_progress_bar=False)
