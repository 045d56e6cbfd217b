"""Issue 52.1: a static-embedding model (sentence-transformers' StaticEmbedding: a token lookup and a
mean, model2vec-style) runs as a dense model, equal to ``SentenceTransformer.encode`` row for row.
Before, every worker crashed on ``max_seq_length`` (the module has no setter) until the pool gave up."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from chunkq.jobs.compute.model_info import check_options, describe
from chunkq.jobs.contract.errors import ConfigError
from chunkq.jobs.contract.specs import EncodeOptions
from tests.helpers import make_texts, max_abs_diff, result_of, run_cli, write_corpus
from tests.tiny_models import static_embedding


@pytest.fixture(scope="module")
def static(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return static_embedding(tmp_path_factory.mktemp("static") / "model")


def test_its_files_say_what_it_is_and_a_length_is_refused(static: Path) -> None:
    info = describe(str(static))
    assert (info.kind, info.dim, info.max_seq_length, info.positions, info.static) == (
        "dense",
        256,
        None,
        None,
        True,
    )
    with pytest.raises(ConfigError, match="is a static-embedding model, which averages every token"):
        check_options(info, EncodeOptions(max_seq_length=128))


@pytest.mark.slow
def test_a_run_of_a_static_model_equals_encode_row_for_row(tmp_path: Path, static: Path) -> None:
    from sentence_transformers import SentenceTransformer

    ids, texts = make_texts(230, seed=52)
    texts[7] = texts[3]  # a repeated text: encoded once, given to both rows
    corpus = write_corpus(tmp_path / "c.jsonl", ids, texts, "jsonl")
    reference = SentenceTransformer(str(static), device="cpu")
    for role, call in ((None, reference.encode), ("query", reference.encode_query)):
        args = ["--chunk-size", "40", "--model", str(static), *(["--role", role] if role else [])]
        done = run_cli("run", str(corpus), "--store", str(tmp_path / "store"), *args)
        assert done.returncode == 0, done.stderr[-3000:]
        run = json.loads(run_cli("runs", "--store", str(tmp_path / "store"), "--json").stdout)[0]["run_id"]
        from chunkq.jobs.contract.run_files import RunLayout

        got, got_ids = result_of(RunLayout(tmp_path / "store", run))
        want: Any = np.asarray(call(texts))
        assert got_ids == ids and got.shape == (230, 256)
        assert max_abs_diff(got, want) == 0.0, role  # each text's mean is its own: no batch moves it


@pytest.mark.slow
def test_a_model2vec_folder_as_model2vec_saves_it_runs_and_is_described(tmp_path: Path) -> None:
    """Issue 65.5: `chunkq model` of a folder model2vec wrote said "dimension unknown" (its vectors
    are "embeddings", not "embedding.weight"), and the report of a static run said "0 longer than
    None tokens"."""
    from sentence_transformers import SentenceTransformer

    from tests.tiny_models import model2vec_folder

    folder = model2vec_folder(tmp_path / "potion-like")
    assert describe(str(folder)).dim == 64
    shown = run_cli("model", str(folder))
    assert shown.returncode == 0 and "dimension           64" in shown.stdout, shown.stdout + shown.stderr
    ids, texts = make_texts(50, seed=53)
    store = tmp_path / "store"
    done = run_cli("run", str(write_corpus(tmp_path / "c.jsonl", ids, texts, "jsonl")), "--store", str(store),
                   "--model", str(folder), "--chunk-size", "25")  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    run = json.loads(run_cli("runs", "--store", str(store), "--json").stdout)[0]["run_id"]
    from chunkq.jobs.contract.run_files import RunLayout

    got, got_ids = result_of(RunLayout(store, run))
    want = SentenceTransformer(str(folder), device="cpu").encode(texts)
    assert got_ids == ids and max_abs_diff(got, want) == 0.0
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-6)  # its Normalize module kept
    report = run_cli("report", run, "--store", str(store))
    assert report.returncode == 0, report.stderr[-2000:]
    table = (store / "runs" / run / "report" / "report.md").read_text()
    assert "none: the model reads a text of any length" in table and "None tokens" not in table
