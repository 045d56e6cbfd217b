"""Issue 32: pay once for a text. Duplicates inside a run are encoded once, and texts an earlier run
encoded are read from the store's vector cache; every result equals a plain encode of its texts."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis

from chunkq.jobs.compute import cache_upkeep
from chunkq.jobs.compute.model_identity import model_identity
from chunkq.jobs.compute.model_refs import BUNDLED_MODEL, resolve_model
from chunkq.jobs.compute.vector_cache import VectorCache, producer, producer_key, text_hashes
from chunkq.jobs.contract.run import Run
from chunkq.jobs.contract.run_files import read_chunk_input, read_json
from chunkq.jobs.contract.specs import EncodeOptions
from tests.helpers import make_texts, max_abs_diff, result_of, run_cli, run_in_process, write_corpus


def _with_duplicates(unique: int, copies: int, seed: int) -> tuple[list[str], list[str]]:
    """``unique`` texts plus ``copies`` exact copies of some of them, shuffled; ids all distinct."""
    _, texts = make_texts(unique, seed=seed)
    rng = random.Random(seed)
    texts = texts + [rng.choice(texts) for _ in range(copies)]
    rng.shuffle(texts)
    return [f"row-{i}" for i in range(len(texts))], texts


def test_duplicates_inside_a_run_are_encoded_once(
    tmp_path: Path, store: Path, connection: redis.Redis, reference_model: Any
) -> None:
    ids, texts = _with_duplicates(35, 15, seed=1)
    distinct = len(set(texts))
    layout, manifest, encoded = run_in_process(tmp_path, store, connection, ids, texts, "dupes")
    assert encoded == distinct < len(texts)
    plan = manifest.plan
    assert plan is not None and plan["duplicate_rows"] == len(texts) - distinct and not plan["identity"]
    matrix, got_ids = result_of(layout)
    assert got_ids == ids
    assert max_abs_diff(matrix, reference_model.encode(texts)) <= 1e-5


def test_a_new_version_encodes_only_changed_and_added_texts(
    tmp_path: Path, store: Path, connection: redis.Redis, reference_model: Any
) -> None:
    ids, texts = make_texts(60, seed=2)
    run_in_process(tmp_path, store, connection, ids, texts, "v1")
    v2_texts = list(texts)
    v2_texts[7] += " changed"
    v2_texts[41] = "a wholly new sentence about copper harbors"
    v2_ids, v2_texts = [*ids, "doc-new"], [*v2_texts, "an added text about lanterns"]
    layout, manifest, encoded = run_in_process(tmp_path, store, connection, v2_ids, v2_texts, "v2")
    assert encoded == 3
    assert manifest.plan is not None and manifest.plan["cached_rows"] == 58
    matrix, got_ids = result_of(layout)
    assert got_ids == v2_ids
    assert max_abs_diff(matrix, reference_model.encode(v2_texts)) <= 1e-5
    # Every text cached: nothing to encode, and still the exact result.
    layout, manifest, encoded = run_in_process(
        tmp_path, store, connection, v2_ids, v2_texts, "v2", chunk_size=7
    )
    assert encoded == 0 and manifest.plan is not None and manifest.plan["cached_rows"] == 61
    assert max_abs_diff(result_of(layout)[0], reference_model.encode(v2_texts)) <= 1e-5
    (summary,) = cache_upkeep.summary(VectorCache(store))
    assert summary["rows"] == 63 and summary["hits"] == 58 + 61


def test_no_cache_encodes_every_row(tmp_path: Path, store: Path, connection: redis.Redis) -> None:
    ids, texts = _with_duplicates(20, 10, seed=3)
    _, manifest, encoded = run_in_process(tmp_path, store, connection, ids, texts, "plain", cache=False)
    assert encoded == len(texts) and manifest.plan is None
    assert not (store / "cache").exists()


# A value other than the default for every option, valid on its own. An option added to
# EncodeOptions without one fails the test below: say here what it is, and in specs.py whether it
# changes a vector.
OTHER_VALUES: dict[str, Any] = {
    "batch_size": 4,
    "normalize_embeddings": True,
    "max_seq_length": 64,
    "precision": "fp16",
    "batch_tokens": 2048,
    "prompt": "query: ",
    "prompt_name": "query",
    "truncate_dim": 32,
    "output_dtype": "int8",
    "trust_remote_code": True,
    "revision": "v2",
    "model_kwargs": {"attn_implementation": "eager"},
    "late_chunking": True,
    "kind": "sparse",
    "role": "query",
    "max_active_dims": 64,
    "allow_missing": True,
    "backend": "openvino",
}
# What a vector cannot depend on: how rows are batched, and what assembly derives from the float32
# vectors the cache keeps (truncation, stored dtype); a row left out is not a row.
NOT_A_VECTORS = {"batch_size", "batch_tokens", "truncate_dim", "output_dtype", "allow_missing"}


def test_every_option_that_changes_a_vector_changes_the_cache_key() -> None:
    """Issue 43.1: --role was not in the key, so a query run's vectors were served to a document
    run. The key is now every option that says it changes a vector; this fails when an option is
    added to the options and not classified, or classified against what it does."""
    options = {f.name for f in dataclasses.fields(EncodeOptions)}
    assert options == set(OTHER_VALUES), f"say what these are: {options ^ set(OTHER_VALUES)}"
    identity = "files:" + "0" * 64
    base = producer_key(producer(BUNDLED_MODEL, identity, EncodeOptions()))
    for name, value in OTHER_VALUES.items():
        key = producer_key(producer(BUNDLED_MODEL, identity, EncodeOptions(**{name: value})))
        assert (key != base) == (name not in NOT_A_VECTORS), name
    assert producer_key(producer(BUNDLED_MODEL, "hub:org/model@" + "1" * 40, EncodeOptions())) != base
    assert producer_key(producer("another-name", identity, EncodeOptions())) == base  # bytes, not names
    queries = producer_key(producer(BUNDLED_MODEL, identity, EncodeOptions(role="query")))
    documents = producer_key(producer(BUNDLED_MODEL, identity, EncodeOptions(role="document")))
    assert len({base, queries, documents}) == 3


def test_a_model_is_the_same_bytes_under_another_name_and_not_after_an_edit(tmp_path: Path) -> None:
    bundled = resolve_model(BUNDLED_MODEL)
    identity = model_identity(BUNDLED_MODEL)
    assert identity is not None and identity.startswith("files:")
    copy = tmp_path / "model"
    shutil.copytree(bundled, copy)
    assert model_identity(str(copy)) == identity  # the same files under another name: the same model
    with open(copy / "config.json", "a") as fh:
        fh.write("\n")
    assert model_identity(str(copy)) != identity


@pytest.mark.slow
def test_other_options_get_no_hits(tmp_path: Path, store: Path, connection: redis.Redis) -> None:
    ids, texts = make_texts(12, seed=5)
    run_in_process(tmp_path, store, connection, ids, texts, "a")
    for encode in (
        EncodeOptions(prompt="passage: "),
        EncodeOptions(max_seq_length=16),
        EncodeOptions(normalize_embeddings=True),
    ):
        _, manifest, encoded = run_in_process(tmp_path, store, connection, ids, texts, "a", encode=encode)
        assert encoded == 12 and manifest.plan is not None and manifest.plan["cached_rows"] == 0


def test_a_tampered_cache_entry_is_set_aside_and_encoded_again(
    tmp_path: Path, store: Path, connection: redis.Redis, reference_model: Any
) -> None:
    ids, texts = make_texts(30, seed=6)
    run_in_process(tmp_path, store, connection, ids, texts, "t")
    (producer_dir,) = (store / "cache").iterdir()
    (vectors,) = (producer_dir / "shards").glob("*.vectors.npy")
    data = bytearray(vectors.read_bytes())
    data[-8:-4] = np.float32(0.5).tobytes()  # a plausible value: only the checksum can tell
    vectors.write_bytes(bytes(data))
    layout, manifest, encoded = run_in_process(tmp_path, store, connection, ids, texts, "t", chunk_size=7)
    assert encoded == 30 and manifest.plan is not None and manifest.plan["cache_damaged_rows"] == 30
    assert list((producer_dir / "damaged").glob("*.vectors.npy"))
    assert max_abs_diff(result_of(layout)[0], reference_model.encode(texts)) <= 1e-5


@pytest.mark.slow
def test_quantized_and_truncated_results_from_cached_floats_equal_plain(
    tmp_path: Path, store: Path, connection: redis.Redis, reference_model: Any
) -> None:
    from sentence_transformers import quantize_embeddings

    ids, texts = _with_duplicates(25, 5, seed=7)
    run_in_process(tmp_path, store, connection, ids, texts, "f")
    layout, manifest, encoded = run_in_process(
        tmp_path, store, connection, ids, texts, "f", encode=EncodeOptions(output_dtype="int8"), cache=True
    )
    assert encoded == 0
    ranges = np.asarray(manifest.ranges, dtype=np.float32)
    floats = reference_model.encode(texts)
    plain = quantize_embeddings(floats, precision="int8", ranges=ranges)
    got = result_of(layout)[0]
    assert np.abs(got.astype(int) - plain.astype(int)).max() <= 1
    # Where they differ, the float lies at a rounding edge (batches move fp32 by ~1e-7): how many do
    # depends on the machine's kernels (12 of 11,520 here, fewer elsewhere), not a share to bound.
    scaled = (floats - ranges[0]) / ((ranges[1] - ranges[0]) / 255) - 128
    at_edge = np.abs(scaled - np.round(scaled)) < 1e-3
    assert at_edge[got != plain].all()
    encode = EncodeOptions(truncate_dim=64, normalize_embeddings=True)
    layout, _, _ = run_in_process(
        tmp_path, store, connection, ids, texts, "n", encode=replace(encode, truncate_dim=None)
    )
    layout, _, encoded = run_in_process(tmp_path, store, connection, ids, texts, "n", encode=encode)
    assert encoded == 0
    want = reference_model.encode(texts, truncate_dim=64, normalize_embeddings=True)
    assert result_of(layout)[0].shape == (30, 64) and max_abs_diff(result_of(layout)[0], want) <= 1e-5


def test_two_writers_at_once_lose_nothing(tmp_path: Path) -> None:
    cache = VectorCache(tmp_path / "store", "p" * 32)
    texts = [[f"text {w}-{i}" for i in range(3000)] for w in range(4)]
    vectors = [np.random.default_rng(w).random((3000, 8), dtype=np.float32) for w in range(4)]
    threads = [
        threading.Thread(target=cache.write, args=(text_hashes(t), v, f"run{w}", 1.0))
        for w, (t, v) in enumerate(zip(texts, vectors, strict=True))
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    shards = cache.shards()
    assert sorted(s.meta["run_id"] for s in shards) == ["run0", "run1", "run2", "run3"]
    for shard in shards:
        w = int(shard.meta["run_id"][-1])
        assert (cache.hashes(shard) == text_hashes(texts[w])).all()
        got = cache.vectors(shard, np.arange(0, 3000, 7))
        assert np.array_equal(got, vectors[w][::7])


def test_a_damaged_marker_or_hash_file_is_set_aside(tmp_path: Path) -> None:
    cache = VectorCache(tmp_path / "store", "q" * 32)
    cache.write(text_hashes(["a", "b"]), np.ones((2, 4), np.float32), "r", 0.0)
    (shard,) = cache.shards()
    hashes = shard.path(".hashes.npy")
    hashes.write_bytes(hashes.read_bytes()[:-1] + b"\x00")
    with pytest.raises(Exception, match="checksum"):
        cache.hashes(shard)
    assert cache.shards() == []
    assert (
        read_json(next((tmp_path / "store" / "cache" / ("q" * 32) / "damaged").glob("*.json")))["rows"] == 2
    )


@pytest.mark.slow
def test_the_partitioned_join_and_a_row_map_in_parts_give_the_same_result(
    tmp_path: Path,
    store: Path,
    connection: redis.Redis,
    reference_model: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """At 10^8 rows the join spills to partition files and the row map is cut into parts: the same
    code paths, driven here by small sizes."""
    from chunkq.supervisor.submit import hash_join, plan

    monkeypatch.setattr(hash_join, "BUCKET_ROWS", 8)  # 64 rows: 8 partitions
    monkeypatch.setattr(plan, "PART_ROWS", 9)
    monkeypatch.setattr(hash_join, "ROW_BLOCK", 5)
    monkeypatch.setattr(plan, "ROW_BLOCK", 5)
    ids, texts = _with_duplicates(40, 24, seed=8)
    run_in_process(tmp_path, store, connection, ids[:30], texts[:30], "half")
    layout, manifest, encoded = run_in_process(tmp_path, store, connection, ids, texts, "all")
    assert manifest.plan is not None and len(manifest.plan["parts"]) == 8
    assert encoded == len(set(texts) - set(texts[:30]))
    matrix, got_ids = result_of(layout)
    assert got_ids == ids and max_abs_diff(matrix, reference_model.encode(texts)) <= 1e-5


@pytest.mark.slow
def test_status_runs_report_metrics_and_the_cache_command_say_what_was_saved(
    tmp_path: Path, store: Path, connection: redis.Redis
) -> None:
    from chunkq.supervisor.watch.metrics import RunMetrics
    from chunkq.supervisor.watch.snapshot import store_snapshot
    from chunkq.tools.report import summary as report_summary
    from chunkq.tools.report import write_report
    from chunkq.tools.run_facts import gather
    from chunkq.tools.run_list import describe_run

    ids, texts = make_texts(20, seed=9)
    run_in_process(tmp_path, store, connection, ids, texts, "s1")
    ids2, texts2 = _with_duplicates(20, 6, seed=9)  # the same 20 texts (seed 9), 6 of them twice
    layout, manifest, encoded = run_in_process(tmp_path, store, connection, ids2, texts2, "s2")
    assert encoded == 0
    want = {"rows": 26, "distinct": 20, "encoded": 0, "from_cache": 20, "deduplicated": 6}
    assert {k: store_snapshot(layout, manifest).cache[k] for k in want} == want  # type: ignore[index]
    assert {k: describe_run(store, layout.run_id).to_json()["cache"][k] for k in want} == want
    facts = gather(Run.of(layout))
    saved = report_summary(facts, [], None, "tokens")["cache"]
    assert saved["chunks_from_cache"] == manifest.chunks and saved["encode_seconds_saved"] > 0
    # Every chunk read from the cache: the run is done, and the figures no chunk gave read "-".
    reported = write_report(Run.of(layout), tmp_path / "report")
    assert (reported["chunks_done"], reported["chunks_encoded"]) == (manifest.chunks, 0)
    assert reported["ran_seconds"] == 0 and reported["rows_per_second"] is None
    page = (tmp_path / "report" / "report.md").read_text()
    assert f"| chunks done | {manifest.chunks} of {manifest.chunks} |" in page
    assert "| throughput | - |" in page and "None" not in page, page
    metrics = RunMetrics(layout.run_id)
    metrics.observe(store_snapshot(layout, manifest))
    sample = metrics.registry.get_sample_value
    assert sample("chunkq_corpus_rows", {"run": layout.run_id, "source": "from_cache"}) == 20
    assert sample("chunkq_corpus_rows", {"run": layout.run_id, "source": "deduplicated"}) == 6

    shown = run_cli("cache", "--store", str(store), "--json")
    assert shown.returncode == 0, shown.stderr
    (entry,) = json.loads(shown.stdout)
    assert entry["rows"] == 20 and entry["hits"] == 20 and entry["runs"] == 2
    kept = run_cli("cache", "clean", "--older-than", "1d", "--store", str(store))
    assert kept.returncode == 0 and "removed 0 shard(s)" in kept.stdout
    bad = run_cli("cache", "clean", "--older-than", "soon", "--store", str(store))
    assert bad.returncode != 0 and "--older-than 'soon'" in bad.stderr
    freed = run_cli("cache", "--store", str(store), "clean")
    assert freed.returncode == 0 and "removed 1 shard(s), 20 texts, 1 producer(s)" in freed.stdout
    assert cache_upkeep.summary(VectorCache(store)) == []


def test_status_of_a_run_under_way_says_what_its_plan_will_encode_not_that_it_did(
    tmp_path: Path, store: Path, connection: redis.Redis
) -> None:
    """A newcomer's status read "15,000 rows: 15,000 encoded" with 3,000 rows done."""
    from chunkq.jobs.compute.model_refs import BUNDLED_MODEL
    from chunkq.jobs.contract.manifest import load_manifest
    from chunkq.jobs.contract.run_files import RunLayout
    from chunkq.jobs.embed import embed_chunk
    from chunkq.supervisor.corpus.records import CorpusOptions
    from chunkq.supervisor.result.assemble import assemble
    from chunkq.supervisor.submit.identity import SubmitRequest
    from chunkq.supervisor.submit.submission import submit

    ids, texts = make_texts(30, seed=21)
    corpus = write_corpus(tmp_path / "c.jsonl", ids, texts, "jsonl")
    request = SubmitRequest(corpus, store, BUNDLED_MODEL, CorpusOptions("jsonl"), chunk_size=10)
    layout = RunLayout(store, submit(request, connection).run_id)
    manifest = load_manifest(layout)
    embed_chunk(manifest.chunk_spec(layout.store, 0).to_dict())

    def cache_line() -> str:
        said = run_cli("status", layout.run_id, "--store", str(store), forks=False)
        assert said.returncode in (0, 2), said.stderr
        (line,) = [line for line in said.stdout.splitlines() if line.startswith("vector cache: ")]
        return line

    assert cache_line().startswith("vector cache: 30 rows planned: 30 to encode, 0 from the vector cache")
    for index in range(1, manifest.chunks):
        embed_chunk(manifest.chunk_spec(layout.store, index).to_dict())
    assemble(Run.of(layout))
    assert cache_line().startswith("vector cache: 30 rows: 30 encoded, 0 from the vector cache")


