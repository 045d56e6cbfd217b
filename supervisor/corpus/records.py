"""Streaming corpus readers: JSON Lines, CSV, Parquet and plain text, one (id, text) at a time.

Memory stays flat in the corpus size. Every error names the file and the line (or row). When a
corpus has no id field, ids are line numbers (row numbers for CSV and Parquet), counted from 1.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from chunkq.jobs.contract.defaults import DEFAULT_ID_FIELD, DEFAULT_TEXT_FIELD
from chunkq.jobs.contract.errors import CorpusError
from chunkq.jobs.contract.storage import is_local
from chunkq.jobs.kinds.cross import pair_text
from chunkq.supervisor.corpus.bad_rows import BadRows, WholeFileError
from chunkq.supervisor.corpus.row_text import MAX_TEXT_BYTES, check_text, unicode_checked

FORMATS = ("jsonl", "csv", "parquet", "txt")
_SUFFIXES = {".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv", ".parquet": "parquet", ".txt": "txt"}


@dataclass(frozen=True)
class CorpusOptions:
    """How to read a corpus; part of a run's identity."""

    format: str
    text_field: str = DEFAULT_TEXT_FIELD
    id_field: str = DEFAULT_ID_FIELD
    max_text_bytes: int = MAX_TEXT_BYTES  # a longer line or text is a data bug, not a document
    pair_field: str | None = None  # --kind cross: the second text of each pair (the passage)
    extra_fields: tuple[str, ...] = ()  # export --columns: fields copied beside each row (not read by runs)


class Record(NamedTuple):
    id: str
    text: str
    where: str  # "file:line" or "file: row N", for error messages
    extra: dict[str, Any] | None = None  # CorpusOptions.extra_fields: their values (None where absent)


def _extra(record: dict[str, Any], opts: CorpusOptions) -> dict[str, Any] | None:
    return {name: record.get(name) for name in opts.extra_fields} if opts.extra_fields else None


def detect_format(path: Path, given: str | None = None) -> str:
    if given:
        if given not in FORMATS:
            raise CorpusError(f"{path}: unknown format {given!r}; use one of {', '.join(FORMATS)}")
        return given
    fmt = _SUFFIXES.get(path.suffix.lower())
    if fmt is None and is_local(path) and path.is_dir():  # not "cannot tell the format" of a folder
        raise CorpusError(f"{path}: is a directory, not a corpus file")
    if fmt is None:
        raise CorpusError(
            f"{path}: cannot tell the format from the suffix {path.suffix!r}; "
            f"pass --format ({', '.join(FORMATS)})"
        )
    return fmt


def check_regular_file(path: Path) -> None:
    """A corpus is a regular file, checked without opening it (a FIFO would block the open)."""
    if not path.exists():
        raise CorpusError(f"{path}: no such file")
    if path.is_dir():
        raise CorpusError(f"{path}: is a directory, not a corpus file")
    if not path.is_file():
        # A pipe (`<(cat c.jsonl)`), FIFO or device would hang, or lose what one pass read: chunkq
        # reads a corpus twice (its checksum, then its rows).
        raise CorpusError(
            f"{path}: not a regular file (a pipe, FIFO or device); chunkq reads a corpus twice "
            "(checksum, then rows): save it to a file first"
        )


def cannot_read(path: Path, exc: OSError) -> CorpusError:
    return CorpusError(f"{path}: cannot read: {exc.strerror or exc}")


