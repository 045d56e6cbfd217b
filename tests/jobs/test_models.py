"""The models people use (issue 23): prompts, Matryoshka truncation, stored dtypes (float16, int8/uint8
on one set of ranges for the run, packed bits), remote code behind the pool's own consent, revisions
and model kwargs; each checked before anything starts and part of the run's identity.

Every result is compared with a plain ``SentenceTransformer.encode`` of the same texts with the same
arguments (and sentence-transformers' own ``quantize_embeddings``), on the real bundled model."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest
import redis

from chunkq.jobs.compute.model_info import describe
from chunkq.jobs.compute.model_refs import BUNDLED_MODEL, resolve_model
from chunkq.jobs.compute.runtime import WorkerContext
from chunkq.jobs.compute.scope import check_spec
from chunkq.jobs.contract.errors import ConfigError, TamperedJobError
from chunkq.jobs.contract.manifest import load_manifest
from chunkq.jobs.contract.run import Run
from chunkq.jobs.contract.run_files import RunLayout
from chunkq.jobs.contract.settings import PoolSettings
from chunkq.jobs.contract.specs import EncodeOptions
from chunkq.jobs.embed import embed_chunk
from chunkq.queue_worker.worker_args import worker_argv
from chunkq.sinks.files import export
from chunkq.supervisor.corpus.records import CorpusOptions
from chunkq.supervisor.request import submit_request
from chunkq.supervisor.result.assemble import assemble
from chunkq.supervisor.result.reader import check_published
from chunkq.supervisor.submit.identity import SubmitRequest
from chunkq.supervisor.submit.submission import submit
from tests.helpers import make_texts, max_abs_diff, run_cli, write_corpus
from tests.tiny_models import bundled_copy

ROWS = 37


def _run(
    tmp_path: Path, connection: redis.Redis, options: EncodeOptions, model: str = BUNDLED_MODEL
) -> tuple[RunLayout, list[str], dict[str, Any]]:
    """Submit ``ROWS`` texts with ``options``, encode every chunk in-process with the real job
    function, assemble; (layout, texts, result manifest)."""
    ids, texts = make_texts(ROWS, seed=23)
    tmp_path.mkdir(exist_ok=True)
    corpus = write_corpus(tmp_path / "c.jsonl", ids, texts, "jsonl")
    store = tmp_path / "store"
    req = SubmitRequest(corpus, store, model, CorpusOptions("jsonl"), chunk_size=10, encode=options)
    layout = RunLayout(store, submit(req, connection).run_id)
    manifest = load_manifest(layout)
    for index in range(manifest.chunks):
        embed_chunk(manifest.chunk_spec(store, index).to_dict())
    return layout, texts, assemble(Run.of(layout))


def _result(layout: RunLayout) -> np.ndarray:
    return np.load(layout.result / "embeddings.npy")


@pytest.mark.slow
def test_prompt_truncation_and_normalisation_give_what_a_plain_encode_gives(
    tmp_path: Path, connection: redis.Redis, reference_model: Any
) -> None:
    options = EncodeOptions(prompt="query: ", truncate_dim=128, normalize_embeddings=True)
    layout, texts, result = _run(tmp_path, connection, options)
    want = reference_model.encode(texts, prompt="query: ", truncate_dim=128, normalize_embeddings=True)
    got = _result(layout)
    assert got.shape == (ROWS, 128) and max_abs_diff(got, want) <= 1e-5
    assert (result["dim"], result["embedding_dim"], result["dtype"]) == (128, 128, "float32")
    # The prompt did something: without it the rows differ.
    assert (
        max_abs_diff(got, reference_model.encode(texts, truncate_dim=128, normalize_embeddings=True)) > 1e-3
    )
    assert load_manifest(layout).options["prompt"] == "query: "


# uint8 computes its ranges as int8 does (a child process loads the model: ~8 s): the slow tier.
@pytest.mark.parametrize(
    "dtype", ["float16", "int8", pytest.param("uint8", marks=pytest.mark.slow), "binary", "ubinary"]
)
@pytest.mark.slow
def test_every_output_dtype_is_stored_verified_and_exported_as_sentence_transformers_makes_it(
    dtype: str, tmp_path: Path, connection: redis.Redis, reference_model: Any
) -> None:
    from sentence_transformers import quantize_embeddings

    layout, texts, result = _run(tmp_path, connection, EncodeOptions(output_dtype=dtype))
    manifest = load_manifest(layout)
    floats = reference_model.encode(texts)
    got = _result(layout)
    if dtype == "float16":
        want = floats.astype(np.float16)
        assert got.dtype == np.float16 and max_abs_diff(got.astype(np.float32), floats) <= 1e-3
    else:
        ranges = None
        if dtype in ("int8", "uint8"):
            # One set of ranges for the run, from the corpus before any chunk ran (here: all 37 texts).
            calibration = manifest.data["calibration"]
            assert calibration["rows"] == ROWS and np.array(calibration["ranges"]).shape == (2, 384)
            ranges = np.array(calibration["ranges"], dtype=np.float32)
            assert np.allclose(ranges, [floats.min(axis=0), floats.max(axis=0)], atol=1e-5)
        want = quantize_embeddings(floats, precision=dtype, ranges=ranges)
        assert got.dtype == want.dtype and got.shape == want.shape
        # The same codes up to float noise between two processes' encodes, which moves a value on a
        # bucket's edge by one: here each dimension's minimum and maximum (2 of 37 rows) sit on edges.
        assert np.mean(got == want) > 0.99 and np.abs(got.astype(int) - want.astype(int)).max() <= 1
    packed = dtype in ("binary", "ubinary")
    assert result["dtype"] == dtype and result["packed_bits"] is packed
    assert (result["dim"], result["embedding_dim"]) == ((48, 384) if packed else (384, 384))
    assert check_published(layout, manifest) == []

    out = tmp_path / "out"
    out.mkdir()
    export(Run.of(layout), "npy", out / "e.npy")
    assert np.array_equal(np.load(out / "e.npy"), got) and np.load(out / "e.npy").dtype == got.dtype
    export(Run.of(layout), "parquet", out / "e.parquet")
    column = pq.read_table(out / "e.parquet").column("embedding").combine_chunks()
    assert np.array_equal(column.flatten().to_numpy().reshape(got.shape), got)
    export(Run.of(layout), "jsonl", out / "e.jsonl")
    first = json.loads((out / "e.jsonl").read_text().splitlines()[0])
    assert np.allclose(first["embedding"], got[0].astype(np.float64))


def test_a_job_asking_for_another_dtype_than_its_run_is_refused(
    tmp_path: Path, connection: redis.Redis
) -> None:
    ids, texts = make_texts(5, seed=3)
    corpus = write_corpus(tmp_path / "c.jsonl", ids, texts, "jsonl")
    req = SubmitRequest(corpus, tmp_path / "s", BUNDLED_MODEL, CorpusOptions("jsonl"), chunk_size=5)
    layout = RunLayout(tmp_path / "s", submit(req, connection).run_id)
    spec = load_manifest(layout).chunk_spec(tmp_path / "s", 0)
    forged = replace(spec, options=replace(spec.options, output_dtype="binary")).to_dict()
    with pytest.raises(TamperedJobError, match="output_dtype"):
        embed_chunk(forged)


@pytest.mark.slow
def test_named_prompts_the_default_prompt_and_refusals_before_anything_starts(
    tmp_path: Path, connection: redis.Redis, reference_model: Any
) -> None:
    model = bundled_copy(
        tmp_path / "model",
        prompts={"query": "query: ", "document": "passage: "},
        default_prompt_name="document",
    )
    info = describe(str(model))
    assert (
        info.prompts == {"query": "query: ", "document": "passage: "}
        and info.default_prompt_name == "document"
    )
    assert (info.dim, info.max_seq_length, info.remote_code) == (384, 256, False)

    layout, texts, _ = _run(tmp_path / "named", connection, EncodeOptions(prompt_name="query"), str(model))
    assert max_abs_diff(_result(layout), reference_model.encode(texts, prompt="query: ")) <= 1e-5
    # No prompt given: the model's default prompt applies, as in a plain encode of this model.
    layout, texts, _ = _run(tmp_path / "default", connection, EncodeOptions(), str(model))
    assert max_abs_diff(_result(layout), reference_model.encode(texts, prompt="passage: ")) <= 1e-5

    corpus = write_corpus(tmp_path / "c.jsonl", *make_texts(3), "jsonl")
    store = tmp_path / "refused"
    with pytest.raises(ConfigError, match=r"no prompt named 'search' \(its prompts: 'document', 'query'\)"):
        submit_request([corpus], store, str(model), prompt_name="search")
    with pytest.raises(ConfigError, match=r"above model .* dimension 384"):
        submit_request([corpus], store, str(model), truncate_dim=512)
    with pytest.raises(ConfigError, match="--prompt or --prompt-name, not both"):
        submit_request([corpus], store, str(model), prompt="x", prompt_name="query")
    shown = run_cli("model", str(model))
    assert shown.returncode == 0 and "default prompt      document" in shown.stdout
    assert "'query': 'query: '" in shown.stdout and "dimension           384" in shown.stdout
    assert not store.exists()


def test_remote_code_is_refused_unless_the_run_and_the_pool_both_allow_it(tmp_path: Path) -> None:
    model = bundled_copy(tmp_path / "model")
    config = model / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "auto_map": {"AutoModel": "x.Model"}}))
    assert describe(str(model)).remote_code
    corpus = write_corpus(tmp_path / "c.jsonl", *make_texts(3), "jsonl")
    with pytest.raises(ConfigError, match=r"brings its own Python code.*--trust-remote-code"):
        submit_request([corpus], tmp_path / "s", str(model))
    allowed = submit_request([corpus], tmp_path / "s", str(model), trust_remote_code=True)
    assert allowed.encode.trust_remote_code

    # A worker refuses such a job unless its pool was started allowing it: a Redis writer could
    # otherwise make every worker import a model's code.
    from chunkq.jobs.contract.specs import ChunkSpec

    spec = ChunkSpec("r", 0, 0, 3, str(model), str(tmp_path / "s"), EncodeOptions(trust_remote_code=True))
    strict = WorkerContext("w", "h", 1, "cpu", store=str(tmp_path / "s"), models=frozenset({str(model)}))
    with pytest.raises(ConfigError, match="chunkq pool --trust-remote-code"):
        check_spec(spec, strict)
    check_spec(spec, replace(strict, remote_code=True))
    check_spec(replace(spec, options=EncodeOptions()), strict)
    assert "--trust-remote-code" in worker_argv(PoolSettings(trust_remote_code=True))
    assert "--trust-remote-code" not in worker_argv(PoolSettings())


@pytest.mark.slow
def test_model_kwargs_are_a_closed_list_and_options_keep_old_fingerprints(
    tmp_path: Path, connection: redis.Redis, reference_model: Any
) -> None:
    with pytest.raises(ConfigError, match="model kwarg 'device_map' is not passed"):
        EncodeOptions(model_kwargs={"device_map": "auto"})
    with pytest.raises(ConfigError, match="attn_implementation='magic'"):
        EncodeOptions(model_kwargs={"attn_implementation": "magic"})
    refused = run_cli("submit", "x.jsonl", "--model-kwargs", '{"trust_remote_code": true}')
    assert refused.returncode == 2 and "model kwarg 'trust_remote_code' is not passed" in refused.stderr
    # Unset, the new options are not in the options' JSON: runs made before them keep their run ids.
    assert EncodeOptions().to_dict() == {
        "batch_size": 32,
        "normalize_embeddings": False,
        "max_seq_length": None,
        "precision": "fp32",
    }
    assert EncodeOptions(revision="abc").to_dict()["revision"] == "abc"

    options = EncodeOptions(model_kwargs={"attn_implementation": "eager"})
    layout, texts, _ = _run(tmp_path, connection, options)
    assert max_abs_diff(_result(layout), reference_model.encode(texts)) <= 1e-5
    assert load_manifest(layout).options["model_kwargs"] == {"attn_implementation": "eager"}


def test_a_cached_hub_model_shows_its_revision(tmp_path: Path) -> None:
    """A model in the Hugging Face cache (the layout ``hf download`` leaves): ``chunkq model`` names
    the snapshot's commit, which ``--revision`` pins."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--chunkq-test--mini"
    shutil.copytree(resolve_model(BUNDLED_MODEL), repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    shown = run_cli("model", "chunkq-test/mini", "--json", HF_HUB_CACHE=str(tmp_path / "hub"))
    assert shown.returncode == 0, shown.stderr
    info = json.loads(shown.stdout)
    assert (info["revision"], info["dim"], info["folder"].endswith(commit)) == (commit, 384, True)


@pytest.mark.slow  # a real chunkq run: embedded Redis, a pool, worker processes
def test_chunkq_run_with_a_named_prompt_truncation_and_int8(tmp_path: Path, reference_model: Any) -> None:
    from sentence_transformers import quantize_embeddings

    model = bundled_copy(tmp_path / "model", prompts={"query": "query: "})
    ids, texts = make_texts(45, seed=9)
    corpus = write_corpus(tmp_path / "c.jsonl", ids, texts, "jsonl")
    store = tmp_path / "store"
    args = ["--model", str(model), "--prompt-name", "query", "--truncate-dim", "64", "--output-dtype", "int8"]
    done = run_cli("run", str(corpus), "--store", str(store), "--chunk-size", "10", *args)
    assert done.returncode == 0, done.stderr[-3000:]
    (layout,) = [RunLayout(store, p.name) for p in (store / "runs").iterdir()]
    manifest = load_manifest(layout)
    ranges = np.array(manifest.data["calibration"]["ranges"], dtype=np.float32)
    want = quantize_embeddings(
        reference_model.encode(texts, prompt="query: ", truncate_dim=64), "int8", ranges=ranges
    )
    got = _result(layout)
    assert got.dtype == np.int8 and got.shape == (45, 64)
    assert np.abs(got.astype(int) - want.astype(int)).max() <= 1
    assert run_cli("assemble", layout.run_id, "--verify", "--store", str(store)).returncode == 0


@pytest.mark.slow  # a real chunkq run loading a model from a Hugging Face cache by its revision
def test_a_run_pins_a_cached_revision_and_an_absent_one_is_refused(
    tmp_path: Path, reference_model: Any
) -> None:
    commit = "89abcdef0123456789abcdef0123456789abcdef"
    repo = tmp_path / "hub" / "models--chunkq-test--mini"
    shutil.copytree(resolve_model(BUNDLED_MODEL), repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    ids, texts = make_texts(12, seed=5)
    corpus = write_corpus(tmp_path / "c.jsonl", ids, texts, "jsonl")
    store, env = tmp_path / "store", {"HF_HUB_CACHE": str(tmp_path / "hub")}
    model = ["--model", "chunkq-test/mini", "--store", str(store)]
    absent = run_cli("run", str(corpus), *model, "--revision", "f" * 40, **env)
    assert absent.returncode == 6 and "is not in the Hugging Face cache" in absent.stderr
    assert not store.exists()
    done = run_cli("run", str(corpus), *model, "--revision", commit, **env)
    assert done.returncode == 0, done.stderr[-3000:]
    (layout,) = [RunLayout(store, p.name) for p in (store / "runs").iterdir()]
    assert load_manifest(layout).options["revision"] == commit
    assert max_abs_diff(_result(layout), reference_model.encode(texts)) <= 1e-5
    local = run_cli("run", str(corpus), "--store", str(store), "--revision", commit)
    assert local.returncode == 6 and "applies to hub models" in local.stderr


@pytest.mark.slow  # loads or runs the model in a subprocess or several times: the slow tier
def test_a_model_saved_by_the_installed_sentence_transformers_is_read_as_it_reads_it(tmp_path: Path) -> None:
    """Issue 37.3: sentence-transformers 6 writes ``embedding_dimension`` and ``pooling_mode``, and
    keeps the maximum length in the tokenizer's config; the checks before a run read the same."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(resolve_model(BUNDLED_MODEL), device="cpu")
    model.prompts = {"query": "query: ", "passage": "passage: "}
    model.default_prompt_name = "query"
    folder = tmp_path / "saved"
    model.save(str(folder))
    info = describe(str(folder))
    assert (
        (info.dim, info.max_seq_length)
        == (
            # sentence-transformers 6 renamed it get_embedding_dimension; older versions have only this
            getattr(model, "get_embedding_dimension", model.get_sentence_embedding_dimension)(),
            model.max_seq_length,
        )
        == (384, 256)
    )
    assert (
        info.prompts == {"query": "query: ", "passage": "passage: "} and info.default_prompt_name == "query"
    )
    corpus = write_corpus(tmp_path / "c.jsonl", *make_texts(3), "jsonl")
    with pytest.raises(ConfigError, match=r"--truncate-dim 999 is above model .* dimension 384"):
        submit_request([corpus], tmp_path / "store", str(folder), truncate_dim=999)
    # A folder whose dimension cannot be read: an option that needs it is refused, not accepted.
    for config in folder.glob("*Pooling/config.json"):
        config.write_text("{}")
    assert describe(str(folder)).dim is None
    with pytest.raises(
        ConfigError, match=r"--truncate-dim 128 cannot be checked: .* dimension is not in its files"
    ):
        submit_request([corpus], tmp_path / "store", str(folder), truncate_dim=128)
    assert not (tmp_path / "store").exists()


@pytest.mark.slow  # loads or runs the model in a subprocess or several times: the slow tier
def test_sentence_transformers_default_prompt_notice_stays_out_of_a_warning_log(tmp_path: Path) -> None:
    """Issue 37.7: "Default prompt name is set to ..." printed at --log-level warning in every worker."""
    import subprocess
    import sys

    from tests.helpers import cli_env

    folder = bundled_copy(tmp_path / "model", prompts={"query": "query: "}, default_prompt_name="query")
    # One process: chunkq's load (filtered), then records as sentence-transformers' own logger writes
    # them (its warning_once would not repeat the load's): the notice stays out, another warning not.
    code = (
        "import logging; logging.basicConfig(level=logging.WARNING); "
        f"from chunkq.jobs.compute import models; models.get_model({str(folder)!r}, 'cpu', 'fp32'); "
        "import sentence_transformers.base.model as m; "
        "m.logger.warning('Default prompt name is set to x (direct)'); m.logger.warning('another warning')"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=cli_env()
    )
    assert out.returncode == 0, out.stderr
    assert "Default prompt name is set to" not in out.stderr and "another warning" in out.stderr
    import sentence_transformers

    source = Path(sentence_transformers.__file__).parent / "base" / "model.py"
    assert "Default prompt name is set to" in source.read_text()  # the text filtered is ST's own


def test_an_int8_runs_calibration_runs_on_the_runs_own_devices(tmp_path: Path) -> None:
    """The calibration's process sees the devices its run was given: a run on the CPU (``--gpus
    none``, or no GPU) calibrates on the CPU, not on a GPU 0 another job may hold; a submit, whose
    pools run elsewhere, leaves the process as it is."""
    from chunkq.jobs.calibrate import ranges_for
    from chunkq.supervisor.request import build_run_request
    from tests.helpers import make_texts, write_corpus

    ids, texts = make_texts(4, seed=5)
    corpus = write_corpus(tmp_path / "c.jsonl", ids, texts, "jsonl")
    request = build_run_request([corpus], store=tmp_path / "s", output_dtype="int8", gpus="none")
    assert request.submit.calibrate_on == ""
    found = ranges_for(BUNDLED_MODEL, EncodeOptions(output_dtype="int8"), texts, request.submit.calibrate_on)
    assert found["visible"] == "" and found["device"] == "cpu" and found["rows"] == 4
    assert np.array(found["ranges"]).shape == (2, 384)
