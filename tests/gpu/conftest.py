"""The GPU tier: real faults on a real GPU through chunkq's own commands (``make test-gpu``: the
host's own python and torch, ``python3 -m pytest -m gpu tests/gpu``).

Skipped where torch sees no CUDA device. On a GPU host without the bundled model's package, point
``CHUNKQ_GPU_TEST_MODEL`` at a local copy of all-MiniLM-L6-v2 (any SentenceTransformer folder).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from tests.tiny_models import GPU_TEST_MODEL_ENV as MODEL_ENV


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device: the gpu tier runs on a GPU host (make test-gpu)")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def gpu() -> Any:
    """The GPU the tier runs on: the first this process may use, as chunkq numbers it (NVML's index,
    what ``--gpus`` takes), honouring an inherited CUDA_VISIBLE_DEVICES."""
    from chunkq.queue_worker.devices.discovery import discover

    found = discover()
    if not found:
        pytest.fail("torch sees CUDA but NVML lists no GPU this process may use")
    return found[0]


@pytest.fixture(scope="session")
def cuda_device(gpu: Any) -> str:
    """The same GPU as torch numbers it in this process, found by UUID: CUDA's device 0 is another
    GPU wherever CUDA_VISIBLE_DEVICES or CUDA_DEVICE_ORDER reorders them."""
    for i in range(torch.cuda.device_count()):
        uuid = str(getattr(torch.cuda.get_device_properties(i), "uuid", ""))
        if gpu.uuid in (uuid, f"GPU-{uuid}", f"MIG-{uuid}"):
            return f"cuda:{i}"
    pytest.fail(f"torch lists no device with {gpu.label}'s UUID {gpu.uuid}")


@pytest.fixture(scope="session")
def gpu_model() -> str:
    """A model reference chunkq and a plain SentenceTransformer can both load on this host."""
    from chunkq.jobs.compute.model_refs import BUNDLED_MODEL, bundled_model_available

    path = os.environ.get(MODEL_ENV)
    if path:
        return path
    if not bundled_model_available():
        pytest.fail(f"neither the bundled model nor {MODEL_ENV} is available on this GPU host")
    return BUNDLED_MODEL
