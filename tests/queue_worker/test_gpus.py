"""GPU selection and pinning, through injected device lists (no GPU here)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from chunkq.jobs.contract.errors import ConfigError
from chunkq.queue_worker.devices.discovery import GpuInfo, discover
from chunkq.queue_worker.devices.gpus import select, worker_environment

GPUS = [GpuInfo(0, "H100", "GPU-aaa", 80 << 30, 70 << 30), GpuInfo(1, "H100", "GPU-bbb", 80 << 30, 79 << 30)]


def test_select_all_none_and_lists() -> None:
    assert select("all", GPUS) == GPUS
    assert select("none", GPUS) == []
    assert select("1", GPUS) == [GPUS[1]]
    assert select("all", []) == []  # no GPU: CPU workers


def test_missing_gpu_is_refused_listing_those_present() -> None:
    with pytest.raises(ConfigError, match=r"GPU 2 does not exist; GPUs present: 0 \(H100\), 1 \(H100\)"):
        select("0,2", GPUS)
    with pytest.raises(ConfigError, match="GPUs present: none"):
        select("0", [])
    with pytest.raises(ConfigError, match="not a GPU index"):
        select("first", GPUS)


def test_worker_environment_pins_one_gpu_before_torch() -> None:
    env = worker_environment({"PATH": "/bin"}, GPUS[1], cpu_threads=4)
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-bbb" and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert env["CHUNKQ_DEVICE"] == "cuda" and env["CHUNKQ_GPU"] == "1"
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert env["OMP_NUM_THREADS"] == "4"
    # its chunk tokenised on its share of the cores, and no more
    assert env["TOKENIZERS_PARALLELISM"] == "true" and env["RAYON_NUM_THREADS"] == "4"
    user = worker_environment({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}, GPUS[0], 1)
    assert user["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:128"
    cpu = worker_environment({"CHUNKQ_GPU": "0"}, None, 2)
    assert cpu["CUDA_VISIBLE_DEVICES"] == "" and cpu["CHUNKQ_DEVICE"] == "cpu" and "CHUNKQ_GPU" not in cpu


def test_discover_without_a_driver_finds_nothing() -> None:
    assert discover() == []  # this machine has no NVIDIA driver; NVML fails and we say "no GPUs"


def test_standby_waits_for_its_predecessor_to_exit(monkeypatch: pytest.MonkeyPatch) -> None:
    import subprocess
    import sys

    from chunkq.queue_worker.processes.standby import WAIT_FOR_PID_ENV, wait_for_predecessor

    old = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    monkeypatch.setenv(WAIT_FOR_PID_ENV, str(old.pid))
    try:
        wait_for_predecessor()
        # pidfd readiness means the process has terminated (a zombie until we reap it): had the wait
        # returned at once, the sleeper would still be running here.
        assert old.poll() == 0
    finally:
        old.kill()
    monkeypatch.setenv(WAIT_FOR_PID_ENV, "999999999")
    wait_for_predecessor()  # a predecessor that is already gone: returns at once


def test_busy_and_short_gpus_are_reported_and_skipped_as_configured(caplog: pytest.LogCaptureFixture) -> None:
    from chunkq.jobs.contract.units import parse_size
    from chunkq.queue_worker.devices.discovery import GpuProcess
    from chunkq.queue_worker.devices.gpus import usable

    busy = GpuInfo(2, "A100", "GPU-ccc", 40 << 30, 30 << 30, (GpuProcess(4242, "python", 10 << 30),))
    gpus = [*GPUS, busy]
    assert usable(gpus, parse_size("75GiB"), skip_busy=False) == [GPUS[1]]
    assert "GPU 0 (H100): 70.0 GiB free, below --min-free-memory 75.0 GiB; skipped" in caplog.text
    assert usable(gpus, 0, skip_busy=True) == GPUS
    assert "GPU 2 (A100) is busy with: python (pid 4242); skipped" in caplog.text
    assert usable(gpus, 0, skip_busy=False) == gpus
    assert parse_size("512MiB") == 512 << 20 and parse_size("1.5g") == 3 << 29 and parse_size("0") == 0
    with pytest.raises(ConfigError, match="cannot read the size"):
        parse_size("lots")
    assert "PYTORCH_NO_NVML" not in worker_environment({}, GPUS[0], 1)  # read by no PyTorch code


@pytest.mark.slow
def test_doctor_on_a_machine_without_gpus(tmp_path: Path, redis_url: str) -> None:
    from tests.helpers import run_cli

    ok = run_cli("doctor", "--json", "--store", str(tmp_path / "s"), "--redis-url", redis_url)
    report = json.loads(ok.stdout)
    assert ok.returncode == 0 and report["ok"] and report["gpus"] == []
    assert report["redis"]["reachable"] and report["store"]["writable"]
    assert any("no NVIDIA GPU found" in note and "CPU" in note for note in report["notes"])
    bad = run_cli("doctor", "--store", str(tmp_path / "s"), "--redis-url", "redis://127.0.0.1:1/0")
    assert bad.returncode == 1 and "PROBLEM: Redis:" in bad.stdout and "check --redis-url" in bad.stdout
    (tmp_path / "ro").mkdir()
    (tmp_path / "ro" / "s").write_text("a file, not a directory")
    unwritable = run_cli("doctor", "--store", str(tmp_path / "ro" / "s"))
    assert unwritable.returncode == 1 and "is not writable" in unwritable.stdout


def test_workers_per_gpu_auto_resolves_to_a_number_and_says_why(caplog: pytest.LogCaptureFixture) -> None:
    from chunkq.jobs.compute.model_refs import BUNDLED_MODEL, resolve_model
    from chunkq.queue_worker.devices.gpus import (
        AUTO_MAX_WORKERS,
        auto_workers_per_gpu,
        model_bytes,
        resolve_workers_per_gpu,
    )

    gib = 1 << 30
    h100 = GpuInfo(
        index=0, name="NVIDIA H100 80GB HBM3", uuid="GPU-1", memory_total=80 * gib, memory_free=79 * gib
    )
    minilm = model_bytes(resolve_model(BUNDLED_MODEL), "fp32")
    assert minilm is not None and 50 << 20 < minilm < 200 << 20  # about 90 MB of safetensors
    assert model_bytes(resolve_model(BUNDLED_MODEL), "fp16") == minilm // 2
    assert auto_workers_per_gpu([h100], 16, minilm)[0] == AUTO_MAX_WORKERS  # cores and memory to spare
    assert auto_workers_per_gpu([h100, h100], 8, minilm)[0] == 2  # 4 cores per GPU feed two
    assert auto_workers_per_gpu([h100], 2, minilm)[0] == 1
    small = GpuInfo(index=0, name="T4", uuid="GPU-2", memory_total=16 * gib, memory_free=12 * gib)
    workers, why = auto_workers_per_gpu([small], 32, 670_000_000, standby=False)  # bge-large in fp16
    assert workers == 3 and "12.0 GiB free" in why and "holds 3" in why
    # Each worker's standby loads beside it (weights and a context): room for two, not three.
    workers, why = auto_workers_per_gpu([small], 32, 670_000_000)
    assert workers == 2 and "holds 2" in why and "a standby's 1.1 GiB" in why
    # --gpu-memory-limit 1GiB: each worker's PyTorch holds at most 1 GiB, so more fit (to the cap of 4)...
    workers, why = auto_workers_per_gpu([small], 32, 670_000_000, standby=False, memory_limit=gib)
    assert workers == AUTO_MAX_WORKERS and "holds 7 (1.0 GiB as --gpu-memory-limit holds PyTorch to" in why
    # ... but never fewer bytes than its weights, whatever the limit says.
    workers, why = auto_workers_per_gpu([small], 32, 4 * gib, standby=False, memory_limit=gib)
    assert workers == 2 and "holds 2 (4.0 GiB as --gpu-memory-limit" in why
    exclusive = GpuInfo(0, "A100", "GPU-3", 80 * gib, 79 * gib, compute_mode="exclusive_process")
    assert auto_workers_per_gpu([exclusive], 32, minilm) == (
        1,
        "a GPU in EXCLUSIVE_PROCESS compute mode takes one process",
    )
    assert auto_workers_per_gpu([], 16, minilm)[0] == 1
    expected, _ = auto_workers_per_gpu([h100], os.cpu_count() or 1, minilm)
    with caplog.at_level(logging.INFO, logger="chunkq.queue_worker.devices.gpus"):
        assert resolve_workers_per_gpu("auto", [h100], BUNDLED_MODEL, "fp32") == expected
        assert resolve_workers_per_gpu("2", [h100], BUNDLED_MODEL, "fp32") == 2
    assert f"workers per GPU: auto means {expected} ({os.cpu_count()} CPU cores for 1 GPU(s)" in caplog.text
    assert caplog.text.count("auto means") == 1  # a number given is used as it is


def test_cpu_workers_default_to_one_single_threaded_worker_per_core_as_memory_holds(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue 64.4: with no GPU the default was one worker of every core's threads."""
    from chunkq.jobs.compute.model_refs import BUNDLED_MODEL
    from chunkq.queue_worker.devices.gpus import CPU_WORKER_BYTES, auto_cpu_workers, resolve_cpu_workers

    gib = 1 << 30
    assert auto_cpu_workers(2, 90 << 20, 20 * gib)[0] == 2
    assert auto_cpu_workers(16, 90 << 20, 20 * gib)[0] == 16
    workers, why = auto_cpu_workers(16, 2 * gib, 8 * gib)  # 2.5 GiB each: 80 % of 8 GiB holds 2
    assert workers == 2 and "holds 2" in why and "one per core (16)" in why
    assert auto_cpu_workers(4, None, CPU_WORKER_BYTES)[0] == 1  # never none
    with caplog.at_level(logging.INFO, logger="chunkq.queue_worker.devices.gpus"):
        assert resolve_cpu_workers(3, BUNDLED_MODEL) == 3  # given: as it is, said nowhere
        found = resolve_cpu_workers(None, BUNDLED_MODEL)
    assert found == min(os.cpu_count() or 1, found) >= 1
    assert caplog.text.count("CPU workers: ") == 1 and "one thread each" in caplog.text


