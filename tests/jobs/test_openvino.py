"""Issue 67: ``--backend openvino``, sentence-transformers' own OpenVINO backend on CPU workers.

Without the ``openvino`` extra (CI's install) a run asking for it is refused before anything starts,
in one line; its options are part of what a vector is, so the vector cache never serves one
backend's or precision's rows for another's. With the extra (``make test-openvino``, a side
environment: optimum-intel holds transformers below 5.6) a run through a pool, a worker SIGKILLed
mid-chunk, equals sentence-transformers on PyTorch within 1e-5; f32 and bf16 runs after a PyTorch run
of the same texts read nothing from the cache, and bf16's agreement with fp32 is in its manifests.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from chunkq.jobs.compute import ov_backend
from chunkq.jobs.compute.models import check_precision
from chunkq.jobs.compute.vector_cache import producer, producer_key
from chunkq.jobs.contract.errors import ConfigError
from chunkq.jobs.contract.specs import EncodeOptions, vector_options
from chunkq.queue_worker.exit_codes import EXIT_CONFIG
from tests.helpers import make_texts, max_abs_diff, only_run, run_cli, write_corpus

installed = ov_backend.missing() is None
needs_openvino = pytest.mark.skipif(
    not installed, reason="the openvino extra is not installed (make test-openvino)"
)


@pytest.mark.skipif(installed, reason="the refusal of a host without OpenVINO")
def test_a_run_asking_for_openvino_without_it_is_refused_in_one_line(tmp_path: Path) -> None:
    ids, texts = make_texts(20, seed=1)
    corpus = write_corpus(tmp_path / "a.jsonl", ids, texts, "jsonl")
    done = run_cli(
        "run", str(corpus), "--store", str(tmp_path / "store"), "--backend", "openvino", forks=False
    )
    said = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == EXIT_CONFIG, done.stderr[-2000:]
    assert said == [
        "chunkq: error: --backend openvino needs OpenVINO and optimum-intel, which this Python lacks: "
        "pip install 'chunkq[openvino]'"
    ], said
    assert not (tmp_path / "store").exists()


def test_the_backend_and_its_precision_are_part_of_what_a_vector_is() -> None:
    """A PyTorch run's options and cache key are what they were before backends existed; OpenVINO
    fp32, OpenVINO bf16 and PyTorch each key the cache apart, OpenVINO's releases with them."""
    torch_run, ov_f32 = EncodeOptions(), EncodeOptions(backend="openvino")
    ov_bf16 = EncodeOptions(backend="openvino", precision="bf16")
    assert "backend" not in torch_run.to_dict() and ov_f32.to_dict()["backend"] == "openvino"
    assert vector_options(ov_f32)["backend"] == "openvino"  # keyed by itself, not only by its releases
    keys = {producer_key(producer("m", "files:x", o)) for o in (torch_run, ov_f32, ov_bf16)}
    assert len(keys) == 3
    assert "openvino" in producer("m", "files:x", ov_f32)["libraries"]
    assert "openvino" not in producer("m", "files:x", torch_run)["libraries"]
    assert torch_run.load_key() != ov_f32.load_key() and not ov_f32.default_load


