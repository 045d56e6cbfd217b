"""Integrity end to end: a damaged published result or chunk output is never vouched for.

Real CLI runs with the embedded Valkey and the bundled model; bytes flipped as a bad disk would.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from chunkq.jobs.contract.run import Run
from chunkq.jobs.contract.run_files import read_json
from chunkq.supervisor.result.writer import publish
from tests.helpers import make_texts, only_run, result_matches, run_cli, write_corpus

# Real pools, workers and CLI runs as subprocesses: the slow tier.
pytestmark = pytest.mark.slow


def _flip(path: Path, offset: int = 200) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def _run(corpus: Path, store: Path) -> Any:
    # The chunk outputs kept past the publish: these tests damage them, or rebuild from them.
    return run_cli("run", str(corpus), "--chunk-size", "20", "--store", str(store), "--keep-outputs")


def test_a_damaged_published_result_is_refused_and_assembled_again(
    tmp_path: Path, reference_model: Any
) -> None:
    ids, texts = make_texts(60, seed=81)
    corpus, store = write_corpus(tmp_path / "c.jsonl", ids, texts, "jsonl"), tmp_path / "store"
    assert _run(corpus, store).returncode == 0
    layout = only_run(store)
    _flip(layout.result / "embeddings.npy")

    verify = run_cli("assemble", layout.run_id, "--verify", "--store", str(store))
    assert verify.returncode == 5, verify.stderr
    assert "embeddings.npy does not match the checksum in result/manifest.json" in verify.stderr

    again = _run(corpus, store)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "already complete" not in again.stdout and "the published result is damaged" in again.stderr
    assert result_matches(layout, texts, reference_model)
    assert run_cli("assemble", layout.run_id, "--verify", "--store", str(store)).returncode == 0


def test_a_damaged_chunk_output_is_set_aside_and_encoded_again(tmp_path: Path, reference_model: Any) -> None:
    ids, texts = make_texts(60, seed=82)
    corpus, store = write_corpus(tmp_path / "c.jsonl", ids, texts, "jsonl"), tmp_path / "store"
    assert _run(corpus, store).returncode == 0
    layout = only_run(store)
    first_meta = read_json(layout.output_meta(1))
    (layout.result / "manifest.json").unlink()  # unpublished: assembly has to read the outputs
    _flip(layout.output_npy(1))

    refused = _run(corpus, store)
    assert refused.returncode == 5, refused.stderr[-3000:]
    assert "chunk 1 (rows 20-39)" in refused.stderr and "the next run encodes it again" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert len(list(layout.damaged_outputs.iterdir())) == 2  # kept for a look, .npy and .json

    again = _run(corpus, store)
    assert again.returncode == 0, again.stderr[-3000:]
    assert read_json(layout.output_meta(1))["finished_at"] > first_meta["finished_at"]
    assert result_matches(layout, texts, reference_model)

    # A chunk whose .npy vanished after it was committed is encoded again by the very next run.
    (layout.result / "manifest.json").unlink()
    layout.output_npy(2).unlink()
    third = _run(corpus, store)
    assert third.returncode == 0, third.stderr[-3000:]
    assert result_matches(layout, texts, reference_model)


def test_a_resumed_run_encodes_a_damaged_chunk_output_again_itself(
    tmp_path: Path, reference_model: Any
) -> None:
    """A hostile pass: a run killed with chunks left, one finished output then damaged: the resume
    said "to be encoded again", finished the other chunks, and failed its assembly on that one
    (exit 5); only a second run mended it. The watch now queues it again."""
    ids, texts = make_texts(100, seed=83)
    corpus, store = write_corpus(tmp_path / "c.jsonl", ids, texts, "jsonl"), tmp_path / "store"
    assert _run(corpus, store).returncode == 0
    layout = only_run(store)
    (layout.result / "manifest.json").unlink()  # as a killed run leaves it: chunks 2-4 not done
    for index in (2, 3, 4):
        layout.output_meta(index).unlink()
        layout.output_npy(index).unlink()
    first_meta = read_json(layout.output_meta(0))
    _flip(layout.output_npy(0))

    again = _run(corpus, store)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "chunk 0's output is damaged" in again.stderr and "to be encoded again" in again.stderr
    assert read_json(layout.output_meta(0))["finished_at"] > first_meta["finished_at"]
    assert result_matches(layout, texts, reference_model)


def test_a_result_is_replaced_in_one_step(tmp_path: Path) -> None:
    """Readers polling result/ never find it missing while a new result replaces the old one."""
    result = tmp_path / "result"
    result.mkdir()
    (result / "manifest.json").write_text("0")
    missing: list[int] = []
    done = threading.Event()

    def read() -> None:
        while not done.is_set():
            if not (result / "manifest.json").exists():
                missing.append(1)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for n in range(1, 300):
            built = tmp_path / f"built-{n}"
            built.mkdir()
            (built / "manifest.json").write_text(str(n))
            publish(built, result, uploaded=None)
    finally:
        done.set()
        reader.join(timeout=10)
    assert (result / "manifest.json").read_text() == "299" and not missing
    assert sorted(p.name for p in tmp_path.iterdir()) == ["result"]  # nothing old left behind


def test_a_damaged_result_is_never_called_published_nor_its_chunk_outputs_freed(tmp_path: Path) -> None:
    """Issue 37.13: a truncated shard was "published" to `runs`, and `clean --outputs-only` freed
    every chunk output, the only good copy; `assemble` then failed."""
    from chunkq.supervisor.result.assemble import assemble
    from tests.helpers import write_encoded_run

    store = tmp_path / "store"
    layout = write_encoded_run(store, "damaged", rows=40, chunk_size=20, dim=16)  # no model needed
    assemble(Run.of(layout), keep_outputs=True)
    embeddings = layout.result / "embeddings.npy"
    good = embeddings.read_bytes()
    embeddings.write_bytes(good[:-1000])  # truncated: seen by its size alone
    runs = run_cli("runs", "--store", str(store))
    assert "damaged result" in runs.stdout and "published" not in runs.stdout, runs.stdout
    status = run_cli("status", layout.run_id, "--store", str(store))
    assert "is DAMAGED (embeddings.npy is" in status.stdout and "result published" not in status.stdout
    assert status.returncode == 5  # a script checking the run with status does not read it as done
    clean = run_cli("clean", layout.run_id, "--outputs-only", "--store", str(store))
    assert clean.returncode != 0 and "is damaged result" in clean.stderr
    assert len(list(layout.outputs.glob("*.npy"))) == 2  # the chunk outputs are all still there

    embeddings.write_bytes(good)
    _flip(embeddings)  # same size: only its checksum tells, and clean checks it before freeing
    clean = run_cli("clean", layout.run_id, "--outputs-only", "--store", str(store))
    assert clean.returncode != 0 and len(list(layout.outputs.glob("*.npy"))) == 2
    assert run_cli("assemble", layout.run_id, "--store", str(store), "--keep-outputs").returncode == 0
    assert run_cli("clean", layout.run_id, "--outputs-only", "--store", str(store)).returncode == 0
    assert not list(layout.outputs.glob("*.npy"))


def test_the_python_api_never_hands_out_a_damaged_one_file_result(tmp_path: Path) -> None:
    """``RunResult.embeddings()`` (memory-mapped or read whole) and ``.ragged()`` of a one-file result
    with one byte flipped, its size unchanged: a memory map or ``np.load`` checks nothing of the
    bytes, so the result's checksums are checked first, and the damage is refused in one line."""
    from chunkq.api import RunResult
    from chunkq.jobs.contract.errors import StoreError
    from chunkq.supervisor.result.assemble import assemble
    from tests.helpers import write_encoded_run, write_ragged_run

    store = tmp_path / "store"
    layout = write_encoded_run(store, "dense", rows=40, chunk_size=20, dim=16)
    assemble(Run.of(layout), keep_outputs=True)
    result = RunResult(layout.run_id, store, 40, 16, 0.0, 1, None)
    good = result.embeddings(mmap=False)
    assert good.shape == (40, 16) and (result.embeddings() == good).all()  # whole, the same either way
    _flip(layout.result / "embeddings.npy")
    for mmap in (True, False):
        with pytest.raises(StoreError, match=r"embeddings\.npy does not match the checksum"):
            result.embeddings(mmap=mmap)
    ragged = write_ragged_run(tmp_path / "ragged-store", "sparse")
    assemble(Run.of(ragged), keep_outputs=True)
    sparse = RunResult(ragged.run_id, ragged.store, 200, 1000, 0.0, 1, None)
    assert len(sparse.ragged().offsets) == 201
    values = sorted(ragged.result.glob("*values.npy"))[0]
    data = bytearray(values.read_bytes())
    data[-1] ^= 0xFF
    values.write_bytes(bytes(data))
    with pytest.raises(StoreError, match=r"values\.npy does not match the checksum"):
        sparse.ragged()
