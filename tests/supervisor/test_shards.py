"""Results that scale (issue 22.3): above a size a result is published as ordered shards, which
verify, export byte for byte as the single-file result of the same run does, and read back through
``RunResult.embeddings()`` as a lazy view."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from chunkq.api import RunResult
from chunkq.jobs.contract.errors import AssemblyError, ConfigError
from chunkq.jobs.contract.manifest import load_manifest
from chunkq.jobs.contract.run import Run
from chunkq.jobs.contract.run_files import RunLayout, read_json
from chunkq.sinks.files import EXPORT_FORMATS, export
from chunkq.supervisor.result.assemble import assemble
from chunkq.supervisor.result.published import shard_bytes
from chunkq.supervisor.result.reader import ShardedEmbeddings, check_published, published_result
from tests.helpers import run_cli, write_encoded_run

DIM = 8
ROW_BYTES = DIM * 4


def _exports(layout: RunLayout, folder: Path) -> dict[str, bytes]:
    folder.mkdir()
    files = {}
    for fmt in EXPORT_FORMATS:
        for path in export(Run.of(layout), fmt, folder / f"out.{fmt}"):
            files[path.name] = path.read_bytes()
    return files


def _api(layout: RunLayout, result: dict[str, Any]) -> RunResult:
    return RunResult(layout.run_id, layout.store, result["rows"], result["dim"], 0.0, 1, None)


def test_a_sharded_result_verifies_and_exports_as_the_single_file_result_does(tmp_path: Path) -> None:
    """1,000 rows in chunks of 64; shards of 300 rows, so shard ends fall inside chunks."""
    layout = write_encoded_run(tmp_path / "store", "sh", rows=1000, chunk_size=64, dim=DIM)
    single = assemble(Run.of(layout), keep_outputs=True)  # assembled again below, from the same outputs
    assert "shards" not in single and (layout.result / "embeddings.npy").is_file()
    whole = np.load(layout.result / "embeddings.npy")
    single_files = _exports(layout, tmp_path / "single")

    shutil.rmtree(layout.result)
    sharded = assemble(Run.of(layout), shard_bytes=300 * ROW_BYTES)
    assert [s["rows"] for s in sharded["shards"]] == [300, 300, 300, 100]
    assert not (layout.result / "embeddings.npy").exists()
    shard_dir = layout.result / sharded["shard_dir"]
    assert sorted(p.name for p in shard_dir.iterdir()) == [
        f"{i:06d}.{ext}" for i in range(4) for ext in ("ids.jsonl", "npy")
    ]
    assert check_published(layout, load_manifest(layout)) == []
    assert np.array_equal(np.concatenate([np.load(shard_dir / f"{i:06d}.npy") for i in range(4)]), whole)
    assert _exports(layout, tmp_path / "sharded") == single_files  # parquet, npy + ids, jsonl

    result = _api(layout, sharded)
    view = result.embeddings()
    assert isinstance(view, ShardedEmbeddings) and view.shape == (1000, DIM) and len(view) == 1000
    assert np.array_equal(np.asarray(view), whole)
    assert np.array_equal(view[299], whole[299]) and np.array_equal(view[-1], whole[-1])
    assert np.array_equal(view[250:650:7], whole[250:650:7])
    picks = [999, 0, 300, 301, 299, 600]
    assert np.array_equal(view[picks], whole[picks]) and np.array_equal(view[picks, 2:5], whole[picks, 2:5])
    assert np.array_equal(np.stack(list(view)), whole)
    with pytest.raises(IndexError):
        view[1000]
    assert result.ids() == [f"r{i}" for i in range(1000)]


def test_a_damaged_or_misdirected_shard_is_named_and_the_result_assembled_again(tmp_path: Path) -> None:
    layout = write_encoded_run(tmp_path / "store", "dmg", rows=500, chunk_size=50, dim=DIM)
    first = assemble(
        Run.of(layout), shard_bytes=200 * ROW_BYTES, keep_outputs=True
    )  # rebuilt below from them
    manifest = load_manifest(layout)
    shard = layout.result / first["shard_dir"] / "000001.npy"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF
    shard.write_bytes(bytes(data))
    problems = check_published(layout, manifest)
    assert problems == [
        f"{first['shard_dir']}/000001.npy does not match the checksum in result/manifest.json"
    ]
    with pytest.raises(AssemblyError, match=r"000001\.npy does not match the checksum"):
        export(Run.of(layout), "npy", tmp_path / "out.npy")
    assert not (tmp_path / "out.npy").exists()

    assert published_result(layout, manifest) is None  # damaged: assembled again, into a new folder
    again = assemble(Run.of(layout), shard_bytes=200 * ROW_BYTES)
    assert again["shard_dir"] != first["shard_dir"] and check_published(layout, manifest) == []
    assert [p.name for p in layout.result.iterdir() if p.is_dir()] == [again["shard_dir"]]

    # A manifest edited to name files outside its result folder is refused, never followed.
    edited = {**read_json(layout.result / "manifest.json"), "shard_dir": "../../inputs"}
    (layout.result / "manifest.json").write_text(json.dumps(edited))
    (problem,) = check_published(layout, manifest)
    assert "lists its files wrongly" in problem and "'../../inputs'" in problem


def test_shard_sizes_are_read_with_units_and_nonsense_is_refused() -> None:
    assert shard_bytes("1GiB") == 2**30 and shard_bytes("512MB") == 512 * 10**6 and shard_bytes(4096) == 4096
    for bad in ("x", "10", "1 PB", "-1GiB"):
        with pytest.raises(ConfigError, match="shard size"):
            shard_bytes(bad)


@pytest.mark.slow
def test_assemble_shard_size_verify_and_export_through_the_cli(tmp_path: Path) -> None:
    store = tmp_path / "store"
    layout = write_encoded_run(store, "cli", rows=90, chunk_size=20, dim=DIM)
    made = run_cli("assemble", "cli", "--store", str(store), "--shard-size", f"{40 * ROW_BYTES}")
    assert made.returncode == 0, made.stderr
    assert made.stdout.strip().endswith("90 x 8 in 3 shards")
    verify = run_cli("assemble", "cli", "--verify", "--store", str(store))
    assert verify.returncode == 0 and "every checksum matches" in verify.stdout, verify.stderr
    out = tmp_path / "e.npy"
    exported = run_cli("export", "cli", "--format", "npy", "--out", str(out), "--store", str(store))
    assert exported.returncode == 0, exported.stderr
    assert np.load(out).shape == (90, DIM) and out.with_name("e.ids.jsonl").read_text().count("\n") == 90
    # --to's running count is for a terminal: to a pipe it left "0/90 rows90/90 rows" (a hostile pass)
    indexed = run_cli("export", "cli", "--to", f"faiss:{tmp_path / 'e.faiss'}", "--store", str(store))
    assert indexed.returncode == 0 and "90 rows of run cli" in indexed.stdout
    assert "/90 rows" not in indexed.stderr, indexed.stderr  # (text mode reads a "\r" as a line end)
    refused = run_cli("assemble", "cli", "--store", str(store), "--shard-size", "lots")
    assert refused.returncode == 6 and "shard size 'lots'" in refused.stderr
    del layout


def test_the_python_api_refuses_a_damaged_result_instead_of_returning_its_rows(tmp_path: Path) -> None:
    """Issue 37.15: RunResult.embeddings() returned swapped shards' rows silently (max diff 0.15) and
    raised raw FileNotFoundError or mmap errors for missing or short files."""
    from chunkq.jobs.contract.errors import StoreError

    layout = write_encoded_run(tmp_path / "store", "dmg", rows=600, chunk_size=64, dim=DIM)
    result = assemble(
        Run.of(layout), shard_bytes=200 * ROW_BYTES, keep_outputs=True
    )  # rebuilt below from them
    api = _api(layout, result)
    shard_dir = layout.result / result["shard_dir"]
    first, second = shard_dir / "000000.npy", shard_dir / "000001.npy"
    good = np.asarray(api.embeddings())
    saved = first.read_bytes()
    first.write_bytes(second.read_bytes())  # same size, same header: only the checksum tells
    second.write_bytes(saved)
    with pytest.raises(StoreError, match=r"000000\.npy does not match the checksum"):
        api.embeddings()[0]
    second.unlink()
    with pytest.raises(StoreError, match=r"the published result is damaged: .*000001\.npy unreadable"):
        api.embeddings()
    shutil.rmtree(layout.result)
    assemble(Run.of(layout))  # one file
    single = _api(layout, read_json(layout.result_manifest))
    (layout.result / "embeddings.npy").write_bytes((layout.result / "embeddings.npy").read_bytes()[:-100])
    with pytest.raises(StoreError, match=r"embeddings\.npy is \d+ bytes, its header makes \d+"):
        single.embeddings()
    assert good.shape == (600, DIM)


def test_an_export_whose_result_is_published_again_meanwhile_stops_in_one_line(tmp_path: Path) -> None:
    """Issue 37.14: `FileNotFoundError` on the old shard folder after 8,192 rows were written, and a
    `JSONDecodeError` for a truncated result/manifest.json."""
    from chunkq.jobs.contract.errors import StoreError
    from chunkq.supervisor.result.reader import BATCH_ROWS, open_result

    layout = write_encoded_run(tmp_path / "store", "moving", rows=3 * BATCH_ROWS, chunk_size=4096, dim=DIM)
    first = assemble(Run.of(layout), shard_bytes=BATCH_ROWS * ROW_BYTES, keep_outputs=True)  # rebuilt below
    reading = open_result(Run.of(layout)).batches()
    next(reading)  # the first shard is read; then its last shard is damaged and a rerun publishes again
    last = layout.result / first["shard_dir"] / "000002.npy"
    data = bytearray(last.read_bytes())
    data[-1] ^= 0xFF
    last.write_bytes(bytes(data))
    assemble(Run.of(layout), shard_bytes=2 * BATCH_ROWS * ROW_BYTES)
    assert not (layout.result / first["shard_dir"]).exists()
    with pytest.raises(StoreError, match="was published again while this export read it"):
        list(reading)
    out = tmp_path / "out.jsonl"
    manifest = layout.result / "manifest.json"
    manifest.write_text(manifest.read_text()[:50])
    with pytest.raises(AssemblyError, match=r"result/manifest\.json is unreadable"):
        export(Run.of(layout), "jsonl", out)
    assert not out.exists()