class _IdPolicy:
    """Ids from the id field if the first record has one (then every record needs it), else row
    numbers (after ``prefix``, which tells the files of a run apart); a field other than the
    default that the first record lacks is refused."""

    def __init__(self, path: Path, field: str, prefix: str = "") -> None:
        self.path, self.field, self.prefix = path, field, prefix
        self.from_field: bool | None = None

    def pick(self, record: dict[str, Any], where: str, number: int, escaped: bool = True) -> str:
        # The field's presence decides, not its value: a first record with a null id must not turn
        # every later id into a line number.
        present = self.field in record
        if self.from_field is None:
            if not present and self.field != DEFAULT_ID_FIELD:
                # A field asked for by name that the first record lacks is a typo, not "no ids":
                # a newcomer's --id-field doc_id gave ids 1, 2, 3... and said nothing.
                fields = ", ".join(repr(name) for name in list(record)[:10])
                raise WholeFileError(
                    f"{where}: no id field {self.field!r} (--id-field); this record's fields: {fields}. "
                    f"Without --id-field, a corpus whose first record has no {DEFAULT_ID_FIELD!r} is "
                    "numbered by line"
                )
            self.from_field = present
        if not self.from_field:
            return f"{self.prefix}{number}"
        if not present:
            raise CorpusError(f"{where}: missing id field {self.field!r} (earlier records have one)")
        value = record[self.field]
        if value is None:
            raise CorpusError(f"{where}: id {self.field!r} is null")
        if isinstance(value, bool) or not isinstance(value, str | int):
            raise CorpusError(
                f"{where}: id {self.field!r} is {type(value).__name__}, expected a string or integer"
            )
        rid = unicode_checked(str(value), f"id {self.field!r}", where) if escaped else str(value)
        if "\0" in rid:  # PostgreSQL's text, C strings and most stores cannot hold it (issue 63.5)
            raise CorpusError(
                f"{where}: id {self.field!r} holds a NUL character (\\u0000 at character "
                f"{rid.index(chr(0))}), which an id cannot carry into every store; remove it"
            )
        return rid


def _text_of(record: dict[str, Any], opts: CorpusOptions, where: str, escaped: bool = True) -> str:
    """The row's text; with a pair field, the pair as one row text (jobs.kinds.cross.pair_text).
    ``escaped``: whether the text may hold a lone surrogate (checked then)."""
    text = _field_text(record, opts.text_field, opts, where, escaped)
    if opts.pair_field is None:
        return text
    return pair_text(text, _field_text(record, opts.pair_field, opts, where, escaped))


def _field_text(record: dict[str, Any], field: str, opts: CorpusOptions, where: str, escaped: bool) -> str:
    if field not in record:
        raise CorpusError(f"{where}: missing text field {field!r}")
    text = record[field]
    if not isinstance(text, str):
        kind = "null" if text is None else type(text).__name__
        raise CorpusError(f"{where}: text field {field!r} is {kind}, not a string")
    return check_text(text, where, opts.max_text_bytes, field, escaped)


_BOM = "\ufeff".encode()
CSV_LINE_SLACK = 1 << 16  # a CSV line holds its id and other columns beside a text at the limit
JSON_ESCAPE_BYTES = 6  # the longest a character's JSON form takes: "\u0001" for one byte of text


def _json_line_limit(opts: CorpusOptions) -> int:
    """A JSON Lines line's limit: its texts at the limit, every character escaped, and the rest. At
    the text limit alone, a 200,000-character Chinese text (600 KB) that json.dumps wrote escaped
    (1.2 MB) was refused as a line over the limit, and so was every text near 1 MiB."""
    return JSON_ESCAPE_BYTES * opts.max_text_bytes * len(_text_fields(opts)) + CSV_LINE_SLACK


READ_BLOCK = 1 << 20


def _raw_lines(fh: Any, limit: int) -> Iterator[bytes]:
    """A binary file's lines, each cut at ``limit + 2`` bytes as ``readline(limit + 2)`` cuts it,
    from any file object: fsspec's buffered files (s3://, gs://) take no size in ``readline``. A
    line over the limit is never held whole: its first ``limit + 2`` bytes end the stream."""
    pending = b""
    while block := fh.read(READ_BLOCK):
        pending += block
        start = 0
        while (cut := pending.find(b"\n", start, start + limit + 2)) >= 0:
            yield pending[start : cut + 1]
            start = cut + 1
        if len(pending) - start >= limit + 2:
            yield pending[start : start + limit + 2]
            return
        pending = pending[start:]
    if pending:
        yield pending


