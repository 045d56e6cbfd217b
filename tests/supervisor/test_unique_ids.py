"""Duplicate ids named together with the corpus's other bad rows (supervisor/submit/dupes.py): a
hostile pass's duplicates came one per run, and a duplicate before a bad row was not named at all."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from chunkq.jobs.contract.errors import CorpusError
from chunkq.supervisor.corpus import bad_rows
from chunkq.supervisor.corpus.records import CorpusOptions, read_corpus
from chunkq.supervisor.submit import dupes
from chunkq.supervisor.submit.dupes import IdRegistry, unique_ids


def _corpus(path: Path, count: int, rows: dict[int, str]) -> Path:
    """``count`` records with ids d1..dN, line N replaced by ``rows[N]``."""
    lines = [rows.get(n, json.dumps({"id": f"d{n}", "text": f"text {n}"})) for n in range(1, count + 1)]
    path.write_text("\n".join(lines) + "\n")
    return path


def _split(path: Path, tmp_path: Path) -> tuple[list[str], list[str]]:
    """The ids the split was given, and the refusal's lines."""
    given: list[str] = []
    with IdRegistry(tmp_path / "ids.sqlite") as registry, pytest.raises(CorpusError) as refused:
        for record in unique_ids(read_corpus(path, CorpusOptions(format="jsonl")), registry):
            given.append(record.id)
    return given, str(refused.value).splitlines()


def _dup(n: int, of: int) -> str:
    return json.dumps({"id": f"d{of}", "text": f"again {n}"})


@pytest.mark.parametrize("block", [1000, 7])
def test_every_duplicate_is_named_in_one_error_and_the_readers_bad_rows_after_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, block: int
) -> None:
    monkeypatch.setattr(dupes, "ID_BLOCK", block)  # one block, and blocks the duplicates span
    path = _corpus(tmp_path / "c.jsonl", 300, {50: _dup(50, 6), 150: _dup(150, 7), 250: _dup(250, 8)})
    given, lines = _split(path, tmp_path)
    assert len(given) < 50  # nothing of a block holding a duplicate reaches the split
    assert lines == [
        f"{path}:50: duplicate id 'd6' (first at {path}:6)",
        "2 more bad rows in the corpus:",
        f"  {path}:150: duplicate id 'd7' (first at {path}:7)",
        f"  {path}:250: duplicate id 'd8' (first at {path}:8)",
    ]
    # A duplicate before the reader's first bad row is named first; the reader's rows follow.
    mixed = _corpus(tmp_path / "m.jsonl", 300, {50: _dup(50, 6), 200: '{"id": "x", ', 260: '{"id": "y"}'})
    assert _split(mixed, tmp_path)[1] == [
        f"{mixed}:50: duplicate id 'd6' (first at {mixed}:6)",
        "2 more bad rows in the corpus:",
        f"  {mixed}:200: invalid JSON (Expecting property name enclosed in double quotes at column 13)",
        f"  {mixed}:260: missing text field 'text'",
    ]


def test_a_reader_error_alone_is_the_readers_own_and_the_list_is_bounded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _corpus(tmp_path / "c.jsonl", 30, {20: '{"id": "d20"}'})
    given, lines = _split(path, tmp_path)
    assert given == [] and lines == [f"{path}:20: missing text field 'text'"]
    monkeypatch.setattr(dupes, "ID_BLOCK", 10)
    many = _corpus(tmp_path / "many.jsonl", 400, {n: _dup(n, 1) for n in range(100, 400, 10)})
    _, lines = _split(many, tmp_path)
    assert len(lines) == 2 + (bad_rows.SHOWN - 1) + 1
    assert lines[-1] == f"  (stopped at {bad_rows.SHOWN} bad rows; the rest is not checked)"


def test_a_block_is_bounded_by_its_texts_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Long texts are not held a thousand at a time (1,000 near the 1 MiB limit held 1 GB)."""
    from chunkq.supervisor.corpus.records import Record

    monkeypatch.setattr(dupes, "ID_BLOCK_CHARACTERS", 50)
    pulled = 0

    def records() -> Iterator[Record]:
        nonlocal pulled
        for n in range(100):
            pulled += 1
            yield Record(f"r{n}", "x" * 20, f"c:{n + 1}")

    with IdRegistry(tmp_path / "ids.sqlite") as registry:
        given = unique_ids(records(), registry)
        assert next(given).id == "r0" and pulled == 3  # 60 characters: over the bound, checked
        assert [r.id for r in given] == [f"r{n}" for n in range(1, 100)]