def _disk_bytes(folder: Path) -> int:
    """What the files below ``folder`` hold on the disk: each inode once, however many links."""
    seen: dict[tuple[int, int], int] = {}
    for path in folder.rglob("*"):
        if path.is_file() and not path.is_symlink():
            st = path.stat()
            seen[(st.st_dev, st.st_ino)] = st.st_size
    return sum(seen.values())


def test_clean_says_what_the_disk_got_back_and_what_the_caches_links_keep(tmp_path: Path) -> None:
    """A newcomer's `chunkq clean RUN` said "freed 22.7 MiB" while the store's size did not move:
    the vector cache links the result's shards. The bytes freed are the disk's, and the rest is named
    with the command that frees it."""
    from chunkq.jobs.contract.run_files import RunLayout

    ids, texts = make_texts(40, seed=12)
    store, corpus = tmp_path / "store", write_corpus(tmp_path / "held.jsonl", ids, texts, "jsonl")
    assert run_cli("run", str(corpus), "--store", str(store), "--chunk-size", "20").returncode == 0
    (root,) = (store / "runs").iterdir()
    layout = RunLayout(store, root.name)
    before = _disk_bytes(store)
    said = run_cli("clean", layout.run_id, "--store", str(store), forks=False)
    assert said.returncode == 0, said.stderr
    freed, kept = said.stdout.strip().splitlines()
    assert freed.startswith("freed ") and freed.endswith(f": run {layout.run_id}")
    assert "of its files stay on the disk: the store's vector cache links them" in kept
    assert "`chunkq cache clean` frees it" in kept
    gone = before - _disk_bytes(store)
    from chunkq.tools.run_list import bytes_below

    number, unit = freed.split()[1:3]
    said_bytes = float(number) * {"B": 1, "KiB": 2**10, "MiB": 2**20}[unit.rstrip(":")]
    # What the run's lock, written by clean itself, adds is the difference: under 1 KiB.
    assert abs(said_bytes - gone) < 1024 and gone < _disk_bytes(store), (freed, gone)
    assert bytes_below(store / "cache")[1] == 0  # what the run held is the cache's alone now