def _lines(path: Path, limit: int, bad: BadRows | None = None) -> Iterator[tuple[int, str]]:
    """The file's lines, numbered; with ``bad``, a line that is not UTF-8 is told to it and skipped."""
    with path.open("rb") as fh:
        lineno = 0
        for raw in _raw_lines(fh, limit):  # never more of a line than the limit allows
            lineno += 1
            if lineno == 1 and raw.startswith(_BOM):  # written by Excel and Windows tools
                raw = raw[len(_BOM) :]
            if len(raw.rstrip(b"\r\n")) > limit:
                over = CorpusError(f"{path}:{lineno}: line is over the limit of {limit} bytes")
                raise over if bad is None else bad.stop(over)
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                undecoded = CorpusError(
                    f"{path}:{lineno}: not valid UTF-8 ({exc.reason} at byte {exc.start})"
                )
                if bad is None:
                    raise undecoded from None
                bad.add(undecoded)
                continue
            yield lineno, line


# json.loads's own scanner, without the 1.4 us a call json.loads spends around it
_scan_json: Any = json.JSONDecoder().scan_once  # type: ignore[attr-defined]


def _json_line(line: str, where: str) -> Any:
    """The line's one JSON value, as ``json.loads`` reads it (which also names what is wrong)."""
    try:
        value, end = _scan_json(line, 0)
        if not line[end:].strip():
            return value
    except (StopIteration, json.JSONDecodeError):  # leading blanks, or no value: json.loads says which
        pass
    try:
        # Without its line end: an error at the end of the line ("Expecting value") was placed at
        # column 1 of the line after, and a string left open ended at the newline, "Invalid control
        # character" (a hostile pass).
        return json.loads(line.rstrip("\r\n"))
    except json.JSONDecodeError as exc:
        # json's own words for some errors end in " at" ("Invalid control character at"): one "at".
        said = exc.msg.removesuffix(" at")
        raise CorpusError(f"{where}: invalid JSON ({said} at column {exc.colno})") from None


def _read_jsonl(path: Path, opts: CorpusOptions, prefix: str) -> Iterator[Record]:
    ids = _IdPolicy(path, opts.id_field, prefix)
    name, bad = str(path), BadRows(path)
    for lineno, line in _lines(path, _json_line_limit(opts), bad):
        if not line.strip():
            continue
        where = f"{name}:{lineno}"
        try:
            record = _json_line(line, where)
            if not isinstance(record, dict):
                raise CorpusError(f"{where}: expected a JSON object, got {type(record).__name__}")
            if ids.from_field is None:  # the first record: a field it lacks was named wrong
                _named_fields(record, opts, where)
            # A lone surrogate comes only from a \u escape: raw UTF-8 holding one does not decode.
            escaped = "\\u" in line
            row = Record(  # not _row: a call fewer a line, on the readers' busiest path
                ids.pick(record, where, lineno, escaped),
                _text_of(record, opts, where, escaped),
                where,
                _extra(record, opts),
            )
        except CorpusError as exc:
            bad.add(exc)
            continue
        if not (bad.found and bad.reading_on(where)):  # the check costs a call only after a bad row
            yield row
    bad.end()


def _named_fields(record: dict[str, Any], opts: CorpusOptions, where: str) -> None:
    """A JSON Lines file's first record has the text fields: a misspelled --text-field gave one
    "missing text field" a row, twenty of them, where one line says what the file holds."""
    for field in _text_fields(opts):
        if field not in record:
            fields = ", ".join(repr(name) for name in list(record)[:10])
            flag = "--text-field" if field == opts.text_field else "--pair-field"
            raise WholeFileError(
                f"{where}: missing text field {field!r} ({flag}); this record's fields: {fields}"
            )


def _text_fields(opts: CorpusOptions) -> tuple[str, ...]:
    return (opts.text_field,) if opts.pair_field is None else (opts.text_field, opts.pair_field)


