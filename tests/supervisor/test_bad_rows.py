"""A corpus file's bad rows in one error (supervisor/corpus/bad_rows.py): the first as before, then
those the reader finds reading on, bounded in rows and seconds; no record after the first bad row."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from chunkq.jobs.contract.errors import CorpusError
from chunkq.supervisor.corpus import bad_rows
from chunkq.supervisor.corpus.records import CorpusOptions, detect_format, read_corpus


def _refusal(path: Path, **options: int) -> tuple[list[str], list[str]]:
    """The ids read before the refusal, and the refusal's lines."""
    read: list[str] = []
    with pytest.raises(CorpusError) as refused:
        for record in read_corpus(path, CorpusOptions(format=detect_format(path), **options)):
            read.append(record.id)
    return read, str(refused.value).splitlines()


def _jsonl(path: Path, rows: dict[int, str], count: int) -> Path:
    """``count`` good records, line N replaced by ``rows[N]``."""
    lines = [rows.get(n, json.dumps({"id": n, "text": f"text {n}"})) for n in range(1, count + 1)]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_every_bad_row_of_a_jsonl_file_is_named_once_the_first_first(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "c.jsonl", {3: '{"id": 3, "text": }', 5: '{"id": 5, "text": ""}', 9: "[1]"}, 12)
    (tmp_path / "c.jsonl").write_bytes(path.read_bytes().replace(b'"text 7"', b'"\xc3\x28"'))
    read, lines = _refusal(path)
    assert read == ["1", "2"]  # nothing after the first bad row is yielded, though the file is read on
    assert lines == [
        f"{path}:3: invalid JSON (Expecting value at column 19)",
        f"3 more bad rows in {path}:",
        f"  {path}:5: text field 'text' is empty",
        f"  {path}:7: not valid UTF-8 (invalid continuation byte at byte 19)",
        f"  {path}:9: expected a JSON object, got list",
    ]


def test_one_bad_row_keeps_its_one_line(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "c.jsonl", {4: '{"id": 4}'}, 10)
    assert _refusal(path) == (["1", "2", "3"], [f"{path}:4: missing text field 'text'"])


def test_csv_and_parquet_rows_are_named_the_same_way(tmp_path: Path) -> None:
    csv = tmp_path / "c.csv"
    csv.write_text("id,text\n1,a\n2,b,extra\n3,c\n4,\n")
    assert _refusal(csv) == (
        ["1"],
        [
            f"{csv}:3: 3 columns where the header has 2",
            f"1 more bad row in {csv}:",
            f"  {csv}:5: text field 'text' is empty",
        ],
    )
    parquet = tmp_path / "c.parquet"
    pq.write_table(pa.table({"id": ["a", "b", "c", "d"], "text": ["x", None, "y", " "]}), parquet)
    assert _refusal(parquet) == (
        ["a"],
        [
            f"{parquet}: row 2: text field 'text' is null, not a string",
            f"1 more bad row in {parquet}:",
            f"  {parquet}: row 4: text field 'text' is empty",
        ],
    )


def test_the_list_stops_at_its_length_and_where_the_reader_cannot_go_on(tmp_path: Path) -> None:
    many = _jsonl(tmp_path / "many.jsonl", {n: f'{{"id": {n}}}' for n in range(2, 80, 2)}, 80)
    read, lines = _refusal(many)
    assert read == ["1"] and len(lines) == 1 + 1 + (bad_rows.SHOWN - 1) + 1
    assert lines[1] == f"{bad_rows.SHOWN - 1} more bad rows in {many}:"
    assert lines[-2] == f"  {many}:{2 * bad_rows.SHOWN}: missing text field 'text'"
    assert lines[-1] == f"  (stopped at {bad_rows.SHOWN} bad rows; the rest is not checked)"
    # a line over the limit is never read whole: the reading ends at it, and says so
    over = _jsonl(
        tmp_path / "over.jsonl", {2: '{"id": 2, "text": }', 4: json.dumps({"id": 4, "text": "x" * 70_000})}, 6
    )
    _, lines = _refusal(over, max_text_bytes=100)
    assert lines[1:] == [
        f"1 more bad row in {over}:",
        f"  {over}:4: line is over the limit of {6 * 100 + (1 << 16)} bytes",
        "  (the reader stops at the last; the rest is not checked)",
    ]


def test_a_misnamed_id_field_is_one_error_not_one_a_row(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "c.jsonl", {}, 30)
    with pytest.raises(CorpusError) as refused:
        list(read_corpus(path, CorpusOptions(format="jsonl", id_field="doc_id")))
    assert str(refused.value).startswith(f"{path}:1: no id field 'doc_id' (--id-field)")
    assert len(str(refused.value).splitlines()) == 1


def test_reading_on_is_bounded_in_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bad_rows, "SCAN_SECONDS", 0.0)
    monkeypatch.setattr(bad_rows, "_CHECK_EVERY", 3)
    path = _jsonl(tmp_path / "c.jsonl", {2: '{"id": 2, "text": ""}', 40: '{"id": 40, "text": ""}'}, 50)
    read, lines = _refusal(path)
    assert read == ["1"] and lines == [
        f"{path}:2: text field 'text' is empty",
        f"no other bad row in {path} so far:",
        f"  (read on for 0 s, to {path}:5; the rest is not checked)",
    ]


def test_a_misnamed_text_field_is_one_error_naming_the_fields_and_columns_are_the_lines_own(
    tmp_path: Path,
) -> None:
    """A hostile pass: --text-field txt gave twenty "missing text field" lines, and an error at the
    end of a line was placed at column 1 (of the line after, the line end included)."""
    path = _jsonl(tmp_path / "c.jsonl", {}, 30)
    with pytest.raises(CorpusError) as refused:
        list(read_corpus(path, CorpusOptions(format="jsonl", text_field="txt")))
    assert (
        str(refused.value)
        == f"{path}:1: missing text field 'txt' (--text-field); this record's fields: 'id', 'text'"
    )
    cut = _jsonl(tmp_path / "cut.jsonl", {2: '{"id": "x", ', 3: '{"id": "d9", "text": "broken'}, 4)
    assert _refusal(cut)[1] == [
        f"{cut}:2: invalid JSON (Expecting property name enclosed in double quotes at column 13)",
        f"1 more bad row in {cut}:",
        f"  {cut}:3: invalid JSON (Unterminated string starting at column 22)",
    ]
