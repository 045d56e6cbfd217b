"""Issue 43, never a wrong result: each way hostile testing published a wrong result with exit 0 while
``assemble --verify`` passed, run end to end through ``chunkq run``; each result equals the
sentence-transformers call it stands for, or the run is refused in one line."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import redis

from chunkq.jobs.compute.model_identity import model_identity
from chunkq.jobs.contract.errors import ConfigError, ModelChangedError
from chunkq.jobs.contract.manifest import load_manifest
from chunkq.jobs.contract.run_files import RunLayout
from chunkq.jobs.embed import embed_chunk
from chunkq.queue_worker.exit_codes import EXIT_CONFIG, EXIT_CONFLICT
from chunkq.supervisor.corpus.records import CorpusOptions
from chunkq.supervisor.submit.identity import SubmitRequest
from chunkq.supervisor.submit.submission import prepare, submit
from tests.helpers import make_texts, max_abs_diff, result_of, run_cli, write_corpus
from tests.tiny_models import bundled_copy, perturb_weights

PROMPTS = {"query": "query: ", "document": "passage: "}  # an asymmetric model, as E5 and BGE are


def _run(corpus: Path, store: Path, *args: str) -> tuple[RunLayout, str]:
    """``chunkq run`` to the end: (the run's layout, what it said on stderr and stdout)."""
    done = run_cli("run", str(corpus), "--store", str(store), "--chunk-size", "20", *args)
    assert done.returncode == 0, done.stderr[-3000:]
    said = done.stdout + done.stderr
    summary = next(line for line in said.splitlines() if line.startswith("run ") and " x " in line)
    return RunLayout(store, summary.split()[1].rstrip(":")), said


def _verified(layout: RunLayout) -> None:
    checked = run_cli("assemble", layout.run_id, "--store", str(layout.store), "--verify")
    assert checked.returncode == 0, checked.stderr


@pytest.mark.slow
def test_query_and_document_runs_of_one_model_in_one_store_each_get_their_own_vectors(
    tmp_path: Path,
) -> None:
    """43.1: a --role query run, then the same corpus without --role, then with --role document, in
    one store: each equals its own sentence-transformers call (before: the second and third were
    served the first one's vectors from the cache, max abs diff 0.118 and 0.144)."""
    from sentence_transformers import SentenceTransformer

    model = bundled_copy(tmp_path / "e5like", prompts=PROMPTS)
    ids, texts = make_texts(45, seed=43)
    corpus = write_corpus(tmp_path / "docs.jsonl", ids, texts, "jsonl")
    store = tmp_path / "store"
    reference = SentenceTransformer(str(model), device="cpu")
    calls = {
        "query": reference.encode_query,
        None: reference.encode,
        "document": reference.encode_document,
    }
    for role, call in calls.items():
        layout, printed = _run(corpus, store, "--model", str(model), *(["--role", role] if role else []))
        assert "45 encoded, 0 from the vector cache" in printed, printed[-2000:]
        got, got_ids = result_of(layout)
        assert got_ids == ids
        assert max_abs_diff(got, np.asarray(call(texts))) <= 1e-5, role
        _verified(layout)
    again = run_cli("run", str(corpus), "--store", str(store), "--chunk-size", "20", "--model", str(model))
    assert again.returncode == 0 and "already complete" in again.stdout, again.stderr[-2000:]
    other = tmp_path / "other.jsonl"
    write_corpus(other, [f"x{i}" for i in ids], texts, "jsonl")  # the same texts: all from the cache
    layout, printed = _run(other, store, "--model", str(model), "--role", "document")
    assert "0 encoded, 45 from the vector cache" in printed, printed[-2000:]
    assert max_abs_diff(result_of(layout)[0], reference.encode_document(texts)) <= 1e-5


@pytest.mark.slow
def test_a_model_replaced_after_a_run_is_refused_by_the_same_command_and_runs_again_after_clean(
    tmp_path: Path,
) -> None:
    """43.2: the model folder's weights replaced between two runs of one command: the second says
    the model changed and what to do (before: "already complete", the old model's result); after
    `chunkq clean`, the same command's result equals the new weights' encode, and the vector cache
    never serves the old model's vectors for the new one."""
    from sentence_transformers import SentenceTransformer

    model = bundled_copy(tmp_path / "model")
    ids, texts = make_texts(40, seed=44)
    corpus = write_corpus(tmp_path / "docs.jsonl", ids, texts, "jsonl")
    store = tmp_path / "store"
    layout, _ = _run(corpus, store, "--model", str(model))
    before = model_identity(str(model))
    perturb_weights(model)
    assert model_identity(str(model)) != before
    refused = run_cli("run", str(corpus), "--store", str(store), "--chunk-size", "20", "--model", str(model))
    assert refused.returncode == EXIT_CONFLICT, refused.stderr
    said = refused.stderr.strip().splitlines()[-1]
    assert f"run {layout.run_id}: model {model} has changed since the run was submitted" in said
    assert f"chunkq clean {layout.run_id}" in said and "--run-id" in said
    cleaned = run_cli("clean", layout.run_id, "--store", str(store))
    assert cleaned.returncode == 0, cleaned.stderr
    layout, printed = _run(corpus, store, "--model", str(model))
    assert "40 encoded, 0 from the vector cache" in printed, printed[-2000:]
    new = SentenceTransformer(str(model), device="cpu").encode(texts)
    assert max_abs_diff(result_of(layout)[0], new) <= 1e-5
    assert json.loads(layout.result_manifest.read_text())["model_identity"] == model_identity(str(model))
    _verified(layout)


@pytest.mark.slow
def test_a_worker_whose_model_is_other_bytes_than_the_runs_refuses_the_chunk(
    tmp_path: Path, store: Path, connection: redis.Redis
) -> None:
    """43.2: a run killed after two chunks, the weights replaced, its chunks then taken by workers:
    each refuses in one line naming both models (a config error: never retried, never published);
    the same submit says the model changed; nothing of the new model enters the result or cache."""
    model = bundled_copy(tmp_path / "model")
    ids, texts = make_texts(40, seed=45)
    corpus = write_corpus(tmp_path / "c.jsonl", ids, texts, "jsonl")
    request = SubmitRequest(corpus, store, str(model), CorpusOptions("jsonl"), chunk_size=10)
    layout = RunLayout(store, submit(request, connection).run_id)
    manifest = load_manifest(layout)
    assert manifest.model_identity == model_identity(str(model))
    for index in (0, 1):
        embed_chunk(manifest.chunk_spec(store, index).to_dict())
    perturb_weights(model)
    with pytest.raises(ConfigError) as refused:
        embed_chunk(manifest.chunk_spec(store, 2).to_dict())
    said = str(refused.value)
    assert "\n" not in said and f"run {layout.run_id} was submitted with files:" in said, said
    assert f"model {model} on this host is files:" in said and "refused rather than mix" in said
    assert not layout.output_meta(2).exists()
    with pytest.raises(ModelChangedError, match="has changed since the run was submitted"):
        prepare(request)


@pytest.mark.slow
def test_a_models_identity_is_its_bytes_whatever_the_layout_and_however_it_changes(tmp_path: Path) -> None:
    """43.3: a model reached through a link, with a linked module folder, or with every file a link
    into a blob store (as `hf download --local-dir` and the hub cache lay it out) is the plain
    folder's identity; a file changed through a link, or replaced with the same size and
    modification time in one process's life (`cp -p`), is another identity."""
    plain = bundled_copy(tmp_path / "plain")
    identity = model_identity(str(plain))
    linked = tmp_path / "linked"
    linked.symlink_to(plain, target_is_directory=True)
    assert model_identity(str(linked)) == identity
    parts = tmp_path / "parts"
    shutil.copytree(plain, parts, ignore=shutil.ignore_patterns("1_Pooling"))
    (parts / "1_Pooling").symlink_to(plain / "1_Pooling", target_is_directory=True)
    assert model_identity(str(parts)) == identity  # before: the linked module folder was not read
    blobs, tree = tmp_path / "blobs", tmp_path / "tree"
    for path in sorted(plain.rglob("*")):
        if path.is_file():
            blob = blobs / f"{len(list(blobs.glob('*'))) if blobs.exists() else 0}"
            blob.parent.mkdir(exist_ok=True)
            shutil.copy2(path, blob)
            target = tree / path.relative_to(plain)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.symlink_to(blob)
    assert model_identity(str(tree)) == identity
    weights = next(p for p in tree.rglob("model.safetensors"))
    stat = weights.stat()
    perturb_weights(tree)  # writes through the link, into the blob
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # as `cp -p` would leave it
    assert weights.stat().st_size == stat.st_size and weights.stat().st_mtime_ns == stat.st_mtime_ns
    changed = model_identity(str(tree))
    assert changed != identity and changed == model_identity(str(tree))
    (parts / "1_Pooling").unlink()
    (parts / "1_Pooling").mkdir()
    (parts / "1_Pooling" / "config.json").write_text((plain / "1_Pooling" / "config.json").read_text() + " ")
    assert model_identity(str(parts)) != identity


@pytest.mark.slow
def test_the_python_apis_loaded_model_follows_its_files(tmp_path: Path) -> None:
    """43.3: chunkq.embed keeps the model loaded between calls; after the folder's weights are
    replaced (same size, same modification time), the next call encodes with the new weights."""
    from sentence_transformers import SentenceTransformer

    import chunkq

    model = bundled_copy(tmp_path / "model")
    texts = ["a river in the mountains", "copper lanterns in the harbor"]
    first = chunkq.embed(texts, model=str(model))
    weights = model / "model.safetensors"
    stat = weights.stat()
    perturb_weights(model)
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    second = chunkq.embed(texts, model=str(model))
    assert max_abs_diff(second, SentenceTransformer(str(model), device="cpu").encode(texts)) <= 1e-5
    assert max_abs_diff(first, second) > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model", "kind", "said"),
    [
        ("splade", "cross", "is a sparse model by its files, run as sparse"),
        ("bundled", "sparse", "is a dense model by its files, run as dense"),
        ("bundled", "multivector", "is a dense model by its files, run as dense"),
        ("clip", "sparse", "is a dense model by its files, run as dense or image"),
        ("bundled", "image", "is a dense model by its files, run as dense"),
        ("bert", "cross", "is a dense model by its files, run as dense"),
    ],
)
def test_a_kind_the_models_files_contradict_is_refused_before_the_run_starts(
    tmp_path: Path, tiny: dict[str, Path], model: str, kind: str, said: str
) -> None:
    """43.4 and 43.9: a SPLADE folder as a cross-encoder, MiniLM as sparse or multi-vector, CLIP as
    sparse, a text-only model as image, a bare BERT as a cross-encoder ran with heads of random
    weights (scores differing at every load, and cached). Refused in one line; nothing created."""
    ids, texts = make_texts(5, seed=1)
    corpus = write_corpus(tmp_path / "c.jsonl", ids, texts, "jsonl")
    store = tmp_path / "store"
    pair = ["--pair-field", "text"] if kind == "cross" else []
    refused = run_cli(
        "run", str(corpus), "--store", str(store), "--model", str(tiny[model]), "--kind", kind, *pair
    )
    assert refused.returncode == EXIT_CONFIG, refused.stderr
    assert refused.stderr.count("\n") == 1 and said in refused.stderr, refused.stderr
    assert not store.exists()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from chunkq.jobs.compute.model_refs import BUNDLED_MODEL, resolve_model
    from tests.tiny_models import bare_bert, splade_encoder, tiny_clip

    folder = tmp_path_factory.mktemp("tiny")
    return {
        "bundled": Path(resolve_model(BUNDLED_MODEL)),
        "splade": splade_encoder(folder / "splade"),
        "clip": tiny_clip(folder / "clip"),
        "bert": bare_bert(folder / "bert"),
    }


@pytest.mark.slow
def test_a_load_that_builds_weights_the_files_lack_is_refused(tiny: dict[str, Path]) -> None:
    """43.4, what the files cannot show: transformers' report of newly initialised weights, and
    sentence-transformers' conversion of one kind into another, refuse the load in the worker."""
    from chunkq.jobs.compute import models
    from chunkq.jobs.contract.specs import EncodeOptions

    with pytest.raises(
        ConfigError, match=r"lacks weights a CrossEncoder needs \(classifier\.bias, classifier\.weight\)"
    ):
        models.get_model(str(tiny["bert"]), "cpu", "fp32", EncodeOptions(kind="cross"))
    with pytest.raises(ConfigError, match="lacks weights a MultiVectorEncoder needs"):
        models.get_model(str(tiny["bert"]), "cpu", "fp32", EncodeOptions(kind="multivector"))
    with pytest.raises(ConfigError, match="was saved as a SparseEncoder, not a CrossEncoder"):
        models.get_model(str(tiny["splade"]), "cpu", "fp32", EncodeOptions(kind="cross"))
    assert models.get_model(str(tiny["bert"]), "cpu", "fp32").identity is not None  # dense: mean pooling
