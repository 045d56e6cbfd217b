"""Issue 44.3: a GPU-tier test whose corpus repeats texts is defeated by the vector cache (27,187
texts that were 10 distinct strings: one small batch, no OOM). Every corpus the tier builds has as
many distinct texts as rows; checked here, on the CPU, where the tier's own run is rare."""

from __future__ import annotations

import re
from pathlib import Path

from tests.gpu.test_gpu_faults import oversized_corpus
from tests.helpers import make_texts

GPU_TIER = Path(__file__).resolve().parents[1] / "gpu"


def test_every_corpus_of_the_gpu_tier_has_a_distinct_text_per_row() -> None:
    calls = {
        (int(n), int(seed))
        for path in GPU_TIER.glob("test_*.py")
        for n, seed in re.findall(r"make_texts\((\d+), seed=(\d+)\)", path.read_text())
    }
    assert calls, "the tier's corpora were not found: update this test with the way they are made"
    for n, seed in sorted(calls):
        _, texts = make_texts(n, seed=seed)
        assert len(set(texts)) == n, (n, seed)
    for rows in (10, 5_000):
        ids, texts = oversized_corpus(rows)
        assert len(set(texts)) == len(set(ids)) == rows
