"""Issue 34: model kinds behind one contract (jobs/kinds). Each kind's run equals the
sentence-transformers call it names, on a small model built here offline (random weights). Every
test that builds or runs a model is in the slow tier."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from chunkq.jobs import kinds
from chunkq.jobs.compute.model_info import describe
from chunkq.jobs.compute.model_refs import BUNDLED_MODEL
from chunkq.jobs.contract.errors import ConfigError
from chunkq.jobs.contract.run import Run
from tests.helpers import WORDS, max_abs_diff, only_run, run_cli
from tests.tiny_models import colbert_encoder, cross_encoder, splade_encoder, tiny_clip


@pytest.fixture(scope="module")
def reranker(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return cross_encoder(tmp_path_factory.mktemp("reranker"), labels=1, save_as_st=True)


def _pairs(n: int, seed: int) -> list[dict[str, str]]:
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        query = " ".join(rng.choice(WORDS, size=int(rng.integers(2, 6))))
        passage = " ".join(rng.choice(WORDS, size=int(rng.integers(5, 60))))
        rows.append({"id": f"pair-{i}", "query": query, "passage": passage})
    if n > 7:
        rows[7] = dict(rows[3], id="pair-7")  # a duplicate pair: scored once, in the result twice
    return rows


def _write_pairs(path: Path, rows: list[dict[str, str]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.slow
def test_the_kind_is_read_from_the_models_files_and_unbuilt_kinds_are_refused(
    tmp_path: Path, reranker: Path
) -> None:
    assert describe(BUNDLED_MODEL).kind == "dense"
    assert describe(str(reranker)).kind == "cross"  # model_type "CrossEncoder"
    raw = cross_encoder(tmp_path, labels=3, save_as_st=False)
    assert describe(str(raw)).kind == "cross"  # a sequence classifier without modules.json
    assert kinds.get("cross").reference == "CrossEncoder.predict(pairs)"
    with pytest.raises(ConfigError, match="kind 'audio': one of dense, cross, sparse, multivector, image"):
        kinds.get("audio")
    shown = run_cli("model", str(reranker))
    assert "kind                cross: a score per (query, passage) pair" in shown.stdout, shown.stdout


def test_a_pair_corpus_is_read_from_json_lines_csv_and_parquet(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from chunkq.jobs.contract.errors import CorpusError
    from chunkq.jobs.kinds.cross import parse_pair
    from chunkq.supervisor.corpus.records import CorpusOptions, read_corpus

    rows = _pairs(5, seed=1)
    jsonl = _write_pairs(tmp_path / "p.jsonl", rows)
    with open(tmp_path / "p.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, ["id", "query", "passage"])
        writer.writeheader()
        writer.writerows(rows)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet")
    for path, fmt in ((jsonl, "jsonl"), (tmp_path / "p.csv", "csv"), (tmp_path / "p.parquet", "parquet")):
        options = CorpusOptions(fmt, text_field="query", pair_field="passage")
        got = [(r.id, parse_pair(r.text)) for r in read_corpus(path, options)]
        assert got == [(r["id"], (r["query"], r["passage"])) for r in rows], fmt
    broken = dict(rows[0], passage=None)
    _write_pairs(tmp_path / "bad.jsonl", [rows[1], broken])
    with pytest.raises(CorpusError, match=r"bad.jsonl:2: text field 'passage' is null"):
        list(
            read_corpus(
                tmp_path / "bad.jsonl", CorpusOptions("jsonl", text_field="query", pair_field="passage")
            )
        )


@pytest.mark.slow
def test_options_a_kind_cannot_honour_are_refused_before_anything_starts(
    tmp_path: Path, reranker: Path
) -> None:
    from chunkq.supervisor.request import submit_request

    corpus = _write_pairs(tmp_path / "p.jsonl", _pairs(4, seed=2))
    store = tmp_path / "store"
    pairs = {"text_field": "query", "pair_field": "passage"}
    cases: list[tuple[dict[str, Any], str]] = [
        ({"text_field": "query"}, "a cross-encoder scores pairs: give --pair-field"),
        ({**pairs, "normalize": True}, "--kind cross: a cross-encoder gives scores, not vectors"),
        ({**pairs, "output_dtype": "int8"}, "scores are stored as float32 or float16, not int8"),
        (
            {**pairs, "long_texts": "window"},
            "--long-texts window is for dense models; this model's kind is cross",
        ),
        (
            {"text_field": "query", "kind": "sparse", "normalize": True},
            "--kind sparse: a sparse vector is not truncated, normalised",
        ),
        ({"allow_missing": True, **pairs}, "--allow-missing is for rows that name what to read"),
    ]
    for given, message in cases:
        with pytest.raises(ConfigError, match=re.escape(message)):
            submit_request([corpus], store, str(reranker), **given)
    with pytest.raises(ConfigError, match="--pair-field is for a cross-encoder"):
        submit_request([corpus], store, None, **pairs)
    # The same refusal from the command line: one line, before a run exists.
    done = run_cli(
        "run", str(corpus), "--model", str(reranker), "--text-field", "query", "--store", str(store)
    )
    assert done.returncode != 0 and "give --pair-field" in done.stderr.strip().splitlines()[-1], done.stderr
    assert "Traceback" not in done.stderr and not (store / "runs").exists()


@pytest.mark.slow
def test_a_cross_encoder_run_equals_predict_through_a_sigkill_and_an_oom_back_off(
    tmp_path: Path, reranker: Path
) -> None:
    """``chunkq run`` of 60 pairs in chunks of 20: chunk 0 runs out of memory above batch 4 (halved
    to 4), chunk 1's first worker is SIGKILLed; the scores equal ``CrossEncoder.predict`` on the
    same pairs within 1e-5, in corpus order with their ids. A second run reads every score from
    the vector cache, keyed by both texts of a pair."""
    from sentence_transformers import CrossEncoder

    rows = _pairs(60, seed=3)
    corpus = _write_pairs(tmp_path / "pairs.jsonl", rows)
    store = tmp_path / "store"
    faults = json.dumps(
        [
            {"kind": "oom", "chunks": [0], "above_batch": 4},
            {"kind": "sigkill", "chunks": [1], "attempts": [1]},
        ]
    )
    args = [
        "--model",
        str(reranker),
        "--text-field",
        "query",
        "--pair-field",
        "passage",
        "--chunk-size",
        "20",
    ]
    done = run_cli(
        "run", str(corpus), *args, "--batch-size", "16", "--store", str(store), CHUNKQ_FAULTS=faults
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "60 x 1 scores" in done.stdout, done.stdout
    layout = only_run(store)
    got = np.load(layout.result / "embeddings.npy")
    ids = [json.loads(x) for x in (layout.result / "ids.jsonl").read_text().splitlines()]
    want = CrossEncoder(str(reranker), device="cpu").predict([(r["query"], r["passage"]) for r in rows])
    assert ids == [r["id"] for r in rows]
    assert got.shape == (60, 1) and max_abs_diff(got[:, 0], np.asarray(want)) <= 1e-5
    first = json.loads(layout.output_meta(0).read_text())
    assert [b["batch_size"] for b in first["oom_backoffs"]] == [16, 8] and first["batch_size"] == 4
    assert json.loads(layout.output_meta(1).read_text())["attempt"] == 2
    again = run_cli("run", str(corpus), *args, "--store", str(tmp_path / "store"), "--run-id", "again")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "0 encoded, 59 from the vector cache, 1 repeating another row's text" in again.stdout, again.stdout


@pytest.mark.slow
def test_a_cross_encoder_with_classes_gives_a_row_of_class_scores(
    tmp_path: Path, store: Path, connection: Any
) -> None:
    """A three-label classifier saved as sentence-transformers 2-4 saved cross-encoders (no module
    list): its kind is read from its files, and each pair's row holds its class scores, stored as
    float16 (in process: submit, the real job function, assembly)."""
    from sentence_transformers import CrossEncoder

    from chunkq.jobs.contract.specs import EncodeOptions
    from chunkq.supervisor.corpus.records import CorpusOptions
    from chunkq.supervisor.submit.identity import SubmitRequest

    model = cross_encoder(tmp_path, labels=3, save_as_st=False)
    rows = _pairs(12, seed=4)
    corpus = _write_pairs(tmp_path / "pairs.jsonl", rows)
    options = EncodeOptions(kind=describe(str(model)).kind, output_dtype="float16")
    pairs = CorpusOptions("jsonl", "query", pair_field="passage")
    request = SubmitRequest(corpus, store, str(model), pairs, chunk_size=5, encode=options, cache=False)
    layout = _encode_in_process(request, connection)
    got = np.load(layout.result / "embeddings.npy")
    want = CrossEncoder(str(model), device="cpu").predict([(r["query"], r["passage"]) for r in rows])
    assert got.dtype == np.float16 and got.shape == (12, 3)
    assert max_abs_diff(got, np.asarray(want, dtype=np.float16)) <= 1e-3  # float16's own rounding


def _encode_in_process(request: Any, connection: Any) -> Any:
    from chunkq.jobs.contract.manifest import load_manifest
    from chunkq.jobs.contract.run_files import RunLayout
    from chunkq.jobs.embed import embed_chunk
    from chunkq.supervisor.result.assemble import assemble
    from chunkq.supervisor.submit.submission import submit

    layout = RunLayout(request.store, submit(request, connection).run_id)
    manifest = load_manifest(layout)
    for index in range(manifest.chunks):
        embed_chunk(manifest.chunk_spec(layout.store, index).to_dict())
    assemble(Run.of(layout))
    return layout


@pytest.mark.slow
def test_the_python_api_scores_pairs_in_process(reranker: Path) -> None:
    from sentence_transformers import CrossEncoder

    import chunkq

    rows = _pairs(9, seed=5)
    pairs = [(r["query"], r["passage"]) for r in rows]
    want = np.asarray(CrossEncoder(str(reranker), device="cpu").predict(pairs))
    here = chunkq.embed(pairs, model=str(reranker))
    assert here.shape == (9, 1) and max_abs_diff(here[:, 0], want) <= 1e-5
    with pytest.raises(ConfigError, match="a cross model takes \\(query, passage\\) pairs, given strs"):
        chunkq.embed(["a text"], model=str(reranker))
    assert chunkq.embed([], model=str(reranker)).shape == (0, 1)


@pytest.fixture(scope="module")
def splade(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return splade_encoder(tmp_path_factory.mktemp("splade"))


def _dense_rows(offsets: Any, indices: Any, values: Any, dim: int) -> np.ndarray:
    out = np.zeros((len(offsets) - 1, dim), dtype=np.float32)
    for i in range(len(offsets) - 1):
        out[i, indices[offsets[i] : offsets[i + 1]]] = values[offsets[i] : offsets[i + 1]]
    return out


@pytest.mark.slow
def test_a_sparse_run_equals_encode_document_through_a_sigkill_and_an_oom_back_off(
    tmp_path: Path, splade: Path
) -> None:
    """``chunkq run --role document --max-active-dims 32`` of 50 texts in chunks of 20, chunk 0 out
    of memory above batch 4, chunk 1's first worker SIGKILLed: the CSR result equals
    ``SparseEncoder.encode_document(texts, max_active_dims=32)``: the same indices, values within
    1e-5, ids in corpus order; the Parquet export has them as lists."""
    import pyarrow.parquet as pq
    from sentence_transformers import SparseEncoder

    from tests.helpers import make_texts, write_corpus

    ids, texts = make_texts(50, seed=8)
    corpus = write_corpus(tmp_path / "docs.jsonl", ids, texts, "jsonl")
    store = tmp_path / "store"
    faults = json.dumps(
        [
            {"kind": "oom", "chunks": [0], "above_batch": 4},
            {"kind": "sigkill", "chunks": [1], "attempts": [1]},
        ]
    )
    args = ["--model", str(splade), "--role", "document", "--max-active-dims", "32", "--chunk-size", "20"]
    done = run_cli(
        "run", str(corpus), *args, "--batch-size", "16", "--store", str(store), CHUNKQ_FAULTS=faults
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "50 x 30522 sparse vectors" in done.stdout, done.stdout
    layout = only_run(store)
    result = {name: np.load(layout.result / f"{name}.npy") for name in ("offsets", "indices", "values")}
    model = SparseEncoder(str(splade), device="cpu")
    want = model.encode_document(texts, max_active_dims=32, convert_to_sparse_tensor=True).coalesce()
    got = _dense_rows(result["offsets"], result["indices"], result["values"], 30522)
    wanted = want.to_dense().numpy()
    assert [json.loads(x) for x in (layout.result / "ids.jsonl").read_text().splitlines()] == ids
    assert np.array_equal(got != 0, wanted != 0)  # the same active dimensions
    assert max_abs_diff(got, wanted) <= 1e-5
    assert (np.diff(result["offsets"]) == 32).all()
    first = json.loads(layout.output_meta(0).read_text())
    assert [b["batch_size"] for b in first["oom_backoffs"]] == [16, 8] and first["batch_size"] == 4
    assert json.loads(layout.output_meta(1).read_text())["attempt"] == 2
    out = tmp_path / "docs.parquet"
    exported = run_cli(
        "export", layout.run_id, "--store", str(store), "--format", "parquet", "--out", str(out)
    )
    assert exported.returncode == 0, exported.stderr
    table = pq.read_table(out)
    assert table.column_names == ["id", "indices", "values"]
    assert table.column("indices")[3].as_py() == result["indices"][96:128].tolist()
    named = tmp_path / "named.jsonl"
    args = ["--store", str(store), "--format", "jsonl", "--out", str(named), "--tokens"]
    assert run_cli("export", layout.run_id, *args).returncode == 0
    row = json.loads(named.read_text().splitlines()[3])
    assert row["tokens"] == model.tokenizer.convert_ids_to_tokens(row["indices"]) and len(row["tokens"]) == 32


@pytest.mark.slow
def test_a_damaged_sparse_chunk_output_is_refused_and_the_python_api_routes_queries(
    tmp_path: Path, splade: Path, reference_model: Any
) -> None:
    """A sparse chunk output whose values were changed fails verification (so it is set aside and
    encoded again); ``chunkq.embed(..., role="query")`` equals ``encode_query``, for a sparse model
    and for the dense default."""
    from sentence_transformers import SparseEncoder

    import chunkq
    from chunkq.jobs.contract.chunk_output import verify_output
    from chunkq.jobs.contract.run_files import RunLayout
    from chunkq.jobs.contract.specs import EncodeOptions
    from chunkq.jobs.embed import embed_chunk
    from tests.helpers import make_texts, write_test_run

    store = tmp_path / "store"
    spec, _ = write_test_run(store, "sparse-run", 0, 6, 9, EncodeOptions(kind="sparse"), model=str(splade))
    embed_chunk(spec.to_dict())
    layout = RunLayout(store, spec.run_id)
    assert verify_output(layout, 0, 6)[1] == ""
    values = layout.output_array(0, "values")
    data = bytearray(values.read_bytes())
    data[-4:] = np.float32(7.0).tobytes()
    values.write_bytes(bytes(data))
    assert verify_output(layout, 0, 6)[1] == "000000.values.npy checksum does not match its metadata"

    _, texts = make_texts(5, seed=10)
    model = SparseEncoder(str(splade), device="cpu")
    got = chunkq.embed(texts, model=str(splade), role="query")
    want = model.encode_query(texts, convert_to_sparse_tensor=True).coalesce().to_dense().numpy()
    assert (
        max_abs_diff(_dense_rows(got.offsets, got.arrays["indices"], got.arrays["values"], got.dim), want)
        <= 1e-5
    )
    dense = chunkq.embed(texts, role="query")
    assert max_abs_diff(dense, reference_model.encode_query(texts)) <= 1e-5


@pytest.mark.slow
def test_a_multivector_run_equals_encode_document_through_a_sigkill_and_an_oom_back_off(
    tmp_path: Path,
) -> None:
    import pyarrow.parquet as pq
    from sentence_transformers import MultiVectorEncoder

    import chunkq
    from tests.helpers import make_texts, write_corpus

    model_dir = colbert_encoder(tmp_path / "colbert")
    ids, texts = make_texts(40, seed=12)
    corpus = write_corpus(tmp_path / "docs.jsonl", ids, texts, "jsonl")
    store = tmp_path / "store"
    faults = json.dumps(
        [
            {"kind": "oom", "chunks": [1], "above_batch": 2},
            {"kind": "sigkill", "chunks": [0], "attempts": [1]},
        ]
    )
    args = ["--model", str(model_dir), "--role", "document", "--chunk-size", "15", "--batch-size", "8"]
    done = run_cli("run", str(corpus), *args, "--store", str(store), CHUNKQ_FAULTS=faults)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "40 x 32 token matrices" in done.stdout, done.stdout
    layout = only_run(store)
    model = MultiVectorEncoder(str(model_dir), device="cpu")
    want = model.encode_document(texts, convert_to_numpy=True)
    got = chunkq.run(str(corpus), str(model_dir), store=store, role="document", chunk_size=15, batch_size=8)
    rows = got.ragged()
    assert got.ids() == ids and rows.dim == 32
    assert [int(n) for n in np.diff(rows.offsets)] == [len(w) for w in want]
    assert max_abs_diff(rows.arrays["vectors"], np.concatenate(want)) <= 1e-5
    assert [b["batch_size"] for b in json.loads(layout.output_meta(1).read_text())["oom_backoffs"]] == [8, 4]
    assert json.loads(layout.output_meta(0).read_text())["attempt"] == 2
    out = tmp_path / "docs.parquet"
    exported = run_cli(
        "export", layout.run_id, "--store", str(store), "--format", "parquet", "--out", str(out)
    )
    assert exported.returncode == 0, exported.stderr
    first = pq.read_table(out).column("vectors")[0].as_py()
    assert max_abs_diff(np.array(first), want[0]) <= 1e-6


@pytest.mark.slow
def test_an_image_run_equals_encode_of_the_images_and_names_the_rows_it_cannot_read(tmp_path: Path) -> None:
    """Images by path, two of them bad (missing; not an image). Without --allow-missing their chunk
    fails, not retried, naming both by id; with it, through a SIGKILL and an OOM back-off, the
    result equals ``SentenceTransformer.encode(images)`` for the others, in order, and the two are
    listed with their reasons by ``chunkq run``, ``status``, the report and the result manifest.
    A text run of the same model gives vectors of the same space."""
    from PIL import Image
    from sentence_transformers import SentenceTransformer

    model_dir = tiny_clip(tmp_path / "clip")
    rng = np.random.default_rng(14)
    rows, images = [], []
    for i in range(16):
        path = tmp_path / "img" / f"{i}.png"
        path.parent.mkdir(exist_ok=True)
        Image.fromarray((rng.random((24 + i, 36, 3)) * 255).astype("uint8")).save(path)
        rows.append({"id": f"img-{i}", "text": str(path)})
        images.append(Image.open(path))
    (tmp_path / "img" / "bad.png").write_bytes(b"not an image")
    rows.insert(5, {"id": "gone", "text": str(tmp_path / "img" / "missing.png")})
    rows.insert(12, {"id": "broken", "text": str(tmp_path / "img" / "bad.png")})
    corpus = _write_pairs(tmp_path / "images.jsonl", rows)
    args = ["--model", str(model_dir), "--kind", "image", "--chunk-size", "6", "--batch-size", "4"]
    refused = run_cli("run", str(corpus), *args, "--store", str(tmp_path / "s1"))
    assert refused.returncode != 0
    assert "id 'gone'" in refused.stderr and "no such file" in refused.stderr, refused.stderr[-3000:]
    assert "id 'broken'" in refused.stderr and "not an image" in refused.stderr
    assert "bad_input errors are not retried" in refused.stderr

    faults = json.dumps(
        [
            {"kind": "oom", "chunks": [0], "above_batch": 2},
            {"kind": "sigkill", "chunks": [2], "attempts": [1]},
        ]
    )
    store = tmp_path / "s2"
    done = run_cli("run", str(corpus), *args, "--allow-missing", "--store", str(store), CHUNKQ_FAULTS=faults)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "2 row(s) left out: 'gone'" in done.stdout and "'broken'" in done.stdout, done.stdout
    layout = only_run(store)
    got = np.load(layout.result / "embeddings.npy")
    ids = [json.loads(x) for x in (layout.result / "ids.jsonl").read_text().splitlines()]
    model = SentenceTransformer(str(model_dir), device="cpu")
    assert ids == [f"img-{i}" for i in range(16)]
    assert got.shape == (16, 16) and max_abs_diff(got, model.encode(images)) <= 1e-5
    result = json.loads(layout.result_manifest.read_text())
    assert [(r["id"], r["row"]) for r in result["bad_rows"]] == [("gone", 5), ("broken", 12)]
    first = json.loads(layout.output_meta(0).read_text())
    assert [b["batch_size"] for b in first["oom_backoffs"]] == [4] and first["batch_size"] == 2
    assert json.loads(layout.output_meta(2).read_text())["attempt"] == 2
    status = run_cli("status", layout.run_id, "--store", str(store))
    assert "--allow-missing: 2 row(s) left out: 'gone'" in status.stdout, status.stdout
    report = run_cli("report", layout.run_id, "--store", str(store), "--out", str(tmp_path / "report"))
    assert report.returncode == 0, report.stderr
    left_out = json.loads((tmp_path / "report" / "report.json").read_text())["rows_left_out"]
    assert [r["id"] for r in left_out] == ["gone", "broken"]
    import chunkq

    texts = ["a red house", "a small dog"]
    vectors = chunkq.embed(texts, model=str(model_dir))
    assert vectors.shape == (2, 16) and max_abs_diff(vectors, model.encode(texts)) <= 1e-5


@pytest.mark.slow
def test_rows_left_out_are_named_on_the_dashboards_job_page(
    tmp_path: Path, store: Path, connection: Any
) -> None:
    """Under --allow-missing the chunk succeeds, so its bad rows are in its RQ job's meta, which
    the dashboard's job page shows a line a field (real job, real Redis, the dashboard's renderer)."""
    import json as json_lib

    from PIL import Image
    from rq.job import Job
    from rq.serializers import JSONSerializer

    from chunkq.jobs.contract.manifest import load_manifest
    from chunkq.jobs.contract.run_files import RunLayout
    from chunkq.jobs.contract.specs import EncodeOptions
    from chunkq.jobs.embed import embed_chunk
    from chunkq.supervisor.corpus.records import CorpusOptions
    from chunkq.supervisor.submit.identity import SubmitRequest
    from chunkq.supervisor.submit.submission import submit
    from chunkq.tools.dashboard import _meta_lines

    model_dir = tiny_clip(tmp_path / "clip")
    good = tmp_path / "good.png"
    Image.new("RGB", (40, 30), (200, 10, 10)).save(good)
    rows = [{"id": "fine", "text": str(good)}, {"id": "gone", "text": str(tmp_path / "missing.png")}]
    corpus = _write_pairs(tmp_path / "images.jsonl", rows)
    options = EncodeOptions(kind="image", allow_missing=True)
    request = SubmitRequest(
        corpus, store, str(model_dir), CorpusOptions("jsonl"), encode=options, cache=False
    )
    layout = RunLayout(store, submit(request, connection).run_id)
    spec = load_manifest(layout).chunk_spec(store, 0)
    job = Job.create(
        embed_chunk, args=[spec.to_dict()], connection=connection, serializer=JSONSerializer, id=spec.job_id
    )
    job.perform()
    shown = Job.fetch(spec.job_id, connection=connection, serializer=JSONSerializer).meta["bad_rows"]
    assert shown == [f"gone: {tmp_path / 'missing.png'}: no such file"]
    assert "gone: " in _meta_lines(json_lib.dumps({"bad_rows": shown}))


@pytest.mark.slow
def test_chunkq_rerank_scores_a_query_against_passages_in_process(tmp_path: Path, reranker: Path) -> None:
    """Issue 45.10: reranking through the command line was a run per query (8.9 s for 20 pairs, a new
    entry in `runs` each time). `chunkq rerank` is CrossEncoder.predict in the command's process,
    best first, and leaves no run behind."""
    from sentence_transformers import CrossEncoder

    passages = [{"id": f"p{i}", "text": " ".join(WORDS[i : i + 8])} for i in range(12)]
    path = _write_pairs(tmp_path / "passages.jsonl", passages)
    done = run_cli("rerank", "river mountain", str(path), "--model", str(reranker), "--json", "--top", "5")
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout)
    want = CrossEncoder(str(reranker), device="cpu").predict(
        [("river mountain", p["text"]) for p in passages]
    )
    best = sorted(zip(want.tolist(), [p["id"] for p in passages], strict=True), reverse=True)[:5]
    assert [g["id"] for g in got] == [rid for _, rid in best]
    assert max_abs_diff(np.array([g["score"] for g in got]), np.array([s for s, _ in best])) <= 1e-5
    assert not (tmp_path / "chunkq-store").exists()


@pytest.mark.slow
def test_chunkq_model_of_a_sparse_model_gives_its_space_and_its_call(splade: Path) -> None:
    """Issue 45.12: it said `dimension unknown (--truncate-dim may keep fewer)`, an option a sparse run
    refuses, and named encode_document where a run without --role calls encode."""
    shown = run_cli("model", str(splade)).stdout
    assert "dimension           30522 (the vocabulary: a sparse vector's space)" in shown, shown
    assert "SparseEncoder.encode(texts) (encode_query / encode_document with --role)" in shown


@pytest.mark.slow
def test_a_kind_of_ones_own_in_one_module_runs_end_to_end(tmp_path: Path, reference_model: Any) -> None:
    """Issue 66.6: a kind registered in one module (tests/kind_scaled.py, named in CHUNKQ_KINDS) runs
    through submit, a pool's workers, assembly and export with nothing else changed, and the vector
    cache, filled by a dense run of the same texts first, never serves it a dense row."""
    from tests import kind_scaled

    texts = [f"{WORDS[i % len(WORDS)]} number {i} of a kind of its own" for i in range(60)]
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"id": f"t{i}", "text": t}) + "\n" for i, t in enumerate(texts)))
    env = {"CHUNKQ_KINDS": "tests.kind_scaled", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    plain = reference_model.encode(texts, convert_to_numpy=True)
    for kind in ("dense", "scaled"):
        done = run_cli(
            "run", "c.jsonl", "--store", "s", "--kind", kind, "--chunk-size", "20", cwd=tmp_path, **env
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
    runs = {
        Run.open(tmp_path / "s", p.name).manifest.kind: p.name for p in (tmp_path / "s" / "runs").iterdir()
    }
    scaled = np.load(tmp_path / "s" / "runs" / runs["scaled"] / "result" / "embeddings.npy")
    assert max_abs_diff(scaled, plain * kind_scaled.SCALE) < 1e-4
    described = run_cli("model", "--json", cwd=tmp_path, forks=False, **env)
    assert "scaled" in json.loads(described.stdout)["kinds"]  # the model's files allow it, as dense
    refused = run_cli("run", "c.jsonl", "--store", "s", "--kind", "scaled", cwd=tmp_path, forks=False)
    assert refused.returncode != 0 and "'scaled' is not one of 'dense'" in refused.stderr  # not named
