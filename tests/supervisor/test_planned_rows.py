"""A row map part's ids, read from the file's bytes a block at a time (issue 64: as a list of str,
a part of 10^6 ids held ~64 MB in the supervisor for the whole build)."""

from __future__ import annotations

import json
import random

import pytest

from chunkq.supervisor.result.planned_rows import BLOCK_BYTES, ROWS_AT_A_TIME, PartIds, rows_at_a_time


def _ids_file(ids: list[object], trailing_newline: bool = True) -> bytes:
    data = "".join(json.dumps(i, ensure_ascii=False) + "\n" for i in ids).encode()
    return data if trailing_newline else data[:-1]


@pytest.mark.parametrize("trailing_newline", [True, False])
def test_a_parts_ids_are_the_lines_of_its_file_whatever_slice_is_taken(trailing_newline: bool) -> None:
    chooser = random.Random(64)
    ids: list[object] = [f"doc-{n}" for n in range(300)]
    ids[7] = {"id": "doc-7", "window": 2}  # a window's id is an object
    ids[8] = "naïve \u2028 line"  # a character bytes.splitlines would not split on, raw UTF-8
    ids[9] = ""
    part = PartIds(_ids_file(ids, trailing_newline))
    assert len(part) == len(ids)
    assert list(part) == ids
    for _ in range(200):
        a, b = sorted(chooser.randrange(-10, len(ids) + 10) for _ in range(2))
        assert part[a:b] == ids[a:b]
    assert [part[n] for n in range(-len(ids), len(ids))] == ids + ids
    with pytest.raises(IndexError):
        part[len(ids)]
    assert len(PartIds(b"")) == 0 and list(PartIds(b"")) == []


def test_an_integer_id_in_the_file_is_read_as_its_string() -> None:
    assert PartIds(b'12\n"12"\n')[0:2] == ["12", "12"]


def test_the_rows_written_at_a_time_are_bounded_by_their_bytes() -> None:
    assert rows_at_a_time(256) * 256 * 4 <= BLOCK_BYTES
    assert rows_at_a_time(4096) * 4096 * 4 <= BLOCK_BYTES
    assert rows_at_a_time(1) == ROWS_AT_A_TIME
    assert rows_at_a_time(10**9) == 1
