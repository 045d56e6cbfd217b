"""Issue 45.1: hybrid search as docs/hybrid.md writes it, end to end against real stores. A dense run
(the bundled MiniLM) and a sparse run (a SPLADE-shaped model built here) of one corpus, exported by
`chunkq export` into one LanceDB table and one pgvector table (the second export adds its columns);
the recipe's own code blocks, taken from the page, fuse the two rankings; each top 10 equals one
computed by hand from sentence-transformers' own outputs."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.helpers import make_texts, run_cli, write_corpus
from tests.tiny_models import splade_encoder

DOC = Path(__file__).resolve().parents[2] / "docs" / "hybrid.md"
K, CANDIDATES, RRF, ACTIVE = 10, 100, 60, 64


def _block(marker: str) -> str:
    """The code block of docs/hybrid.md that starts with ``marker``."""
    for block in re.findall(r"```(?:python|sql)\n(.*?)```", DOC.read_text(), re.DOTALL):
        if block.startswith(marker):
            return str(block)
    raise AssertionError(f"docs/hybrid.md has no block starting {marker!r}")


def _fused(rankings: list[list[str]]) -> list[str]:
    scores: dict[str, float] = {}
    for ranking in rankings:
        for rank, rid in enumerate(ranking, 1):
            scores[rid] = scores.get(rid, 0.0) + 1.0 / (RRF + rank)
    return sorted(scores, key=lambda rid: (-scores[rid], rid))[:K]


def _by_hand(texts: list[str], ids: list[str], query: str, splade: Path) -> list[str]:
    """The fused top 10 from sentence-transformers' own calls, ranked and fused here."""
    from sentence_transformers import SentenceTransformer, SparseEncoder

    from chunkq.jobs.compute.model_refs import BUNDLED_MODEL, resolve_model

    dense = SentenceTransformer(resolve_model(BUNDLED_MODEL), device="cpu")
    docs, q = dense.encode(texts).astype(np.float64), dense.encode_query([query])[0].astype(np.float64)
    cosine = docs @ q / (np.linalg.norm(docs, axis=1) * np.linalg.norm(q))
    order = np.array(ids)
    dense_rank = order[np.lexsort((order, -cosine))][:CANDIDATES].tolist()
    sparse = SparseEncoder(str(splade), device="cpu")
    doc_vectors = sparse.encode_document(texts, max_active_dims=ACTIVE, convert_to_sparse_tensor=True)
    query_vector = sparse.encode_query([query], max_active_dims=ACTIVE, convert_to_sparse_tensor=True)
    dots = (doc_vectors.to_dense().double() @ query_vector.to_dense().double()[0]).numpy()
    sparse_rank = order[np.lexsort((order, -dots))][:CANDIDATES].tolist()
    return _fused([dense_rank, sparse_rank])


@pytest.mark.slow
def test_the_hybrid_recipe_fuses_a_dense_and_a_sparse_run_in_one_table(
    tmp_path: Path,
    postgres: str,
) -> None:
    import lancedb
    import psycopg
    from pgvector import SparseVector
    from pgvector.psycopg import register_vector

    import chunkq

    ids, texts = make_texts(300, seed=45)
    corpus = write_corpus(tmp_path / "docs.jsonl", ids, texts, "jsonl")
    store = tmp_path / "store"
    splade = splade_encoder(tmp_path / "splade")
    for run_id, extra in (
        ("docs-dense", []),
        ("docs-sparse", ["--model", str(splade), "--role", "document", "--max-active-dims", str(ACTIVE)]),
    ):
        done = run_cli(
            "run", str(corpus), "--store", str(store), "--run-id", run_id, "--chunk-size", "100", *extra
        )
        assert done.returncode == 0, done.stderr[-3000:]
    lance_url = f"lancedb://{tmp_path / 'lance'}/docs"
    pg_url = f"{postgres}&table=docs"
    for url in (lance_url, pg_url):
        first = run_cli(
            "export", "docs-dense", "--store", str(store), "--to", url, "--columns", "text", "--json"
        )
        second = run_cli("export", "docs-sparse", "--store", str(store), "--to", url, "--json")
        assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
        added = json.loads(second.stdout)
        assert added["table_rows"] == 300 and added["columns_added"], added  # one row per id, both columns
    table = lancedb.connect(str(tmp_path / "lance")).open_table("docs")
    assert {"vector", "sparse_indices", "sparse_values", "text"} <= set(table.schema.names)

    query = "river mountain harbor"
    dense_query = chunkq.embed([query], role="query")[0]
    sparse = chunkq.embed([query], model=str(splade), role="query", max_active_dims=ACTIVE)
    sparse_query = dict(zip(sparse.arrays["indices"].tolist(), sparse.arrays["values"].tolist(), strict=True))
    want = _by_hand(texts, ids, query, splade)

    recipe: dict[str, Any] = {}
    exec(compile(_block("# hybrid-lancedb"), str(DOC), "exec"), recipe)  # noqa: S102 - the page's own code
    assert recipe["hybrid_lancedb"](table, dense_query, sparse_query, k=K) == want

    sql = _block("-- hybrid-pgvector")
    with psycopg.connect(postgres) as conn:
        register_vector(conn)
        params = {
            "dense": dense_query,
            "sparse": SparseVector(sparse_query, sparse.dim),
            "candidates": CANDIDATES,
            "rrf": RRF,
            "k": K,
        }
        got = [rid for rid, _ in conn.execute(sql, params).fetchall()]
    assert got == want