def _read_txt(path: Path, opts: CorpusOptions, prefix: str) -> Iterator[Record]:
    if opts.pair_field is not None:
        raise CorpusError(
            f"{path}: a text file holds one text a line, not pairs; use JSON Lines, CSV or Parquet"
        )
    bad = BadRows(path)
    for lineno, line in _lines(path, opts.max_text_bytes, bad):
        text = line.rstrip("\r\n")
        if text.strip() and not (bad.found and bad.reading_on(f"{path}:{lineno}")):
            yield Record(f"{prefix}{lineno}", text, f"{path}:{lineno}")
    bad.end()


def _read_csv(path: Path, opts: CorpusOptions, prefix: str) -> Iterator[Record]:
    ids = _IdPolicy(path, opts.id_field, prefix)
    # The csv module refuses fields over 131,072 characters by default; the limit is chunkq's own.
    csv.field_size_limit(max(csv.field_size_limit(), opts.max_text_bytes + 1))
    # Physical lines bounded as every reader's are: a huge line is refused by number, never read
    # whole by the csv module (a 1 GB line peaked at 2.17 GB before).
    read = [0]  # the last physical line read: the csv module's line_num lags behind it at an error

    def lines() -> Iterator[str]:
        for read[0], line in _lines(path, opts.max_text_bytes + CSV_LINE_SLACK):
            yield line

    # strict: a quote left open swallowed the lines after it into one text (a hostile pass's file
    # published 4 rows of 5, exit 0); a quote closed mid-field ("ok"trailing) was joined silently.
    reader = csv.DictReader(lines(), strict=True)
    bad, ended = BadRows(path), 1
    try:
        _check_csv_header(reader.fieldnames or [], opts, path)
        for number, row in enumerate(reader, 1):
            where = f"{path}:{reader.line_num}"
            try:
                record = _csv_record(row, len(reader.fieldnames or []), ids, opts, where, number)
            except CorpusError as exc:
                bad.add(exc)
                continue
            finally:
                ended = read[0]
            if not (bad.found and bad.reading_on(where)):
                yield record
    except csv.Error as exc:
        raise bad.stop(_malformed_csv(path, exc, ended + 1, read[0])) from None
    bad.end()


def _check_csv_header(header: Sequence[str], opts: CorpusOptions, path: Path) -> None:
    for name in _text_fields(opts):
        if name not in header:
            raise CorpusError(f"{path}:1: header has no column {name!r} (columns: {', '.join(header)})")
    for name in {*_text_fields(opts), opts.id_field}:
        if header.count(name) > 1:  # DictReader keeps the last one's values, silently
            raise CorpusError(f"{path}:1: header names column {name!r} {header.count(name)} times")


def _malformed_csv(path: Path, exc: csv.Error, began: int, at: int) -> CorpusError:
    if at <= began:
        return CorpusError(f"{path}:{at}: malformed CSV: {exc}")
    return CorpusError(
        f"{path}:{began}: malformed CSV: {exc} at line {at}, in the record that began on line {began} "
        "(a quote opened there and not closed where its field ends?)"
    )


def _csv_record(
    row: dict[Any, Any], columns: int, ids: _IdPolicy, opts: CorpusOptions, where: str, number: int
) -> Record:
    if None in row or any(value is None for value in row.values()):
        # DictReader files a longer row's extra values under None, a shorter row's gaps as None.
        found = sum(v is not None for k, v in row.items() if k is not None) + len(row.get(None) or [])
        plural = "" if found == 1 else "s"
        raise CorpusError(f"{where}: {found} column{plural} where the header has {columns}")
    return _row(ids, row, opts, where, number)


def _row(
    ids: _IdPolicy, record: dict[str, Any], opts: CorpusOptions, where: str, number: int, escaped: bool = True
) -> Record:
    return Record(
        ids.pick(record, where, number, escaped),
        _text_of(record, opts, where, escaped),
        where,
        _extra(record, opts),
    )


PARQUET_BATCH_ROWS = 1024


