"""A chunk is tokenised once and cut into batches (issue 31, item 12): the embeddings equal a plain
``encode`` of the same texts, prompts, truncation and padding side included."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from chunkq.jobs.compute import models, token_batches
from chunkq.jobs.compute.model_refs import BUNDLED_MODEL
from tests.helpers import make_texts, max_abs_diff

PROMPTS = ("query: ", "passage: ")  # the prompts these tests give


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Any, list[int]]]:
    """chunkq's loaded model, its preprocessing counted (texts per call): its input module's, which
    chunkq calls for texts directly, and the model's own, which would call it in turn."""
    model = models.get_model(BUNDLED_MODEL, "cpu", "fp32").model
    calls: list[int] = []
    real = model[0].preprocess

    def preprocess(texts: list[Any], *args: Any, **kwargs: Any) -> Any:
        if list(texts) not in ([p] for p in PROMPTS):  # sentence-transformers measures a prompt alone
            calls.append(len(texts))
        return real(texts, *args, **kwargs)

    monkeypatch.setattr(model[0], "preprocess", preprocess)
    yield model, calls


@pytest.mark.slow  # the model, and a plain encode to compare with
@pytest.mark.parametrize("by_tokens", [False, True])
def test_one_tokenisation_gives_a_plain_encodes_embeddings(
    counted: tuple[Any, list[int]], reference_model: Any, by_tokens: bool
) -> None:
    model, calls = counted
    _, texts = make_texts(90, seed=12)
    kwargs = {"prompt": "query: ", "truncate_dim": 128, "normalize_embeddings": True}
    got = token_batches.encode(model, texts, 300 if by_tokens else 7, kwargs, by_tokens=by_tokens)
    assert calls == [90]  # the whole chunk, once
    expected = reference_model.encode(texts, prompt="query: ", truncate_dim=128, normalize_embeddings=True)
    assert got.shape == (90, 128) and max_abs_diff(got, expected) <= 1e-5


@pytest.mark.slow  # loads or runs the model in a subprocess or several times: the slow tier
def test_a_left_padding_tokenizer_is_trimmed_from_the_left(
    counted: tuple[Any, list[int]], reference_model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decoder embedders pad on the left; BERT's positions then differ from right padding, so a
    wrong trim would show."""
    model, _calls = counted
    monkeypatch.setattr(model.tokenizer, "padding_side", "left")
    monkeypatch.setattr(reference_model.tokenizer, "padding_side", "left")
    _, texts = make_texts(40, seed=13)
    got = token_batches.encode(model, texts, 8, {}, by_tokens=False)
    # With left padding a text's result depends on its batch's longest: compare batch by batch.
    lengths = token_batches.token_lengths(model, texts, int(model.max_seq_length))
    batches = token_batches.plan_fixed(lengths, 8)
    expected = np.empty_like(got)
    for batch in batches:
        expected[batch] = reference_model.encode([texts[i] for i in batch], batch_size=len(batch))
    assert max_abs_diff(got, expected) <= 1e-5
    monkeypatch.setattr(reference_model.tokenizer, "padding_side", "right")
    for batch in batches:
        expected[batch] = reference_model.encode([texts[i] for i in batch], batch_size=len(batch))
    assert max_abs_diff(got, expected) > 1e-4  # the side matters: a trim from the wrong side would show


@pytest.mark.slow  # loads or runs the model in a subprocess or several times: the slow tier
def test_features_that_cannot_be_cut_fall_back_to_encode_per_batch(
    counted: tuple[Any, list[int]], reference_model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from chunkq.jobs.compute import tokenized

    model, calls = counted
    monkeypatch.setattr(tokenized, "features", lambda model, texts, prompt: None)  # e.g. flattened inputs
    _, texts = make_texts(20, seed=14)
    got = token_batches.encode(model, texts, 8, {"prompt": "passage: "}, by_tokens=False)
    assert calls == [8, 8, 4]  # encode's own preprocessing, batch by batch
    assert max_abs_diff(got, reference_model.encode(texts, prompt="passage: ")) <= 1e-5


@pytest.mark.slow  # the model, and a plain encode to compare with
def test_a_chunk_tokenised_ahead_gives_a_plain_encodes_embeddings_in_input_order(
    counted: tuple[Any, list[int]], reference_model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 52.2: slices tokenised in a thread while the model runs the slice before, cut from the
    chunk ordered by length; every row where it was, equal to the plain encode, each text once."""
    monkeypatch.setattr(token_batches, "PIPELINE_ROWS", 40)
    model, calls = counted
    _, texts = make_texts(130, seed=13)
    kwargs = {"prompt": "query: ", "normalize_embeddings": True}
    seen: list[int] = []
    got = token_batches.encode(model, texts, 16, kwargs, by_tokens=False, on_rows=seen.append, ahead=True)
    assert calls == [40, 40, 40, 10] and seen[-1] == 130 and seen == sorted(seen)
    expected = reference_model.encode(texts, prompt="query: ", normalize_embeddings=True)
    assert got.shape == (130, 384) and max_abs_diff(got, expected) <= 1e-5
    monkeypatch.setenv(token_batches.AHEAD_ENV, "1")
    assert token_batches.tokenise_ahead(model)
    monkeypatch.setenv(token_batches.AHEAD_ENV, "")
    assert not token_batches.tokenise_ahead(model)  # the CPU's default: measured to lose there
