"""What GPUs a process may use, on hosts as they really are (issue 31, items 7-9): an inherited
CUDA_VISIBLE_DEVICES (Slurm, the Kubernetes device plugin), MIG instances, GPUs NVML cannot read,
compute modes. NVML is simulated (``queue_worker/drills/simulated_nvml.py``): it fails with pynvml's own
exception classes, as the real library does."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import redis

from chunkq.jobs.contract.errors import ConfigError
from chunkq.jobs.contract.settings import PoolSettings
from chunkq.queue_worker import exit_codes
from chunkq.queue_worker.devices import discovery, torch_build
from chunkq.queue_worker.devices.discovery import SIMULATED_ENV, read_all, visible
from chunkq.queue_worker.devices.gpus import select, worker_environment
from chunkq.queue_worker.drills.simulated_nvml import SimulatedNvml
from chunkq.queue_worker.processes.pool import Pool
from tests.helpers import run_cli

GIB = 1 << 30
THREE = {"gpus": [{"uuid": f"GPU-{n}aaa-0000"} for n in range(3)]}


def _host(data: dict[str, Any]) -> list[discovery.GpuInfo]:
    return read_all(SimulatedNvml(data))


def test_an_inherited_visible_list_is_read_as_cuda_reads_it(caplog: pytest.LogCaptureFixture) -> None:
    host = _host(THREE)
    assert [g.index for g in visible(host, None)] == [0, 1, 2]
    assert [g.index for g in visible(host, "1")] == [1]
    assert [g.index for g in visible(host, "GPU-2aaa,0")] == [2, 0]  # a UUID prefix, in the given order
    assert visible(host, "") == []  # an empty list hides every GPU
    with caplog.at_level(logging.WARNING):
        assert [g.index for g in visible(host, "0,7,1")] == [0]  # CUDA stops at the first bad entry
    assert "'7' matches no GPU here" in caplog.text
    assert visible(host, "GPU-") == []  # ambiguous: no match


def test_gpus_all_means_this_processs_gpus_and_another_jobs_gpu_is_refused() -> None:
    host = _host(THREE)
    mine = visible(host, "1")
    assert select("all", host, mine) == [host[1]]
    assert select("1", host, mine) == [host[1]]
    with pytest.raises(ConfigError, match=r"GPU 0 is not one this process may use .*: GPU 1 \(NVIDIA H100"):
        select("0", host, mine)
    with pytest.raises(ConfigError, match="GPU 5 does not exist"):
        select("5", host, mine)


def test_gpus_nvml_cannot_read_are_skipped_with_a_line_and_indices_count_the_rest(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A cgroup that hides GPU 0 (Slurm's ConstrainDevices): NVML lists it but refuses to open it,
    and CUDA counts only the devices the process can open."""
    data = {"gpus": [{"error": "NO_PERMISSION"}, {}, {"error": "GPU_IS_LOST"}, {}]}
    with caplog.at_level(logging.WARNING):
        host = _host(data)
    assert [g.index for g in host] == [1, 3]
    assert "GPU 0: NVML cannot read it (Insufficient Permissions); skipped" in caplog.text
    assert "GPU 2: NVML cannot read it (GPU is lost); skipped" in caplog.text
    assert [g.index for g in visible(host, "0")] == [1]


def test_mig_instances_are_pinned_by_their_mig_uuid(caplog: pytest.LogCaptureFixture) -> None:
    data = {
        "gpus": [
            {
                "uuid": "GPU-parent-0",
                "name": "NVIDIA A100-SXM4-80GB",
                "mig": [{"memory_total": 20 * GIB}] * 2,
            },
            {"uuid": "GPU-plain-1"},
            {"uuid": "GPU-empty-2", "mig": []},
        ]
    }
    with caplog.at_level(logging.WARNING):
        host = _host(data)
    assert [(g.label, g.uuid) for g in host] == [
        ("GPU 0 MIG 0", "MIG-parent-0-mig0"),
        ("GPU 0 MIG 1", "MIG-parent-0-mig1"),
        ("GPU 1", "GPU-plain-1"),
    ]
    assert "GPU 2 (NVIDIA H100 80GB HBM3): MIG is on but it has no MIG instance; skipped" in caplog.text
    env = worker_environment({}, host[1], 1)
    assert env["CUDA_VISIBLE_DEVICES"] == "MIG-parent-0-mig1" and env["CHUNKQ_GPU"] == "0-mig1"
    assert visible(host, "MIG-parent-0-mig1") == [host[1]]
    assert visible(host, "GPU-parent-0") == []  # CUDA does not take a MIG GPU's own UUID
    assert select("0", host) == host[:2]


