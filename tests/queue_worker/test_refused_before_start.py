"""Issue 43.9: options that made every attempt fail (and the run end quarantined, or say only "the
worker pool exited") are refused before anything starts, in one line, with nothing created."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from chunkq.jobs.compute.model_info import describe
from chunkq.jobs.compute.model_refs import BUNDLED_MODEL
from chunkq.jobs.contract.errors import ConfigError
from chunkq.queue_worker.exit_codes import EXIT_CONFIG
from chunkq.supervisor.request import build_run_request
from tests.helpers import make_texts, run_cli, write_corpus


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    ids, texts = make_texts(5, seed=2)
    return write_corpus(tmp_path / "c.jsonl", ids, texts, "jsonl")


def test_a_sequence_longer_than_the_models_positions_is_refused(tmp_path: Path, corpus: Path) -> None:
    """600 on a 512-position model: accepted before, every attempt failed and the chunk was
    quarantined. 512 itself is what the model takes."""
    assert describe(BUNDLED_MODEL).positions == 512
    with pytest.raises(ConfigError, match=r"--max-seq-length 600 is above model .* 512 positions"):
        build_run_request([corpus], store=tmp_path / "s", max_seq_length=600)
    build_run_request([corpus], store=tmp_path / "s", max_seq_length=512)
    assert not (tmp_path / "s").exists()


def test_half_precision_on_a_run_without_a_gpu_is_refused(tmp_path: Path, corpus: Path) -> None:
    """Before: the pool's CPU workers each refused the chunks, and the run said only "the worker
    pool exited" (exit 8), the reason in run.log."""
    with pytest.raises(ConfigError, match="--precision fp16 needs a GPU, and these workers run on the cpu"):
        build_run_request([corpus], store=tmp_path / "s", precision="fp16", gpus="none")


def test_an_unknown_keyword_of_the_api_names_the_one_meant(tmp_path: Path, corpus: Path) -> None:
    """The CLI says "Did you mean --chunk-size?"; chunkq.run(chunksize=250) said only its name."""
    with pytest.raises(
        ConfigError, match=r"^unknown option\(s\): chunksize \(did you mean chunk_size\?\), zzz$"
    ):
        build_run_request([corpus], store=tmp_path / "s", chunksize=250, zzz=1)


def test_a_folder_that_holds_no_model_is_refused(tmp_path: Path, corpus: Path) -> None:
    """A project folder given as --model: each worker's load failed in turn ("Unrecognized model")
    and the run ended "no device left to run workers on"."""
    folder = tmp_path / "project"
    (folder / "src").mkdir(parents=True)
    (folder / "README.md").write_text("not a model")
    with pytest.raises(ConfigError, match=r"the folder .*project holds no model \(neither modules.json"):
        build_run_request([corpus], store=tmp_path / "s", model=str(folder))
    assert not (tmp_path / "s").exists()


def test_a_model_given_as_a_file_is_said_to_be_one(tmp_path: Path) -> None:
    """A hostile pass: a file given as --model was "neither a local folder nor in the Hugging Face
    cache", with advice to download it."""
    from chunkq.jobs.compute.model_refs import check_model

    (tmp_path / "model.safetensors").write_bytes(b"x")
    with pytest.raises(
        ConfigError, match=r"model '.*model.safetensors' is a file; give the folder the model"
    ):
        check_model(str(tmp_path / "model.safetensors"))


def test_a_model_without_its_tokenizers_vocabulary_is_refused(tmp_path: Path, corpus: Path) -> None:
    """A hostile pass: the bundled model without its tokenizer files loaded a tokenizer of five
    special tokens, read every word as [UNK] and published 500 nearly equal vectors, exit 0."""
    from tests.tiny_models import bundled_copy

    model = bundled_copy(tmp_path / "model")
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        (model / name).unlink()
    with pytest.raises(
        ConfigError, match=r"model .*model holds no tokenizer vocabulary \(none of tokenizer.json"
    ):
        build_run_request([corpus], store=tmp_path / "s", model=str(model))
    (model / "vocab.txt").write_text("[PAD]\n[UNK]\n")  # a vocabulary file: what it holds, the load tells
    build_run_request([corpus], store=tmp_path / "s", model=str(model))
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("option", ["window_tokens", "window_stride"])
def test_window_sizes_without_windows_are_refused(tmp_path: Path, corpus: Path, option: str) -> None:
    """Silently ignored before (as --pool was not: it was refused)."""
    flag = "--" + option.replace("_", "-")
    with pytest.raises(ConfigError, match=f"{flag} is for --long-texts window or late"):
        build_run_request([corpus], store=tmp_path / "s", **{option: 64})
    build_run_request([corpus], store=tmp_path / "s", long_texts="window", **{option: 64})


