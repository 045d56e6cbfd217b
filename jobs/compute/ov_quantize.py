"""An int8 model for ``--backend openvino --precision int8``, made offline from the model and texts
of the user's own (``chunkq quantize``): NNCF's post-training static quantization of the model's
OpenVINO export, calibrated on those texts, saved as sentence-transformers names a quantized
OpenVINO model (``openvino/openvino_model_qint8_quantized.xml``) in a copy of the model's folder.

int8 is a model, not a setting: it rounds every matrix product (all-MiniLM-L6-v2 here: min cosine
with fp32 0.99 in the issue's measurement) and it depends on the texts it was calibrated on, so a
run gets it only by naming both (``--precision int8`` and a folder holding such a file), and the
run's identity and vector-cache key cover the file as part of the model's bytes. The copy keeps
the PyTorch weights: a run measures its agreement with them (``agreement.py``).
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

from chunkq.jobs.contract.errors import ConfigError

log = logging.getLogger(__name__)

QUANTIZED_FILE = "openvino/openvino_model_qint8_quantized.xml"  # sentence-transformers' name for one
CALIBRATION_TEXTS = 300  # NNCF's default subset size


def quantized(folder: str | Path) -> bool:
    """Whether the model folder holds an int8 OpenVINO model under the name a run looks for."""
    return (Path(folder) / QUANTIZED_FILE).is_file()


def missing_quantized(folder: str | None, model: str) -> str | None:
    """Why ``--precision int8`` cannot run ``model`` (in ``folder``), in one line; None when it can."""
    if folder is not None and quantized(folder):
        return None
    return (
        f"--precision int8 runs an int8 OpenVINO model, and model {model} holds none "
        f"({QUANTIZED_FILE}): make one from your own texts with "
        f"'chunkq quantize {model} CORPUS --out FOLDER', then give --model FOLDER"
    )


def quantize(source: str, texts: list[str], out: Path) -> Path:
    """Copy the model folder ``source`` to ``out`` and add its int8 OpenVINO model, calibrated on
    ``texts``. Written beside and renamed into place: ``out`` is whole or absent."""
    import nncf
    import openvino
    from sentence_transformers import SentenceTransformer

    if out.exists():
        raise ConfigError(f"{out} exists: give --out a folder that does not")
    if not texts:
        raise ConfigError("no texts to calibrate on")
    tmp = out.with_name(f".{out.name}.{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(source, tmp, ignore=shutil.ignore_patterns("openvino", ".git"))
    try:
        model = SentenceTransformer(str(tmp), device="cpu", backend="openvino")
        graph: Any = model[0].auto_model.model  # type: ignore[union-attr]
        names = {port.get_any_name() for port in graph.inputs}
        limit = model.max_seq_length

        def feed(text: str) -> dict[str, Any]:
            encoded = model.tokenizer(text, truncation=True, max_length=limit, return_tensors="np")
            return {k: v for k, v in encoded.items() if k in names}

        log.info("quantizing %s to int8 on %d texts", source, len(texts))
        int8 = nncf.quantize(
            graph,
            nncf.Dataset([feed(t) for t in texts]),
            model_type=nncf.ModelType.TRANSFORMER,
            subset_size=len(texts),
        )
        (tmp / QUANTIZED_FILE).parent.mkdir(parents=True, exist_ok=True)
        openvino.save_model(int8, str(tmp / QUANTIZED_FILE))
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out / QUANTIZED_FILE