@pytest.mark.slow
def test_a_partial_result_leaves_out_every_row_of_a_missing_chunks_texts(
    tmp_path: Path, store: Path, connection: redis.Redis, reference_model: Any
) -> None:
    from chunkq.jobs.contract.manifest import load_manifest
    from chunkq.jobs.contract.run_files import RunLayout
    from chunkq.jobs.embed import embed_chunk
    from chunkq.supervisor.corpus.records import CorpusOptions
    from chunkq.supervisor.result.assemble import Failure, assemble
    from chunkq.supervisor.result.reader import check_published
    from chunkq.supervisor.submit.identity import SubmitRequest
    from chunkq.supervisor.submit.submission import submit

    ids, texts = _with_duplicates(30, 20, seed=10)
    corpus = write_corpus(tmp_path / "p.jsonl", ids, texts, "jsonl")
    request = SubmitRequest(corpus, store, BUNDLED_MODEL, CorpusOptions("jsonl"), chunk_size=10)
    layout = RunLayout(store, submit(request, connection).run_id)
    manifest = load_manifest(layout)
    for index in range(1, manifest.chunks):  # chunk 0 is quarantined
        embed_chunk(manifest.chunk_spec(store, index).to_dict())
    chunk0 = set(read_chunk_input(layout, 0)[1])
    failure = Failure(0, 0, 10, "j", "other", 3, "boom", "", True)
    result = assemble(Run.of(layout), missing=[failure])
    kept = [i for i, t in enumerate(texts) if t not in chunk0]
    assert result["rows"] == len(kept) < len(texts) and not result["complete"]
    assert result["missing"][0]["rows"] == len(texts) - len(kept)
    assert check_published(layout, manifest) == []
    matrix, got = result_of(layout)
    assert got == [ids[i] for i in kept]
    assert max_abs_diff(matrix, reference_model.encode([texts[i] for i in kept])) <= 1e-5
    assert all(
        e["rows"] == 0 for e in cache_upkeep.summary(VectorCache(store))
    )  # a partial result adds nothing


