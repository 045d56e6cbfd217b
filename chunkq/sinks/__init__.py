"""Sinks: a published, verified result written where people search it (shared/DESIGN.md "Sinks").

``chunkq export RUN --to URL`` and ``RunResult.export_to(URL)``. One module per sink, chosen by the
URL's scheme (``SINKS``); each reads the published result and nothing else, and writes it
idempotently by id, so an export that is killed and run again ends with exactly the run's rows:

- ``lancedb://PATH/TABLE`` (``lance``): an embedded LanceDB table, rows merged by id.
- ``faiss:PATH`` (``faiss_index``): a FAISS index file (``--index``, trained on a sample of the run)
  and its ids beside it, built whole and put in place at once.
- ``postgresql://.../DB?table=T`` (``pgvector``): a pgvector table, rows upserted by id a batch per
  transaction.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from chunkq.jobs import kinds
from chunkq.jobs.errors import ConfigError, StoreError
from chunkq.jobs.run_files import RunLayout
from chunkq.jobs.storage import is_local
from chunkq.supervisor.result import verified_result

SINK_BATCH_ROWS = 4096  # rows a sink is given at once: memory stays one batch whatever the run's size


@dataclass(frozen=True)
class Rows:
    """What a sink is told of the result before its rows: their count, width and stored dtype, the
    run's metric (cosine where its vectors are unit length), and the run it is."""

    run_id: str
    rows: int
    dim: int
    dtype: str  # the result's output dtype: float32, float16, int8, uint8, binary, ubinary
    normalized: bool
    windowed: bool  # each row a window: its id is "<text id>#<window>", with the window's columns
    columns: tuple[str, ...] = ()  # --columns: corpus fields copied beside each row, as text


class Sink(Protocol):
    def writes_to(self) -> list[str]:
        """The local paths it writes (checked to lie outside the store); [] for a server."""
        ...

    def open(self, rows: Rows) -> None: ...

    def write(self, ids: list[str], vectors: np.ndarray[Any, Any], columns: dict[str, list[Any]]) -> None: ...

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


_PASSWORD_IN_QUERY = re.compile(r"(?i)((?:^|[?&;])password=)[^&;]*")


def redacted(url: str) -> str:
    """``url`` as every message, summary and log line shows it: no password, neither the one in its
    user part (``postgresql://u:SECRET@h/db``) nor one in its query (``?password=SECRET``)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    where, slash, tail = rest.partition("/")
    user, at, host = where.rpartition("@")
    name, _, password = user.partition(":")
    if at and password:
        where = f"{name}:***@{host}"
    return _PASSWORD_IN_QUERY.sub(r"\1***", f"{scheme}://{where}{slash}{tail}")


def open_sink(url: str, options: dict[str, Any]) -> Sink:
    """The sink ``url`` names, by its scheme; ConfigError for a scheme chunkq does not write."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "lancedb":
        from chunkq.sinks.lance import LanceSink

        return LanceSink(url)
    if scheme == "faiss":
        from chunkq.sinks.faiss_index import FaissSink

        return FaissSink(url, options.get("index") or "Flat", force=bool(options.get("force")))
    if scheme in ("postgresql", "postgres"):
        from chunkq.sinks.pgvector import PgvectorSink

        return PgvectorSink(url)
    raise ConfigError(
        f"--to {redacted(url)}: chunkq writes to lancedb://PATH/TABLE, faiss:PATH and "
        "postgresql://.../DB?table=T"
    )


def _outside_the_store(layout: RunLayout, sink: Sink, url: str) -> None:
    """No sink writes into the store (a FAISS index over ``result/embeddings.npy`` lost the result)."""
    if not is_local(layout.store):
        return
    store = os.path.realpath(layout.store)
    for path in sink.writes_to():
        where = os.path.realpath(path)
        if where == store or where.startswith(store + os.sep):
            where_said = f"--to {redacted(url)}"
            raise ConfigError(
                f"{where_said} is inside the store {layout.store}, which is chunkq's; export elsewhere"
            )


# Errors of the stores' own clients (FAISS's C++ ones arrive as a plain RuntimeError): a sink turns
# what it can foresee into a line of its own; whatever else they raise is still said in one line.
CLIENT_MODULES = frozenset({"psycopg", "lancedb", "lance", "pyarrow", "faiss"})


def _one_line(exc: BaseException, url: str) -> BaseException:
    module = type(exc).__module__.split(".")[0]
    if module not in CLIENT_MODULES and type(exc) is not RuntimeError:
        return exc
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return StoreError(f"--to {redacted(url)}: {type(exc).__name__}: {redacted_text(first, url)}")


def redacted_text(text: str, url: str) -> str:
    """``text`` with ``url``'s password taken out wherever a client's message repeated it."""
    for secret in _secrets(url):
        text = text.replace(secret, "***")
    return text