def test_openvino_is_for_cpu_workers_in_fp32_bf16_or_a_named_int8_model_and_dense_models(
    tmp_path: Path,
) -> None:
    check_precision("bf16", "cpu", "openvino")
    check_precision("int8", "cpu", "openvino")
    with pytest.raises(ConfigError, match=r"--backend openvino runs models on the CPU.*--gpus none"):
        check_precision("fp32", "cuda:0", "openvino")
    with pytest.raises(
        ConfigError, match="--precision fp16 with --backend openvino: give fp32 or bf16 or int8"
    ):
        check_precision("fp16", "cpu", "openvino")
    with pytest.raises(ConfigError, match="backend must be one of torch, openvino, got 'onnx'"):
        EncodeOptions(backend="onnx")
    from chunkq.jobs import kinds

    kinds.check_options(EncodeOptions(kind="sparse", backend="openvino"))
    kinds.check_options(EncodeOptions(kind="cross", backend="openvino"))
    with pytest.raises(ConfigError, match="--kind multivector: --backend openvino runs dense, cross, sparse"):
        kinds.check_options(EncodeOptions(kind="multivector", backend="openvino"))
    with pytest.raises(ConfigError, match="--kind cross: --precision bf16 on openvino is for dense models"):
        kinds.check_options(EncodeOptions(kind="cross", backend="openvino", precision="bf16"))
    ids, texts = make_texts(10, seed=2)
    corpus = write_corpus(tmp_path / "a.jsonl", ids, texts, "jsonl")
    late = run_cli(
        "run",
        str(corpus),
        "--store",
        str(tmp_path / "s"),
        "--backend",
        "openvino",
        "--long-texts",
        "late",
        forks=False,
    )
    assert (
        late.returncode == EXIT_CONFIG
        and "--backend openvino gives no token vectors for --long-texts late" in late.stderr
    )
    # int8 is a quantized OpenVINO model, named: never PyTorch's, never a model that holds none.
    with pytest.raises(ConfigError, match="--precision int8 runs an int8 OpenVINO model: give --backend"):
        EncodeOptions(precision="int8")
    torch_int8 = run_cli(
        "run", str(corpus), "--store", str(tmp_path / "s"), "--precision", "int8", forks=False
    )
    assert torch_int8.returncode == EXIT_CONFIG and "give --backend openvino too" in torch_int8.stderr
    with pytest.raises(ConfigError, match=r"holds none \(openvino/openvino_model_qint8_quantized.xml\)"):
        ov_backend.load(lambda where: pytest.fail(where), str(tmp_path), None, "int8")


@needs_openvino
@pytest.mark.slow
def test_an_openvino_run_through_a_sigkill_equals_pytorch_and_bf16_never_reads_its_cache(
    tmp_path: Path, reference_model: Any
) -> None:
    ids, texts = make_texts(240, seed=67)
    corpus = write_corpus(tmp_path / "a.jsonl", ids, texts, "jsonl")
    plain = reference_model.encode(texts)
    store = tmp_path / "store"
    faults = json.dumps([{"kind": "sigkill", "chunks": [1], "attempts": [1]}])
    args = ["run", str(corpus), "--store", str(store), "--chunk-size", "60", "--backend", "openvino"]
    done = run_cli(*args, CHUNKQ_FAULTS=faults)
    assert done.returncode == 0, done.stderr[-3000:]
    layout = only_run(store)
    got = np.load(layout.result / "embeddings.npy")
    assert [json.loads(x) for x in (layout.result / "ids.jsonl").read_text().splitlines()] == ids
    assert max_abs_diff(got, plain) <= 1e-5
    assert json.loads(layout.output_meta(1).read_text())["attempt"] == 2  # the killed chunk, again

    torch_store = tmp_path / "torch"
    assert run_cli("run", str(corpus), "--store", str(torch_store)).returncode == 0
    f32 = run_cli("run", str(corpus), "--store", str(torch_store), "--backend", "openvino")
    assert "240 encoded, 0 from the vector cache" in f32.stdout, f32.stdout
    bf16 = run_cli(
        *("run", str(corpus), "--store", str(torch_store), "--chunk-size", "60"),
        *("--backend", "openvino", "--precision", "bf16"),
    )
    assert bf16.returncode == 0, bf16.stderr[-3000:]
    assert "240 encoded, 0 from the vector cache" in bf16.stdout, bf16.stdout
    runs = sorted((torch_store / "runs").iterdir(), key=lambda p: p.stat().st_mtime)
    rounded = np.load(runs[-1] / "result" / "embeddings.npy")
    cosine = (rounded * plain).sum(1) / np.linalg.norm(rounded, axis=1) / np.linalg.norm(plain, axis=1)
    assert max_abs_diff(rounded, plain) > 1e-5 and cosine.min() > 0.999  # its own rows, close
    # What bf16 costs, measured by the workers on the first chunks' own rows, in the result's manifest.
    agreement = json.loads((runs[-1] / "result" / "manifest.json").read_text())["agreement"]
    assert agreement["with"] == "torch fp32" and agreement["rows"] == 200 and agreement["chunks"] == 4
    assert cosine.min() - 1e-4 <= agreement["min_cosine"] <= agreement["mean_cosine"] < 1.0
    metas = [json.loads(p.read_text()) for p in sorted((runs[-1] / "outputs").glob("*.json"))]
    assert min(m["agreement"]["min_cosine"] for m in metas) == agreement["min_cosine"]
    assert "agreement" not in json.loads(only_run(store).result_manifest.read_text())  # f32: none


