"""``chunkq export --out``: a published result (one file or shards) as one Parquet, .npy or JSON Lines
file, with its ids: the file formats of the table of destinations (``destinations.py``).

Streaming: rows are read and written a batch at a time, so memory stays flat in the row count.
The values are the result's values, unchanged, in its dtype (float32, float16, int8, uint8; binary
and ubinary as their packed bytes, 8 dimensions each). The result is read once
(``supervisor.result.reader``), its checksums and values checked on the way; the file appears at
``--out`` only once it is whole and every check passed.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from chunkq.jobs import kinds
from chunkq.jobs.contract.errors import ConfigError, StoreWriteError, refused_write
from chunkq.jobs.contract.manifest import RunManifest
from chunkq.jobs.contract.run import Run
from chunkq.jobs.contract.storage import as_the_caller_would, remove_leftovers_beside, temp_beside
from chunkq.sinks.corpus_columns import beside_rows
from chunkq.sinks.destinations import FILE_FORMATS, outside_the_store
from chunkq.supervisor.result.published import WINDOW_COLUMNS
from chunkq.supervisor.result.reader import BATCH_ROWS, PublishedResult, open_result

EXPORT_FORMATS = FILE_FORMATS


def ids_path_beside(out: Path) -> Path:
    """Where ``--format npy`` writes the ids: beside the array, one JSON string per line."""
    return out.with_name(out.stem + ".ids.jsonl")


EMBEDDING, SCORE, SCORES = "embedding", "score", "scores"


def value_column(kind: str, dim: int) -> str:
    """What a Parquet or JSON Lines export calls a row's value: a cross-encoder's score (a row of
    class scores), else its embedding."""
    if kind == "cross":
        return SCORE if dim == 1 else SCORES
    return EMBEDDING


STDOUT = Path("-")


@dataclass(frozen=True)
class _Target:
    """Where an export goes: a path replaced whole by rename, or a stream written through."""

    path: Path
    through: bool  # a pipe, FIFO, character device or stdout: written in place, never replaced


def _target(out: Path, force: bool, fmt: str) -> _Target:
    """Check ``--out``: a new file in an existing folder; an existing file only with ``force`` (a
    link to one replaces the file it names, not the link); a pipe, FIFO or device (``/dev/stdout``,
    ``-``) is written through, never replaced by a regular file."""
    if out == STDOUT:
        out = Path("/dev/stdout")
    if os.path.exists(out):
        if not stat.S_ISREG(os.stat(out).st_mode):
            if fmt == "npy":
                raise ConfigError(
                    f"{out}: --format npy writes two files (the array and its ids); give a file path"
                )
            return _Target(out, through=True)
        if not force:
            raise ConfigError(f"{out} exists; pass --force to replace it")
        return _Target(Path(os.path.realpath(out)), through=False)
    if out.is_symlink():
        raise ConfigError(f"{out} is a link to nothing ({os.readlink(out)}); give a file path")
    if not out.parent.is_dir():
        raise ConfigError(f"{out.parent}: no such folder; create it first")
    return _Target(out, through=False)


@contextmanager
def _written_whole(target: _Target) -> Iterator[Path]:
    """A temporary file beside the target, renamed over it only when the block ends without an
    error; or, for a stream, the target itself."""
    if target.through:
        yield target.path
        return
    out = target.path
    remove_leftovers_beside(out)  # a killed export's
    tmp = temp_beside(out)
    try:
        yield tmp
        as_the_caller_would(tmp)  # a result is for sharing; the store stays owner-only
        os.replace(tmp, out)
    except Exception as exc:
        why = refused_write(exc)  # said of the export's file, not of the store (which keeps the run)
        if why is None:
            raise
        raise StoreWriteError(
            f"{why} writing {out}; make room (or fix the permissions) and run the same export again "
            "(nothing of it was left there)"
        ) from exc
    finally:
        tmp.unlink(missing_ok=True)


def export(
    published: Run,
    fmt: str,
    out: Path,
    force: bool = False,
    tokens: bool = False,
    level: str = "window",
    columns: tuple[str, ...] = (),
) -> list[Path]:
    """Write the run's result to ``out`` in ``fmt``; the files written. ``tokens``: a sparse run's
    active dimensions as the model's vocabulary words too. ``level`` document: a windowed run's
    vectors per text instead of its windows. ``columns``: corpus fields written beside each row, as
    text (Parquet and JSON Lines; a window's text field is its own span)."""
    layout, run = published.layout, published.manifest
    if out != STDOUT:  # the ids beside an .npy too: through a link they overwrote a run's result
        outside_the_store(layout.store, [out, ids_path_beside(out)] if fmt == "npy" else [out], str(out))
    kind = run.kind
    if tokens and kind != "sparse":
        raise ConfigError(f"--tokens names a sparse vector's dimensions; run {layout.run_id} is {kind}")
    if columns and (fmt == "npy" or kinds.get(kind).ragged):
        what = "an .npy file holds the matrix alone (its ids beside it)" if fmt == "npy" else f"a {kind} run"
        raise ConfigError(
            f"--columns: {what} takes no corpus fields here; export --format parquet or jsonl of a dense "
            "run, or --to a table, for fields beside each row"
        )
    if kinds.get(kind).ragged:
        return _export_ragged(published, fmt, _target(out, force, fmt), tokens)
    target = _target(out, force, fmt)
    reader = open_result(published, level)
    value = value_column(kind, reader.dim)
    fields = beside_rows(run, columns, value, reader.windowed)
    if fmt == "parquet":
        _parquet(reader, value, target, fields)
        return [target.path]
    if fmt == "jsonl":
        with _written_whole(target) as tmp, open(tmp, "w", encoding="utf-8") as fh:
            for ids, block in reader.batches():
                extra = fields.of(ids) if fields is not None else {}
                for i, (rid, row) in enumerate(zip(ids, block.tolist(), strict=True)):
                    # A window's id is an object: its fields become the line's (id, window, span, tokens).
                    line = dict(rid) if isinstance(rid, dict) else {"id": rid}
                    line.update({name: values[i] for name, values in extra.items()})
                    line[value] = row[0] if value == SCORE else row
                    fh.write(json.dumps(line, ensure_ascii=False) + "\n")
        return [target.path]
    ids_target = _target(ids_path_beside(target.path), force, fmt)
    with _written_whole(target) as tmp, _written_whole(ids_target) as ids_tmp:
        with open(tmp, "wb") as emb, open(ids_tmp, "w", encoding="utf-8") as ids_fh:
            np.lib.format.write_array_header_1_0(
                emb, {"descr": reader.dtype.str, "fortran_order": False, "shape": (reader.rows, reader.dim)}
            )
            for ids, block in reader.batches():
                emb.write(block.tobytes())
                ids_fh.writelines(json.dumps(rid, ensure_ascii=False) + "\n" for rid in ids)
    return [target.path, ids_target.path]


def _parquet(reader: PublishedResult, name: str, out: _Target, fields: Any = None) -> None:
    if out.through:
        # Arrow's Parquet writer seeks, which a pipe cannot: build the file privately, then stream it.
        with tempfile.TemporaryDirectory(prefix="chunkq-export-") as scratch:
            built = _Target(Path(scratch) / "out.parquet", through=False)
            _parquet(reader, name, built, fields)
            with open(built.path, "rb") as src, open(out.path, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        return
    import pyarrow as pa
    import pyarrow.parquet as pq

    value_type = pa.from_numpy_dtype(reader.dtype)
    windows = reader.windowed
    columns = [("id", pa.string())] + [(name, pa.int64()) for name in WINDOW_COLUMNS if windows]
    columns += [(field, pa.string()) for field in (fields.names if fields is not None else ())]
    stored = value_type if name == SCORE else pa.list_(value_type, reader.dim)
    schema = pa.schema([*columns, (name, stored)])
    with _written_whole(out) as tmp:
        with pq.ParquetWriter(tmp, schema) as writer:
            for ids, block in reader.batches():
                values = pa.array(block.reshape(-1), type=value_type)
                data: dict[str, Any] = {
                    name: values if name == SCORE else pa.FixedSizeListArray.from_arrays(values, reader.dim)
                }
                if windows:
                    data["id"] = pa.array([str(rid["id"]) for rid in ids], pa.string())
                    for field in WINDOW_COLUMNS:  # not `name`: that is the value column's, every batch
                        data[field] = pa.array([int(rid[field]) for rid in ids], pa.int64())
                else:
                    data["id"] = pa.array(ids, pa.string())
                if fields is not None:
                    data.update({k: pa.array(v, pa.string()) for k, v in fields.of(ids).items()})
                writer.write_table(pa.table(data, schema=schema))


def _arrow_type(pa: Any, array: Any) -> Any:
    """An entry's Arrow type: a word, a vector (a fixed-size list), or a number."""
    if array.dtype == object:
        return pa.string()
    if array.ndim == 2:
        return pa.list_(pa.from_numpy_dtype(array.dtype), array.shape[1])
    return pa.from_numpy_dtype(array.dtype)


def _vocabulary(run: RunManifest) -> Any:
    """The run's model's tokens by id (its tokenizer.json): a sparse vector's dimensions by name."""
    from chunkq.jobs.compute.model_info import describe, load_tokenizer

    folder = describe(run.model, run.options.get("revision")).folder
    if folder is None:
        raise ConfigError(f"--tokens: model {run.model}'s files are not on this host")
    tokenizer = load_tokenizer(folder)
    return np.array([tokenizer.id_to_token(i) or "" for i in range(tokenizer.get_vocab_size())], dtype=object)


def _ragged_batch(
    pa: Any, schema: Any, ids: list[Any], cut: np.ndarray[Any, Any], arrays: dict[str, np.ndarray[Any, Any]]
) -> Any:
    """Rows of a ragged block as an Arrow table: each entry array's slice as a list per row."""
    data: dict[str, Any] = {"id": pa.array(ids, pa.string())}
    for name, array in arrays.items():
        part = array[int(cut[0]) : int(cut[-1])]
        values = (
            pa.FixedSizeListArray.from_arrays(pa.array(part.reshape(-1)), part.shape[1])
            if part.ndim == 2
            else pa.array(part, type=schema.field(name).type.value_type)
        )
        data[name] = pa.ListArray.from_arrays(pa.array(cut - cut[0], pa.int32()), values)
    return pa.table(data, schema=schema)


def _export_ragged(published: Run, fmt: str, target: _Target, tokens: bool = False) -> list[Path]:
    """A ragged result as Parquet or JSON Lines: ``id`` and each entry array as a list per row
    (sparse: ``indices`` list<int32>, ``values`` list<float32>; multivector: ``vectors``, a list of
    fixed-size lists), read once a block (the result, or one shard) at a time, each file checked
    against its checksum before its rows are written."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    reader = open_result(published)
    if fmt == "npy":
        kind = reader.run.kind
        raise ConfigError(f"a {kind} result has no matrix to write as .npy; export parquet or jsonl")
    vocabulary = _vocabulary(published.manifest) if tokens else None

    def each_block() -> Iterator[tuple[list[Any], np.ndarray[Any, Any], dict[str, np.ndarray[Any, Any]]]]:
        for ids, arrays in reader.ragged_blocks():
            offsets = arrays.pop("offsets")
            if vocabulary is not None:
                arrays["tokens"] = vocabulary[np.asarray(arrays["indices"])]
            yield ids, offsets, arrays

    if fmt == "jsonl":
        with _written_whole(target) as tmp, open(tmp, "w", encoding="utf-8") as out:
            for ids, offsets, arrays in each_block():
                for row, rid in enumerate(ids):
                    a, b = int(offsets[row]), int(offsets[row + 1])
                    fields = {name: array[a:b].tolist() for name, array in arrays.items()}
                    out.write(json.dumps({"id": rid, **fields}, ensure_ascii=False) + "\n")
        return [target.path]
    schema: Any = None
    with _written_whole(target) as tmp:
        writer: Any = None
        try:
            for ids, offsets, arrays in each_block():
                if writer is None:
                    # A token matrix's entries are vectors: a list of fixed-size lists, as a dense row is one.
                    types = {name: _arrow_type(pa, a) for name, a in arrays.items()}
                    schema = pa.schema([("id", pa.string()), *((n, pa.list_(t)) for n, t in types.items())])
                    writer = pq.ParquetWriter(tmp, schema)
                for start in range(0, len(ids), BATCH_ROWS):
                    stop = min(start + BATCH_ROWS, len(ids))
                    writer.write_table(
                        _ragged_batch(pa, schema, ids[start:stop], offsets[start : stop + 1], arrays)
                    )
        finally:
            if writer is not None:
                writer.close()
    return [target.path]