def test_cpu_workers_follow_the_cores_this_process_may_use_not_the_hosts() -> None:
    """Issue 65.7: a pool given 1 CPU of a bigger node (Slurm's task plugin, taskset, a cpuset)
    counted the node's cores: one worker per core it cannot run on."""
    if shutil.which("taskset") is None or (os.cpu_count() or 1) < 2:
        pytest.skip("needs taskset and two cores")
    code = (
        "from chunkq.jobs.compute.model_refs import BUNDLED_MODEL\n"
        "from chunkq.queue_worker.devices.gpus import cpu_threads_per_worker, resolve_cpu_workers\n"
        "from chunkq.queue_worker.devices.gpus import usable_cores\n"
        "print(usable_cores(), resolve_cpu_workers(None, BUNDLED_MODEL), cpu_threads_per_worker(1))"
    )
    cmd = ["taskset", "-c", "0", sys.executable, "-c", code]
    pinned = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True)
    assert pinned.stdout.split() == ["1", "1", "1"], pinned.stderr[-2000:]


def test_auto_sizes_the_model_from_the_weights_that_load(tmp_path: Path) -> None:
    """An OpenVINO or ONNX export, or a .bin beside the .safetensors, is not loaded: not counted."""
    from chunkq.queue_worker.devices.gpus import model_bytes

    model = tmp_path / "model"
    for name, size in {
        "model.safetensors": 1000,
        "pytorch_model.bin": 1000,  # the same weights in the older format: not loaded
        "openvino/openvino_model.bin": 500,
        "onnx/model.onnx": 700,
        "onnx/model.onnx_data.bin": 700,
        "2_Dense/pytorch_model.bin": 40,  # a module with only .bin weights: loaded
        "config.json": 10,
    }.items():
        (model / name).parent.mkdir(parents=True, exist_ok=True)
        (model / name).write_bytes(b"x" * size)
    assert model_bytes(str(model), "fp32") == 1040
    assert model_bytes(str(model), "fp16") == 520


