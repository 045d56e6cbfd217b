"""A decoder embedding model (issue 68.4, its CPU part): Qwen3-Embedding's shape (a Qwen3 decoder,
last-token pooling, a tokenizer that pads on the left), built small with random weights
(tests/tiny_models.py). chunkq runs it as sentence-transformers does, through the paths a long GPU
run leans on: an OOM back-off, a worker killed mid-chunk, token-budget batches and windows.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.helpers import make_texts, max_abs_diff, only_run, result_of, run_cli, run_in_process, write_corpus
from tests.tiny_models import decoder_embedding


@pytest.fixture(scope="module")
def decoder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return decoder_embedding(tmp_path_factory.mktemp("decoder"))


@pytest.fixture(scope="module")
def decoder_reference(decoder: Path) -> Any:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(decoder), device="cpu")


def _varied(n: int) -> tuple[list[str], list[str]]:
    """Texts of 1 to ~60 words, so every batch pads (on the left, for this tokenizer)."""
    ids, texts = make_texts(n, seed=17)
    return ids, [" ".join([text] * (1 + i % 6)) for i, text in enumerate(texts)]


def test_the_model_is_what_it_says(decoder_reference: Any) -> None:
    """The shape under test: a decoder, last-token pooling, left padding, unit vectors."""
    transformer, pooling = decoder_reference[0], decoder_reference[1]
    assert transformer.auto_model.config.model_type == "qwen3"
    assert transformer.tokenizer.padding_side == "left"
    assert pooling.get_config_dict()["pooling_mode"] == "lasttoken"
    vectors = decoder_reference.encode(["a short text", "a rather longer text than the first one is"])
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)


def test_token_budget_batches_and_windows_equal_sentence_transformers(
    tmp_path: Path, store: Path, connection: Any, decoder: Path, decoder_reference: Any
) -> None:
    """Token-budget batches (sorted by length, so each batch pads differently from
    sentence-transformers' own) and windows of a long text: each row equals ``encode`` of its text
    or its window's span within 1e-5."""
    from chunkq.jobs.contract.specs import EncodeOptions

    ids, texts = _varied(30)
    layout, _, encoded = run_in_process(
        tmp_path,
        store,
        connection,
        ids,
        texts,
        "budget",
        model=str(decoder),
        encode=EncodeOptions(batch_tokens=96),
    )
    matrix, got_ids = result_of(layout)
    assert got_ids == ids and encoded == 30
    assert max_abs_diff(matrix, decoder_reference.encode(texts)) <= 1e-5

    long_texts = [" ".join(texts), "a short one"]
    layout, manifest, _ = run_in_process(
        tmp_path,
        store,
        connection,
        ["long", "short"],
        long_texts,
        "windows",
        model=str(decoder),
        long_texts="window",
        window_tokens=40,
        cache=False,
    )
    matrix, rows = result_of(layout)
    spans = [long_texts[["long", "short"].index(r["id"])][r["char_start"] : r["char_end"]] for r in rows]
    assert manifest.plan["windows"]["windowed"] == 1 and len(rows) > 2
    assert max_abs_diff(matrix, decoder_reference.encode(spans)) <= 1e-5


@pytest.mark.slow
def test_a_decoder_run_equals_encode_through_a_sigkill_and_an_oom_back_off(
    tmp_path: Path, decoder: Path, decoder_reference: Any
) -> None:
    """``chunkq run`` of 40 texts in chunks of 10: chunk 0 runs out of memory above batch 2 (halved
    from 8 to 2), chunk 1's first worker is SIGKILLed; the vectors equal ``encode`` within 1e-5, in
    corpus order."""
    ids, texts = _varied(40)
    corpus = write_corpus(tmp_path / "c.jsonl", ids, texts, "jsonl")
    faults = json.dumps(
        [
            {"kind": "oom", "chunks": [0], "above_batch": 2},
            {"kind": "sigkill", "chunks": [1], "attempts": [1]},
        ]
    )
    args = ("--model", str(decoder), "--chunk-size", "10", "--batch-size", "8")
    done = run_cli("run", str(corpus), *args, "--store", str(tmp_path / "store"), CHUNKQ_FAULTS=faults)
    assert done.returncode == 0, done.stderr[-3000:]
    layout = only_run(tmp_path / "store")
    matrix, got_ids = result_of(layout)
    assert got_ids == ids
    assert max_abs_diff(matrix, decoder_reference.encode(texts)) <= 1e-5
    first = json.loads(layout.output_meta(0).read_text())
    assert [b["batch_size"] for b in first["oom_backoffs"]] == [8, 4] and first["batch_size"] == 2
    assert json.loads(layout.output_meta(1).read_text())["attempt"] == 2
