"""Issue 44.1 and 44.4, on the CPU: the seeds' host, where NVML cannot initialise (a driver updated
under a running system) while CUDA works. chunkq listed no GPU there and ran CPU workers; it now
asks CUDA (in a child process, so no context is ever created in the pool or supervisor) and uses
the GPUs it lists, with what only NVML tells marked unknown.

NVML fails for real here: a stand-in ``libnvidia-ml.so.1`` built at test time (tests/nvml_standin.py)
answers every call with NVML_ERROR_LIB_RM_VERSION_MISMATCH, and nvidia-ml-py raises its own
``NVMLError_LibRmVersionMismatch: RM has detected an NVML/RM version mismatch.``, as on that host.
This host has no CUDA driver, so CUDA's answer is a stand-in (``CHUNKQ_SIMULATED_CUDA``); the GPU
tier runs the same with the real driver (tests/gpu)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from chunkq.jobs.contract.errors import ConfigError
from chunkq.queue_worker.devices import cuda_devices, discovery, torch_build
from chunkq.queue_worker.devices.discovery import SIMULATED_ENV
from chunkq.queue_worker.devices.gpus import choose, worker_environment
from chunkq.queue_worker.exit_codes import EXIT_CONFIG
from tests.helpers import make_texts, run_cli, write_corpus
from tests.nvml_standin import MESSAGE, build, compiler

UUID = "GPU-5f1c3a2e-8d0b-4c6e-9a7f-0123456789ab"
H100 = {"index": 0, "uuid": UUID, "name": "NVIDIA H100 80GB HBM3", "memory_total": 85_520_809_984}


@pytest.fixture
def cuda_sees_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """CUDA's answer on the seeds' host: one H100 (the stand-in for the driver this host lacks)."""
    path = tmp_path / "cuda.json"
    path.write_text(json.dumps({"devices": [{**H100, "pci_bus_id": "00000000:19:00.0"}]}))
    monkeypatch.setenv(cuda_devices.SIMULATED_ENV, str(path))
    monkeypatch.setenv(torch_build.SIMULATED_ENV, "13.0")  # and a CUDA build of torch, as it has
    return {cuda_devices.SIMULATED_ENV: str(path), torch_build.SIMULATED_ENV: "13.0"}


@pytest.fixture
def nvml_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """NVML failing as the simulated library says it does on that host (in this process)."""
    path = tmp_path / "nvml.json"
    path.write_text(json.dumps({"gpus": [], "init_error": "LIB_RM_VERSION_MISMATCH"}))
    monkeypatch.setenv(SIMULATED_ENV, str(path))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return {SIMULATED_ENV: str(path)}


def test_the_gpus_cuda_lists_are_used_where_nvml_cannot_initialise(
    nvml_fails: dict[str, str], cuda_sees_one: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    found = discovery.survey()
    assert found.driver_broken and found.nvml_error_name == "LIB_RM_VERSION_MISMATCH"
    (gpu,) = found.gpus
    assert (gpu.index, gpu.uuid, gpu.name, gpu.source) == (0, UUID, H100["name"], discovery.FROM_CUDA)
    assert gpu.memory_free is None and gpu.processes == () and gpu.compute_mode == "unknown"
    assert choose("all", "0", "use") == [gpu] == choose("0", "0", "use")  # before: "GPU 0 does not exist"
    assert choose("all", "8GiB", "skip") == [gpu]  # free memory unknown: not a reason to skip it
    assert worker_environment({}, gpu, 4)["CUDA_VISIBLE_DEVICES"] == UUID  # pinned by CUDA's UUID
    assert choose("none", "0", "use") == []  # the CPU, asked for in so many words
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # this process may use no GPU: said by its parent
    assert choose("all", "0", "use") == []
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-ffff")
    with pytest.raises(ConfigError, match="CUDA_VISIBLE_DEVICES='GPU-ffff' leaves this process none of"):
        choose("all", "0", "use")


def test_a_broken_driver_with_no_gpu_from_cuda_never_falls_back_to_the_cpu(
    nvml_fails: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "none.json"
    path.write_text(json.dumps({"devices": [], "error": "cuInit: CUDA driver version is insufficient"}))
    monkeypatch.setenv(cuda_devices.SIMULATED_ENV, str(path))
    with pytest.raises(
        ConfigError, match=r"the NVIDIA driver is broken .* give --gpus none to run on the CPU"
    ):
        choose("all", "0", "use")
    assert choose("none", "0", "use") == []
    no_driver = tmp_path / "nodriver.json"
    no_driver.write_text(json.dumps({"gpus": [], "init_error": "LIBRARY_NOT_FOUND"}))
    monkeypatch.setenv(SIMULATED_ENV, str(no_driver))
    assert choose("all", "0", "use") == []  # a CPU host: CPU workers, as ever


def test_gpus_the_filters_leave_out_stop_the_pool_rather_than_run_it_on_the_cpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "nvml.json"
    path.write_text(json.dumps({"gpus": [{"memory_total": 80 << 30, "memory_free": 2 << 30}]}))
    monkeypatch.setenv(SIMULATED_ENV, str(path))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.raises(
        ConfigError, match=r"no GPU left to use \(GPU 0 .*2.0 GiB free, below --min-free-memory 8.0"
    ):
        choose("all", "8GiB", "use")


def test_cuda_is_asked_in_a_child_that_says_why_it_lists_none() -> None:
    """The real question, on this host without a CUDA driver: the child's own answer."""
    answer = cuda_devices.ask()
    assert answer.devices == [] and "libcuda.so.1" in str(answer.error)