@needs_openvino
@pytest.mark.slow
def test_int8_runs_only_a_model_quantized_and_named_as_such_and_records_what_it_costs(
    tmp_path: Path, reference_model: Any
) -> None:
    """``chunkq quantize`` makes an int8 OpenVINO copy of the model from the user's own texts, offline;
    a run names it (``--precision int8`` and the copy), rounds, and records its agreement with fp32.
    A model without one is refused before anything starts."""
    ids, texts = make_texts(120, seed=8)
    corpus = write_corpus(tmp_path / "a.jsonl", ids, texts, "jsonl")
    store = tmp_path / "store"
    refused = run_cli(
        "run", str(corpus), "--store", str(store), "--backend", "openvino", "--precision", "int8"
    )
    assert refused.returncode == EXIT_CONFIG and "chunkq quantize" in refused.stderr, refused.stderr
    assert not (store / "runs").exists() or not list((store / "runs").iterdir())

    folder = tmp_path / "int8-model"
    made = run_cli("quantize", "bundled:all-MiniLM-L6-v2", str(corpus), "--out", str(folder), "--texts", "64")
    assert made.returncode == 0, made.stderr[-3000:]
    assert (folder / "openvino" / "openvino_model_qint8_quantized.xml").is_file()
    assert (folder / "model.safetensors").is_file()  # PyTorch's weights kept: what agreement measures against

    args = ["run", str(corpus), "--store", str(store), "--model", str(folder), "--chunk-size", "60"]
    done = run_cli(*args, "--backend", "openvino", "--precision", "int8")
    assert done.returncode == 0, done.stderr[-3000:]
    layout = only_run(store)
    got = np.load(layout.result / "embeddings.npy")
    plain = reference_model.encode(texts)
    cosine = (got * plain).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(plain, axis=1)
    assert max_abs_diff(got, plain) > 1e-3 and cosine.min() > 0.9  # int8's own rows: rounded, close
    result = json.loads(layout.result_manifest.read_text())
    assert result["options"]["precision"] == "int8" and result["options"]["backend"] == "openvino"
    agreement = result["agreement"]
    assert agreement["rows"] == 100 and agreement["chunks"] == 2
    assert cosine.min() - 1e-3 <= agreement["min_cosine"] <= agreement["mean_cosine"] < 1.0


@needs_openvino
@pytest.mark.slow
def test_a_cross_encoder_and_a_sparse_model_on_openvino_equal_pytorch(tmp_path: Path) -> None:
    """sentence-transformers offers OpenVINO for CrossEncoder and SparseEncoder too: a run of each
    kind with ``--backend openvino`` gives PyTorch's scores, and PyTorch's active dimensions and values,
    within 1e-5."""
    from sentence_transformers import CrossEncoder, SparseEncoder

    from tests.tiny_models import cross_encoder, splade_encoder

    reranker = cross_encoder(tmp_path / "reranker", labels=1, save_as_st=True)
    splade = splade_encoder(tmp_path / "splade")
    ids, texts = make_texts(40, seed=5)
    pairs = [(texts[i], texts[(i + 7) % len(texts)]) for i in range(len(texts))]
    rows = [{"id": i, "query": q, "passage": p} for i, (q, p) in zip(ids, pairs, strict=True)]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    corpus = write_corpus(tmp_path / "docs.jsonl", ids, texts, "jsonl")
    openvino = ("--backend", "openvino", "--chunk-size", "20")

    scored = run_cli(
        *("run", str(tmp_path / "pairs.jsonl"), "--store", str(tmp_path / "a"), "--model", str(reranker)),
        *("--text-field", "query", "--pair-field", "passage", *openvino),
    )
    assert scored.returncode == 0, scored.stderr[-3000:]
    got = np.load(only_run(tmp_path / "a").result / "embeddings.npy")
    assert "on cpu (openvino, fp32)" in (only_run(tmp_path / "a").root / "logs" / "run.log").read_text()
    want = CrossEncoder(str(reranker), device="cpu").predict(pairs)
    assert got.shape == (40, 1) and max_abs_diff(got[:, 0], want) <= 1e-5

    done = run_cli("run", str(corpus), "--store", str(tmp_path / "b"), "--model", str(splade), *openvino)
    assert done.returncode == 0, done.stderr[-3000:]
    result = {
        k: np.load(only_run(tmp_path / "b").result / f"{k}.npy") for k in ("offsets", "indices", "values")
    }
    wanted = SparseEncoder(str(splade), device="cpu").encode(texts, convert_to_sparse_tensor=True)
    wanted = wanted.coalesce().to_dense().numpy()
    dense = np.zeros_like(wanted)
    for i in range(len(texts)):
        span = slice(result["offsets"][i], result["offsets"][i + 1])
        dense[i, result["indices"][span]] = result["values"][span]
    assert np.array_equal(dense != 0, wanted != 0) and max_abs_diff(dense, wanted) <= 1e-5


