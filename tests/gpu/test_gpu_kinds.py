"""Issue 44.5: what had only run on the CPU, on a real GPU through ``chunkq run``, each against the
sentence-transformers call it stands for on the same GPU: the sparse, cross, multi-vector and image
kinds (small random-weight models built here, as the CPU tests build them), windows and late
chunking, the vector cache, half precisions and ``--batch-tokens auto``.

Tolerances: fp32 rows within cosine 0.99999 of the call (batch composition moves GPU fp32 results by
up to ~3e-4, measured on an H100); fp16 within 0.9995 and bf16 within 0.995 of the same model run in that
precision by sentence-transformers: their mantissas hold 10 and 7 bits, so a reordered accumulation
moves a 384-wide row by ~1e-3 and ~1e-2 of its norm at most; scores within 1e-4 absolute.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from chunkq.jobs.compute.model_refs import resolve_model
from chunkq.jobs.contract.run_files import RunLayout
from tests.gpu.test_gpu_faults import MIN_COSINE, _min_cosine, _only_run
from tests.helpers import make_texts, run_cli, write_corpus

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]

HALF_COSINE = {"fp16": 0.9995, "bf16": 0.995}


def _run(tmp_path: Path, gpu: Any, corpus: Path, *args: str) -> RunLayout:
    store = tmp_path / "store"
    done = run_cli("run", str(corpus), "--gpus", str(gpu.index), "--store", str(store), *args, timeout=800)
    assert done.returncode == 0, done.stderr[-4000:]
    return _only_run(store)


def _ids(layout: RunLayout) -> list[Any]:
    return [json.loads(line) for line in (layout.result / "ids.jsonl").read_text().splitlines()]


def _csr(layout: RunLayout, dim: int) -> np.ndarray[Any, Any]:
    offsets, indices, values = (np.load(layout.result / f"{n}.npy") for n in ("offsets", "indices", "values"))
    out = np.zeros((len(offsets) - 1, dim), dtype=np.float32)
    for i in range(len(offsets) - 1):
        out[i, indices[offsets[i] : offsets[i + 1]]] = values[offsets[i] : offsets[i + 1]]
    return out


def test_sparse_and_multivector_runs_equal_their_encoders_on_the_gpu(
    tmp_path: Path, gpu: Any, cuda_device: str
) -> None:
    from sentence_transformers import MultiVectorEncoder, SparseEncoder

    from tests.tiny_models import colbert_encoder, splade_encoder

    ids, texts = make_texts(120, seed=41)
    corpus = write_corpus(tmp_path / "c.jsonl", ids, texts, "jsonl")
    splade = splade_encoder(tmp_path / "splade")
    layout = _run(
        tmp_path / "s", gpu, corpus, "--model", str(splade), "--chunk-size", "40", "--role", "document"
    )
    want = SparseEncoder(str(splade), device=cuda_device).encode_document(
        texts, convert_to_sparse_tensor=True
    )
    wanted = want.coalesce().to_dense().float().cpu().numpy()
    assert (
        _ids(layout) == ids
        and _min_cosine(_csr(layout, wanted.shape[1]) + 1e-12, wanted + 1e-12) >= MIN_COSINE
    )
    colbert = colbert_encoder(tmp_path / "colbert")
    layout = _run(
        tmp_path / "m", gpu, corpus, "--model", str(colbert), "--chunk-size", "40", "--role", "document"
    )
    offsets, vectors = np.load(layout.result / "offsets.npy"), np.load(layout.result / "vectors.npy")
    model = MultiVectorEncoder(str(colbert), device=cuda_device)
    for i, rows in enumerate(model.encode_document(texts)):
        rows = np.asarray(rows.float().cpu() if torch.is_tensor(rows) else rows, dtype=np.float32)
        assert offsets[i + 1] - offsets[i] == len(rows)
        assert _min_cosine(vectors[offsets[i] : offsets[i + 1]], rows) >= MIN_COSINE


def test_cross_and_image_runs_equal_predict_and_encode_on_the_gpu(
    tmp_path: Path, gpu: Any, cuda_device: str
) -> None:
    from PIL import Image
    from sentence_transformers import CrossEncoder, SentenceTransformer

    from tests.tiny_models import cross_encoder, tiny_clip

    rows = [
        {"id": f"p{i}", "query": f"query {i} river", "passage": t}
        for i, t in enumerate(make_texts(80, 42)[1])
    ]
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    reranker = cross_encoder(tmp_path / "cross", labels=1, save_as_st=True)
    layout = _run(
        tmp_path / "x",
        gpu,
        pairs,
        "--model",
        str(reranker),
        "--text-field",
        "query",
        "--pair-field",
        "passage",
    )
    got = np.load(layout.result / "embeddings.npy").reshape(-1)
    want = CrossEncoder(str(reranker), device=cuda_device).predict([(r["query"], r["passage"]) for r in rows])
    assert float(np.max(np.abs(got - np.asarray(want, dtype=np.float32).reshape(-1)))) <= 1e-4
    clip = tiny_clip(tmp_path / "clip")
    images, refs = [], []
    for i in range(24):
        path = tmp_path / "img" / f"{i}.png"
        path.parent.mkdir(exist_ok=True)
        Image.new("RGB", (30 + i, 20 + i), (10 * i % 256, 120, 200)).save(path)
        refs.append({"id": f"img{i}", "text": str(path)})
        images.append(Image.open(path))
    corpus = tmp_path / "images.jsonl"
    corpus.write_text("".join(json.dumps(r) + "\n" for r in refs))
    layout = _run(tmp_path / "i", gpu, corpus, "--model", str(clip), "--kind", "image", "--chunk-size", "10")
    want = SentenceTransformer(str(clip), device=cuda_device).encode(images)
    assert _min_cosine(np.load(layout.result / "embeddings.npy"), want) >= MIN_COSINE


def test_windows_late_chunking_and_the_vector_cache_on_the_gpu(
    tmp_path: Path, gpu: Any, gpu_model: str, cuda_device: str
) -> None:
    from sentence_transformers import SentenceTransformer

    from tests.jobs.test_windows import _late_reference, _long_text

    texts = [_long_text(700, seed=s) for s in range(6)] + [f"a short text {i}" for i in range(20)]
    ids = [f"t{i}" for i in range(len(texts))]
    corpus = write_corpus(tmp_path / "long.jsonl", ids, texts, "jsonl")
    plain = SentenceTransformer(resolve_model(gpu_model), device=cuda_device)
    layout = _run(tmp_path / "w", gpu, corpus, "--model", gpu_model, "--long-texts", "window")
    rows = _ids(layout)
    spans = [texts[ids.index(r["id"])][r["char_start"] : r["char_end"]] for r in rows]
    assert len(rows) > len(texts)
    assert _min_cosine(np.load(layout.result / "embeddings.npy"), plain.encode(spans)) >= MIN_COSINE
    layout = _run(tmp_path / "l", gpu, corpus, "--model", gpu_model, "--long-texts", "late")
    plan = json.loads((layout.root / "manifest.json").read_text())["plan"]["windows"]
    from chunkq.jobs.compute.model_info import load_tokenizer
    from chunkq.supervisor.submit.windows import late_windows

    tokenizer = load_tokenizer(resolve_model(gpu_model))
    want = []
    for r in _ids(layout):
        text = texts[ids.index(r["id"])]
        segment, window = list(late_windows(text, tokenizer, plan["context"], plan["tokens"], None))[
            r["window"]
        ]
        want.append(
            _late_reference(
                plain, text, (segment.char_start, segment.char_end), (window.char_start, window.char_end)
            )
        )
    assert _min_cosine(np.load(layout.result / "embeddings.npy"), np.array(want)) >= MIN_COSINE
    store = tmp_path / "cache-store"
    first = run_cli("run", str(corpus), "--model", gpu_model, "--gpus", str(gpu.index), "--store", str(store))
    assert first.returncode == 0, first.stderr[-3000:]
    again = write_corpus(tmp_path / "again.jsonl", [f"x{i}" for i in ids], texts, "jsonl")
    second = run_cli("run", str(again), "--model", gpu_model, "--gpus", str(gpu.index), "--store", str(store))
    assert (
        second.returncode == 0
        and f"0 encoded, {len(texts)} from the vector cache" in second.stdout + second.stderr
    )
    (run,) = [p for p in (store / "runs").iterdir() if p.name.startswith("again-")]
    assert _min_cosine(np.load(run / "result" / "embeddings.npy"), plain.encode(texts)) >= MIN_COSINE


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_half_precisions_and_batch_tokens_auto_on_the_gpu(
    tmp_path: Path, gpu: Any, gpu_model: str, cuda_device: str, precision: str
) -> None:
    from sentence_transformers import SentenceTransformer

    ids, texts = make_texts(400, seed=43)
    corpus = write_corpus(tmp_path / "c.jsonl", ids, texts, "jsonl")
    args = ["--model", gpu_model, "--precision", precision, "--batch-tokens", "auto", "--chunk-size", "100"]
    layout = _run(tmp_path, gpu, corpus, *args)
    dtype = torch.float16 if precision == "fp16" else torch.bfloat16
    plain = SentenceTransformer(resolve_model(gpu_model), device=cuda_device).to(dtype)
    want = np.asarray(plain.encode(texts, convert_to_tensor=True).float().cpu(), dtype=np.float32)
    got = np.load(layout.result / "embeddings.npy")
    measured = _min_cosine(got, want)
    print(f"{precision} --batch-tokens auto: min cosine {measured:.6f} against sentence-transformers")
    assert measured >= HALF_COSINE[precision]


def test_a_decoder_embedding_model_with_token_budgets_windows_and_an_oom_back_off_on_the_gpu(
    tmp_path: Path, gpu: Any, cuda_device: str
) -> None:
    """Issue 68.4: Qwen3-Embedding's shape (a decoder, last-token pooling, left padding; small, random
    weights: tests/tiny_models.py) through ``--batch-tokens auto``, an OOM in its first chunk (halved
    to batch 8) and ``--long-texts window``, each against sentence-transformers on the same GPU."""
    from sentence_transformers import SentenceTransformer

    from tests.jobs.test_windows import _long_text
    from tests.tiny_models import decoder_embedding

    decoder = decoder_embedding(tmp_path / "decoder")
    plain = SentenceTransformer(str(decoder), device=cuda_device)
    ids, texts = make_texts(300, seed=47)
    texts = [" ".join([t] * (1 + i % 6)) for i, t in enumerate(texts)]  # every batch padded, on the left
    corpus = write_corpus(tmp_path / "c.jsonl", ids, texts, "jsonl")
    want = plain.encode(texts)
    layout = _run(tmp_path / "b", gpu, corpus, "--model", str(decoder), "--batch-tokens", "auto")
    assert _ids(layout) == ids
    assert _min_cosine(np.load(layout.result / "embeddings.npy"), want) >= MIN_COSINE
    faults = json.dumps([{"kind": "oom", "chunks": [0], "above_batch": 8}])
    store = tmp_path / "oom-store"
    args = ["--model", str(decoder), "--batch-size", "32", "--chunk-size", "100", "--batch-tokens", "off"]
    done = run_cli(
        "run", str(corpus), *args, "--gpus", str(gpu.index), "--store", str(store), CHUNKQ_FAULTS=faults
    )
    assert done.returncode == 0, done.stderr[-4000:]
    layout = _only_run(store)
    meta = json.loads(layout.output_meta(0).read_text())
    assert meta["batch_size"] == 8 and [b["batch_size"] for b in meta["oom_backoffs"]] == [32, 16]
    assert _min_cosine(np.load(layout.result / "embeddings.npy"), want) >= MIN_COSINE
    long_texts = [_long_text(600, seed=s) for s in range(3)] + texts[:20]
    long_ids = [f"t{i}" for i in range(len(long_texts))]
    corpus = write_corpus(tmp_path / "long.jsonl", long_ids, long_texts, "jsonl")
    layout = _run(tmp_path / "w", gpu, corpus, "--model", str(decoder), "--long-texts", "window")
    rows = _ids(layout)
    spans = [long_texts[long_ids.index(r["id"])][r["char_start"] : r["char_end"]] for r in rows]
    assert len(rows) > len(long_texts)
    assert _min_cosine(np.load(layout.result / "embeddings.npy"), plain.encode(spans)) >= MIN_COSINE