@pytest.mark.slow
@pytest.mark.skipif(compiler() is None and not os.environ.get("CI"), reason="no C compiler here")
def test_doctor_and_run_under_a_real_failing_nvml(tmp_path: Path, cuda_sees_one: dict[str, str]) -> None:
    """nvidia-ml-py loads the stand-in library and raises the seeds' host's own error. `doctor`
    lists the GPU CUDA sees, names NVML's failure as a problem, what still works and what to do;
    before, it said "no NVIDIA GPU found ... workers will run on the CPU" and ok."""
    env = {"LD_LIBRARY_PATH": str(build(tmp_path / "nvml")), **cuda_sees_one}
    done = run_cli("doctor", "--json", "--store", str(tmp_path / "s"), **env)
    report = json.loads(done.stdout)
    assert done.returncode == 1 and not report["ok"], done.stderr
    assert report["nvml"] == {"available": False, "error": MESSAGE}
    (gpu,) = report["gpus"]
    assert gpu["uuid"] == UUID and gpu["source"] == "cuda" and gpu["memory_free"] is None
    problem = next(p for p in report["problems"] if p.startswith("NVML"))  # and: torch here is a CPU build
    assert problem.startswith(f"NVML cannot initialise ({MESSAGE}): 1 GPU(s) found through CUDA instead")
    assert "free memory, processes, compute mode and MIG are unknown" in problem and "reboot" in problem
    assert not any("no NVIDIA GPU found" in note for note in report["notes"])
    shown = run_cli("doctor", "--store", str(tmp_path / "s"), **env)
    assert f"GPU 0: NVIDIA H100 80GB HBM3 ({UUID}), 79.6 GiB, found through CUDA" in shown.stdout
    ids, texts = make_texts(4, seed=1)
    corpus = write_corpus(tmp_path / "c.jsonl", ids, texts, "jsonl")
    store = tmp_path / "store"
    broken = {**env, cuda_devices.SIMULATED_ENV: ""}  # CUDA asked for real: this host has no driver
    refused = run_cli("run", str(corpus), "--store", str(store), **broken)
    assert refused.returncode == EXIT_CONFIG, refused.stderr
    said = refused.stderr.strip().splitlines()[-1]
    assert said.startswith(f"chunkq: error: NVML cannot initialise ({MESSAGE}) and CUDA lists no GPU")
    assert "give --gpus none to run on the CPU instead" in said and not store.exists()
    on_cpu = run_cli("run", str(corpus), "--store", str(store), "--gpus", "none", **broken)
    assert on_cpu.returncode == 0, on_cpu.stderr[-2000:]
