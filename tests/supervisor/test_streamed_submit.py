"""Issue 64.2: a new run's chunks are queued while its corpus is still split (supervisor/submit/
streaming.py, streamed_plan.py). The plan made in one pass is the two-pass plan, chunk for chunk;
a worker accepts a chunk queued before the manifest exists; a command killed mid-split resumes to
the exact result; a bad row after chunks were encoded still leaves nothing. Real runs, the bundled
model."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from chunkq.jobs.compute.model_refs import BUNDLED_MODEL
from chunkq.jobs.contract.manifest import RunManifest, load_manifest
from chunkq.jobs.contract.run_files import RunLayout, read_chunk_input
from chunkq.jobs.embed import check_against_manifest
from chunkq.supervisor.corpus.records import CorpusOptions
from chunkq.supervisor.submit.identity import SubmitRequest
from chunkq.supervisor.submit.submission import prepare
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


class _Recorded:
    """A SplitFeed that checks each chunk as a worker would, the moment it is handed over."""

    def __init__(self, layout: RunLayout) -> None:
        self.layout = layout
        self.specs: dict[int, dict[str, Any]] = {}
        self.before_manifest = 0

    def queue(self, manifest: RunManifest, indices: list[int]) -> None:
        self.before_manifest += not self.layout.manifest.exists()
        for index in indices:
            spec = manifest.chunk_spec(self.layout.store, index)
            check_against_manifest(self.layout, spec, None)  # what the worker does first
            assert spec.rows == len(read_chunk_input(self.layout, index)[0])
            self.specs[index] = spec.to_dict()

    def restart(self) -> None:
        raise AssertionError("a fresh store has no split to restart")

    def abandon(self) -> None:
        raise AssertionError("the corpus is good")


def _files(layout: RunLayout, folder: str) -> dict[str, bytes]:
    root = layout.root / folder
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_the_plan_made_in_one_pass_is_the_two_pass_plan_and_its_chunks_are_taken_early(
    tmp_path: Path,
) -> None:
    """Duplicates, texts the cache holds and new ones, mixed: the streamed run's chunk inputs, row
    map and cached chunks' vectors are the two-pass run's byte for byte, and every chunk handed to
    the queue before the manifest existed is the chunk the manifest names at the end."""
    store = tmp_path / "store"
    ids, texts = make_texts(40, seed=71)
    filled = run_cli(
        "run", str(write_corpus(tmp_path / "a.jsonl", ids, texts, "jsonl")), "--store", str(store)
    )
    assert filled.returncode == 0, filled.stderr[-3000:]
    _, new_texts = make_texts(90, seed=72)
    mixed = [texts[i % 40] if i % 3 == 0 else new_texts[i % 31] for i in range(300)]
    corpus = write_corpus(tmp_path / "b.jsonl", [f"b{i}" for i in range(300)], mixed, "jsonl")

    def request(run_id: str) -> SubmitRequest:
        return SubmitRequest(
            corpus, store, BUNDLED_MODEL, CorpusOptions("jsonl"), chunk_size=7, run_id=run_id
        )

    two = prepare(request("two-pass")).manifest
    layout = RunLayout(store, "one-pass")
    feed = _Recorded(layout)
    one = prepare(request("one-pass"), feed=feed).manifest
    assert one.plan is not None and two.plan is not None and one.plan["streamed"] is True
    timing = {"parts": None, "cache_seconds_saved": None, "streamed": None}
    assert {**one.plan, **timing} == {**two.plan, **timing}
    assert one.plan["cached_rows"] == 40 and one.plan["duplicate_rows"] > 0 and one.plan["encode_rows"] == 31
    assert (one.chunks, one.rows) == (two.chunks, two.rows)
    twin = RunLayout(store, "two-pass")
    assert _files(layout, "inputs") == _files(twin, "inputs")
    assert _files(layout, "plan") == _files(twin, "plan")
    for index in range(one.encode_chunks, one.chunks):  # the cached chunks' vectors, read at submit
        assert np.array_equal(np.load(layout.output_npy(index)), np.load(twin.output_npy(index)))
    assert feed.before_manifest >= 1 and feed.specs
    for index, spec in feed.specs.items():
        assert spec == one.chunk_spec(store, index).to_dict()
    assert not layout.splitting.exists() and load_manifest(layout).data == one.data


def _short_texts(n: int, seed: int) -> tuple[list[str], list[str]]:
    """Many rows, so that the split lasts, of a few tokens each, so that encoding them is quick."""
    ids, texts = make_texts(n, seed)
    return ids, [f"{i} {' '.join(text.split()[:2])}" for i, text in enumerate(texts)]


def _stop_at_split(run: Any, store: Path) -> RunLayout:
    """Freeze the command once its first chunks are queued, its split not done; the layout.

    ``splitting.json`` is written before the chunks it lists are queued (a split cut short between
    the two is split again); a command frozen in between had queued nothing, and no worker ever
    encoded (it timed out twice in full suites). So the freeze waits for chunk 0's job in Redis."""
    import redis

    from chunkq.jobs.contract.specs import chunk_job_id
    from chunkq.jobs.queue.enqueue import job_statuses
    from chunkq.supervisor.server.store_redis import served_url

    wait_for(lambda: any((store / "runs").glob("*/splitting.json")), 180, "the split's first chunks")
    layout = only_run(store)
    wait_for(lambda: served_url(store) is not None, 60, "the run's Redis to be advertised")
    with redis.Redis.from_url(str(served_url(store))) as connection:
        job = chunk_job_id(layout.run_id, 0)

        def queued() -> bool:
            return job_statuses(connection, [job]) != [None] or layout.output_meta(0).exists()

        wait_for(queued, 60, "chunk 0's job in Redis")
    os.kill(run.pid, signal.SIGSTOP)  # the command only: its workers go on with the queued chunks
    layout = only_run(store)
    assert not layout.manifest.exists()
    try:
        wait_for(lambda: layout.output_meta(0).exists(), 180, "a worker to encode a chunk queued mid-split")
    except AssertionError as timed_out:
        raise AssertionError(f"{timed_out}\n{_what_the_tree_does(run.pid, store, layout)}") from None
    return layout


