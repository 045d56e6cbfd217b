"""The GPU tier: real faults on a real GPU through chunkq's own commands (``make test-gpu``).

Skipped where torch sees no CUDA device. On a GPU host without the bundled model's package, point
``CHUNKQ_GPU_TEST_MODEL`` at a local copy of all-MiniLM-L6-v2 (any SentenceTransformer folder).
"""

from __future__ import annotations

import os

import pytest
import torch

MODEL_ENV = "CHUNKQ_GPU_TEST_MODEL"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device: the gpu tier runs on a GPU host (make test-gpu)")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def gpu_model() -> str:
    """A model reference chunkq and a plain SentenceTransformer can both load on this host."""
    from chunkq.jobs.models import BUNDLED_MODEL, bundled_model_available

    path = os.environ.get(MODEL_ENV)
    if path:
        return path
    if not bundled_model_available():
        pytest.fail(f"neither the bundled model nor {MODEL_ENV} is available on this GPU host")
    return BUNDLED_MODEL