def _refuse_long_texts(column: Any, limit: int, path: Path, before: int) -> None:
    """Refuse a text over the limit from Arrow's byte lengths, before it is copied into Python."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if pa.types.is_dictionary(column.type):
        column = column.dictionary_decode()
    if getattr(pa.types, "is_string_view", lambda _: False)(column.type):  # binary_length takes no views
        column = column.cast(pa.large_string())
    if len(column) == 0 or pc.max(pc.binary_length(column)).as_py() <= limit:
        return
    over = pc.indices_nonzero(pc.greater(pc.binary_length(column), limit))[0].as_py()
    raise CorpusError(f"{path}: row {before + over + 1}: text is over the limit of {limit} bytes")


def _read_parquet(path: Path, opts: CorpusOptions, prefix: str) -> Iterator[Record]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        # A local file by name; an object (s3://, gs://) through fsspec, read in ranges as Arrow asks.
        pfile = pq.ParquetFile(str(path) if is_local(path) else path.open("rb"))
    except (pa.ArrowException, OSError) as exc:
        raise CorpusError(f"{path}: not a readable Parquet file: {exc}") from None
    ids = _IdPolicy(path, opts.id_field, prefix)
    number, bad = 0, BadRows(path)
    for batch in pfile.iter_batches(
        batch_size=PARQUET_BATCH_ROWS, columns=_parquet_columns(pfile, opts, path)
    ):
        try:
            for name in _text_fields(opts):
                _refuse_long_texts(batch.column(name), opts.max_text_bytes, path, number)
        except CorpusError as exc:  # never copied into Python: the reading stops there
            raise bad.stop(exc) from None
        for record in batch.to_pylist():
            number += 1
            where = f"{path}: row {number}"
            try:
                row = _row(ids, record, opts, where, number)
            except CorpusError as exc:
                bad.add(exc)
                continue
            if not (bad.found and bad.reading_on(where)):
                yield row
    bad.end()


def _parquet_columns(pfile: Any, opts: CorpusOptions, path: Path) -> list[str]:
    """The columns a run reads, once the schema shows each as it must be."""
    import pyarrow as pa

    schema = pfile.schema_arrow
    for name in _text_fields(opts):
        if name not in schema.names:
            raise CorpusError(f"{path}: no column {name!r} (columns: {', '.join(schema.names)})")
        text_type = schema.field(name).type
        if pa.types.is_dictionary(text_type):  # how pyarrow and pandas write repetitive string columns
            text_type = text_type.value_type
        # string_view: what Polars and pyarrow's newer writers may give a text column (a hostile pass)
        kinds = (pa.types.is_string, pa.types.is_large_string, getattr(pa.types, "is_string_view", None))
        if not any(kind(text_type) for kind in kinds if kind is not None):
            raise CorpusError(f"{path}: column {name!r} has type {text_type}, expected string")
    if opts.id_field not in schema.names and opts.id_field != DEFAULT_ID_FIELD:  # see _IdPolicy
        raise CorpusError(
            f"{path}: no column {opts.id_field!r} (--id-field; columns: {', '.join(schema.names)})"
        )
    columns = [*_text_fields(opts)] + ([opts.id_field] if opts.id_field in schema.names else [])
    columns += [name for name in opts.extra_fields if name in schema.names and name not in columns]
    return columns


_READERS = {"jsonl": _read_jsonl, "csv": _read_csv, "parquet": _read_parquet, "txt": _read_txt}


def read_corpus(path: Path, opts: CorpusOptions, number_prefix: str = "") -> Iterator[Record]:
    """Yield (id, text) in corpus order; raise CorpusError naming the file and line on bad input,
    or the file when it cannot be read."""
    check_regular_file(path)
    return _readable(_READERS[opts.format](path, opts, number_prefix), path)


def _readable(records: Iterator[Record], path: Path) -> Iterator[Record]:
    try:
        yield from records
    except OSError as exc:
        raise cannot_read(path, exc) from exc
