"""Sinks: a published, verified result written where people search it (docs/sinks.md).

``chunkq export RUN --to URL`` and ``RunResult.export_to(URL)``. One module per sink, chosen by the
URL's scheme; each reads the published result and nothing else, and writes it idempotently by id,
so an export that is killed and run again ends with exactly the run's rows:

- ``lancedb://PATH/TABLE`` (``lance``): an embedded LanceDB table, rows merged by id.
- ``faiss:PATH`` (``faiss_index``): a FAISS index file (``--index``, trained on a sample of the run)
  and its ids beside it, built whole and put in place at once.
- ``postgresql://.../DB?table=T`` (``pgvector``): a pgvector table, rows upserted by id a batch per
  transaction.

Those and the file formats (``files``: Parquet, .npy, JSON Lines) are one table,
``destinations.DESTINATIONS``.

A dense run writes a vector column, a sparse run a sparse one (pgvector's ``sparsevec``, LanceDB's
index and value lists): two runs of one corpus exported to one table are one row per id with both
columns (a column the table lacks is added), which is what hybrid search reads (docs/hybrid.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from chunkq.jobs.contract.errors import StoreError, StoreWriteError, refused_write
from chunkq.jobs.contract.redaction import redact, redacted
from chunkq.jobs.contract.run import Run
from chunkq.sinks.corpus_columns import CorpusColumns, check_columns
from chunkq.sinks.destinations import for_url, outside_the_store
from chunkq.sinks.row_texts import HASH_COLUMN, RowHashes
from chunkq.sinks.rows import SPARSE, Rows, most_active, row_keys, row_kind, sparse_batches
from chunkq.sinks.same_rows import Held, check_same_rows
from chunkq.supervisor.result.reader import LEVELS, PublishedResult, open_result

SINK_BATCH_ROWS = 4096  # rows a sink is given at once: memory stays one batch whatever the run's size


class Sink(Protocol):
    label: str  # how messages name the destination: "--to URL: table T", the URL without a password
    # True: nothing reaches the destination before close() (built aside, put in place at once), so
    # the result is checked as it is read; False (a table written a batch at a time): checked whole
    # before the first row is written, a second read.
    whole: bool

    def writes_to(self) -> list[str]:
        """The local paths it writes (checked to lie outside the store); [] for a server."""
        ...

    def open(self, rows: Rows) -> None:
        """Connect, and check that the destination can take these rows; nothing written yet."""
        ...

    def columns(self) -> set[str]:
        """The columns this export writes (none for an index file)."""
        ...

    def held(self) -> Held | None:
        """What an existing table holds, where it holds rows; None otherwise."""
        ...

    def prepare(self) -> None:
        """Create the destination, or add the columns it lacks: after every check has passed."""
        ...

    def write(self, ids: list[str], vectors: Any, columns: dict[str, list[Any]]) -> None:
        """``vectors``: a matrix (``rows.kind`` dense) or ``SparseRows`` (sparse)."""
        ...

    def close(self) -> dict[str, Any]: ...

    def abort(self) -> None: ...


@dataclass
class Progress:
    total: int
    written: int = 0
    started: float = field(default_factory=time.monotonic)

    def summary(self) -> dict[str, Any]:
        seconds = time.monotonic() - self.started
        return {
            "rows": self.total,
            "written": self.written,
            "seconds": round(seconds, 2),
            "rows_per_second": round(self.written / seconds, 1) if seconds > 0 else None,
        }


def open_sink(url: str, options: dict[str, Any]) -> Sink:
    """The sink ``url`` names, by its scheme in the table of destinations; ConfigError for a scheme
    chunkq does not write."""
    return for_url(url).open(url, options)


# Errors of the stores' own clients (FAISS's C++ ones arrive as a plain RuntimeError): a sink turns
# what it can foresee into a line of its own; whatever else they raise is still said in one line.
CLIENT_MODULES = frozenset({"psycopg", "lancedb", "lance", "pyarrow", "faiss"})


def _one_line(exc: BaseException, url: str) -> BaseException:
    why = refused_write(exc)  # a full disk, in LanceDB's Rust and FAISS's C++ words too
    if why is not None:
        return StoreWriteError(
            f"--to {redacted(url)}: {why} where the export writes; make room (or fix the permissions) "
            "and run the same export again: it writes the run's rows by id, so it ends with exactly them"
        )
    module = type(exc).__module__.split(".")[0]
    if module not in CLIENT_MODULES and type(exc) is not RuntimeError:
        return exc
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return StoreError(f"--to {redacted(url)}: {type(exc).__name__}: {redact(first)}")


def _shape(published: Run, options: dict[str, Any], columns: tuple[str, ...]) -> tuple[PublishedResult, Rows]:
    """The published result, opened at its level, and what its rows are as the sink is told."""
    result = open_result(published, str(options.get("level") or LEVELS[0]))
    run = result.run
    kind = row_kind(run)
    if result.level == "document":
        normalized = bool(((run.plan or {}).get("windows") or {}).get("normalize"))
    elif run.unit_length is not None:  # recorded at submit, from the model's files
        normalized = run.unit_length
    else:  # a run from before it was recorded, or whose model was not on the submitting host
        normalized = bool(run.options.get("normalize_embeddings"))
        if not normalized and run.kind == "dense":
            from chunkq.jobs.compute.model_info import describe

            normalized = describe(run.model, run.options.get("revision")).normalizes
    column = options.get("column")
    check_columns(columns, column)
    rows = Rows(
        published.run_id,
        result.rows,
        result.dim,
        run.output_dtype,
        normalized,
        result.windowed,
        columns,
        kind,
        column,
        most_active(result) if kind == SPARSE else None,
    )
    return result, rows


def _run_keys(result: PublishedResult, rows: Rows) -> Any:
    """The run's rows as a table is keyed: each row's id and text hash (pyarrow)."""
    import pyarrow as pa

    hashes = RowHashes(result.layout, result.run, result.level)
    keys: list[str] = []
    digests: list[str] = []
    for ids in result.ids():
        keys += row_keys(ids, rows.windowed)[0]
        digests += hashes.of(ids)
    return pa.table({"id": pa.array(keys, pa.string()), HASH_COLUMN: pa.array(digests, pa.string())})


def export_to(
    published: Run,
    url: str,
    options: dict[str, Any] | None = None,
    on_progress: Callable[[Progress], None] | None = None,
    batch_rows: int = SINK_BATCH_ROWS,
    columns: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Write RUN's published result to ``url``; a summary (rows, written, seconds, rows/s, and what
    the sink says of itself). No damaged row reaches the destination: a sink that puts its output in
    place at once reads the result once, checked on the way; a table is checked whole first.
    ``options``: ``index`` (FAISS), ``force`` (FAISS), ``column`` (the vector column's name),
    ``level`` (``document``: a windowed run's vectors per text)."""
    options = options or {}
    layout = published.layout
    result, rows = _shape(published, options, columns)
    run, level = result.run, result.level
    corpus = CorpusColumns(run, columns, rows.windowed) if columns else None
    sink = open_sink(url, options)
    outside_the_store(layout.store, sink.writes_to(), f"--to {redacted(url)}")
    progress = Progress(rows.rows)
    batches: Iterator[tuple[list[Any], Any]] = (
        sparse_batches(result, batch_rows) if rows.kind == SPARSE else result.batches(batch_rows)
    )
    if not sink.whole:
        result.verify()
    try:
        sink.open(rows)
        held = sink.held()
        if held is not None:  # rows there already: the same corpus rows, or nothing is touched
            check_same_rows(sink.label, held, _run_keys(result, rows), sink.columns())
        hashes = RowHashes(layout, run, level) if HASH_COLUMN in sink.columns() else None
        sink.prepare()
        if on_progress is not None:
            on_progress(progress)  # the destination ready, no row written yet
        for ids, block in batches:
            keys, extra = row_keys(ids, rows.windowed)
            if corpus is not None:
                extra.update(corpus.of(ids))
            if hashes is not None:
                extra[HASH_COLUMN] = hashes.of(ids)
            sink.write(keys, block, extra)
            progress.written += len(keys)
            if on_progress is not None:
                on_progress(progress)
        told = sink.close()
    except Exception as exc:
        sink.abort()
        raise _one_line(exc, url) from exc
    except BaseException:
        sink.abort()
        raise
    # A plain run's rows are its rows: "level" names a windowed run's choice ("window").
    shown = level if rows.windowed or level == "document" else "row"
    return {"url": redacted(url), "run_id": layout.run_id, "level": shown, **progress.summary(), **told}


__all__ = ["Progress", "Rows", "Sink", "export_to", "open_sink"]
