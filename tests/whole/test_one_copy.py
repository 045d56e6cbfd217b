"""Issue 64.3 and 64.5: the result is written while the chunks land, and after a verified publish a
run's vectors are on disk once: the chunk arrays are freed, and the vector cache takes the result's
own file as a shard under a second name (a hard link). Real runs, the bundled model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from chunkq.jobs.contract.run_files import RunLayout, read_json
from tests.helpers import (
    make_texts,
    max_abs_diff,
    only_run,
    result_of,
    run_cli,
    start_cli,
    stop_tree,
    wait_for,
    write_corpus,
)


def _vector_files(store: Path) -> dict[int, list[str]]:
    """Every .npy file of the store holding rows of vectors (its hashes files aside), by inode."""
    found: dict[int, list[str]] = {}
    for path in store.rglob("*.npy"):
        if path.name.endswith(".hashes.npy") or "plan" in path.parts:
            continue
        found.setdefault(path.stat().st_ino, []).append(str(path.relative_to(store)))
    return found


@pytest.mark.slow
def test_a_runs_vectors_are_on_disk_once_and_serve_the_cache_after_the_run_is_gone(
    tmp_path: Path, reference_model: object
) -> None:
    ids, texts = make_texts(60, seed=64)
    store = tmp_path / "store"
    common = ["--store", str(store), "--chunk-size", "10"]
    first = run_cli("run", str(write_corpus(tmp_path / "a.jsonl", ids, texts, "jsonl")), *common)
    assert first.returncode == 0, first.stderr[-3000:]
    layout = only_run(store)
    got, got_ids = result_of(layout)
    want = reference_model.encode(texts)  # type: ignore[attr-defined]
    assert got_ids == ids and max_abs_diff(got, want) <= 1e-5
    # One copy: the result's file, which the cache names too; no chunk array is left.
    (names,) = _vector_files(store).values()
    assert sorted(n.split("/")[0] for n in names) == ["cache", "runs"], names
    assert not list(layout.outputs.glob("*.npy")) and len(list(layout.outputs.glob("*.json"))) == 6
    phases = read_json(layout.phases)
    assert phases["build"]["seconds"] > 0 and phases["write"]["seconds"] < phases["build"]["seconds"] + 1
    # Another run of the texts reads every one from that file; so does one after the first is gone.
    for name in ("b", "c"):
        corpus = write_corpus(tmp_path / f"{name}.jsonl", [f"{name}{i}" for i in ids], texts, "jsonl")
        again = run_cli("run", str(corpus), *common)
        assert again.returncode == 0, again.stderr[-3000:]
        assert "60 rows: 0 encoded, 60 from the vector cache" in again.stdout + again.stderr
        assert run_cli("clean", layout.run_id, "--store", str(store), forks=False).returncode == 0
        runs = sorted((store / "runs").iterdir(), key=lambda p: p.stat().st_mtime)
        layout = RunLayout(store, runs[-1].name)
        got, got_ids = result_of(layout)
        assert got_ids == [f"{name}{i}" for i in ids] and max_abs_diff(got, want) <= 1e-5


@pytest.mark.slow
def test_a_damaged_result_whose_outputs_were_freed_is_encoded_again_by_the_same_command(
    tmp_path: Path, reference_model: object
) -> None:
    ids, texts = make_texts(40, seed=65)
    store = tmp_path / "store"
    args = ["run", str(write_corpus(tmp_path / "a.jsonl", ids, texts, "jsonl")), "--store", str(store)]
    args += ["--chunk-size", "10"]
    assert run_cli(*args).returncode == 0
    layout = only_run(store)
    path = layout.result / "embeddings.npy"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x20  # the cache names these bytes too: its shard is as damaged
    path.write_bytes(bytes(data))
    status = run_cli("status", layout.run_id, "--store", str(store), forks=False)
    assert "is DAMAGED" in status.stdout and "encodes its chunks again" in status.stdout, status.stdout
    again = run_cli(*args)
    assert again.returncode == 0, again.stderr[-3000:]
    got, got_ids = result_of(layout)
    assert got_ids == ids and max_abs_diff(got, reference_model.encode(texts)) <= 1e-5  # type: ignore[attr-defined]
    other = write_corpus(tmp_path / "b.jsonl", [f"b{i}" for i in ids], texts, "jsonl")
    later = run_cli("run", str(other), "--store", str(store), "--chunk-size", "10")
    assert later.returncode == 0, later.stderr[-3000:]
    newest = sorted((store / "runs").iterdir(), key=lambda p: p.stat().st_mtime)[-1]
    got, _ = result_of(RunLayout(store, newest.name))
    assert max_abs_diff(got, reference_model.encode(texts)) <= 1e-5  # type: ignore[attr-defined]


@pytest.mark.slow
def test_a_run_killed_while_its_result_is_built_resumes_to_the_exact_result(
    tmp_path: Path, reference_model: object
) -> None:
    """SIGKILL of the whole command (its pool and workers too) once the build has begun, before the
    last chunk: the same command removes the half-built result and publishes the exact one."""
    ids, texts = make_texts(80, seed=66)
    store = tmp_path / "store"
    args = ["run", str(write_corpus(tmp_path / "a.jsonl", ids, texts, "jsonl")), "--store", str(store)]
    args += ["--chunk-size", "10"]
    faults = json.dumps([{"kind": "slow", "chunks": [7], "seconds": 60}])
    run = start_cli(tmp_path / "run.log", *args, CHUNKQ_FAULTS=faults)
    try:
        wait_for(lambda: any((store / "runs").glob("*/.result.tmp-*")), 180, "the result's build to begin")
    finally:
        stop_tree(run)  # SIGKILL, the command and everything it started
    layout = only_run(store)
    assert not layout.result_manifest.exists()
    again = run_cli(*args)
    assert again.returncode == 0, again.stderr[-3000:]
    got, got_ids = result_of(layout)
    assert got_ids == ids and max_abs_diff(got, reference_model.encode(texts)) <= 1e-5  # type: ignore[attr-defined]
    assert not list((store / "runs").glob("*/.result.tmp-*"))


@pytest.mark.slow
def test_a_corpus_with_repeated_texts_and_cache_hits_is_built_as_it_lands_and_kept_once(
    tmp_path: Path, reference_model: object
) -> None:
    """Duplicates and vector-cache hits make the corpus rows not the chunk rows in order: the result
    is built by the row map as chunks land (supervisor/result/mapped_building.py), equal to a plain
    encode, and the cache takes it as a shard too."""
    ids, texts = make_texts(50, seed=67)
    texts = texts + texts[:20]  # 20 rows repeat earlier texts
    ids = ids + [f"again{i}" for i in range(20)]
    store = tmp_path / "store"
    want = reference_model.encode(texts)  # type: ignore[attr-defined]
    for name in ("a", "b"):  # b: every text from the cache, hits written at submit
        corpus = write_corpus(tmp_path / f"{name}.jsonl", [f"{name}{i}" for i in ids], texts, "jsonl")
        done = run_cli("run", str(corpus), "--store", str(store), "--chunk-size", "10")
        assert done.returncode == 0, done.stderr[-3000:]
        newest = sorted((store / "runs").iterdir(), key=lambda p: p.stat().st_mtime)[-1]
        layout = RunLayout(store, newest.name)
        got, got_ids = result_of(layout)
        assert got_ids == [f"{name}{i}" for i in ids] and max_abs_diff(got, want) <= 1e-5
        phases = read_json(layout.phases)
        assert phases["build"]["seconds"] > 0 and phases["write"]["seconds"] < 1.0, phases
        assert (layout.result / "embeddings.npy").stat().st_nlink == 2  # the cache's shard too
    assert "70 rows: 0 encoded, 50 from the vector cache, 20 repeating" in done.stdout