def test_a_gpu_memory_limit_is_checked_where_given_and_reaches_each_worker() -> None:
    """--gpu-memory-limit: a size, handed to every worker, which caps PyTorch's allocator on its GPU
    (the cap itself runs in the GPU tier: tests/gpu/test_gpu_faults.py's capped real OOM)."""
    from chunkq.jobs.compute import cuda
    from chunkq.jobs.contract.settings import PoolSettings
    from chunkq.queue_worker.worker_args import worker_argv
    from tests.helpers import run_cli

    argv = worker_argv(PoolSettings(gpu_memory_limit="2GiB"))
    assert argv[argv.index("--gpu-memory-limit") + 1] == "2GiB"
    refusals = (
        ("lots", "cannot read the size 'lots'"),
        ("-1GiB", "'-1GiB' is below zero"),
        ("inf", "'inf': not a finite number"),
        ("nanG", "'nanG': not a finite number"),
    )
    for option in ("--gpu-memory-limit", "--min-free-memory"):
        for bad, said in refusals:
            refused = run_cli("pool", "--redis-url", "redis://127.0.0.1:1/0", option, bad, forks=False)
            assert refused.returncode == 2 and f"Invalid value for '{option}'" in refused.stderr
            assert said in refused.stderr, refused.stderr
    # Nothing to cap on the CPU, or with no limit: torch.cuda is not touched (this torch has none).
    assert cuda.limit_memory("cpu", 2 << 30) is None and cuda.limit_memory("cuda:0", 0) is None


def test_the_devices_chunkq_run_chose_reach_its_pool_whole() -> None:
    """Issue 54.2: `chunkq run` surveys the GPUs once and hands its choice to its pool."""
    from chunkq.queue_worker.devices.discovery import GpuProcess, devices_from_json, devices_json

    busy = GpuInfo(2, "H100", "MIG-ccc", 40 << 30, None, (GpuProcess(7, "python", 1 << 30),), mig=1)
    chosen = [*GPUS, busy]
    assert devices_from_json(devices_json(chosen)) == chosen
    assert devices_from_json(devices_json([])) == []