@pytest.mark.slow
def test_the_command_line_says_each_in_one_line_and_creates_nothing(tmp_path: Path, corpus: Path) -> None:
    store = tmp_path / "store"
    for args, said in (
        (["--max-seq-length", "600"], "--max-seq-length 600 is above model"),
        (["--precision", "fp16", "--gpus", "none"], "--precision fp16 needs a GPU"),
        (["--window-tokens", "64"], "--window-tokens is for --long-texts window or late"),
    ):
        refused = run_cli("run", str(corpus), "--store", str(store), *args)
        assert refused.returncode == EXIT_CONFIG, refused.stderr
        assert refused.stderr.count("\n") == 1 and said in refused.stderr, refused.stderr
        assert not store.exists()


def _gpu_host(tmp_path: Path) -> dict[str, str]:
    """A host whose driver lists one H100 (simulated NVML), under this CPU build of torch."""
    import json

    from chunkq.queue_worker.devices.discovery import SIMULATED_ENV

    path = tmp_path / "gpus.json"
    path.write_text(json.dumps({"gpus": [{"name": "NVIDIA H100 80GB HBM3"}]}))
    return {SIMULATED_ENV: str(path)}


def test_a_cpu_build_of_torch_on_a_gpu_host_is_refused_before_the_run(tmp_path: Path, corpus: Path) -> None:
    """51.11: every worker refused its GPU in turn and the terminal said only "the worker pool exited
    before the run finished" (exit 8)."""
    from chunkq.queue_worker.devices import torch_build

    installed = torch_build.build()
    assert installed is not None and installed["cuda"] is None and installed["__version__"].endswith("+cpu")
    store = tmp_path / "store"
    done = run_cli("run", str(corpus), "--store", str(store), forks=False, **_gpu_host(tmp_path))
    assert done.returncode == EXIT_CONFIG, done.stderr
    (said,) = [line for line in done.stderr.splitlines() if line.startswith("chunkq:")]
    assert said == (
        "chunkq: error: this host's driver lists 1 GPU(s) (GPU 0: NVIDIA H100 80GB HBM3), and the installed "
        f"torch {installed['__version__']} is built without CUDA: no worker could use them. Install a CUDA "
        "build of torch (pip install torch, without +cpu), or give --gpus none to run on the CPU"
    )
    assert not store.exists()


@pytest.mark.slow
def test_a_pool_that_gives_up_says_its_workers_reason_on_the_terminal(tmp_path: Path, corpus: Path) -> None:
    """51.11: what cannot be checked before the run (here a torch said to be a CUDA build that finds no
    device) is said in the command's last line, in the worker's words, not only in run.log."""
    from chunkq.queue_worker.devices import torch_build

    env = {**_gpu_host(tmp_path), torch_build.SIMULATED_ENV: "13.0"}
    done = run_cli("run", str(corpus), "--store", str(tmp_path / "store"), **env)
    assert done.returncode == 8, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("chunkq: error: the worker pool exited before the run finished: worker pool-")
    assert "was given GPU 0 but torch sees no CUDA device" in last and "refusing to run on the CPU" in last
    # Nothing was encoded: the run (its log with it) is not kept, and the line says so.
    assert last.endswith(
        "nothing was encoded, so the run is not kept: mend the cause and run the same command"
    )


@pytest.mark.slow
def test_a_model_its_workers_cannot_load_is_named_in_the_last_line_and_not_kept(
    tmp_path: Path, corpus: Path, redis_url: str, connection: Any
) -> None:
    """A config.json transformers cannot read passes every check submit can make; its workers each
    failed to load it, with a traceback only, and the run's last line said "no device left to run
    workers on". Now each says why in one line, which the last line repeats; and the run, in which
    nothing was done, is not kept: kept, it held the broken model's identity and refused the same
    command once the model was mended (a hostile pass)."""
    from tests.tiny_models import bundled_copy

    model = bundled_copy(tmp_path / "model")
    config = (model / "config.json").read_text()
    (model / "config.json").write_text("{not json")
    store = tmp_path / "store"
    common = ["--store", str(store), "--model", str(model), "--redis-url", redis_url]
    done = run_cli("run", str(corpus), *common)
    assert done.returncode == 8, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert f"could not load model {model}: OSError: It looks like the config file at" in last, last
    assert last.endswith(
        "nothing was encoded, so the run is not kept: mend the cause and run the same command"
    )
    assert not any((store / "runs").iterdir())
    left = [key for key in connection.keys("*") if b"c-" in key or b"chunkq:run-queues" in key]
    assert left == [] and connection.smembers("rq:queues") <= {b"rq:queue:chunkq"}, left  # its queue too
    (model / "config.json").write_text(config)
    again = run_cli("run", str(corpus), *common)
    assert again.returncode == 0, again.stderr[-3000:]