def _what_the_tree_does(pid: int, store: Path, layout: RunLayout) -> str:
    """For a timed-out wait: each process of the command's tree, its state and where it waits in the
    kernel, and the end of the run's log (a wait that once failed in a full suite and not alone)."""
    import psutil

    lines = []
    for proc in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
        try:
            wchan = Path(f"/proc/{proc.pid}/wchan").read_text()
            lines.append(f"{proc.pid} {proc.status()} {wchan} {' '.join(proc.cmdline()[:4])}")
        except (psutil.Error, OSError) as gone:
            lines.append(f"{proc.pid} {gone}")
    log = store / "runs" / layout.run_id / "logs" / "run.log"
    tail = log.read_text(errors="replace")[-4000:] if log.is_file() else "(no run log)"
    return "\n".join(lines) + "\n--- run log ---\n" + tail


@pytest.mark.slow
def test_a_run_killed_while_its_corpus_is_split_resumes_to_the_exact_result(
    tmp_path: Path, reference_model: Any
) -> None:
    """SIGKILL of the command and everything it started mid-split, after a worker encoded a chunk
    queued then: the same command splits the corpus again and publishes the exact result."""
    ids, texts = _short_texts(3000, seed=73)
    store = tmp_path / "store"
    args = ["run", str(write_corpus(tmp_path / "a.jsonl", ids, texts, "jsonl")), "--store", str(store)]
    args += ["--chunk-size", "10"]
    run = start_cli(tmp_path / "run.log", *args)
    try:
        layout = _stop_at_split(run, store)
    finally:
        stop_tree(run)
    assert layout.splitting.exists() and not layout.manifest.exists()
    again = run_cli(*args)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "was being split when its command stopped; splitting it again" in again.stdout + again.stderr
    got, got_ids = result_of(layout)
    assert got_ids == ids and max_abs_diff(got, reference_model.encode(texts)) <= 1e-5
    assert not layout.splitting.exists()


@pytest.mark.slow
def test_a_bad_row_after_chunks_were_encoded_still_leaves_nothing(tmp_path: Path) -> None:
    """A duplicate id on the last row, found after a worker encoded a chunk queued mid-split: the
    command stops with the pool killed and removes every file and folder it created."""
    ids, texts = _short_texts(3000, seed=74)
    ids[-1] = ids[0]
    store = tmp_path / "store"
    corpus = write_corpus(tmp_path / "a.jsonl", ids, texts, "jsonl")
    run = start_cli(tmp_path / "run.log", "run", str(corpus), "--store", str(store), "--chunk-size", "10")
    try:
        _stop_at_split(run, store)
        os.kill(run.pid, signal.SIGCONT)
        code = run.wait(timeout=180)
    finally:
        stop_tree(run)
    said = (tmp_path / "run.log").read_text()
    assert code == 3 and f"duplicate id {ids[0]!r}" in said, said[-3000:]
    assert not store.exists()


def test_the_hash_index_is_a_dict_of_its_keys_through_growth_and_collisions(monkeypatch: Any) -> None:
    """Blocks of keys put and looked up as the streamed plan does, negative numbers included, with
    keys whose slots collide (equal first 8 bytes), the table moved a few keys at a time as it grows:
    every lookup is the dict's."""
    from chunkq.jobs.compute.vector_cache import text_hashes
    from chunkq.supervisor.submit import hash_index
    from chunkq.supervisor.submit.hash_index import MISSING, HashIndex

    monkeypatch.setattr(hash_index, "_MOVED_AT_A_TIME", 333)

    index, truth = HashIndex(capacity=4), dict[bytes, int]()
    keys = text_hashes(str(i) for i in range(20_000))
    clash = np.frombuffer(b"".join(k[:8] + bytes([i]) * 8 for i, k in enumerate(keys[:50].tolist())), "S16")
    keys = np.concatenate([keys, clash])
    for start in range(0, len(keys), 997):
        block = keys[start : start + 997]
        numbers = -np.arange(start, start + len(block)) - 1  # -1 too: no number is taken for missing
        assert (index.get(block) == MISSING).all()
        index.put(block, numbers)
        truth.update(zip(block.tolist(), numbers.tolist(), strict=True))
        probe = keys[: start + len(block)][::7]
        assert index.get(probe).tolist() == [truth[k] for k in probe.tolist()]
    assert len(index) == len(truth) == len(keys)
    assert (index.get(text_hashes(f"x{i}" for i in range(500))) == MISSING).all()