def test_compute_modes(caplog: pytest.LogCaptureFixture, redis_url: str) -> None:
    data = {"gpus": [{"compute_mode": 2}, {"compute_mode": 3}, {"compute_mode": 0}]}
    with caplog.at_level(logging.WARNING):
        host = _host(data)
    assert (
        "GPU 0 (NVIDIA H100 80GB HBM3): compute mode PROHIBITED, no process may use it; skipped"
        in caplog.text
    )
    assert [(g.index, g.exclusive) for g in host] == [(1, True), (2, False)]
    settings = PoolSettings(redis_url=redis_url, workers_per_gpu="2", name="modes")
    pool = Pool(settings, host)
    assert [slot.key for slot in pool.slots] == ["gpu1-w0", "gpu2-w0", "gpu2-w1"]  # one process on GPU 1


def test_nvml_that_cannot_start_means_no_gpu() -> None:
    assert _host({"gpus": [{}], "init_error": "DRIVER_NOT_LOADED"}) == []


@pytest.fixture
def three_gpus(tmp_path: Path) -> dict[str, str]:
    path = tmp_path / "gpus.json"
    path.write_text(json.dumps(THREE))
    # Their torch a CUDA build, as on a GPU host: the pool goes as far as pinning a worker.
    return {SIMULATED_ENV: str(path), "CUDA_VISIBLE_DEVICES": "1", torch_build.SIMULATED_ENV: "13.0"}


@pytest.mark.slow  # loads or runs the model in a subprocess or several times: the slow tier
def test_doctor_under_an_inherited_visible_list_shows_that_gpu_alone(
    three_gpus: dict[str, str], tmp_path: Path
) -> None:
    done = run_cli("doctor", "--json", "--store", str(tmp_path / "s"), **three_gpus)
    report = json.loads(done.stdout)
    assert [gpu["label"] for gpu in report["gpus"]] == ["GPU 1"]
    assert any(
        "CUDA_VISIBLE_DEVICES=1: this process may use GPU 1; --gpus all means these" in n
        for n in report["notes"]
    )
    plain = run_cli("doctor", "--store", str(tmp_path / "s"), **three_gpus, PYTORCH_NO_NVML="1")
    assert "GPU 1: NVIDIA H100 80GB HBM3 (GPU-1aaa-0000)" in plain.stdout and "GPU 0:" not in plain.stdout
    assert "PYTORCH_NO_NVML is set: no PyTorch code reads it" in plain.stdout


@pytest.mark.slow
def test_pool_gpus_all_under_an_inherited_visible_list_uses_that_gpu_alone(
    three_gpus: dict[str, str], redis_url: str
) -> None:
    refused = run_cli("pool", "--gpus", "0", "--queue", "sim", CHUNKQ_REDIS_URL=redis_url, **three_gpus)
    assert refused.returncode == exit_codes.EXIT_CONFIG
    assert "GPU 0 is not one this process may use (CUDA_VISIBLE_DEVICES='1' gives it: GPU 1" in refused.stderr
    args = ("pool", "--gpus", "all", "--queue", "sim", "--workers-per-gpu", "1")
    done = run_cli(*args, CHUNKQ_REDIS_URL=redis_url, timeout=180, **three_gpus)
    # The worker pinned to GPU 1 finds no CUDA in this CPU build and refuses to run on the CPU;
    # with no device left the pool gives up: what matters is which GPU it was given.
    assert done.returncode == exit_codes.EXIT_CONFIG, done.stderr[-3000:]
    assert "on GPU 1 (NVIDIA H100 80GB HBM3)" in done.stderr
    assert "GPU 0 (" not in done.stderr and "GPU 2 (" not in done.stderr
    assert "CUDA_VISIBLE_DEVICES='GPU-1aaa-0000'" in done.stderr
    assert redis.Redis.from_url(redis_url).ping()


@pytest.mark.slow  # loads or runs the model in a subprocess or several times: the slow tier
def test_doctor_says_which_gpu_takes_one_process(tmp_path: Path) -> None:
    path = tmp_path / "gpus.json"
    path.write_text(json.dumps({"gpus": [{"compute_mode": 3}, {"error": "GPU_IS_LOST"}]}))
    done = run_cli("doctor", "--json", "--store", str(tmp_path / "s"), **{SIMULATED_ENV: str(path)})
    report = json.loads(done.stdout)
    assert [gpu["label"] for gpu in report["gpus"]] == ["GPU 0"] and report["gpus"][0]["exclusive"]
    assert "GPU 0 is in EXCLUSIVE_PROCESS compute mode: one worker, no standby" in report["notes"]
    assert "GPU 1: NVML cannot read it (GPU is lost); skipped" in done.stderr


def test_the_parent_death_signal_loads_no_library_in_the_child(monkeypatch: pytest.MonkeyPatch) -> None:
    """preexec_fn runs between fork and exec, where loading a library could deadlock on the loader's
    lock held by another thread at the fork: libc is loaded once, at import."""
    import ctypes

    from chunkq.queue_worker.processes import lifeline

    def no_loading(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a library was loaded in the child")

    monkeypatch.setattr(ctypes, "CDLL", no_loading)
    lifeline.die_with_parent()  # uses the libc loaded at import
