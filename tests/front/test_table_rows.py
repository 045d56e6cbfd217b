"""Issue 51.4, 51.5, 51.13: a table chunkq writes holds one corpus's rows, each row's columns from its
own text. A second export brings the same rows (same ids, same texts: each row's ``text_sha256``) or
is refused in one line with the counts, the table left exactly as it was; so is an export pgvector
cannot hold, and --columns names that chunkq writes itself."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from chunkq.jobs.contract.errors import ConfigError
from chunkq.jobs.contract.run import Run
from chunkq.queue_worker.exit_codes import EXIT_CONFIG
from chunkq.sinks import export_to
from chunkq.supervisor.result.assemble import assemble
from tests.helpers import make_texts, run_cli, write_corpus, write_encoded_run, write_ragged_run
from tests.tiny_models import splade_encoder

ACTIVE = 16


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _pg_rows(url: str, table: str) -> list[tuple[Any, ...]]:
    import psycopg

    with psycopg.connect(url) as conn:
        return conn.execute(f'SELECT * FROM "{table}" ORDER BY id').fetchall()  # noqa: S608 - a test's own table


def _said(done: Any) -> str:
    assert done.returncode == EXIT_CONFIG, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    return lines[0]


@pytest.mark.slow
def test_a_sparse_run_of_another_corpus_is_refused_by_a_table_of_this_ones_dense_and_sparse_rows(
    tmp_path: Path,
    postgres: str,
) -> None:
    """51.4 end to end: a dense and a sparse run of corpus c1 exported into one LanceDB table and one
    pgvector table (every row's vectors equal sentence-transformers' own for its text); then the
    sparse run of c2 (30 of c1's ids, one with another text, and 5 new ids) into each: refused, with
    the counts, the table as it was (before: "35 rows ... the table holds 45 rows", exit 0, ten rows
    with the first run's vectors, one with another text's, five without a dense vector)."""
    import lancedb
    from sentence_transformers import SentenceTransformer, SparseEncoder

    from chunkq.jobs.compute.model_refs import BUNDLED_MODEL, resolve_model

    ids, texts = make_texts(40, seed=514)
    c2_ids = ids[:30] + [f"new{i}" for i in range(5)]
    c2_texts = [*texts[:29], texts[29] + " (edited)", *make_texts(5, seed=515)[1]]
    store, splade = tmp_path / "store", splade_encoder(tmp_path / "splade")
    sparse = ["--model", str(splade), "--role", "document", "--max-active-dims", str(ACTIVE)]
    for run_id, corpus, extra in (
        ("c1-dense", write_corpus(tmp_path / "c1.jsonl", ids, texts, "jsonl"), []),
        ("c1-sparse", tmp_path / "c1.jsonl", sparse),
        ("c2-sparse", write_corpus(tmp_path / "c2.jsonl", c2_ids, c2_texts, "jsonl"), sparse),
    ):
        done = run_cli("run", str(corpus), "--store", str(store), "--run-id", run_id, *extra)
        assert done.returncode == 0, done.stderr[-3000:]
        assert run_cli("assemble", run_id, "--store", str(store), "--verify").returncode == 0

    dense_want = SentenceTransformer(resolve_model(BUNDLED_MODEL), device="cpu").encode(texts)
    sparse_want = SparseEncoder(str(splade), device="cpu").encode_document(
        texts, max_active_dims=ACTIVE, convert_to_sparse_tensor=True
    )
    lance_url, pg_url = f"lancedb://{tmp_path / 'lance'}/docs", f"{postgres}&table=docs"
    for url in (lance_url, pg_url):
        for run_id in ("c1-dense", "c1-sparse"):
            done = run_cli("export", run_id, "--store", str(store), "--to", url)
            assert done.returncode == 0, done.stderr
    table = lancedb.connect(str(tmp_path / "lance")).open_table("docs")
    rows = {r["id"]: r for r in table.to_arrow().to_pylist()}
    assert sorted(rows) == sorted(ids)
    for i, rid in enumerate(ids):
        row = rows[rid]
        assert row["text_sha256"] == _sha(texts[i])
        assert np.abs(np.array(row["vector"], np.float32) - dense_want[i]).max() <= 1e-5
        want = sparse_want[i].coalesce()
        assert row["sparse_indices"] == want.indices()[0].tolist()
        assert np.allclose(row["sparse_values"], want.values().numpy(), atol=1e-5)
    version, pg_before = table.version, _pg_rows(postgres, "docs")
    assert len(pg_before) == 40 and all(r[0] in rows for r in pg_before)

    for url in (lance_url, pg_url):
        said = _said(run_cli("export", "c2-sparse", "--store", str(store), "--to", url))
        assert (
            "holds other rows than this run's: 10 the run does not have, 5 the table does not have, " in said
        )
        assert (
            "1 of another text (the table: 40 rows, the run: 35)" in said and "export to a new table" in said
        )
    assert lancedb.connect(str(tmp_path / "lance")).open_table("docs").version == version
    assert _pg_rows(postgres, "docs") == pg_before
    # Into a table of its own, the same run goes.
    alone = run_cli("export", "c2-sparse", "--store", str(store), "--to", f"{postgres}&table=c2", "--json")
    assert alone.returncode == 0 and json.loads(alone.stdout)["table_rows"] == 35, alone.stderr
    assert json.loads(alone.stdout)["level"] == "row"  # 53.7: a plain run's --json said "window"


@pytest.mark.slow
def test_a_table_is_refused_when_it_cannot_be_checked_and_a_rerun_after_a_kill_goes_on(
    tmp_path: Path,
    postgres: str,
) -> None:
    import lancedb
    import psycopg
    import pyarrow as pa

    layout = write_encoded_run(tmp_path / "store", "plain", 30, 10, 4)
    assemble(Run.of(layout))
    url = f"lancedb://{tmp_path / 'db'}/t"

    def killed(progress: Any) -> None:
        if progress.written >= 10:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        export_to(Run.of(layout), url, on_progress=killed, batch_rows=10)
    assert export_to(Run.of(layout), url)["table_rows"] == 30  # the rows it lacked, from the same run
    db = lancedb.connect(str(tmp_path / "db"))
    legacy = pa.table({"id": ["r0", "r1"], "vector": pa.array([[0.0] * 4] * 2, pa.list_(pa.float32(), 4))})
    db.create_table("legacy", data=legacy)  # rows, and no text hash: written before 51.4 or by hand
    with pytest.raises(ConfigError, match=r"holds 2 rows and no text_sha256 column, so chunkq cannot check"):
        export_to(Run.of(layout), f"lancedb://{tmp_path / 'db'}/legacy")
    with psycopg.connect(postgres, autocommit=True) as conn:
        conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
        conn.execute("CREATE TABLE legacy (id text PRIMARY KEY, embedding vector(4))")
        conn.execute("INSERT INTO legacy VALUES ('r0', '[0,0,0,0]')")
    with pytest.raises(ConfigError, match="holds 1 rows and no text_sha256 column"):
        export_to(Run.of(layout), f"{postgres}&table=legacy")
    assert _pg_rows(postgres, "legacy") == [("r0", "[0,0,0,0]")]  # no column added


@pytest.mark.slow
def test_a_sparse_run_pgvector_cannot_hold_is_refused_before_the_table_is_touched(
    tmp_path: Path,
    postgres: str,
) -> None:
    """51.5: a SPLADE run of ~29,000 non-zeros a row was refused only after ALTER TABLE ... ADD COLUMN
    was committed, leaving an empty column behind."""
    import psycopg

    dense = write_encoded_run(tmp_path / "a", "dense", 20, 10, 4)
    assemble(Run.of(dense))
    export_to(Run.of(dense), f"{postgres}&table=wide")
    before = _pg_rows(postgres, "wide")
    sparse = write_ragged_run(tmp_path / "b", "sparse", rows=20, chunk_size=10, entries=16_001, dim=30_522)
    assemble(Run.of(sparse))
    with pytest.raises(ConfigError, match=r"hold up to 16,001 non-zero values, and pgvector's sparsevec"):
        export_to(Run.of(sparse), f"{postgres}&table=wide")
    with psycopg.connect(postgres) as conn:
        names = [r[0] for r in conn.execute("SELECT column_name FROM information_schema.columns "
                                            "WHERE table_name = 'wide'").fetchall()]  # fmt: skip
    assert "sparse" not in names and _pg_rows(postgres, "wide") == before


def test_columns_chunkq_writes_itself_are_refused_by_name(tmp_path: Path) -> None:
    """51.13: --columns sparse_values (or any column chunkq writes) failed inside LanceDB and
    PostgreSQL; chunkq's own check names them, as it did vector and embedding."""
    layout = write_encoded_run(tmp_path / "store", "names", 10, 10, 4)
    assemble(Run.of(layout))
    for name in ("sparse", "sparse_indices", "sparse_values", "text_sha256", "vector", "embedding", "window"):
        with pytest.raises(ConfigError, match=rf"--columns '{name}': a corpus field named with letters"):
            export_to(Run.of(layout), f"lancedb://{tmp_path / 'db'}/t", columns=(name,))
    for name in ("dense", "dense_indices", "dense_values"):
        with pytest.raises(ConfigError, match=rf"--columns '{name}'"):
            export_to(Run.of(layout), f"lancedb://{tmp_path / 'db'}/t", {"column": "dense"}, columns=(name,))
    with pytest.raises(ConfigError, match=r"--column 'text_sha256'"):
        export_to(Run.of(layout), f"lancedb://{tmp_path / 'db'}/t", {"column": "text_sha256"})
