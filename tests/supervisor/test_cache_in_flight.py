"""A run's finished chunks serve the vector cache before the run publishes (issue 65.4: a run
submitted beside a long one that held the same texts got "0 from the vector cache")."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import redis

from chunkq.jobs.compute.model_refs import BUNDLED_MODEL
from chunkq.jobs.compute.vector_cache import VectorCache
from chunkq.jobs.contract.manifest import load_manifest
from chunkq.jobs.contract.run import Run
from chunkq.jobs.contract.run_files import RunLayout
from chunkq.jobs.embed import embed_chunk
from chunkq.supervisor.corpus.records import CorpusOptions
from chunkq.supervisor.result.assemble import assemble
from chunkq.supervisor.result.mapped_building import start_build
from chunkq.supervisor.submit.identity import SubmitRequest
from chunkq.supervisor.submit.submission import submit
from tests.helpers import make_texts, max_abs_diff, result_of, write_corpus


def _submit(store: Path, corpus: Path, connection: redis.Redis) -> RunLayout:
    done = submit(
        SubmitRequest(corpus, store, BUNDLED_MODEL, CorpusOptions("jsonl"), chunk_size=10), connection
    )
    return RunLayout(store, done.run_id)


def _early_shards(store: Path, layout: RunLayout) -> list[str]:
    cache = VectorCache(store, str((load_manifest(layout).plan or {})["producer"]))
    return [s.name for s in cache.shards() if s.meta.get("until_published")]


def test_a_runs_finished_chunks_serve_the_cache_before_it_publishes(
    tmp_path: Path, store: Path, connection: redis.Redis
) -> None:
    ids, texts = make_texts(40, seed=65)
    first = _submit(store, write_corpus(tmp_path / "a.jsonl", ids, texts, "jsonl"), connection)
    manifest = load_manifest(first)
    for index in (0, 1):  # two of its four chunks finished; the run goes on
        embed_chunk(manifest.chunk_spec(store, index).to_dict())
    build = start_build(first, manifest, 1 << 30)
    assert build is not None
    build.advance(pending={2, 3})
    assert build.next == 2 and len(_early_shards(store, first)) == 2

    # A second run of the first two chunks' texts, and ten new ones, while the first goes on.
    new_ids, new_texts = make_texts(10, seed=66)
    corpus = write_corpus(
        tmp_path / "b.jsonl", [f"b{i}" for i in ids[:20]] + new_ids, texts[:20] + new_texts, "jsonl"
    )
    second = _submit(store, corpus, connection)
    plan = load_manifest(second).plan or {}
    assert (plan["cached_rows"], plan["encode_rows"]) == (20, 10)

    for index in (2, 3):
        embed_chunk(manifest.chunk_spec(store, index).to_dict())
    build.advance(pending=set())
    assemble(Run(first, manifest), build=build)
    assert _early_shards(store, first) == []  # the result's own parts serve them now
    assert not list((first.root / "outputs").glob("*.npy"))  # one copy: the chunk arrays went

    manifest2 = load_manifest(second)
    for index in range(manifest2.chunks):
        embed_chunk(manifest2.chunk_spec(store, index).to_dict())
    assemble(Run(second, manifest2))
    got, got_ids = result_of(second)
    want, _ = result_of(first)
    assert got_ids == [f"b{i}" for i in ids[:20]] + new_ids
    assert max_abs_diff(got[:20], want[:20]) == 0.0 and np.isfinite(got).all()


def test_a_run_that_stops_feeding_the_cache_takes_back_what_its_finished_chunks_served(
    tmp_path: Path, store: Path, connection: redis.Redis
) -> None:
    """A later chunk that may not join the cache (its code read what the load did not, other
    libraries, a chunk from the cache): nothing of the run stays in it, the early chunks neither."""
    ids, texts = make_texts(20, seed=67)
    first = _submit(store, write_corpus(tmp_path / "a.jsonl", ids, texts, "jsonl"), connection)
    manifest = load_manifest(first)
    embed_chunk(manifest.chunk_spec(store, 0).to_dict())
    build = start_build(first, manifest, 1 << 30)
    assert build is not None and build.feed is not None
    build.advance(pending={1})
    assert len(_early_shards(store, first)) == 1
    embed_chunk(manifest.chunk_spec(store, 1).to_dict())
    meta_path = first.output_meta(1)
    meta = json.loads(meta_path.read_text())
    build.feed.add(
        1, {**meta, "code_read_late": ["helper/late.py"]}, np.zeros((10, 4), np.float32), texts[10:]
    )
    assert _early_shards(store, first) == [] and build.feed.broken
