"""A rounding precision's agreement with fp32 (issue 67.2), as the workers measure it: which rows, the
cosines against the bundled model on PyTorch in fp32, the run's figure from its chunks'. The whole path
with OpenVINO's bf16 is ``test_openvino.py``'s (``make test-openvino``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from chunkq.jobs.compute import agreement, models
from chunkq.jobs.compute.model_refs import BUNDLED_MODEL
from chunkq.jobs.contract.specs import EncodeOptions
from chunkq.jobs.embed import encode_texts
from tests.helpers import make_texts

BF16 = EncodeOptions(backend="openvino", precision="bf16")


def test_only_a_rounding_precision_on_another_backend_is_measured_and_only_in_the_first_chunks() -> None:
    assert agreement.measures(BF16, 0) and agreement.measures(BF16, agreement.AGREEMENT_CHUNKS - 1)
    assert not agreement.measures(BF16, agreement.AGREEMENT_CHUNKS)
    assert not agreement.measures(EncodeOptions(backend="openvino"), 0)  # f32: exact, nothing to measure
    assert not agreement.measures(EncodeOptions(precision="bf16"), 0)  # PyTorch's bf16 is a GPU's, not this


def test_the_rows_measured_are_spread_over_the_chunk() -> None:
    picked = agreement.sample(1000)
    assert len(picked) == agreement.AGREEMENT_ROWS_PER_CHUNK and picked[0] == 0 and picked[-1] == 999
    assert max(np.diff(picked)) - min(np.diff(picked)) <= 1
    assert agreement.sample(7) == list(range(7)) and agreement.sample(1) == [0] and agreement.sample(0) == []


def test_a_chunk_is_measured_against_the_model_on_pytorch_in_fp32_and_the_copy_is_dropped(
    reference_model: Any,
) -> None:
    _, texts = make_texts(120, seed=7)
    exact = np.asarray(reference_model.encode(texts), dtype=np.float32)
    rounded = exact.copy()
    picked = agreement.sample(len(texts))
    held = set(models._cache)
    rounded[picked[3]] += 0.05  # one measured row moved: its cosine is the minimum
    found = agreement.measure(BUNDLED_MODEL, BF16, texts, rounded, encode_texts)
    a, b = rounded[picked[3]], exact[picked[3]]
    want = float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))
    assert found["rows"] == len(picked) and found["with"] == "torch fp32"
    assert abs(found["min_cosine"] - want) < 2e-6 and found["min_cosine"] < found["mean_cosine"] < 1.0
    assert set(models._cache) == held  # the fp32 copy loaded for it was dropped again


def test_the_runs_figure_is_the_least_of_its_chunks_and_the_mean_over_their_rows() -> None:
    chunks = [
        {
            "rows": 50,
            "with": "torch fp32",
            "min_cosine": 0.9999,
            "mean_cosine": 0.99995,
            "cosine_sum": 49.9975,
        },
        {"rows": 10, "with": "torch fp32", "min_cosine": 0.9990, "mean_cosine": 0.9995, "cosine_sum": 9.995},
    ]
    found = agreement.of_the_run(chunks)
    assert found == {
        "rows": 60,
        "with": "torch fp32",
        "chunks": 2,
        "min_cosine": 0.999,
        "mean_cosine": round((49.9975 + 9.995) / 60, 6),
    }
    assert agreement.of_the_run([]) is None