def test_clean_removes_a_dead_writers_files_but_not_a_live_ones(tmp_path: Path) -> None:
    import os
    import time

    cache = VectorCache(tmp_path / "store", "o" * 32)
    cache.write(text_hashes(["kept"]), np.ones((1, 4), np.float32), "r", 0.0)
    folder = tmp_path / "store" / "cache" / ("o" * 32) / "shards"
    dead, live = folder / "dead-1.vectors.npy", folder / "live-1.vectors.npy"
    dead.write_bytes(b"x")
    live.write_bytes(b"x")
    os.utime(dead, (time.time() - 7200, time.time() - 7200))
    removed = cache_upkeep.clean(cache, older_than=10**6)
    assert removed["orphans"] == 1 and removed["shards"] == 0
    assert not dead.exists() and live.exists() and len(cache.shards()) == 1


def test_a_run_begun_before_the_cache_resumes_as_it_was(
    tmp_path: Path, store: Path, connection: redis.Redis
) -> None:
    """The same command after an upgrade finds the run it began, not a new one (its identity had
    no cache); it finishes without the cache. Asking for the cache by name makes a new run."""
    from chunkq.jobs.contract.manifest import load_manifest
    from chunkq.jobs.contract.run_files import RunLayout
    from chunkq.supervisor.corpus.records import CorpusOptions
    from chunkq.supervisor.submit.identity import SubmitRequest
    from chunkq.supervisor.submit.submission import submit

    ids, texts = make_texts(20, seed=12)
    corpus = write_corpus(tmp_path / "old.jsonl", ids, texts, "jsonl")
    old = submit(
        SubmitRequest(corpus, store, BUNDLED_MODEL, CorpusOptions("jsonl"), chunk_size=10, cache=False),
        connection,
    )
    manifest_path = RunLayout(store, old.run_id).manifest
    data = json.loads(manifest_path.read_text())
    assert "vector_cache" not in data["identity"]  # what a run made before the cache looks like
    again = submit(
        SubmitRequest(corpus, store, BUNDLED_MODEL, CorpusOptions("jsonl"), chunk_size=10), connection
    )
    assert again.run_id == old.run_id and not again.created
    assert load_manifest(RunLayout(store, again.run_id)).plan is None
    asked = submit(
        SubmitRequest(corpus, store, BUNDLED_MODEL, CorpusOptions("jsonl"), chunk_size=10, cache=True),
        connection,
    )
    assert asked.run_id != old.run_id and asked.created


