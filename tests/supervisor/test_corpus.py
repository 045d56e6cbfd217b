"""Corpus readers: every format yields the same rows; bad input names the file and line."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from chunkq.jobs.contract.errors import CorpusError
from chunkq.supervisor.corpus.records import CorpusOptions, check_regular_file, detect_format, read_corpus
from chunkq.supervisor.request import check_corpora
from tests.helpers import make_texts, write_corpus


def _read(path: Path, fmt: str | None = None, **kw: Any) -> list[tuple[str, str]]:
    return [(r.id, r.text) for r in read_corpus(path, CorpusOptions(format=detect_format(path, fmt), **kw))]


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet"])
def test_formats_with_ids_read_identically(tmp_path: Path, fmt: str) -> None:
    ids, texts = make_texts(50, seed=3)
    texts[5] = 'comma, "quote" and\nnewline'
    rows = _read(write_corpus(tmp_path / f"c.{fmt}", ids, texts, fmt))
    assert rows == list(zip(ids, texts, strict=True))


def test_txt_ids_are_line_numbers_and_blank_lines_are_skipped(tmp_path: Path) -> None:
    path = tmp_path / "c.txt"
    path.write_text("first\n\nthird\r\nfourth\n", encoding="utf-8")
    assert _read(path) == [("1", "first"), ("3", "third"), ("4", "fourth")]


def test_jsonl_without_id_field_uses_line_numbers(tmp_path: Path) -> None:
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "a"}\n\n{"text": "b"}\n', encoding="utf-8")
    assert _read(path) == [("1", "a"), ("3", "b")]


def test_custom_fields(tmp_path: Path) -> None:
    path = tmp_path / "c.jsonl"
    path.write_text('{"key": 7, "body": "x"}\n', encoding="utf-8")
    assert _read(path, text_field="body", id_field="key") == [("7", "x")]


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet"])
def test_an_id_field_asked_for_by_name_that_the_corpus_lacks_is_refused(tmp_path: Path, fmt: str) -> None:
    """A typo in --id-field numbered every row by line and said nothing (a newcomer's pass); the
    same typo in --text-field was refused. The default field, absent, still means line numbers."""
    ids, texts = make_texts(3, seed=4)
    path = write_corpus(tmp_path / f"c.{fmt}", ids, texts, fmt)
    lacks = {
        "parquet": r"c.parquet: no column 'doc_id' \(--id-field; columns: id, text\)",
        "csv": r"c.csv:2: no id field 'doc_id' \(--id-field\); this record's fields: 'id', 'text'",
        "jsonl": r"c.jsonl:1: no id field 'doc_id' \(--id-field\); this record's fields: 'id', 'text'",
    }[fmt]
    with pytest.raises(CorpusError, match=lacks):
        _read(path, id_field="doc_id")
    assert [row_id for row_id, _ in _read(path, id_field="id")] == ids


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"id": 1, "text": "ok"}\n{"id": 2, "text": \n', "c.jsonl:2: invalid JSON"),
        ('{"id": 1, "text": "a\tb"}\n', "c.jsonl:1: invalid JSON (Invalid control character at column 21)"),
        ('{"id": 1, "text": "ok"}\n{"id": 2}\n', "c.jsonl:2: missing text field 'text'"),
        ('{"id": 1, "text": 5}\n', "c.jsonl:1: text field 'text' is int, not a string"),
        ('{"id": 1, "text": null}\n', "c.jsonl:1: text field 'text' is null"),
        ('["a list"]\n', "c.jsonl:1: expected a JSON object, got list"),
        ('{"id": 1, "text": "a"}\n{"text": "b"}\n', "c.jsonl:2: missing id field 'id'"),
        ('{"id": [1], "text": "a"}\n', "c.jsonl:1: id 'id' is list"),
    ],
)
def test_jsonl_errors_name_file_and_line(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "c.jsonl"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(CorpusError, match=re.escape(message)):
        _read(path)


def test_non_utf8_names_line(tmp_path: Path) -> None:
    path = tmp_path / "c.txt"
    path.write_bytes(b"fine\nbad \xff byte\n")
    with pytest.raises(CorpusError, match=r"c.txt:2: not valid UTF-8"):
        _read(path)


def test_csv_missing_column_and_ragged_rows(tmp_path: Path) -> None:
    path = tmp_path / "c.csv"
    path.write_text("id,body\n1,x\n", encoding="utf-8")
    with pytest.raises(CorpusError, match=r"c.csv:1: header has no column 'text'"):
        _read(path)
    path.write_text("id,text\n1,x\n2\n", encoding="utf-8")
    with pytest.raises(CorpusError, match=r"c.csv:3: 1 column where the header has 2$"):
        _read(path)
    path.write_text("id,text\n1,x\n2,y,z,w\n", encoding="utf-8")
    with pytest.raises(CorpusError, match=r"c.csv:3: 4 columns where the header has 2$"):
        _read(path)


def test_a_csv_quote_left_open_or_closed_mid_field_is_refused_not_joined(tmp_path: Path) -> None:
    """A hostile pass: a quote left open swallowed the next line into its text ("a3" vanished: 4
    rows of 5 published, exit 0); one closed mid-field ("ok"trailing) was joined into "oktrailing".
    A quoted field over several lines is a CSV's own and still read."""
    path = tmp_path / "c.csv"
    path.write_text('id,text\na1,"first"\na2,"open\na3,"third"\na4,fourth\n', encoding="utf-8")
    with pytest.raises(CorpusError) as refused:
        _read(path)
    assert str(refused.value) == (
        f"{path}:3: malformed CSV: ',' expected after '\"' at line 4, in the record that began on line 3 "
        "(a quote opened there and not closed where its field ends?)"
    )
    path.write_text('id,text\na1,x\na2,"open to the end\na3,third\n', encoding="utf-8")
    with pytest.raises(CorpusError, match=r"c.csv:3: malformed CSV: unexpected end of data at line 4"):
        _read(path)
    path.write_text('id,text\nb3,"ok"trailing\n', encoding="utf-8")
    with pytest.raises(CorpusError, match=r"c.csv:2: malformed CSV: ',' expected after '\"'$"):
        _read(path)
    path.write_text('id,text\n1,"two\nlines"\n2,plain\n', encoding="utf-8")
    assert _read(path) == [("1", "two\nlines"), ("2", "plain")]


def test_a_csv_header_naming_the_text_or_id_column_twice_is_refused(tmp_path: Path) -> None:
    """DictReader kept the last column's values: the row's text was "y" of "x,y", silently."""
    path = tmp_path / "c.csv"
    path.write_text("id,text,text\na1,x,y\n", encoding="utf-8")
    with pytest.raises(CorpusError, match=r"c.csv:1: header names column 'text' 2 times$"):
        _read(path)
    path.write_text("id,text,id\na1,x,a2\n", encoding="utf-8")
    with pytest.raises(CorpusError, match=r"c.csv:1: header names column 'id' 2 times$"):
        _read(path)


def test_parquet_wrong_column_type(tmp_path: Path) -> None:
    path = tmp_path / "c.parquet"
    pq.write_table(pa.table({"id": ["a"], "text": [1]}), path)
    with pytest.raises(CorpusError, match=r"column 'text' has type int64, expected string"):
        _read(path)


def test_missing_file_directory_and_unknown_suffix(tmp_path: Path) -> None:
    with pytest.raises(CorpusError, match="no such file"):
        _read(tmp_path / "absent.jsonl")
    (tmp_path / "dir.jsonl").mkdir()
    with pytest.raises(CorpusError, match="is a directory"):
        _read(tmp_path / "dir.jsonl")
    with pytest.raises(CorpusError, match="pass --format"):
        detect_format(tmp_path / "c.dat")
    (tmp_path / "corpora").mkdir()  # a folder without a suffix: what it is, not "cannot tell the format"
    with pytest.raises(CorpusError, match=r"corpora: is a directory, not a corpus file$"):
        detect_format(tmp_path / "corpora")


def test_unreadable_file(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        # root reads any file whatever its mode; /proc/self/mem fails to read at offset 0 for everyone.
        path = Path("/proc/self/mem")
    else:
        path = tmp_path / "c.jsonl"
        path.write_text(json.dumps({"text": "a"}) + "\n")
        path.chmod(0)
    with pytest.raises(CorpusError, match="cannot read"):
        check_corpora([path], CorpusOptions(format="jsonl"))


@pytest.mark.parametrize(
    ("fmt", "content", "message"),
    [
        (
            "jsonl",
            '{"id": 1, "text": "ok"}\n{"id": 2, "text": "  "}\n',
            "c.jsonl:2: text field 'text' is empty",
        ),
        ("csv", "id,text\n1,ok\n2,\n", "c.csv:3: text field 'text' is empty"),
    ],
)
def test_empty_text_is_refused(tmp_path: Path, fmt: str, content: str, message: str) -> None:
    path = tmp_path / f"c.{fmt}"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(CorpusError, match=message):
        _read(path)


def test_line_over_the_size_limit_is_refused_without_reading_it_whole(tmp_path: Path) -> None:
    path = tmp_path / "c.jsonl"
    # A JSON Lines line may hold its text at the limit with every character escaped, and the rest.
    limit = 6 * 1000 + (1 << 16)
    path.write_text('{"text": "ok"}\n' + json.dumps({"text": "x" * limit}) + "\n", encoding="utf-8")
    with pytest.raises(CorpusError, match=rf"c.jsonl:2: line is over the limit of {limit} bytes"):
        _read(path, max_text_bytes=1000)
    path.write_text('{"text": "ok"}\n' + json.dumps({"text": "x" * 5000}) + "\n", encoding="utf-8")
    with pytest.raises(CorpusError, match=r"c.jsonl:2: text is over the limit of 1000 bytes"):
        _read(path, max_text_bytes=1000)
    # A text under the limit that json.dumps escaped (6 bytes a character) is no line over it.
    path.write_text(json.dumps({"text": "\u4e2d" * 300}) + "\n", encoding="utf-8")
    assert len(path.read_bytes()) > 1000 and _read(path, max_text_bytes=1000) == [("1", "\u4e2d" * 300)]
    parquet = tmp_path / "c.parquet"
    pq.write_table(pa.table({"text": ["ok", "y" * 5000]}), parquet)
    with pytest.raises(CorpusError, match=r"row 2: text is over the limit of 1000 bytes"):
        _read(parquet, max_text_bytes=1000)


def test_a_byte_order_mark_is_not_part_of_the_first_column_or_line(tmp_path: Path) -> None:
    """Issue 21.5: Excel's "CSV UTF-8" starts with U+FEFF; the id column must still be found."""
    bom = "\ufeff"
    csv_ids = tmp_path / "ids.csv"
    csv_ids.write_text(bom + 'id,text\nx7,"first"\ny8,second\n', encoding="utf-8")
    assert _read(csv_ids) == [("x7", "first"), ("y8", "second")]
    text_first = tmp_path / "text-first.csv"
    text_first.write_text(bom + "text,id\nfirst,x7\n", encoding="utf-8")
    assert _read(text_first) == [("x7", "first")]
    jsonl = tmp_path / "c.jsonl"
    jsonl.write_text(bom + '{"id": "a", "text": "first"}\n', encoding="utf-8")
    assert _read(jsonl) == [("a", "first")]


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_a_null_id_in_the_first_record_is_an_error_not_line_numbers(tmp_path: Path, fmt: str) -> None:
    """Issue 21.8: a null first id used to switch the whole corpus to line-number ids."""
    path = tmp_path / f"c.{fmt}"
    if fmt == "jsonl":
        path.write_text('{"id": null, "text": "a"}\n{"id": "k", "text": "b"}\n', encoding="utf-8")
        where = f"{path}:1"
    else:
        pq.write_table(pa.table({"id": [None, "k"], "text": ["a", "b"]}), path)
        where = f"{path}: row 1"
    with pytest.raises(CorpusError, match=f"^{re.escape(where)}: id 'id' is null$"):
        _read(path)


def test_a_pipe_is_refused_in_one_line_before_it_is_read(tmp_path: Path) -> None:
    """Issue 21.12: a FIFO hung silently; `<(cat c.jsonl)` lost its first byte to the check."""
    fifo = tmp_path / "corpus.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(CorpusError, match=r"not a regular file .*save it to a file first"):
        check_regular_file(fifo)  # returns at once: it never opens the FIFO, so no writer is needed
    read_end, write_end = os.pipe()
    try:
        with pytest.raises(CorpusError, match="not a regular file"):
            check_regular_file(Path(f"/dev/fd/{read_end}"))
    finally:
        os.close(read_end)
        os.close(write_end)


def test_a_csv_field_up_to_the_documented_limit_is_read(tmp_path: Path) -> None:
    """Issue 21.16: the csv module's own 131,072-character limit used to refuse a 200 KB text."""
    path = tmp_path / "c.csv"
    long_text = "word " * 40_000  # 200,000 characters
    write_corpus(path, ["a"], [long_text], "csv")
    assert _read(path) == [("a", long_text)]
    with pytest.raises(CorpusError, match=r"c\.csv:2: line is over the limit of 165536 bytes"):
        _read(path, max_text_bytes=100_000)  # the line is refused before the csv module reads it whole
    with pytest.raises(CorpusError, match=r"c\.csv:2: text is over the limit of 190000 bytes"):
        _read(path, max_text_bytes=190_000)  # a line within the bound, a text over the limit


def test_a_dictionary_encoded_parquet_text_column_is_read(tmp_path: Path) -> None:
    """Issue 21.16: the encoding pyarrow and pandas choose for repetitive strings."""
    path = tmp_path / "c.parquet"
    texts = pa.array(["alpha", "beta", "alpha"]).dictionary_encode()
    pq.write_table(pa.table({"id": ["1", "2", "3"], "text": texts}), path)
    assert pa.types.is_dictionary(pq.ParquetFile(path).schema_arrow.field("text").type)
    assert _read(path) == [("1", "alpha"), ("2", "beta"), ("3", "alpha")]


def test_a_string_view_parquet_text_column_is_read_and_its_limit_held(tmp_path: Path) -> None:
    """A hostile pass: a string_view column (newer writers' strings) was refused as not a string."""
    path = tmp_path / "c.parquet"
    texts = pa.array(["alpha", "b" * 2000], type=pa.string_view())
    pq.write_table(pa.table({"id": ["1", "2"], "text": texts}), path)
    assert _read(path, max_text_bytes=5000) == [("1", "alpha"), ("2", "b" * 2000)]
    with pytest.raises(CorpusError, match=r"c.parquet: row 2: text is over the limit of 1000 bytes"):
        _read(path, max_text_bytes=1000)


def test_limits_count_bytes_and_a_huge_line_or_text_is_refused_by_number_without_being_held(
    tmp_path: Path,
) -> None:
    """Issue 37.16: the Parquet limit counted characters while its message said bytes; a 1 GB CSV line
    peaked at 2.17 GB before it was refused, naming no line; a 200 MB Parquet text at 936 MB."""
    import tracemalloc

    wide = "é" * 600_000  # 600,000 characters, 1.2 MB in UTF-8: over the 1 MiB limit
    path = tmp_path / "wide.parquet"
    write_corpus(path, ["a", "b"], ["fine", wide], "parquet")
    with pytest.raises(CorpusError, match=r"wide\.parquet: row 2: text is over the limit of 1048576 bytes"):
        _read(path)

    huge = tmp_path / "huge.csv"
    with open(huge, "w", encoding="utf-8") as fh:
        fh.write("id,text\n1,short\n2,")
        for _ in range(64):
            fh.write("x" * (1 << 20))  # a 64 MiB field on line 3
        fh.write("\n")
    tracemalloc.start()
    try:
        with pytest.raises(CorpusError, match=r"huge\.csv:3: line is over the limit"):
            _read(huge)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, peak  # a few blocks, never the line
