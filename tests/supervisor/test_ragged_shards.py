"""A ragged result (sparse CSR, token vectors) larger than ``--shard-size`` is published as ordered
shards of whole chunks, like a matrix result: verified file by file, read back by the Python API
and exported, equal to the same run published as one block. Model-free (random chunk outputs as
workers leave them), so any size is cheap; the kinds' own runs are tests/jobs/test_kinds.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest

from chunkq.api import RunResult
from chunkq.jobs.contract.errors import AssemblyError
from chunkq.jobs.contract.manifest import load_manifest
from chunkq.jobs.contract.ragged import SCHEMAS, WIDE
from chunkq.jobs.contract.run import Run
from chunkq.jobs.contract.run_files import RunLayout, read_json
from chunkq.sinks.files import export
from chunkq.supervisor.result.assemble import assemble
from chunkq.supervisor.result.reader import check_published, open_result
from tests.helpers import write_ragged_run

DIM = {"sparse": 1000, "multivector": 8}  # write_ragged_run's


def _bytes_of_chunk(layout: RunLayout, kind: str) -> int:
    meta = read_json(layout.output_meta(0))
    per_entry = sum(
        np.dtype(d).itemsize * (meta["dim"] if n in WIDE else 1) for n, d in SCHEMAS[kind].items()
    )
    return int((meta["rows"] + 1) * 8 + meta["entries"] * per_entry)


@pytest.mark.parametrize("kind", ["sparse", "multivector"])
def test_a_ragged_result_over_the_shard_size_is_shards_of_whole_chunks_equal_to_one_block(
    tmp_path: Path, kind: str
) -> None:
    whole = write_ragged_run(tmp_path / "one", kind)
    sharded = write_ragged_run(tmp_path / "many", kind)
    assemble(Run.of(whole))
    assemble(Run.of(sharded), shard_bytes=3 * _bytes_of_chunk(sharded, kind))  # about 3 chunks a shard
    result = read_json(sharded.result_manifest)
    shards = result["ragged"]["shards"]
    assert 3 <= len(shards) <= 8 and sum(s["rows"] for s in shards) == 200
    assert all(s["rows"] % 20 == 0 for s in shards)  # whole chunks
    assert not (sharded.result / "offsets.npy").exists()
    assert check_published(sharded, load_manifest(sharded)) == []

    results = [
        RunResult(layout.run_id, layout.store, 200, DIM[kind], 0, 1, None) for layout in (whole, sharded)
    ]
    one, many = (result.ragged() for result in results)
    assert np.array_equal(one.offsets, many.offsets) and many.offsets.dtype == np.int64
    assert all(np.array_equal(one.arrays[name], many.arrays[name]) for name in SCHEMAS[kind])
    assert results[1].ids() == [f"r{i}" for i in range(200)] == results[0].ids()
    for layout in (whole, sharded):
        export(Run.of(layout), "parquet", tmp_path / f"{layout.store.name}.parquet")
        export(Run.of(layout), "jsonl", tmp_path / f"{layout.store.name}.jsonl")
    assert pq.read_table(tmp_path / "one.parquet").equals(pq.read_table(tmp_path / "many.parquet"))
    lines = (tmp_path / "many.jsonl").read_text().splitlines()
    assert (tmp_path / "one.jsonl").read_text().splitlines() == lines
    assert [json.loads(line)["id"] for line in lines] == [f"r{i}" for i in range(200)]


def test_a_damaged_shard_is_found_and_the_result_assembled_again(tmp_path: Path) -> None:
    layout = write_ragged_run(tmp_path / "store", "sparse")
    assemble(
        Run.of(layout), shard_bytes=2 * _bytes_of_chunk(layout, "sparse"), keep_outputs=True
    )  # rebuilt below
    result: dict[str, Any] = read_json(layout.result_manifest)
    shard = layout.result / result["ragged"]["shard_dir"] / "000002.values.npy"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert any(
        "000002.values.npy does not match" in p for p in check_published(layout, load_manifest(layout))
    )
    with pytest.raises(AssemblyError, match=r"000002\.values\.npy"):
        open_result(Run.of(layout)).verify()
    with pytest.raises(AssemblyError):
        export(Run.of(layout), "parquet", tmp_path / "out.parquet")  # nothing damaged goes out
    assert not (tmp_path / "out.parquet").exists()
    assemble(
        Run.of(layout), shard_bytes=2 * _bytes_of_chunk(layout, "sparse")
    )  # made again from the chunk outputs
    assert check_published(layout, load_manifest(layout)) == []
    # A manifest edited to name a folder outside the result is refused, never followed.
    edited = read_json(layout.result_manifest)
    edited["ragged"]["shard_dir"] = "../../outside"
    layout.result_manifest.write_text(json.dumps(edited))
    assert any("wrongly" in p for p in check_published(layout, load_manifest(layout)))