def _secrets(url: str) -> list[str]:
    from urllib.parse import parse_qs, unquote, urlsplit

    try:
        parts = urlsplit(url)
        found = [parts.password] if parts.password else []
        found += parse_qs(parts.query).get("password", [])
    except ValueError:
        return []
    return [s for s in found + [unquote(s) for s in found] if s]


def _row_ids(ids: list[Any], windowed: bool) -> tuple[list[str], dict[str, list[Any]]]:
    """Each row's key in the sink and the window columns: a window's id is its text's and number."""
    if not windowed:
        return [str(rid) for rid in ids], {}
    columns: dict[str, list[Any]] = {"text_id": [str(rid["id"]) for rid in ids]}
    for name in ("window", "char_start", "char_end", "tokens"):
        columns[name] = [int(rid[name]) for rid in ids]
    return [f"{rid['id']}#{rid['window']}" for rid in ids], columns


COLUMN_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")
RESERVED = frozenset({"id", "vector", "embedding", "text_id", "window", "char_start", "char_end", "tokens"})


def check_columns(columns: tuple[str, ...]) -> None:
    for name in columns:
        if not COLUMN_NAME.fullmatch(name) or name in RESERVED:
            raise ConfigError(
                f"--columns {name!r}: a corpus field named with letters, digits and underscores, other "
                f"than {', '.join(sorted(RESERVED))}"
            )


def _as_text(value: Any) -> str | None:
    return value if value is None or isinstance(value, str) else json.dumps(value, ensure_ascii=False)


class _CorpusColumns:
    """The corpus fields of each result row, read from the run's corpus in step with the result
    (both are in corpus order; a window's rows share their text's record)."""

    def __init__(self, manifest: Any, names: tuple[str, ...], windowed: bool) -> None:
        from chunkq.supervisor.submit import run_corpus_fields

        self.names, self.windowed = names, windowed
        self.records = run_corpus_fields(manifest, names)
        self.current: Any = None

    def of(self, ids: list[Any]) -> dict[str, list[Any]]:
        found: dict[str, list[Any]] = {name: [] for name in self.names}
        for rid in ids:
            key = str(rid["id"] if self.windowed else rid)
            while self.current is None or self.current.id != key:
                self.current = next(self.records, None)
                if self.current is None:
                    raise StoreError(f"--columns: row {key!r} of the result is not in the run's corpus")
            for name in self.names:
                found[name].append(_as_text((self.current.extra or {}).get(name)))
        return found


def _batches(layout: RunLayout, batch_rows: int) -> Iterator[tuple[list[Any], np.ndarray[Any, Any]]]:
    from chunkq.tools.export import _ResultReader

    reader = _ResultReader(layout)
    held_ids: list[Any] = []
    held: list[np.ndarray[Any, Any]] = []
    count = 0
    for ids, block in reader.batches():
        held_ids += ids
        held.append(block)
        count += len(ids)
        while count >= batch_rows:
            rows = np.concatenate(held)
            yield held_ids[:batch_rows], rows[:batch_rows]
            held_ids, held, count = held_ids[batch_rows:], [rows[batch_rows:]], count - batch_rows
    if held_ids:
        yield held_ids, np.concatenate(held)


def export_to(
    layout: RunLayout,
    url: str,
    options: dict[str, Any] | None = None,
    on_progress: Callable[[Progress], None] | None = None,
    batch_rows: int = SINK_BATCH_ROWS,
    columns: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Write RUN's published result to ``url``; a summary (rows, written, seconds, rows/s, and what
    the sink says of itself). The result is verified whole (every checksum) before a row is written."""
    run, result = verified_result(layout)
    if kinds.get(run.kind).ragged:
        raise ConfigError(f"run {layout.run_id} is {run.kind}: its rows vary in length; export it as Parquet")
    windowed = bool((run.plan or {}).get("windows"))
    normalized = bool(run.options.get("normalize_embeddings")) or bool((run.plan or {}).get("normalize"))
    if not normalized:
        from chunkq.jobs.model_info import describe

        normalized = describe(run.model, run.options.get("revision")).normalizes and run.kind == "dense"
    check_columns(columns)
    rows = Rows(
        layout.run_id,
        int(result["rows"]),
        int(result["dim"]),
        run.output_dtype,
        normalized,
        windowed,
        columns,
    )
    corpus = _CorpusColumns(run, columns, windowed) if columns else None
    sink = open_sink(url, options or {})
    _outside_the_store(layout, sink, url)
    progress = Progress(rows.rows)
    try:
        sink.open(rows)
        for ids, block in _batches(layout, batch_rows):
            keys, extra = _row_ids(ids, windowed)
            if corpus is not None:
                extra.update(corpus.of(ids))
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
    return {"url": redacted(url), "run_id": layout.run_id, **progress.summary(), **told}
