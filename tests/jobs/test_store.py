"""Specs and the store layout: safe run ids, atomic writes, output verification."""

from __future__ import annotations

import gzip
import re
from pathlib import Path

import numpy as np
import pytest

from chunkq.jobs.contract.chunk_output import verify_output
from chunkq.jobs.contract.errors import ConfigError, TamperedJobError
from chunkq.jobs.contract.run_files import (
    RunLayout,
    atomic_write_json,
    read_json,
    write_output,
)
from chunkq.jobs.contract.specs import ChunkSpec, EncodeOptions, chunk_job_id, validate_run_id
from chunkq.jobs.contract.storage import list_with_mtime


@pytest.mark.parametrize(
    "bad", ["", "../etc", "a/b", "/abs", "a__b", "a_", "-lead", "x" * 81, "a:b", "a.b", "ab\n", "a\n"]
)
def test_unsafe_run_ids_are_refused(bad: str) -> None:
    with pytest.raises(ConfigError, match="invalid run id"):
        validate_run_id(bad)
    with pytest.raises(ConfigError):
        RunLayout("/tmp/store", bad)


def test_job_ids_are_deterministic_and_rq_safe() -> None:
    assert chunk_job_id("corpus-abc_1", 7) == "corpus-abc_1__c000007"
    assert chunk_job_id("r", 1_234_567) == "r__c1234567"


def test_chunk_spec_round_trips_through_json_dict() -> None:
    spec = ChunkSpec(
        "r1", 2, 50, 25, "bundled:x", "/s", EncodeOptions(batch_size=8, normalize_embeddings=True)
    )
    assert ChunkSpec.from_dict(spec.to_dict()) == spec
    with pytest.raises(ConfigError, match="precision"):
        EncodeOptions(precision="int4")
    with pytest.raises(ConfigError, match="batch size"):
        EncodeOptions(batch_size=0)


@pytest.mark.parametrize(
    ("edit", "said"),
    [
        (
            {"options": {"batch_size": 8, "model_kwarg": "x"}},
            "chunk options has field(s) this chunkq does not know: 'model_kwarg'",
        ),
        ({"device_map": "auto"}, "chunk spec has field(s) this chunkq does not know: 'device_map'"),
        ({"options": ["fp16"]}, "chunk spec options must be an object"),
    ],
)
def test_a_spec_with_fields_this_chunkq_does_not_know_is_refused_in_one_line(
    edit: dict[str, object], said: str
) -> None:
    """Issue 37.16: a foreign key in a job's options failed with a raw TypeError."""
    spec = ChunkSpec("r1", 2, 50, 25, "bundled:x", "/s").to_dict()
    with pytest.raises(TamperedJobError, match=re.escape(said)):
        ChunkSpec.from_dict({**spec, **edit})