def _read_only_mounts_work() -> bool:
    """Whether this host lets a test mount a folder read-only in a namespace of its own."""
    import subprocess

    probe = "mount --bind /tmp /tmp && mount -o remount,bind,ro /tmp"
    try:
        return (
            subprocess.run(["unshare", "-rm", "sh", "-c", probe], capture_output=True, timeout=30).returncode
            == 0
        )
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.slow
@pytest.mark.skipif(
    not os.environ.get("CI") and not _read_only_mounts_work(),
    reason="unshare cannot mount a folder read-only here (CI must)",
)
def test_a_read_only_cache_costs_time_not_the_run(tmp_path: Path, reference_model: Any) -> None:
    """Issue 43.12: the cache on a read-only mount made a new run exit 11 after its run folder
    existed. The cache is derived data: the run reads what it can, says it cannot add, and
    publishes the right result. The mount is real (EROFS, as a read-only volume gives), made with
    unshare so a root test user is refused too."""
    import subprocess

    from chunkq.jobs.contract.run_files import RunLayout
    from tests.helpers import CLI, cli_env

    store = tmp_path / "store"
    ids, texts = make_texts(30, seed=12)
    first = write_corpus(tmp_path / "a.jsonl", ids, texts[:15] * 2, "jsonl")
    assert run_cli("run", str(first), "--store", str(store), "--chunk-size", "10").returncode == 0
    second = write_corpus(tmp_path / "b.jsonl", ids, texts, "jsonl")
    cache = store / "cache"
    mount = f"mount --bind {cache} {cache} && mount -o remount,bind,ro {cache} && exec"
    command = " ".join([mount, *CLI, "run", str(second), "--store", str(store), "--chunk-size", "10"])
    done = subprocess.run(
        ["unshare", "-rm", "sh", "-c", command], env=cli_env(), capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "15 encoded, 15 from the vector cache" in done.stdout + done.stderr
    assert "the vector cache cannot be written" in done.stderr and "Read-only file system" in done.stderr
    layout = RunLayout(store, next(p.name for p in (store / "runs").iterdir() if p.name.startswith("b-")))
    got, got_ids = result_of(layout)
    assert got_ids == ids and max_abs_diff(got, reference_model.encode(texts)) <= 1e-5


def test_rows_encoded_by_other_library_releases_stay_out_of_the_cache(
    tmp_path: Path, store: Path, connection: redis.Redis
) -> None:
    """The cache's key holds the releases of the libraries that compute a vector (a release has
    changed what a model computes); a chunk a worker of other releases encoded is not added under it."""
    import json

    from chunkq.jobs.compute.vector_cache import VectorCache, library_versions
    from chunkq.jobs.contract.manifest import load_manifest
    from chunkq.jobs.contract.run_files import RunLayout
    from chunkq.jobs.embed import embed_chunk
    from chunkq.supervisor.corpus.records import CorpusOptions
    from chunkq.supervisor.result.assemble import assemble
    from chunkq.supervisor.submit.identity import SubmitRequest
    from chunkq.supervisor.submit.submission import submit

    assert producer(BUNDLED_MODEL, "files:x", EncodeOptions())["libraries"] == library_versions()
    ids, texts = make_texts(30, seed=31)
    corpus = write_corpus(tmp_path / "c.jsonl", ids, texts, "jsonl")
    request = SubmitRequest(corpus, store, BUNDLED_MODEL, CorpusOptions("jsonl"), chunk_size=10)
    layout = RunLayout(store, submit(request, connection).run_id)
    manifest = load_manifest(layout)
    for index in range(manifest.chunks):
        embed_chunk(manifest.chunk_spec(store, index).to_dict())
    meta = json.loads(layout.output_meta(1).read_text())
    assert meta["libraries"] == library_versions()
    meta["libraries"] = {**meta["libraries"], "transformers": "4.9"}  # as an older worker records it
    layout.output_meta(1).write_text(json.dumps(meta))
    assemble(Run.of(layout))
    cache = VectorCache(store, manifest.plan["producer"])
    assert sum(s.rows for s in cache.shards()) == 20


def test_the_key_holds_each_release_that_changes_a_vector_and_not_torchs_patch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 51.2: a tokenizers release that tokenises differently, or a patch release of
    sentence-transformers or transformers, is another producer; torch's patch release (~1e-7) and
    its build (+cpu, +cu130) are not."""
    import importlib.metadata

    real = importlib.metadata.version
    installed = {
        name: real(name) for name in ("sentence-transformers", "transformers", "tokenizers", "torch")
    }

    def key_with(**releases: str) -> str:
        table = {**installed, **{name.replace("_", "-"): v for name, v in releases.items()}}
        monkeypatch.setattr(importlib.metadata, "version", lambda name: table.get(name) or real(name))
        vector_cache._library_versions.cache_clear()  # read once a process: this test changes them
        return producer_key(producer(BUNDLED_MODEL, "files:x", EncodeOptions()))

    from chunkq.jobs.compute import vector_cache

    base = key_with(torch="2.13.0+cpu")
    assert key_with(torch="2.13.1+cu130") == base
    assert key_with(torch="2.14.0") != base
    for name in ("tokenizers", "transformers", "sentence_transformers"):
        major, minor, patch = installed[name.replace("_", "-")].split("+")[0].split(".")[:3]
        bumped = f"{major}.{minor}.{int(patch.rstrip('abcdefghijklmnopqrstuvwxyz')) + 1}"  # a patch release
        assert key_with(torch="2.13.0", **{name: bumped}) != base, name
    monkeypatch.undo()
    vector_cache._library_versions.cache_clear()  # the real releases again, for later tests