@needs_openvino
@pytest.mark.slow
def test_two_workers_loading_at_once_export_the_model_once_and_read_the_same_export(tmp_path: Path) -> None:
    """Two processes load the bundled model on OpenVINO at the same moment on a host with no export:
    one exports it (under the lock), the other waits and reads that export; one folder, marked whole,
    nothing half-written left beside it, and the same vectors from both."""
    import os
    import subprocess
    import sys

    probe = (
        "import logging, sys\n"
        "import numpy as np\n"
        "logging.basicConfig(level=logging.INFO, stream=sys.stderr)\n"
        "from chunkq.jobs.compute import models\n"
        "from chunkq.jobs.compute.model_refs import BUNDLED_MODEL\n"
        "from chunkq.jobs.contract.specs import EncodeOptions\n"
        "loaded = models.get_model(BUNDLED_MODEL, 'cpu', 'fp32', EncodeOptions(backend='openvino'))\n"
        "np.save(sys.argv[1], loaded.model.encode(['one text', 'and another, longer text']))\n"
    )
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"), HF_HUB_OFFLINE="1")
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", probe, str(tmp_path / f"{i}.npy")],
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    said = [run.communicate(timeout=600)[1] for run in runs]
    assert [run.returncode for run in runs] == [0, 0], said
    assert "".join(said).count("exporting the model to OpenVINO, once for this host") == 1, said
    kept = tmp_path / "cache" / "chunkq" / "openvino"
    (folder,) = [p for p in kept.iterdir() if p.is_dir()]
    assert ov_backend.exported(folder) and not [p for p in kept.iterdir() if p.name.startswith(".")]
    assert np.array_equal(np.load(tmp_path / "0.npy"), np.load(tmp_path / "1.npy"))
    # `chunkq cache exports` lists it as current; --clean keeps it, --clean --all removes it.
    xdg = {"XDG_CACHE_HOME": env["XDG_CACHE_HOME"]}
    (listed,) = json.loads(run_cli("cache", "exports", "--json", **xdg).stdout)
    assert listed["export"] == folder.name and listed["state"] == "current", listed
    assert listed["made_with"] == ov_backend.releases() and listed["bytes"] > 1 << 20
    assert "all_minilm_l6_v2" in listed["model"] and listed["identity"].startswith("files:")
    assert run_cli("cache", "exports", "--clean", **xdg).stdout.startswith("removed 0 export(s)")
    assert run_cli("cache", "exports", "--clean", "--all", **xdg).stdout.startswith("removed 1 export(s)")
    assert list(kept.iterdir()) == []  # its lock file too


@needs_openvino
def test_the_fork_server_never_starts_openvino_so_no_forked_worker_inherits_it() -> None:
    """What the fork server imports before it forks (``fork_server.PRELOAD``: torch,
    sentence-transformers, the worker) imports nothing of OpenVINO or optimum-intel: each worker
    starts OpenVINO's runtime, and its threads, itself, as it loads an OpenVINO model."""
    import subprocess
    import sys

    from chunkq.queue_worker.processes.fork_server import PRELOAD

    probe = (
        "import importlib, sys\n"
        f"for name in {PRELOAD!r}: importlib.import_module(name)\n"
        "runtimes = ('openvino', 'optimum', 'nncf')\n"
        "print(sorted({m.split('.')[0] for m in sys.modules if m.startswith(runtimes)}))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]", done.stdout