def test_atomic_write_leaves_no_temporary_files(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "m.json"
    atomic_write_json(target, {"a": 1})
    atomic_write_json(target, {"a": 2})
    assert read_json(target) == {"a": 2}
    assert sorted(p.name for p in target.parent.iterdir()) == ["m.json"]


def test_a_listing_skips_files_renamed_while_it_runs(tmp_path: Path) -> None:
    """A worker's temporary file can be renamed between the listing and the look at it (seen in CI)."""
    for n in range(5):
        (tmp_path / f".{n:06d}.json.tmp").write_text("{}")
    listing = list_with_mtime(tmp_path)
    first, _mtime = next(listing)
    for other in tmp_path.iterdir():
        if other.name != first:
            other.unlink()
    assert list(listing) == []


def test_atomic_write_failure_keeps_the_old_file(tmp_path: Path) -> None:
    target = tmp_path / "m.json"
    atomic_write_json(target, {"a": 1})
    with pytest.raises(TypeError):
        atomic_write_json(target, {"a": object()})
    assert read_json(target) == {"a": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["m.json"]


AS_ANOTHER_USER = """
import os, sys
from pathlib import Path
from chunkq.jobs.contract.chunk_output import verify_output
from chunkq.jobs.contract.errors import StoreWriteError
from chunkq.jobs.contract.run_files import RunLayout
os.setgid(65534); os.setuid(65534)
try:
    print(verify_output(RunLayout(Path(sys.argv[1]), "r1"), 0, 3))
except StoreWriteError as exc:
    print("StoreWriteError:", exc)
"""


def test_an_output_this_user_may_not_read_is_the_stores_to_fix_not_damaged(tmp_path: Path) -> None:
    """The hostile pass, on a store shared by two users: an output another user wrote (0600) was
    "damaged; moved to outputs/damaged" and encoded again; the store's permissions are what is wrong."""
    import os
    import subprocess
    import sys
    import tempfile

    if os.geteuid() != 0:
        pytest.skip("needs root, to read as another user")
    store = Path(tempfile.mkdtemp(dir="/tmp"))  # a folder another user can pass through
    try:
        layout = RunLayout(store, "r1")
        write_output(layout, 0, np.ones((3, 4), dtype=np.float32), {"run_id": "r1", "chunk": 0})
        for folder in (store, *store.rglob("*")):
            if folder.is_dir():
                folder.chmod(0o755)  # every folder open; the files as chunkq writes them, owner-only
        seen = subprocess.run(
            [sys.executable, "-c", AS_ANOTHER_USER, str(store)], capture_output=True, text=True, timeout=60
        )
        said = seen.stdout.strip()
        assert (
            said.startswith("StoreWriteError: cannot read ") and "000000.json: Permission denied" in said
        ), said + seen.stderr[-2000:]
        assert "fix their owner or mode" in said and layout.output_meta(0).is_file()  # nothing moved
    finally:
        import shutil

        shutil.rmtree(store)


def test_verify_output_detects_every_defect(tmp_path: Path) -> None:
    layout = RunLayout(tmp_path, "r1")
    array = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert verify_output(layout, 0, 3) == (None, "output metadata missing")
    write_output(layout, 0, array, {"run_id": "r1", "chunk": 0})
    meta, why = verify_output(layout, 0, 3)
    assert why == "" and meta is not None and meta["rows"] == 3 and meta["dim"] == 4
    assert verify_output(layout, 0, 4)[1] == "000000.npy has 3 rows, expected 4"
    raw = bytearray(layout.output_npy(0).read_bytes())
    raw[-1] ^= 0xFF
    layout.output_npy(0).write_bytes(bytes(raw))
    assert "checksum does not match" in verify_output(layout, 0, 3)[1]
    layout.output_npy(0).unlink()
    assert verify_output(layout, 0, 3)[1] == "000000.npy missing"
    assert layout.done_chunks() == {0}  # the marker alone says "done"; verification says otherwise


def test_a_chunk_input_is_read_in_one_parse_and_a_bad_row_is_still_named(tmp_path: Path) -> None:
    """Issue 52: the chunk's rows are parsed in one call, split at "\\n" alone (a text may hold
    U+2028 or U+0085, where splitlines() would cut it); a malformed row still names its line."""
    from chunkq.jobs.contract.errors import BadInputError, StoreError
    from chunkq.jobs.contract.run_files import RunLayout, read_chunk_input, write_chunk_input

    layout = RunLayout(tmp_path, "r")
    rows = [("a", "x\u2028y\x85z\nw"), ("b", "plain"), ("c", "\u2029")]
    write_chunk_input(layout, 0, rows)
    assert read_chunk_input(layout, 0) == (["a", "b", "c"], [text for _, text in rows])
    path = layout.input_path(0)
    assert path.name == "000000.jsonl.gz" and gzip.decompress(path.read_bytes()).count(b"\n") == 3
    path.write_bytes(gzip.compress(gzip.decompress(path.read_bytes()).replace(b'"plain"}', b'"plain"')))
    with pytest.raises(BadInputError, match=r"000000.jsonl.gz:2: invalid JSON"):
        read_chunk_input(layout, 0)
    path.write_bytes(path.read_bytes()[:-9])  # cut short: its gzip trailer gone
    with pytest.raises(StoreError, match=r"000000.jsonl.gz is damaged .* cannot be read back"):
        read_chunk_input(layout, 0)
    path.unlink()  # a store written before inputs were compressed: plain JSON Lines, read as they are
    layout.plain_input_path(0).write_text('{"id": "a", "text": "old"}\n')
    assert read_chunk_input(layout, 0) == (["a"], ["old"])
